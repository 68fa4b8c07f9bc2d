// paddletune CPU kernels (float32), compiled on first use by paddletune/kernels/__init__.py.
//
// Why: paddle 3.3.1's CPU softmax / cross-entropy kernels are single-threaded and make several
// passes, and RMSNorm / SwiGLU run as chains of broadcast elementwise ops; these make one or two
// passes per row, split rows over the OpenMP threads paddle's MKL already uses (libiomp5), and
// vectorize exp. Results equal paddle's ops to float32 rounding (tests/test_kernels.py).
#include "paddle/extension.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <vector>

#include "fast_exp.h"

namespace {

// exp_neg(x) for x in [-80, 0]: fast_exp.h

// softmax of one row into out; masked entries (mask[j] != 0) count as -1e9,
// exactly as masked_fill(-1e9) + softmax: zero probability, or uniform when all are masked.
inline void softmax_row(const float* x, const bool* mask, float* out, int64_t T) {
  float m = -INFINITY;
  for (int64_t j = 0; j < T; ++j) {
    const float v = mask[j] ? -1e9f : x[j];
    m = v > m ? v : m;
  }
  const bool some_open = m > -1e9f;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < T; ++j) {
    float d = (mask[j] ? -1e9f : x[j]) - m;
    d = d < -80.f ? -80.f : d;   // exp(-80) ~ 2e-35: below every probability that matters
    const float e = (mask[j] && some_open) ? 0.f : exp_neg(d);
    out[j] = e;
    s += e;
  }
  const float inv = 1.f / s;
#pragma omp simd
  for (int64_t j = 0; j < T; ++j) out[j] *= inv;
}

}  // namespace

// logits [n, V], targets [n] (int64, 0 <= t < V) -> loss [n] = logsumexp(row) - row[t], and
// the logits are OVERWRITTEN with softmax(row) - onehot(t), the gradient of sum(loss) with
// respect to them: the caller's logits block is a temporary, and a second [n, V] buffer would
// cost as much memory again (131 MB at n = 1024, V = 32000).
std::vector<paddle::Tensor> SoftmaxXent(const paddle::Tensor& logits, const paddle::Tensor& targets) {
  PD_CHECK(logits.dtype() == paddle::DataType::FLOAT32, "pt_softmax_xent: float32 logits only");
  PD_CHECK(logits.shape().size() == 2, "pt_softmax_xent: logits must be [n, V]");
  const int64_t n = logits.shape()[0], V = logits.shape()[1];
  PD_CHECK(targets.numel() == n, "pt_softmax_xent: one target per row");
  auto loss = paddle::empty({n}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  float* g = const_cast<float*>(logits.data<float>());   // in place, see above
  const int64_t* t = targets.data<int64_t>();
  float* l = loss.data<float>();
  for (int64_t i = 0; i < n; ++i) PD_CHECK(t[i] >= 0 && t[i] < V, "pt_softmax_xent: target out of range");
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float* gi = g + i * V;
    float m = -INFINITY;
    for (int64_t j = 0; j < V; ++j) m = gi[j] > m ? gi[j] : m;
    const float target_logit = gi[t[i]];
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < V; ++j) {
      float d = gi[j] - m;
      d = d < -80.f ? -80.f : d;
      const float e = exp_neg(d);
      gi[j] = e;
      s += e;
    }
    const float inv = 1.f / s;
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) gi[j] *= inv;
    l[i] = std::log(s) + m - target_logit;
    gi[t[i]] -= 1.f;
  }
  return {loss};
}

// Row mapping shared by the masked softmax pair: scores [B, H, S, T] as B*H*S rows of T;
// mask [Bm, 1, S, T] (bool, Bm = 1 or B) applies mask row (b or 0, s) to row (b, h, s).
static inline const bool* mask_row(const bool* mask, int64_t r, int64_t H, int64_t S, int64_t T, int64_t Bm) {
  const int64_t b = r / (H * S), s = r % S;
  return mask + ((Bm == 1 ? 0 : b) * S + s) * T;
}

