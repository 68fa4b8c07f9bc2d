// paddletune CPU blocked attention (float32): the computation on raw pointers, without paddle
// (attention.cc wraps it as ops; benchmarks/attention_micro.cc times it alone).
//
// out_i = sum_j softmax_j(scale * q_i . k_j + mask_ij) v_j, computed FlashAttention-2 style: for a
// block of BR query rows, key blocks of BC are visited with an online softmax (running row max m
// and row sum l, the accumulator rescaled by exp(m_old - m_new)), so nothing of size [S, T] is
// ever held; the forward saves only lse_i = m_i + log l_i. The backward recomputes each score
// block from lse (p_ij = exp(s_ij - lse_i)) and accumulates, per (batch, query head):
//   dv_j += p_ij do_i;  dp_ij = do_i . v_j;  ds_ij = p_ij (dp_ij - delta_i), delta_i = do_i . o_i;
//   dq_i += scale ds_ij k_j;  dk_j += scale ds_ij q_i.
// Block products run on a register-tiled AVX2 micro-kernel (gemm below) that reads its left
// operand through (row, column) strides, so p^T do and ds^T q need no transposed copy.
// Tasks: (batch, head, query block) forward, (batch, head, key block) backward (see kTasksNote).
//
// kTasksNote: the threads of `omp parallel` claim tasks from an atomic counter rather than through
// `omp for`: with torch's libgomp loaded in the process (tests, peers), the OpenMP entry points of
// this library can resolve to two runtimes (paddle's libiomp5 and libgomp), and `omp for` then
// handed every thread every task (measured: backward gradients accumulated twice, forward intact).
// Each task is done exactly once whatever the runtime; work still spreads over the threads.
//
// Layouts: q [B, N, S, D], k / v [B, K, T, D] (query head n reads KV head n / (N / K)), out
// [B, S, N, D] (the layout the output projection reads), lse [B, N, S].
// Masks, any combination: causal (key j visible to query i iff j <= i + T - S), a bool mask
// [Bm, 1, S, T] (Bm = 1 or B, true = blocked), packed rows: starts [B, S] int32 = the first key of
// query i's example (keys below it blocked; with causal this is block-diagonal causal attention),
// a key window [B, 2] int32 = (first, end) of row b's unpadded keys (left / right padding).
// A query row with every key blocked outputs the mean of v over all T keys and passes no gradient
// to q and k: what masked_fill(-1e9) + softmax gives (the reference path in models/layers.py).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <vector>

#include "fast_exp.h"

#include <immintrin.h>

namespace ptattn {

constexpr int64_t BR = 64;    // query rows per block
constexpr int64_t BC = 256;   // keys per block: a [BR, BC] score block (64 KB) stays in L2
// row stride of score blocks and k^T / v^T panels: BC + 16 floats, not a 1 KB multiple, whose rows
// would share 4 of L1's 64 sets (the tiles walk 32-64 such rows per micro-kernel call)
constexpr int64_t LDS = BC + 16;

// exp(x) for x <= 0, clamped at -80 (fast_exp.h's polynomial)
__attribute__((always_inline)) inline float exp_le0(float x) { return exp_neg(x < -80.f ? -80.f : x); }

// C[R, 8V] = alpha * A[R, k] B[k, 8V] + beta * C (beta 0: C is not read); A[r, p] = A[r ar + p ap]
// (ap = 1: row-major; ar = 1: A is the transpose of a row-major matrix), B row-major.
// Register tile of R x V 8-float vectors; every B row is loaded once per R rows of A.
// (An own micro-kernel keeps the library free of an MKL link; block shapes are small and fixed.)
template <int R, int V, int KC = 0>
inline void tile(int64_t k_, float alpha, const float* A, int64_t ar, int64_t ap, const float* B, int64_t ldb,
                 float beta, float* C, int64_t ldc) {
  const int64_t k = KC ? KC : k_;   // KC > 0: the depth known at compile time (unrolled: k = D = 32)
#if defined(__AVX2__) && defined(__FMA__)
  __m256 c[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) c[r][v] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    __m256 b[V];
    for (int v = 0; v < V; ++v) b[v] = _mm256_loadu_ps(B + p * ldb + 8 * v);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * ar + p * ap);
      for (int v = 0; v < V; ++v) c[r][v] = _mm256_fmadd_ps(a, b[v], c[r][v]);
    }
  }
  const __m256 al = _mm256_set1_ps(alpha), be = _mm256_set1_ps(beta);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      float* cp = C + r * ldc + 8 * v;
      __m256 x = _mm256_mul_ps(al, c[r][v]);
      if (beta != 0.f) x = _mm256_fmadd_ps(be, _mm256_loadu_ps(cp), x);
      _mm256_storeu_ps(cp, x);
    }
