// paddletune CPU blocked attention (float32), forward and backward, as paddle ops: the inputs'
// checks and shapes here, the computation in attention_core.h (the math, layouts and masks are
// described there). Compiled with cpu_kernels.cc.
#include "paddle/extension.h"

#include <vector>

#include "attention_core.h"

namespace {

ptattn::Problem make_problem(const paddle::Tensor& q, const paddle::Tensor& k, float sc, bool ca,
                             const paddle::Tensor& m, bool use_mask, const paddle::Tensor& st, bool use_starts,
                             const paddle::Tensor& win, bool use_window) {
  ptattn::Problem P;
  const auto qs = q.shape(), ks = k.shape();
  PD_CHECK(qs.size() == 4 && ks.size() == 4, "pt_flash_attn: q [B, N, S, D], k / v [B, K, T, D]");
  P.B = qs[0], P.N = qs[1], P.S = qs[2], P.D = qs[3], P.K = ks[1], P.T = ks[2];
  PD_CHECK(ks[0] == P.B && ks[3] == P.D && P.K > 0 && P.N % P.K == 0,
           "pt_flash_attn: k must be [B, K, T, D], N % K == 0");
  PD_CHECK(P.T >= P.S || !ca, "pt_flash_attn: causal needs T >= S");
  P.g = P.N / P.K, P.past = P.T - P.S, P.scale = sc, P.causal = ca;
  if (use_mask) {
    const auto ms = m.shape();
    PD_CHECK(ms.size() == 4 && ms[1] == 1 && ms[2] == P.S && ms[3] == P.T && (ms[0] == 1 || ms[0] == P.B),
             "pt_flash_attn: mask must be [B or 1, 1, S, T]");
    P.mask = m.data<bool>(), P.Bm = ms[0];
  }
  if (use_starts) {
    PD_CHECK(st.numel() == P.B * P.S && P.T == P.S, "pt_flash_attn: starts must be [B, S] with T == S");
    P.starts = st.data<int32_t>();
  }
  if (use_window) {
    PD_CHECK(win.numel() == 2 * P.B, "pt_flash_attn: window must be [B, 2] (first key, end key)");
    P.window = win.data<int32_t>();
  }
  return P;
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
                                      const paddle::Tensor& mask, const paddle::Tensor& starts,
                                      const paddle::Tensor& window, float scale, bool causal, bool use_mask,
                                      bool use_starts, bool use_window) {
  PD_CHECK(q.dtype() == paddle::DataType::FLOAT32 && k.dtype() == paddle::DataType::FLOAT32 &&
           v.dtype() == paddle::DataType::FLOAT32, "pt_flash_attn: float32 only");
  const auto P = make_problem(q, k, scale, causal, mask, use_mask, starts, use_starts, window, use_window);
  auto out = paddle::empty({P.B, P.S, P.N * P.D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto lse = paddle::empty({P.B, P.N, P.S}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  ptattn::forward(P, q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(), lse.data<float>());
  return {out, lse};
}

std::vector<paddle::Tensor> FlashAttnBwd(const paddle::Tensor& q, const paddle::Tensor& k, const paddle::Tensor& v,
                                         const paddle::Tensor& out, const paddle::Tensor& lse,
                                         const paddle::Tensor& dout, const paddle::Tensor& mask,
                                         const paddle::Tensor& starts, const paddle::Tensor& window, float scale,
                                         bool causal, bool use_mask, bool use_starts, bool use_window) {
  const auto P = make_problem(q, k, scale, causal, mask, use_mask, starts, use_starts, window, use_window);
  PD_CHECK(dout.numel() == P.B * P.S * P.N * P.D && out.numel() == P.B * P.S * P.N * P.D,
           "pt_flash_attn_bwd: dout / out shape");
  auto dq = paddle::empty({P.B, P.N, P.S, P.D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  // per query head dk / dv, summed over each KV head's g query heads at the end (GQA)
  auto dkh = paddle::empty({P.B, P.N, P.T, P.D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto dvh = paddle::empty({P.B, P.N, P.T, P.D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  ptattn::backward(P, q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(), lse.data<float>(),
                   dout.data<float>(), dq.data<float>(), dkh.data<float>(), dvh.data<float>());
  if (P.g == 1) return {dq, dkh, dvh};
  return {dq, sum_groups(dkh, P.K), sum_groups(dvh, P.K)};
}

PD_BUILD_OP(pt_flash_attn)
    .Inputs({"Q", "K", "V", "Mask", "Starts", "Window"})
    .Outputs({"Out", "Lse"})
    .Attrs({"scale: float", "causal: bool", "use_mask: bool", "use_starts: bool", "use_window: bool"})
    .SetKernelFn(PD_KERNEL(FlashAttn));

PD_BUILD_OP(pt_flash_attn_bwd)
    .Inputs({"Q", "K", "V", "Out", "Lse", "DOut", "Mask", "Starts", "Window"})
    .Outputs({"DQ", "DK", "DV"})
    .Attrs({"scale: float", "causal: bool", "use_mask: bool", "use_starts: bool", "use_window: bool"})
    .SetKernelFn(PD_KERNEL(FlashAttnBwd));
