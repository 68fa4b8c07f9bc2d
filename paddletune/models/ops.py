"""The op table: which implementation the fusable ops of every model family run, chosen once per
run from the device and logged in one line.

Every family reaches these ops through models/layers.py only (RMSNorm, swiglu, RopeTables,
attention), and layers.py asks `table()` which column to run:

    op          "cpu" column (today's CPU path)            "gpu" column (paddle's fused ops)
    rms_norm    kernels.rms_norm, else expand + matmul mean  paddle.incubate...fused_rms_norm
    swiglu      kernels.swiglu, else silu(g) * u            paddle.nn.functional.swiglu
    rope        kernels.rope_heads_first, else the D x D     paddle.incubate...fused_rotary_position_
                signed-permutation matmul (RopeTables)        embedding (x [B, S, N, D], neox style)
    attention   kernels.blocked_attention (online softmax,   flash_attention (causal, no padding),
                O(S) memory: causal, bool masks, packed       scaled_dot_product_attention (masks),
                rows, GQA), see cpu_attention; else dense     flashmask_attention (packed rows),
                [B, K, g*S, T] matmuls + CPU masked softmax   all in paddle's [B, S, N, D] layout
    ALiBi, custom attention dropout (ChatGLM, TP), ChatGLM's half-dim rope, LayerNorm + GELU
    (GPT-2 / OPT / Bloom): plain paddle ops in the gpu column (no fused paddle op takes them).

Choice: PADDLETUNE_OPS=cpu|gpu forces a column (tests force "gpu" on CPU to run the fused ops
that have CPU kernels); otherwise "gpu" when paddle is a CUDA build with a GPU device set, else
"cpu". `use("gpu")` switches it for a block of code (tests).

On a CPU tensor the gpu column runs the fused op only where paddle 3.3.1 has a CPU kernel for
it: sdpa, flash_attention (causal; CPU ignores softmax_scale and has no GQA, so q is rescaled
and K/V heads repeated there), F.swiglu; fused_rms_norm only forward, float32, on CPUs with
AVX-512F (its CPU kernel dies with SIGILL on AVX2-only CPUs, measured; it has no CPU backward);
fused rope and flashmask have no CPU kernel. The rest fall back to plain paddle ops, and `TAKEN` records every paddle function actually called
(tools/gpu_check.py asserts the GPU choices were taken on a GPU).
"""
import logging
import math
import os
from contextlib import contextmanager

import paddle
import paddle.nn.functional as F

logger = logging.getLogger("paddletune")
_STATE = {}
TAKEN = set()   # names of the paddle functions the gpu column called (gpu_check reads it)


def column():
    """'cpu' or 'gpu': the column this run uses, chosen on first call and logged once."""
    if "column" not in _STATE:
        forced = os.environ.get("PADDLETUNE_OPS", "").strip().lower()
        if forced and forced not in ("cpu", "gpu"):
            raise ValueError(f"PADDLETUNE_OPS={forced!r}: use cpu or gpu (or unset it)")
        on_gpu = paddle.is_compiled_with_cuda() and "gpu" in paddle.device.get_device()
        _STATE["column"] = forced or ("gpu" if on_gpu else "cpu")
        logger.info("op table: %s column (%s)%s", _STATE["column"], DESCRIBE[_STATE["column"]],
                    " [PADDLETUNE_OPS]" if forced else "")
    return _STATE["column"]


DESCRIBE = {
    "cpu": "attention, RMSNorm / SwiGLU / rope on paddletune's CPU kernels (blocked attention; dense "
           "where it does not apply)",
    "gpu": "attention paddle flash_attention / scaled_dot_product_attention / flashmask_attention in "
           "[B, S, N, D], fused_rms_norm, fused_rotary_position_embedding, F.swiglu",
}


