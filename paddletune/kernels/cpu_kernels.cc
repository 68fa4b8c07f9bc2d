// paddletune CPU kernels (float32), compiled on first use by paddletune/kernels/__init__.py.
//
// Why: paddle 3.3.1's CPU softmax / cross-entropy kernels are single-threaded and make several
// passes; these make one or two passes per row, split rows over the OpenMP threads paddle's MKL
// already uses (libiomp5), and vectorize exp. Results equal paddle's kernels to float32
// rounding (tests/test_kernels.py compares them).
#include "paddle/extension.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// exp(x) for x in [-80, 0] (callers clamp): x = k ln2 + r, |r| <= ln2/2, exp(r) by a degree-7
// polynomial (Cephes expf coefficients), 2^k through the exponent bits. Plain arithmetic, so the loops vectorize without
// -ffast-math (which would also break NaN propagation). Relative error < 2e-7.
inline float exp_neg(float x) {
  const float k = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;   // round to nearest
  const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187045e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

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

// logits [n, V], targets [n] (int64, 0 <= t < V) -> loss [n] = logsumexp(row) - row[t],
// grad [n, V] = softmax(row) - onehot(t): the gradient of sum(loss) with respect to logits.
std::vector<paddle::Tensor> SoftmaxXent(const paddle::Tensor& logits, const paddle::Tensor& targets) {
  PD_CHECK(logits.dtype() == paddle::DataType::FLOAT32, "pt_softmax_xent: float32 logits only");
  PD_CHECK(logits.shape().size() == 2, "pt_softmax_xent: logits must be [n, V]");
  const int64_t n = logits.shape()[0], V = logits.shape()[1];
  PD_CHECK(targets.numel() == n, "pt_softmax_xent: one target per row");
  auto grad = paddle::empty({n, V}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto loss = paddle::empty({n}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* x = logits.data<float>();
  const int64_t* t = targets.data<int64_t>();
  float* g = grad.data<float>();
  float* l = loss.data<float>();
  for (int64_t i = 0; i < n; ++i) PD_CHECK(t[i] >= 0 && t[i] < V, "pt_softmax_xent: target out of range");
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * V;
    float* gi = g + i * V;
    float m = -INFINITY;
    for (int64_t j = 0; j < V; ++j) m = xi[j] > m ? xi[j] : m;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < V; ++j) {
      float d = xi[j] - m;
      d = d < -80.f ? -80.f : d;
      const float e = exp_neg(d);
      gi[j] = e;
      s += e;
    }
    const float inv = 1.f / s;
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) gi[j] *= inv;
    l[i] = std::log(s) + m - xi[t[i]];
    gi[t[i]] -= 1.f;
  }
  return {loss, grad};
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

PD_BUILD_OP(pt_softmax_xent)
    .Inputs({"Logits", "Targets"})
    .Outputs({"Loss", "Grad"})
    .SetKernelFn(PD_KERNEL(SoftmaxXent));

PD_BUILD_OP(pt_masked_softmax)
    .Inputs({"Scores", "Mask"})
    .Outputs({"Probs"})
    .SetKernelFn(PD_KERNEL(MaskedSoftmax));

PD_BUILD_OP(pt_masked_softmax_bwd)
    .Inputs({"Probs", "DProbs", "Mask"})
    .Outputs({"DScores"})
    .SetKernelFn(PD_KERNEL(MaskedSoftmaxBwd));