std::vector<paddle::Tensor> MaskedSoftmax(const paddle::Tensor& scores, const paddle::Tensor& mask) {
  PD_CHECK(scores.dtype() == paddle::DataType::FLOAT32, "pt_masked_softmax: float32 scores only");
  PD_CHECK(scores.shape().size() == 4, "pt_masked_softmax: scores must be [B, H, S, T]");
  const auto sh = scores.shape(), mh = mask.shape();
  const int64_t B = sh[0], H = sh[1], S = sh[2], T = sh[3], Bm = mh[0];
  PD_CHECK(mh.size() == 4 && mh[1] == 1 && mh[2] == S && mh[3] == T && (Bm == 1 || Bm == B),
           "pt_masked_softmax: mask must be [B or 1, 1, S, T]");
  auto out = paddle::empty(sh, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* x = scores.data<float>();
  const bool* mk = mask.data<bool>();
  float* o = out.data<float>();
  const int64_t rows = B * H * S;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) softmax_row(x + r * T, mask_row(mk, r, H, S, T, Bm), o + r * T, T);
  return {out};
}

// d scores = p * (dp - sum(dp * p)) per row, and 0 where masked (masked_fill passes no gradient).
std::vector<paddle::Tensor> MaskedSoftmaxBwd(const paddle::Tensor& probs, const paddle::Tensor& dprobs,
                                             const paddle::Tensor& mask) {
  const auto sh = probs.shape(), mh = mask.shape();
  const int64_t B = sh[0], H = sh[1], S = sh[2], T = sh[3], Bm = mh[0];
  PD_CHECK(dprobs.shape() == sh, "pt_masked_softmax_bwd: probs and their gradient differ in shape");
  auto out = paddle::empty(sh, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* p = probs.data<float>();
  const float* dp = dprobs.data<float>();
  const bool* mk = mask.data<bool>();
  float* o = out.data<float>();
  const int64_t rows = B * H * S;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* pr = p + r * T;
    const float* dr = dp + r * T;
    const bool* m = mask_row(mk, r, H, S, T, Bm);
    float* orow = o + r * T;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < T; ++j) dot += pr[j] * dr[j];
#pragma omp simd
    for (int64_t j = 0; j < T; ++j) orow[j] = m[j] ? 0.f : pr[j] * (dr[j] - dot);
  }
  return {out};
}

// RMSNorm over the last axis (H): y = w * x * r with r = 1 / sqrt(mean(x^2) + eps) per row.
// Returns y and r (kept for the backward).
std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x, const paddle::Tensor& w, float eps) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && w.dtype() == paddle::DataType::FLOAT32,
           "pt_rms_norm: float32 only");
  const int64_t H = w.numel(), rows = x.numel() / H;
  PD_CHECK(x.shape().back() == H, "pt_rms_norm: weight size differs from the last axis");
  auto y = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto r = paddle::empty({rows}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  float* yp = y.data<float>();
  float* rp = r.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    const float* xi = xp + i * H;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < H; ++j) ss += xi[j] * xi[j];
    const float ri = 1.f / std::sqrt(ss / H + eps);
    rp[i] = ri;
    float* yi = yp + i * H;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) yi[j] = wp[j] * (xi[j] * ri);
  }
  return {y, r};
}