#else
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 8 * V; ++j) {
      float acc = 0.f;
      for (int64_t p = 0; p < k; ++p) acc += A[r * ar + p * ap] * B[p * ldb + j];
      C[r * ldc + j] = alpha * acc + (beta != 0.f ? beta * C[r * ldc + j] : 0.f);
    }
#endif
}

// C = alpha * A[m, k] B[k, n] + beta * C (beta 0: C is not read); A[r, p] = A[r ar + p ap], B and C
// row-major.
inline void gemm(int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t ar, int64_t ap,
                 const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  auto rest = [&](int64_t i0, int64_t rows, int64_t j0) {   // columns j0..n of rows i0..i0+rows
    for (int64_t r = i0; r < i0 + rows; ++r)
      for (int64_t j = j0; j < n; ++j) {
        float acc = 0.f;
        for (int64_t p = 0; p < k; ++p) acc += A[r * ar + p * ap] * B[p * ldb + j];
        C[r * ldc + j] = alpha * acc + (beta != 0.f ? beta * C[r * ldc + j] : 0.f);
      }
  };
#define PT_ROWS(RR)                                                                                \
  {                                                                                                \
    const float* a = A + i * ar;                                                                   \
    float* c = C + i * ldc;                                                                        \
    int64_t j = 0;                                                                                 \
    if (k == 32 && ap == 1)                                                                        \
      for (; j + 16 <= n; j += 16) tile<RR, 2, 32>(k, alpha, a, ar, 1, B + j, ldb, beta, c + j, ldc); \
    for (; j + 16 <= n; j += 16) tile<RR, 2>(k, alpha, a, ar, ap, B + j, ldb, beta, c + j, ldc);   \
    for (; j + 8 <= n; j += 8) tile<RR, 1>(k, alpha, a, ar, ap, B + j, ldb, beta, c + j, ldc);     \
    rest(i, RR, j);                                                                                \
  }
  int64_t i = 0;
  for (; i + 6 <= m; i += 6) PT_ROWS(6)   // 12 accumulators: enough in flight to cover FMA latency
  for (; i + 4 <= m; i += 4) PT_ROWS(4)
  for (; i < m; ++i) PT_ROWS(1)
#undef PT_ROWS
}

// dst[cols, rows] = src[rows, cols]^T (row strides lds, ldd)
inline void transpose(const float* src, int64_t rows, int64_t cols, int64_t lds, float* dst, int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
}

// The problem and its masks; blocked(i, j) and the visible key range of a query block.
struct Problem {
  int64_t B, N, K, S, T, D, g, past;
  float scale;
  bool causal;
  const bool* mask = nullptr;       // [Bm, 1, S, T] or null
  int64_t Bm = 1;
  const int32_t* starts = nullptr;  // [B, S] or null
  const int32_t* window = nullptr;  // [B, 2] or null