def compute_dtype(requested=None, declared="float32", on_gpu=None):
    """The dtype a model runs in: `requested` (e.g. the predictor's --dtype) or else the
    checkpoint's `declared` one (config.json torch_dtype). On CPU, float16 / bfloat16 become
    float32 (paddle's CPU kernels have no 16-bit matmul), said in one log line."""
    dtype = requested or declared or "float32"
    if on_gpu is None:
        on_gpu = paddle.is_compiled_with_cuda() and "gpu" in paddle.device.get_device()
    if dtype in ("float16", "bfloat16") and not on_gpu:
        logger.info("dtype %s: computing in float32 on CPU (paddle's CPU has no %s matmul)", dtype, dtype)
        return "float32"
    return dtype


def gpu():
    """True when the gpu column runs."""
    return column() == "gpu"


@contextmanager
def use(name):
    """Run the enclosed code with column `name` ('cpu' / 'gpu'), then restore the previous one."""
    before = _STATE.get("column")
    _STATE["column"] = name
    try:
        yield
    finally:
        if before is None:
            _STATE.pop("column", None)
        else:
            _STATE["column"] = before


def _on_gpu(t):
    return not t.place.is_cpu_place()


def _cpu_has_avx512():
    if "avx512" not in _STATE:
        try:
            with open("/proc/cpuinfo") as f:
                _STATE["avx512"] = " avx512f" in f.read()
        except OSError:
            _STATE["avx512"] = False
    return _STATE["avx512"]


# ------------------------------------------------------------------------------ cpu column attention

def cpu_attention(q, k, v, bias, dropout, training, scale, alibi=None, dropout_fn=None):
    """The CPU column's attention row: the blocked kernel (kernels/attention.py, memory linear in
    S) for q [B, N, S, D], k / v [B, K, T, D] float32 with bias None (no mask), the plain causal
    mask, any bool mask [B|1, 1, S, T], a layers.PackedRows (block-diagonal causal via each
    query's example start) or a layers.PaddedRows (causal within each row's key window).
    Returns [B, S, N*D], or None for the cases that keep the dense reference path: ALiBi,
    attention dropout while training (the kernel has no dropout), the decode step (S == 1: one
    query row, nothing to block), 16-/64-bit dtypes, kernels off, PADDLETUNE_BLOCKED_ATTENTION=0
    (the dense path everywhere: the step-time A/B in benchmarks/README.md)."""
    if alibi is not None or dropout_fn is not None or (dropout > 0 and training) or q.shape[2] == 1:
        return None
    if os.environ.get("PADDLETUNE_BLOCKED_ATTENTION", "1") == "0":   # A/B switch (benchmarks/README.md)
        return None
    from .. import kernels
    from .layers import PackedRows, PaddedRows, is_plain_causal

    S, T = q.shape[2], k.shape[2]
    if isinstance(bias, PaddedRows):
        return kernels.blocked_attention(q, k, v, scale, causal=True, window=bias.window) if T == S else None
    if isinstance(bias, PackedRows):
        if T != S:
            return None
        if not hasattr(bias, "_starts"):   # made once per forward, shared by the layers
            bias._starts = paddle.to_tensor(kernels.example_starts(bias.runs, S))
        return kernels.blocked_attention(q, k, v, scale, causal=True, starts=bias._starts)
    if bias is None:
        return kernels.blocked_attention(q, k, v, scale)
    if is_plain_causal(bias, S) and T == S:
        return kernels.blocked_attention(q, k, v, scale, causal=True)
    return kernels.blocked_attention(q, k, v, scale, mask=bias)


# ------------------------------------------------------------------------------ gpu column ops

def rms_norm_args(x, weight, eps):
    """(args, kwargs) paddletune passes to fused_rms_norm: normalise over the last axis."""
    return (x, weight.astype(x.dtype), None, eps), dict(begin_norm_axis=len(x.shape) - 1)


def _fused_rms_norm_runs(x, weight):
    """fused_rms_norm on a GPU always. paddle 3.3.1's CPU build registers only its float32 forward
    (phi::fusion::RmsNormAvxKernel, AVX-512F code: SIGILL on AVX2-only CPUs) and no backward
    kernel, so on CPU it is used only where that kernel can run: AVX-512F, float32, no gradient."""
    if _on_gpu(x):
        return True
    needs_grad = paddle.is_grad_enabled() and not (x.stop_gradient and weight.stop_gradient)
    return _cpu_has_avx512() and x.dtype == paddle.float32 and not needs_grad