// dx = r * (g - x * r^2 * mean(g * x)) with g = dy * w; dw = sum over rows of dy * x * r
// (per-thread partial sums, added in thread order: deterministic for a fixed thread count).
std::vector<paddle::Tensor> RmsNormBwd(const paddle::Tensor& x, const paddle::Tensor& w, const paddle::Tensor& r,
                                       const paddle::Tensor& dy, bool want_dw) {
  const int64_t H = w.numel(), rows = x.numel() / H;
  auto dx = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto dw = paddle::empty({want_dw ? H : 1}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  const float* rp = r.data<float>();
  const float* dyp = dy.data<float>();
  float* dxp = dx.data<float>();
  float* dwp = dw.data<float>();
  const int threads = omp_get_max_threads();
  std::vector<float> partial(want_dw ? static_cast<size_t>(threads) * H : 0, 0.f);
#pragma omp parallel num_threads(threads)
  {
    float* acc = want_dw ? partial.data() + static_cast<size_t>(omp_get_thread_num()) * H : nullptr;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      const float* xi = xp + i * H;
      const float* di = dyp + i * H;
      const float ri = rp[i];
      float c = 0.f;
#pragma omp simd reduction(+ : c)
      for (int64_t j = 0; j < H; ++j) c += di[j] * wp[j] * xi[j];
      const float k = ri * ri * ri * c / H;
      float* o = dxp + i * H;
#pragma omp simd
      for (int64_t j = 0; j < H; ++j) o[j] = ri * di[j] * wp[j] - xi[j] * k;
      if (acc) {
#pragma omp simd
        for (int64_t j = 0; j < H; ++j) acc[j] += di[j] * xi[j] * ri;
      }
    }
  }
  if (want_dw) {
    for (int64_t j = 0; j < H; ++j) dwp[j] = 0.f;
    for (int t = 0; t < threads; ++t)
      for (int64_t j = 0; j < H; ++j) dwp[j] += partial[static_cast<size_t>(t) * H + j];
  } else {
    dwp[0] = 0.f;
  }
  return {dx, dw};
}

// sigmoid without overflow: exp only of non-positive arguments.
inline float sigmoid(float v) {
  float a = v < 0.f ? v : -v;
  a = a < -80.f ? -80.f : a;
  const float e = exp_neg(a);
  return v < 0.f ? e / (1.f + e) : 1.f / (1.f + e);
}

// SwiGLU: out = silu(gate) * up, silu(v) = v * sigmoid(v).
std::vector<paddle::Tensor> Swiglu(const paddle::Tensor& gate, const paddle::Tensor& up) {
  PD_CHECK(gate.dtype() == paddle::DataType::FLOAT32 && up.dtype() == paddle::DataType::FLOAT32,
           "pt_swiglu: float32 only");
  PD_CHECK(gate.shape() == up.shape(), "pt_swiglu: gate and up differ in shape");
  const int64_t n = gate.numel();
  auto out = paddle::empty(gate.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* g = gate.data<float>();
  const float* u = up.data<float>();
  float* o = out.data<float>();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) o[i] = g[i] * sigmoid(g[i]) * u[i];
  return {out};
}

// d gate = dy * up * s * (1 + gate * (1 - s)), d up = dy * silu(gate), s = sigmoid(gate).
std::vector<paddle::Tensor> SwigluBwd(const paddle::Tensor& gate, const paddle::Tensor& up, const paddle::Tensor& dy) {
  const int64_t n = gate.numel();
  auto dg = paddle::empty(gate.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto du = paddle::empty(gate.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* g = gate.data<float>();
  const float* u = up.data<float>();
  const float* d = dy.data<float>();
  float* dgp = dg.data<float>();
  float* dup = du.data<float>();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid(g[i]);
    dgp[i] = d[i] * u[i] * s * (1.f + g[i] * (1.f - s));
    dup[i] = d[i] * g[i] * s;
  }
  return {dg, du};
}

// Rotary embedding with the head transpose folded in: x [B, S, N, D] -> out [B, N, S, D],
// out = scale * (x * cos + rotate_half(x) * sin), rotate_half([x1, x2]) = [-x2, x1] (halves of D),
// cos / sin [B, S, D]. `scale` lets attention put 1/sqrt(D) on q here instead of on the scores.
std::vector<paddle::Tensor> Rope(const paddle::Tensor& x, const paddle::Tensor& cos, const paddle::Tensor& sin,
                                 float scale) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && cos.dtype() == paddle::DataType::FLOAT32 &&
           sin.dtype() == paddle::DataType::FLOAT32, "pt_rope: float32 only");
  const auto sh = x.shape();
  PD_CHECK(sh.size() == 4 && sh[3] % 2 == 0, "pt_rope: x must be [B, S, N, D] with even D");
  const int64_t B = sh[0], S = sh[1], N = sh[2], D = sh[3], h = D / 2;
  PD_CHECK(cos.numel() == B * S * D && sin.numel() == B * S * D, "pt_rope: cos/sin must be [B, S, D]");
  auto out = paddle::empty({B, N, S, D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* xp = x.data<float>();
  const float* cp = cos.data<float>();
  const float* sp = sin.data<float>();
  float* op = out.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < B * S; ++r) {
    const int64_t b = r / S, s = r % S;
    const float* c = cp + r * D;
    const float* sn = sp + r * D;
    for (int64_t n = 0; n < N; ++n) {
      const float* xi = xp + (r * N + n) * D;
      float* o = op + ((b * N + n) * S + s) * D;
#pragma omp simd
      for (int64_t j = 0; j < h; ++j) o[j] = scale * (xi[j] * c[j] - xi[j + h] * sn[j]);
#pragma omp simd
      for (int64_t j = h; j < D; ++j) o[j] = scale * (xi[j] * c[j] + xi[j - h] * sn[j]);
    }
  }
  return {out};
}

