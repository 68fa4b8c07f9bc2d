// paddletune CPU blocked attention (float32), forward and backward, compiled with cpu_kernels.cc.
//
// out_i = sum_j softmax_j(scale * q_i . k_j + mask_ij) v_j, computed FlashAttention-2 style: for a
// block of BR query rows, key blocks of BC are visited with an online softmax (running row max m
// and row sum l, the accumulator rescaled by exp(m_old - m_new)), so nothing of size [S, T] is
// ever held; the forward saves only lse_i = m_i + log l_i. The backward recomputes each score
// block from lse (p_ij = exp(s_ij - lse_i)) and accumulates, per (batch, query head):
//   dv_j += p_ij do_i;  dp_ij = do_i . v_j;  ds_ij = p_ij (dp_ij - delta_i), delta_i = do_i . o_i;
//   dq_i += scale ds_ij k_j;  dk_j += scale ds_ij q_i.
// Block products run on a register-tiled AVX2 micro-kernel (gemm below) on the calling thread; the
// OpenMP loop runs over (batch, head, query block) tasks forward and (batch, head) backward.
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
// query i's example (keys below it blocked; with causal this is block-diagonal causal attention).
// A query row with every key blocked outputs the mean of v over all T keys and passes no gradient
// to q and k: what masked_fill(-1e9) + softmax gives (the reference path in models/layers.py).
#include "paddle/extension.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <vector>

#include "fast_exp.h"

#include <immintrin.h>

namespace {

constexpr int64_t BR = 64;    // query rows per block
constexpr int64_t BC = 256;   // keys per block: a [BR, BC] score block (64 KB) stays in L2

// exp(x) for x <= 0, clamped at -80 (fast_exp.h's polynomial)
__attribute__((always_inline)) inline float exp_le0(float x) { return exp_neg(x < -80.f ? -80.f : x); }

// C[R, 8V] = alpha * A[R, k] B[k, 8V] + beta * C (beta 0: C is not read), A and B row-major.
// Register tile of R x V 8-float vectors; every B row is loaded once per R rows of A.
// (An own micro-kernel keeps the library free of an MKL link; block shapes are small and fixed.)
template <int R, int V>
inline void tile(int64_t k, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                 float* C, int64_t ldc) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 c[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) c[r][v] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    __m256 b[V];
    for (int v = 0; v < V; ++v) b[v] = _mm256_loadu_ps(B + p * ldb + 8 * v);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * lda + p);
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
      for (int64_t p = 0; p < k; ++p) acc += A[r * lda + p] * B[p * ldb + j];
      C[r * ldc + j] = alpha * acc + (beta != 0.f ? beta * C[r * ldc + j] : 0.f);
    }
#endif
}

// C = alpha * A[m, k] B[k, n] + beta * C, all row-major (beta 0: C is not read).
void gemm(int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
          float beta, float* C, int64_t ldc) {
  int64_t i = 0;
  auto rest = [&](int64_t i0, int64_t rows, int64_t j0) {   // columns j0..n of rows i0..i0+rows
    for (int64_t r = i0; r < i0 + rows; ++r)
      for (int64_t j = j0; j < n; ++j) {
        float acc = 0.f;
        for (int64_t p = 0; p < k; ++p) acc += A[r * lda + p] * B[p * ldb + j];
        C[r * ldc + j] = alpha * acc + (beta != 0.f ? beta * C[r * ldc + j] : 0.f);
      }
  };
  for (; i + 6 <= m; i += 6) {   // 12 accumulators: enough in flight to cover FMA latency
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) tile<6, 2>(k, alpha, A + i * lda, lda, B + j, ldb, beta, C + i * ldc + j, ldc);
    for (; j + 8 <= n; j += 8) tile<6, 1>(k, alpha, A + i * lda, lda, B + j, ldb, beta, C + i * ldc + j, ldc);
    rest(i, 6, j);
  }
  for (; i + 4 <= m; i += 4) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) tile<4, 2>(k, alpha, A + i * lda, lda, B + j, ldb, beta, C + i * ldc + j, ldc);
    for (; j + 8 <= n; j += 8) tile<4, 1>(k, alpha, A + i * lda, lda, B + j, ldb, beta, C + i * ldc + j, ldc);
    rest(i, 4, j);
  }
  for (; i < m; ++i) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) tile<1, 2>(k, alpha, A + i * lda, lda, B + j, ldb, beta, C + i * ldc + j, ldc);
    for (; j + 8 <= n; j += 8) tile<1, 1>(k, alpha, A + i * lda, lda, B + j, ldb, beta, C + i * ldc + j, ldc);
    rest(i, 1, j);
  }
}