  // keys [lo, hi) that query rows [i0, i1) of batch b may see at most
  void key_range(int64_t b, int64_t i0, int64_t i1, int64_t* lo, int64_t* hi) const {
    *lo = 0, *hi = T;
    if (causal) *hi = std::min<int64_t>(T, i1 - 1 + past + 1);
    if (starts) {
      int64_t m = S;
      for (int64_t i = i0; i < i1; ++i) m = std::min<int64_t>(m, starts[b * S + i]);
      *lo = m;
    }
    if (window) *lo = std::max<int64_t>(*lo, window[2 * b]), *hi = std::min<int64_t>(*hi, window[2 * b + 1]);
  }
  // columns of the key block at j0 worth computing for rows ending at i1 (causal: up to the
  // diagonal, rounded up to 8 so the tiles cover them; the rest of the block is blocked anyway)
  int64_t block_cols(int64_t j0, int64_t hi) const {
    const int64_t c = std::min(BC, T - j0);
    return std::min(c, (hi - j0 + 7) / 8 * 8);
  }
  // false when the bool mask blocks the whole [rows, cols] block at (i0, j0): its products are skipped
  bool mask_open(int64_t b, int64_t i0, int64_t rows, int64_t j0, int64_t cols) const {
    if (!mask) return true;
    for (int64_t r = 0; r < rows; ++r) {
      const bool* mr = mask + ((Bm == 1 ? 0 : b) * S + i0 + r) * T + j0;
      for (int64_t c = 0; c < cols; ++c)
        if (!mr[c]) return true;
    }
    return false;
  }
  // set blocked scores of the [rows, cols] block at (i0, j0) (row stride LDS) to -inf; false if all are
  bool apply(int64_t b, int64_t i0, int64_t rows, int64_t j0, int64_t cols, float* s) const {
    const int64_t wlo = window ? window[2 * b] - j0 : 0, whi = window ? window[2 * b + 1] - j0 : cols;
    if (!mask && (!causal || j0 + cols - 1 <= i0 + past) && wlo <= 0 && whi >= cols) {   // open unless packed
      bool open = true;
      for (int64_t r = 0; starts && r < rows; ++r) open &= starts[b * S + i0 + r] <= j0;
      if (open) return true;
    }
    bool any = false;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      float* sr = s + r * LDS;
      const int64_t lim = std::min<int64_t>(causal ? i + past - j0 : cols - 1, whi - 1);   // last open column
      const int64_t first = std::max<int64_t>(starts ? starts[b * S + i] - j0 : 0, wlo);
      const bool* mr = mask ? mask + ((Bm == 1 ? 0 : b) * S + i) * T + j0 : nullptr;
      for (int64_t c = 0; c < cols; ++c) {
        const bool off = c > lim || c < first || (mr && mr[c]);
        sr[c] = off ? -INFINITY : sr[c];
        any |= !off;
      }
    }
    return any;
  }
};

// p[c] = exp(p[c] - shift), 0 where p[c] = -inf (blocked); returns the sum
inline float exp_shifted(float* p, int64_t cols, float shift) {
  float sum = 0.f;
  int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 sh = _mm256_set1_ps(shift), ninf = _mm256_set1_ps(-INFINITY);
  __m256 acc = _mm256_setzero_ps();
  for (; c + 8 <= cols; c += 8) {
    const __m256 x = _mm256_loadu_ps(p + c);
    const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), exp8_neg(_mm256_sub_ps(x, sh)));
    _mm256_storeu_ps(p + c, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float x : lanes) sum += x;
#endif
  for (; c < cols; ++c) {
    const float e = p[c] == -INFINITY ? 0.f : exp_le0(p[c] - shift);
    p[c] = e;
    sum += e;
  }
  return sum;
}

// one pass over a backward row: p[c] = exp(p[c] - L) (0 where blocked), dp[c] = p[c] (dp[c] - delta)
inline void probs_and_ds(float* __restrict__ p, float* __restrict__ dp, int64_t cols, float L, float delta) {
  int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 sh = _mm256_set1_ps(L), ninf = _mm256_set1_ps(-INFINITY), dl = _mm256_set1_ps(delta);
  for (; c + 8 <= cols; c += 8) {
    const __m256 x = _mm256_loadu_ps(p + c);
    const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), exp8_neg(_mm256_sub_ps(x, sh)));
    _mm256_storeu_ps(p + c, e);
    _mm256_storeu_ps(dp + c, _mm256_mul_ps(e, _mm256_sub_ps(_mm256_loadu_ps(dp + c), dl)));
  }