// dx [B, S, N, D] from dout [B, N, S, D]: dx_i = scale * (dout_i cos_i + (i < D/2 ? dout_{i+h} sin_{i+h}
// : -dout_{i-h} sin_{i-h})), the transpose of the forward's linear map.
std::vector<paddle::Tensor> RopeBwd(const paddle::Tensor& dout, const paddle::Tensor& cos, const paddle::Tensor& sin,
                                    float scale) {
  const auto sh = dout.shape();
  const int64_t B = sh[0], N = sh[1], S = sh[2], D = sh[3], h = D / 2;
  auto dx = paddle::empty({B, S, N, D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* gp = dout.data<float>();
  const float* cp = cos.data<float>();
  const float* sp = sin.data<float>();
  float* dp = dx.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < B * S; ++r) {
    const int64_t b = r / S, s = r % S;
    const float* c = cp + r * D;
    const float* sn = sp + r * D;
    for (int64_t n = 0; n < N; ++n) {
      const float* g = gp + ((b * N + n) * S + s) * D;
      float* o = dp + (r * N + n) * D;
#pragma omp simd
      for (int64_t j = 0; j < h; ++j) o[j] = scale * (g[j] * c[j] + g[j + h] * sn[j + h]);
#pragma omp simd
      for (int64_t j = h; j < D; ++j) o[j] = scale * (g[j] * c[j] - g[j - h] * sn[j - h]);
    }
  }
  return {dx};
}

PD_BUILD_OP(pt_softmax_xent)
    .Inputs({"Logits", "Targets"})
    .Outputs({"Loss"})
    .SetKernelFn(PD_KERNEL(SoftmaxXent));

PD_BUILD_OP(pt_masked_softmax)
    .Inputs({"Scores", "Mask"})
    .Outputs({"Probs"})
    .SetKernelFn(PD_KERNEL(MaskedSoftmax));

PD_BUILD_OP(pt_masked_softmax_bwd)
    .Inputs({"Probs", "DProbs", "Mask"})
    .Outputs({"DScores"})
    .SetKernelFn(PD_KERNEL(MaskedSoftmaxBwd));

PD_BUILD_OP(pt_rms_norm)
    .Inputs({"X", "Weight"})
    .Outputs({"Y", "Rstd"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(RmsNorm));

PD_BUILD_OP(pt_rms_norm_bwd)
    .Inputs({"X", "Weight", "Rstd", "DY"})
    .Outputs({"DX", "DWeight"})
    .Attrs({"want_dw: bool"})
    .SetKernelFn(PD_KERNEL(RmsNormBwd));

PD_BUILD_OP(pt_swiglu)
    .Inputs({"Gate", "Up"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(Swiglu));

PD_BUILD_OP(pt_swiglu_bwd)
    .Inputs({"Gate", "Up", "DOut"})
    .Outputs({"DGate", "DUp"})
    .SetKernelFn(PD_KERNEL(SwigluBwd));

PD_BUILD_OP(pt_rope)
    .Inputs({"X", "Cos", "Sin"})
    .Outputs({"Out"})
    .Attrs({"scale: float"})
    .SetKernelFn(PD_KERNEL(Rope));

PD_BUILD_OP(pt_rope_bwd)
    .Inputs({"DOut", "Cos", "Sin"})
    .Outputs({"DX"})
    .Attrs({"scale: float"})
    .SetKernelFn(PD_KERNEL(RopeBwd));