// dst[cols, rows] = src[rows, cols]^T (src row stride lds)
void transpose(const float* src, int64_t rows, int64_t cols, int64_t lds, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * lds + c];
}

// The problem and its masks; blocked(i, j) and the visible key range of a query block.
struct Problem {
  int64_t B, N, K, S, T, D, g, past;
  float scale;
  bool causal;
  const bool* mask = nullptr;   // [Bm, 1, S, T] or null
  int64_t Bm = 1;
  const int32_t* starts = nullptr;   // [B, S] or null

  Problem(const paddle::Tensor& q, const paddle::Tensor& k, float sc, bool ca, const paddle::Tensor& m, bool use_mask,
          const paddle::Tensor& st, bool use_starts) {
    const auto qs = q.shape(), ks = k.shape();
    PD_CHECK(qs.size() == 4 && ks.size() == 4, "pt_flash_attn: q [B, N, S, D], k / v [B, K, T, D]");
    B = qs[0], N = qs[1], S = qs[2], D = qs[3], K = ks[1], T = ks[2];
    PD_CHECK(ks[0] == B && ks[3] == D && K > 0 && N % K == 0, "pt_flash_attn: k must be [B, K, T, D], N % K == 0");
    PD_CHECK(T >= S || !ca, "pt_flash_attn: causal needs T >= S");
    g = N / K, past = T - S, scale = sc, causal = ca;
    if (use_mask) {
      const auto ms = m.shape();
      PD_CHECK(ms.size() == 4 && ms[1] == 1 && ms[2] == S && ms[3] == T && (ms[0] == 1 || ms[0] == B),
               "pt_flash_attn: mask must be [B or 1, 1, S, T]");
      mask = m.data<bool>(), Bm = ms[0];
    }
    if (use_starts) {
      PD_CHECK(st.numel() == B * S && T == S, "pt_flash_attn: starts must be [B, S] with T == S");
      starts = st.data<int32_t>();
    }
  }
  // keys [lo, hi) that query rows [i0, i1) of batch b may see at most
  void key_range(int64_t b, int64_t i0, int64_t i1, int64_t* lo, int64_t* hi) const {
    *lo = 0, *hi = T;
    if (causal) *hi = std::min<int64_t>(T, i1 - 1 + past + 1);
    if (starts) {
      int64_t m = S;
      for (int64_t i = i0; i < i1; ++i) m = std::min<int64_t>(m, starts[b * S + i]);
      *lo = m;
    }
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
  // set blocked scores of the [rows, cols] block at (i0, j0) to -inf; false if all are blocked
  bool apply(int64_t b, int64_t i0, int64_t rows, int64_t j0, int64_t cols, float* s) const {
    if (!mask && (!causal || j0 + cols - 1 <= i0 + past)) {   // below the diagonal: open unless packed
      bool open = true;
      for (int64_t r = 0; starts && r < rows; ++r) open &= starts[b * S + i0 + r] <= j0;
      if (open) return true;
    }
    bool any = false;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      float* sr = s + r * cols;
      const int64_t lim = causal ? i + past - j0 : cols - 1;    // last open column (causal)
      const int64_t first = starts ? starts[b * S + i] - j0 : 0;
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
float exp_shifted(float* p, int64_t cols, float shift) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < cols; ++c) {
    const float e = p[c] == -INFINITY ? 0.f : exp_le0(p[c] - shift);
    p[c] = e;
    sum += e;
  }
  return sum;
}

// mean of v over all T keys of (b, kv head): the output of a fully blocked row
void mean_v(const float* v, int64_t T, int64_t D, float* out) {
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  for (int64_t j = 0; j < T; ++j)
    for (int64_t d = 0; d < D; ++d) out[d] += v[j * D + d];
  for (int64_t d = 0; d < D; ++d) out[d] /= static_cast<float>(T);
}

// [B, N, T, D] per query head -> [B, K, T, D]: the sum over each KV head's g = N / K query heads
// (O(B N T D), once per backward: one thread)
paddle::Tensor sum_groups(const paddle::Tensor& per_head, int64_t K) {
  const auto sh = per_head.shape();
  const int64_t B = sh[0], N = sh[1], g = N / K, per = sh[2] * sh[3];
  auto out = paddle::empty({B, K, sh[2], sh[3]}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* src = per_head.data<float>();
  float* dst = out.data<float>();
  for (int64_t bk = 0; bk < B * K; ++bk) {
    const float* first = src + (bk / K * N + bk % K * g) * per;   // head (bk % K) * g of batch bk / K
    for (int64_t x = 0; x < per; ++x) {
      float acc = 0.f;
      for (int64_t h = 0; h < g; ++h) acc += first[h * per + x];
      dst[bk * per + x] = acc;
    }
  }
  return out;
}

}  // namespace

std::vector<paddle::Tensor> FlashAttn(const paddle::Tensor& q, const paddle::Tensor& k, const paddle::Tensor& v,
                                      const paddle::Tensor& mask, const paddle::Tensor& starts, float scale,
                                      bool causal, bool use_mask, bool use_starts) {
  PD_CHECK(q.dtype() == paddle::DataType::FLOAT32 && k.dtype() == paddle::DataType::FLOAT32 &&
           v.dtype() == paddle::DataType::FLOAT32, "pt_flash_attn: float32 only");
  const Problem P(q, k, scale, causal, mask, use_mask, starts, use_starts);
  const int64_t B = P.B, N = P.N, S = P.S, T = P.T, D = P.D, nqb = (S + BR - 1) / BR;
  auto out = paddle::empty({B, S, N * D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto lse = paddle::empty({B, N, S}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float *qp = q.data<float>(), *kp = k.data<float>(), *vp = v.data<float>();
  float *op = out.data<float>(), *lp = lse.data<float>();
  // k^T per key block, made once: panel (b, kv head, block at j0) = [D, cols] at offset
  // (b K + kv) T D + j0 D, row stride cols (not T: a 4 KB-multiple stride thrashes L1 sets)
  std::vector<float> ktall(static_cast<size_t>(B * P.K * D * T));
  std::atomic<int64_t> kdone{0};
#pragma omp parallel
  for (int64_t bk = kdone++; bk < B * P.K; bk = kdone++)
    for (int64_t j0 = 0; j0 < T; j0 += BC)
      transpose(kp + bk * T * D + j0 * D, std::min(BC, T - j0), D, D, ktall.data() + bk * T * D + j0 * D);
  std::atomic<int64_t> next{0};   // tasks are claimed from this counter, see kTasksNote
#pragma omp parallel
  {
    std::vector<float> sb(BR * BC), acc(BR * D), m(BR), l(BR), mean(D);
    for (int64_t task = next++; task < B * N * nqb; task = next++) {
      const int64_t b = task / (N * nqb), n = (task / nqb) % N, i0 = (task % nqb) * BR;
      const int64_t rows = std::min(BR, S - i0);
      const float* qi = qp + ((b * N + n) * S + i0) * D;
      const float* vb = vp + (b * P.K + n / P.g) * T * D;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.f);
      int64_t lo, hi;
      P.key_range(b, i0, i0 + rows, &lo, &hi);
      for (int64_t j0 = lo - lo % BC; j0 < hi; j0 += BC) {
        const int64_t cols = std::min(BC, T - j0);
        float* s = sb.data();
        if (!P.mask_open(b, i0, rows, j0, cols)) continue;
        gemm(rows, cols, D, scale, qi, D, ktall.data() + (b * P.K + n / P.g) * T * D + j0 * D, cols, 0.f, s, cols);
        if (!P.apply(b, i0, rows, j0, cols, s)) continue;
        for (int64_t r = 0; r < rows; ++r) {
          float* sr = s + r * cols;
          float bm = -INFINITY;
#pragma omp simd reduction(max : bm)
          for (int64_t c = 0; c < cols; ++c) bm = std::max(bm, sr[c]);
          const float mn = bm > m[r] ? bm : m[r];
          if (mn == -INFINITY) {   // nothing open in this row yet: p = 0
            std::fill(sr, sr + cols, 0.f);
            continue;
          }
          const float corr = exp_le0(m[r] - mn);   // m[r] = -inf gives exp(-80) ~ 0 times acc = 0
          const float sum = exp_shifted(sr, cols, mn);
          l[r] = l[r] * corr + sum;
          m[r] = mn;
          float* ar = acc.data() + r * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
        }
        gemm(rows, D, cols, 1.f, s, cols, vb + j0 * D, D, 1.f, acc.data(), D);
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
  return {out, lse};
}

std::vector<paddle::Tensor> FlashAttnBwd(const paddle::Tensor& q, const paddle::Tensor& k, const paddle::Tensor& v,
                                         const paddle::Tensor& out, const paddle::Tensor& lse,
                                         const paddle::Tensor& dout, const paddle::Tensor& mask,
                                         const paddle::Tensor& starts, float scale, bool causal, bool use_mask,
                                         bool use_starts) {
  const Problem P(q, k, scale, causal, mask, use_mask, starts, use_starts);
  const int64_t B = P.B, N = P.N, K = P.K, S = P.S, T = P.T, D = P.D, g = P.g, nqb = (S + BR - 1) / BR;
  PD_CHECK(dout.numel() == B * S * N * D && out.numel() == B * S * N * D, "pt_flash_attn_bwd: dout / out shape");
  auto dq = paddle::empty({B, N, S, D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  // per query head dk / dv, summed over each KV head's g query heads at the end (GQA)
  auto dkh = paddle::empty({B, N, T, D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto dvh = paddle::empty({B, N, T, D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float *qp = q.data<float>(), *kp = k.data<float>(), *vp = v.data<float>();
  const float *op = out.data<float>(), *lp = lse.data<float>(), *gp = dout.data<float>();
  float *dqp = dq.data<float>(), *dkp = dkh.data<float>(), *dvp = dvh.data<float>();
  const int64_t ld = N * D;   // row stride of out / dout [B, S, N, D]
  std::atomic<int64_t> next{0};   // tasks are claimed from this counter, see kTasksNote
#pragma omp parallel
  {
    std::vector<float> pb(BR * BC), dpb(BR * BC), tb(BR * BC), kt(D * BC), vt(D * BC), delta(S), u(D);
    std::vector<int64_t> qlo(nqb), qhi(nqb);
    for (int64_t task = next++; task < B * N; task = next++) {
      const int64_t b = task / N, n = task % N;
      const float* qh = qp + task * S * D;
      const float* kb = kp + (b * K + n / g) * T * D;
      const float* vb = vp + (b * K + n / g) * T * D;
      const float* lh = lp + task * S;
      float* dqh = dqp + task * S * D;
      float* dk = dkp + task * T * D;
      float* dv = dvp + task * T * D;
      std::fill(dqh, dqh + S * D, 0.f);
      std::fill(dk, dk + T * D, 0.f);
      std::fill(dv, dv + T * D, 0.f);
      std::fill(u.begin(), u.end(), 0.f);
      for (int64_t i = 0; i < S; ++i) {
        const float* o = op + (b * S + i) * ld + n * D;
        const float* go = gp + (b * S + i) * ld + n * D;
        float dsum = 0.f;
        for (int64_t d = 0; d < D; ++d) dsum += o[d] * go[d];
        delta[i] = dsum;
        if (lh[i] == INFINITY)   // fully blocked row: d v_j += do_i / T for every key
          for (int64_t d = 0; d < D; ++d) u[d] += go[d];
      }
      for (int64_t ib = 0; ib < nqb; ++ib)
        P.key_range(b, ib * BR, std::min(S, (ib + 1) * BR), &qlo[ib], &qhi[ib]);
      for (int64_t j0 = 0; j0 < T; j0 += BC) {
        const int64_t cols = std::min(BC, T - j0);
        bool transposed = false;
        for (int64_t ib = 0; ib < nqb; ++ib) {
          const int64_t i0 = ib * BR, rows = std::min(BR, S - i0);
          if (qhi[ib] <= j0 || qlo[ib] >= j0 + cols || !P.mask_open(b, i0, rows, j0, cols)) continue;
          float* p = pb.data();
          float* dp = dpb.data();
          if (!transposed) {   // k and v of this key block as [D, cols], once for all query blocks
            transpose(kb + j0 * D, cols, D, D, kt.data());
            transpose(vb + j0 * D, cols, D, D, vt.data());
            transposed = true;
          }
          gemm(rows, cols, D, scale, qh + i0 * D, D, kt.data(), cols, 0.f, p, cols);
          if (!P.apply(b, i0, rows, j0, cols, p)) continue;
          const float* go = gp + (b * S + i0) * ld + n * D;
          gemm(rows, cols, D, 1.f, go, ld, vt.data(), cols, 0.f, dp, cols);   // dp = do v^T
          for (int64_t r = 0; r < rows; ++r) {
            float* __restrict__ pr = p + r * cols;
            float* __restrict__ dr = dp + r * cols;
            const float L = lh[i0 + r], dl = delta[i0 + r];
            if (L == INFINITY) {   // a fully blocked row: no softmax gradient (handled through u)
              std::fill(pr, pr + cols, 0.f);
              std::fill(dr, dr + cols, 0.f);
              continue;
            }
            exp_shifted(pr, cols, L);
#pragma omp simd
            for (int64_t c = 0; c < cols; ++c) dr[c] = pr[c] * (dr[c] - dl);
          }
          float* t = tb.data();
          transpose(p, rows, cols, cols, t);
          gemm(cols, D, rows, 1.f, t, rows, go, ld, 1.f, dv + j0 * D, D);                // dv += p^T do
          gemm(rows, D, cols, scale, dp, cols, kb + j0 * D, D, 1.f, dqh + i0 * D, D);    // dq += ds k
          transpose(dp, rows, cols, cols, t);
          gemm(cols, D, rows, scale, t, rows, qh + i0 * D, D, 1.f, dk + j0 * D, D);      // dk += ds^T q
        }
      }
      bool any = false;
      for (int64_t d = 0; d < D; ++d) any |= u[d] != 0.f;
      if (any)
        for (int64_t j = 0; j < T; ++j)
          for (int64_t d = 0; d < D; ++d) dv[j * D + d] += u[d] / static_cast<float>(T);
    }

  }
  if (g == 1) return {dq, dkh, dvh};
  auto dk = sum_groups(dkh, K), dv = sum_groups(dvh, K);
  return {dq, dk, dv};
}

PD_BUILD_OP(pt_flash_attn)
    .Inputs({"Q", "K", "V", "Mask", "Starts"})
    .Outputs({"Out", "Lse"})
    .Attrs({"scale: float", "causal: bool", "use_mask: bool", "use_starts: bool"})
    .SetKernelFn(PD_KERNEL(FlashAttn));

PD_BUILD_OP(pt_flash_attn_bwd)
    .Inputs({"Q", "K", "V", "Out", "Lse", "DOut", "Mask", "Starts"})
    .Outputs({"DQ", "DK", "DV"})
    .Attrs({"scale: float", "causal: bool", "use_mask: bool", "use_starts: bool"})
    .SetKernelFn(PD_KERNEL(FlashAttnBwd));