#endif
  for (; c < cols; ++c) {
    const float e = p[c] == -INFINITY ? 0.f : exp_le0(p[c] - L);
    p[c] = e;
    dp[c] = e * (dp[c] - delta);
  }
}

// max of x[0..n) (-inf for an all -inf row)
inline float row_max(const float* x, int64_t n) {
  float m = -INFINITY;
  int64_t c = 0;
#if defined(__AVX2__)
  __m256 a = _mm256_set1_ps(-INFINITY);
  for (; c + 8 <= n; c += 8) a = _mm256_max_ps(a, _mm256_loadu_ps(x + c));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, a);
  for (float y : lanes) m = std::max(m, y);
#endif
  for (; c < n; ++c) m = std::max(m, x[c]);
  return m;
}

// mean of v over all T keys of (b, kv head): the output of a fully blocked row
inline void mean_v(const float* v, int64_t T, int64_t D, float* out) {
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  for (int64_t j = 0; j < T; ++j)
    for (int64_t d = 0; d < D; ++d) out[d] += v[j * D + d];
  for (int64_t d = 0; d < D; ++d) out[d] /= static_cast<float>(T);
}

// Forward: out [B, S, N, D], lse [B, N, S] (+inf marks a fully blocked row).
inline void forward(const Problem& P, const float* qp, const float* kp, const float* vp, float* op, float* lp) {
  const int64_t B = P.B, N = P.N, S = P.S, T = P.T, D = P.D, nqb = (S + BR - 1) / BR;
  // k^T per key block, made once: panel (b, kv head, block jb) = [D, LDS] at (bk nkb + jb) D LDS
  const int64_t nkb = (T + BC - 1) / BC;
  std::vector<float> ktall(static_cast<size_t>(B * P.K * nkb * D * LDS));
  std::atomic<int64_t> kdone{0};
#pragma omp parallel
  for (int64_t bk = kdone++; bk < B * P.K; bk = kdone++)
    for (int64_t j0 = 0; j0 < T; j0 += BC)
      transpose(kp + bk * T * D + j0 * D, std::min(BC, T - j0), D, D, ktall.data() + (bk * nkb + j0 / BC) * D * LDS,
                LDS);
  std::atomic<int64_t> next{0};   // tasks are claimed from this counter, see kTasksNote
#pragma omp parallel
  {
    std::vector<float> sb(BR * LDS), acc(BR * D), m(BR), l(BR), mean(D);
    for (int64_t task = next++; task < B * N * nqb; task = next++) {
      const int64_t b = task / (N * nqb), n = (task / nqb) % N, i0 = (task % nqb) * BR;
      const int64_t rows = std::min(BR, S - i0);
      const float* qi = qp + ((b * N + n) * S + i0) * D;
      const float* vb = vp + (b * P.K + n / P.g) * T * D;
      const float* kt = ktall.data() + (b * P.K + n / P.g) * nkb * D * LDS;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.f);
      int64_t lo, hi;
      P.key_range(b, i0, i0 + rows, &lo, &hi);
      for (int64_t j0 = lo - lo % BC; j0 < hi; j0 += BC) {
        const int64_t cols = P.block_cols(j0, hi);
        float* s = sb.data();
        if (!P.mask_open(b, i0, rows, j0, cols)) continue;
        gemm(rows, cols, D, P.scale, qi, D, 1, kt + j0 / BC * D * LDS, LDS, 0.f, s, LDS);
        if (!P.apply(b, i0, rows, j0, cols, s)) continue;
        for (int64_t r = 0; r < rows; ++r) {
          float* sr = s + r * LDS;
          const float bm = row_max(sr, cols);
          const float mn = bm > m[r] ? bm : m[r];
          if (mn == -INFINITY) {   // nothing open in this row yet: p = 0
            std::fill(sr, sr + cols, 0.f);
            continue;
          }
          const float sum = exp_shifted(sr, cols, mn);
          if (mn != m[r]) {   // rescale the accumulator to the new max (m[r] = -inf: acc is 0)
            const float corr = exp_le0(m[r] - mn);
            l[r] *= corr;
            float* ar = acc.data() + r * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
          }
          l[r] += sum;
          m[r] = mn;
        }
        gemm(rows, D, cols, 1.f, s, LDS, 1, vb + j0 * D, D, 1.f, acc.data(), D);
      }
      bool have_mean = false;
      for (int64_t r = 0; r < rows; ++r) {
        float* o = op + ((b * S + i0 + r) * N + n) * D;
        if (m[r] == -INFINITY) {   // every key blocked: uniform weights over all T keys
          if (!have_mean) mean_v(vb, T, D, mean.data()), have_mean = true;
          std::copy(mean.begin(), mean.end(), o);
          lp[(b * N + n) * S + i0 + r] = INFINITY;   // marks the row for the backward
          continue;
        }
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
        lp[(b * N + n) * S + i0 + r] = m[r] + std::log(l[r]);
      }
    }
  }
}