def rms_norm(x, weight, eps):
    """weight * x / sqrt(mean(x^2, -1) + eps), x [..., H], weight [H]; statistics in float32 for
    16-bit x (layers.wide), output in x's dtype."""
    if _fused_rms_norm_runs(x, weight):
        from paddle.incubate.nn.functional import fused_rms_norm

        TAKEN.add("fused_rms_norm")
        args, kwargs = rms_norm_args(x, weight, eps)
        return fused_rms_norm(*args, **kwargs)[0]
    from .layers import wide

    x32 = x.astype(wide(x.dtype))
    y = x32 * paddle.rsqrt(paddle.mean(paddle.square(x32), axis=-1, keepdim=True) + eps)
    return y.astype(x.dtype) * weight.astype(x.dtype)


def swiglu_args(gate, up):
    return (gate, up), {}


def swiglu(gate, up):
    """silu(gate) * up, paddle's fused op (CPU and GPU kernels)."""
    TAKEN.add("swiglu")
    args, kwargs = swiglu_args(gate, up)
    return F.swiglu(*args, **kwargs)


def rope_args(x, cos, sin):
    """(args, kwargs) for fused_rotary_position_embedding on x [B, S, N, D] with per-row tables
    cos, sin [B, S, D]: the tables flattened to [1, B*S, 1, D] and position_ids [B, S] = b*S + s
    pick each row's own entry (the op takes one [1, L, 1, D] table). use_neox_rotary_style=False
    is paddle's name for rotate-half (first / second half pairs), the HF Llama convention."""
    B, S, N, D = x.shape
    flat = lambda t: t.reshape([1, B * S, 1, D]).astype(x.dtype)  # noqa: E731
    pos = paddle.arange(B * S, dtype="int64").reshape([B, S])
    return (x, None, None), dict(sin=flat(sin), cos=flat(cos), position_ids=pos, use_neox_rotary_style=False)


def rope(x, cos, sin, scale=1.0):
    """Rotary embedding (rotate-half) of x [B, S, N, D] with cos, sin [B, S, D], times `scale`,
    returned heads first [B, N, S, D] (the layout the model files keep)."""
    if _on_gpu(x):
        from paddle.incubate.nn.functional import fused_rotary_position_embedding

        TAKEN.add("fused_rotary_position_embedding")
        args, kwargs = rope_args(x, cos, sin)
        out = fused_rotary_position_embedding(*args, **kwargs)[0]
    else:   # no CPU kernel: plain ops (split + concat, not the CPU column's permutation matmul)
        c, s = cos.unsqueeze(2).astype(x.dtype), sin.unsqueeze(2).astype(x.dtype)
        x1, x2 = paddle.split(x, 2, axis=-1)
        out = x * c + paddle.concat([-x2, x1], axis=-1) * s
    if scale != 1.0:
        out = out * scale
    return out.transpose([0, 2, 1, 3])


def attention(q, k, v, bias, dropout, training, scale, causal, neg):
    """Attention through paddle's fused ops. q [B, N, S, D]; k, v [B, K, T, D] (heads first, as the
    models keep them and the KV cache stores them); bias: None, a bool mask [B|1, 1, S, T] (True =
    blocked) or a layers.PackedRows; causal: bias is the plain causal mask with T = S.
    Returns [B, S, N*D].

    - causal, no padding: flash_attention(q, k, v, causal=True) on [B, S, N, D];
    - a mask: scaled_dot_product_attention with the additive mask (blocked -> `neg`, not -inf, so a
      fully blocked padding row gives the CPU path's uniform row instead of NaN);
    - packed rows: flashmask_attention with per-key document ends on GPU; on CPU (no kernel) sdpa
      per block of whole examples (layers.PackedRows)."""
    B, N, S, D = q.shape
    p = dropout if training else 0.0
    qs, ks, vs = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))   # paddle's [B, S, heads, D]
    if hasattr(bias, "blocks"):
        return _packed(qs, ks, vs, bias, p, training, scale, neg).reshape([B, S, N * D])
    if causal and (not _on_gpu(qs) or qs.dtype in (paddle.float16, paddle.bfloat16)):
        out = _flash_causal(qs, ks, vs, p, training, scale)   # (GPU flash kernels: 16-bit only)
    else:
        out = _sdpa(qs, ks, vs, bias, p, training, scale, neg)
    return out.reshape([B, S, N * D])


def sdpa_args(qs, ks, vs, bias, p, training, scale, neg):
    """(args, kwargs) for scaled_dot_product_attention: [B, S, heads, D] inputs, grouped KV heads
    as they are (enable_gqa), the bool mask as an additive one of q's dtype."""
    mask = None if bias is None else paddle.zeros(bias.shape, qs.dtype).masked_fill(bias, neg)
    return (qs, ks, vs), dict(attn_mask=mask, dropout_p=p, is_causal=False, training=training,
                              scale=scale, enable_gqa=True)


def _sdpa(qs, ks, vs, bias, p, training, scale, neg):
    TAKEN.add("scaled_dot_product_attention")
    args, kwargs = sdpa_args(qs, ks, vs, bias, p, training, scale, neg)
    return F.scaled_dot_product_attention(*args, **kwargs)


def flash_args(qs, ks, vs, p, training, scale):
    """(args, kwargs) paddletune passes to flash_attention (tests bind them to its signature)."""
    return (qs, ks, vs), dict(dropout=p, causal=True, training=training, softmax_scale=scale)


def _flash_causal(qs, ks, vs, p, training, scale):
    from paddle.nn.functional.flash_attention import flash_attention

    if not _on_gpu(qs):
        # paddle's CPU flash_attention ignores softmax_scale and has no grouped KV heads
        D, g = qs.shape[-1], qs.shape[2] // ks.shape[2]
        if scale != 1.0 / math.sqrt(D):
            qs = qs * (scale * math.sqrt(D))
        scale = None
        if g > 1:
            ks, vs = (paddle.repeat_interleave(t, g, axis=2) for t in (ks, vs))
    args, kwargs = flash_args(qs, ks, vs, p, training, scale)
    TAKEN.add("flash_attention")
    return flash_attention(*args, **kwargs)[0]


def flashmask_args(qs, ks, vs, layout, p, training, scale):
    """(args, kwargs) for flashmask_attention over packed rows: startend_row_indices [B, 1, S, 1]
    int32 = for key j, the first query row that may not see it (the end of j's example), with
    causal=True: document-causal attention."""
    B, S = layout.shape
    ends = paddle.to_tensor(layout.key_ends()).reshape([B, 1, S, 1])
    return (qs, ks, vs, ends), dict(dropout=p, causal=True, training=training, softmax_scale=scale)


def _packed(qs, ks, vs, layout, p, training, scale, neg):
    if _on_gpu(qs) and qs.dtype in (paddle.float16, paddle.bfloat16):
        from paddle.nn.functional.flash_attention import flashmask_attention

        args, kwargs = flashmask_args(qs, ks, vs, layout, p, training, scale)
        TAKEN.add("flashmask_attention")
        return flashmask_attention(*args, **kwargs)
    whole = layout.whole_row_mask()
    if whole is not None:
        return _sdpa(qs, ks, vs, whole, p, training, scale, neg)
    rows = [[] for _ in range(qs.shape[0])]
    for b, lo, hi, blocked in layout.blocks:
        sl = lambda t: t[b:b + 1, lo:hi]  # noqa: E731
        rows[b].append(_sdpa(sl(qs), sl(ks), sl(vs), blocked, p, training, scale, neg))
    return paddle.concat([paddle.concat(r, axis=1) if len(r) > 1 else r[0] for r in rows], axis=0)