// Backward tasks are (batch, head, key block), FlashAttention-2's split for dk / dv: 8 heads x
// S / 256 key blocks, so the threads stay balanced at batch 1 and under causal (a key block's work
// falls with its position; tasks are claimed in order). Each task owns its dk / dv rows; dq rows
// get contributions from every key block, so each thread accumulates one head's dq [S, D] in its
// own zeroed copy, added into dq under a mutex when its next task is another head (a thread's
// claimed tasks only move forward, so it flushes at most once per head).
struct BwdScratch {
  std::vector<float> pb, dpb, kt, vt, dq;
  int64_t head = -1;   // the (b, n) whose dq contributions dq holds
  explicit BwdScratch(const Problem& P)
      : pb(BR * LDS), dpb(BR * LDS), kt(P.D * LDS), vt(P.D * LDS), dq(P.S * P.D, 0.f) {}
  void flush(float* dqp, std::mutex& mu) {
    if (head < 0) return;
    {
      std::lock_guard<std::mutex> hold(mu);
      float* dst = dqp + head * static_cast<int64_t>(dq.size());
      for (size_t x = 0; x < dq.size(); ++x) dst[x] += dq[x];
    }
    std::fill(dq.begin(), dq.end(), 0.f);
    head = -1;
  }
};

// One task: dk, dv of key block j0 of (b, n); dq of (b, n) into w.dq. delta [S] = do_i . o_i, u [D] = the sum
// of do over fully blocked rows of (b, n) (their uniform weights pass do_i / T to every v_j).
inline void bwd_task(const Problem& P, int64_t b, int64_t n, int64_t j0, const float* qp, const float* kp,
                     const float* vp, const float* lp, const float* gp, const float* delta, const float* u,
                     float* dkp, float* dvp, BwdScratch& w) {
  const int64_t S = P.S, T = P.T, D = P.D, ld = P.N * D, bn = b * P.N + n, full = std::min(BC, T - j0);
  const float* qh = qp + bn * S * D;
  const float* kb = kp + (b * P.K + n / P.g) * T * D;
  const float* vb = vp + (b * P.K + n / P.g) * T * D;
  const float* lh = lp + bn * S;
  float* dqh = w.dq.data();
  float* dk = dkp + bn * T * D + j0 * D;
  float* dv = dvp + bn * T * D + j0 * D;
  std::fill(dk, dk + full * D, 0.f);
  for (int64_t j = 0; j < full; ++j)   // fully blocked rows' share (u is mostly 0)
    for (int64_t d = 0; d < D; ++d) dv[j * D + d] = u[d] / static_cast<float>(T);
  transpose(kb + j0 * D, full, D, D, w.kt.data(), LDS);   // k, v of the block as [D, LDS]
  transpose(vb + j0 * D, full, D, D, w.vt.data(), LDS);
  float *p = w.pb.data(), *dp = w.dpb.data();
  for (int64_t i0 = 0; i0 < S; i0 += BR) {
    const int64_t rows = std::min(BR, S - i0);
    int64_t lo, hi;
    P.key_range(b, i0, i0 + rows, &lo, &hi);
    if (hi <= j0 || lo >= j0 + full) continue;
    const int64_t cols = P.block_cols(j0, hi);
    if (!P.mask_open(b, i0, rows, j0, cols)) continue;
    gemm(rows, cols, D, P.scale, qh + i0 * D, D, 1, w.kt.data(), LDS, 0.f, p, LDS);
    if (!P.apply(b, i0, rows, j0, cols, p)) continue;
    const float* go = gp + (b * S + i0) * ld + n * D;
    gemm(rows, cols, D, 1.f, go, ld, 1, w.vt.data(), LDS, 0.f, dp, LDS);   // dp = do v^T
    for (int64_t r = 0; r < rows; ++r) {
      float* __restrict__ pr = p + r * LDS;
      float* __restrict__ dr = dp + r * LDS;
      const float L = lh[i0 + r];
      if (L == INFINITY) {   // a fully blocked row: no softmax gradient (handled through u)
        std::fill(pr, pr + cols, 0.f);
        std::fill(dr, dr + cols, 0.f);
        continue;
      }
      probs_and_ds(pr, dr, cols, L, delta[i0 + r]);
    }
    gemm(cols, D, rows, 1.f, p, 1, LDS, go, ld, 1.f, dv, D);                          // dv += p^T do
    gemm(rows, D, cols, P.scale, dp, LDS, 1, kb + j0 * D, D, 1.f, dqh + i0 * D, D);    // dq += ds k
    gemm(cols, D, rows, P.scale, dp, 1, LDS, qh + i0 * D, D, 1.f, dk, D);              // dk += ds^T q
  }
}

// Backward: dq [B, N, S, D], per query head dkh / dvh [B, N, T, D] (the caller sums GQA groups).
inline void backward(const Problem& P, const float* qp, const float* kp, const float* vp, const float* op,
                     const float* lp, const float* gp, float* dqp, float* dkp, float* dvp) {
  const int64_t B = P.B, N = P.N, S = P.S, T = P.T, D = P.D, nkb = (T + BC - 1) / BC;
  const int64_t ld = N * D;   // row stride of out / dout [B, S, N, D]
  std::vector<float> delta(B * N * S), u(B * N * D, 0.f);
  for (int64_t bn = 0; bn < B * N; ++bn)   // O(B N S D), one thread
    for (int64_t i = 0; i < S; ++i) {
      const float* o = op + (bn / N * S + i) * ld + bn % N * D;
      const float* go = gp + (bn / N * S + i) * ld + bn % N * D;
      float dsum = 0.f;
      for (int64_t d = 0; d < D; ++d) dsum += o[d] * go[d];
      delta[bn * S + i] = dsum;
      if (lp[bn * S + i] == INFINITY)   // fully blocked row: d v_j += do_i / T for every key
        for (int64_t d = 0; d < D; ++d) u[bn * D + d] += go[d];
    }
  std::fill(dqp, dqp + B * N * S * D, 0.f);
  std::mutex mu;
  std::atomic<int64_t> next{0};   // tasks are claimed from this counter, see kTasksNote
#pragma omp parallel
  {
    BwdScratch w(P);
    for (int64_t task = next++; task < B * N * nkb; task = next++) {
      const int64_t bn = task / nkb;
      if (bn != w.head) w.flush(dqp, mu), w.head = bn;
      bwd_task(P, bn / N, bn % N, task % nkb * BC, qp, kp, vp, lp, gp, delta.data() + bn * S, u.data() + bn * D,
               dkp, dvp, w);
    }
    w.flush(dqp, mu);
  }
}

}  // namespace ptattn
