"""paddle's fused `weight_only_linear` for weight_only_int8 / weight_only_int4 on CUDA GPUs.

UNTESTED: our machines have no GPU (paddle 3.3.1 CPU has no weight_only_linear kernel). The path
is guarded three ways: it is only tried for CUDA tensors in float16/bfloat16 with a supported
algorithm and block size; the first conversion of every layer is checked against the reference
(CPU-path) matmul on a random input; any exception or mismatch disables the fused path for the
process with one warning, and the reference path (the same on CPU and GPU) is used instead.

Conversion: the layer's weight is dequantized once into the compute dtype, requantized by
paddle.nn.quant.weight_quantize into paddle's kernel layout (per output channel for int8, groups
of 64/128 input rows per output channel for int4), and our codes are dropped: between forwards
the layer still holds only codes and scales. The backward dx = dy @ W dequantizes with
paddle.nn.quant.weight_dequantize.

Only layers with blocks along "in" (column-parallel and unsplit layers) are converted: there our
scales are per output row (int8) or per 64/128 input features of an output row (int4, when
blocksize divides in_features), exactly paddle's, so the values survive requantization. Layers
with blocks along "out" (row-parallel plan: per input column scales) cannot take paddle's
per-output-channel layout without a second rounding, so they keep the reference path.
"""
import logging

import paddle
from paddle.autograd import PyLayer

from ..models import hf, ops

logger = logging.getLogger("paddletune")
_STATE = {"disabled": False}
CHECK_TOL = {"int8": 2e-2, "int4": 2e-2}   # relative max error vs the reference, fp16/bf16


def _eligible(x, layer):
    algo = layer.algo
    # the op table's gpu column (models/ops.py) on a CUDA build; nf4 / fp4 have no fused_dtype:
    # they stay on paddletune's chunked dequantize + matmul (weight_only.matmul_reference)
    if algo.fused_dtype is None or not paddle.is_compiled_with_cuda() or not ops.gpu():
        return False
    if layer.block_axis != "in":   # per-input-column scales: paddle's layout cannot hold them
        return False
    if not x.place.is_gpu_place() or x.dtype not in (paddle.float16, paddle.bfloat16):
        return False
    if algo.bits == 4 and layer.blocksize not in (64, 128):
        return False
    return layer.in_features % layer.blocksize == 0 if algo.bits == 4 else True


def _group(layer):
    return layer.blocksize if layer.algo.bits == 4 else -1


def _disable(why):
    _STATE["disabled"] = True
    logger.warning("fused weight_only_linear disabled (%s); using the reference dequantize+matmul "
                   "path", why)


def _convert(layer, dtype):
    """Replace our codes by paddle's fused layout after checking one random product."""
    from paddle.nn.quant import weight_only_linear, weight_quantize

    try:
        w = layer.dequantize(dtype)   # paddle layout [in, out] (layer.fused is still None)
        args, kwargs = weight_quantize_args(w, layer)
        q, s = weight_quantize(*args, **kwargs)
        x0 = paddle.randn([4, layer.in_features]).astype(dtype)
        ref = paddle.matmul(x0, w).astype("float32")
        got = weight_only_linear(x0, q, None, s, layer.algo.fused_dtype,
                                 group_size=_group(layer)).astype("float32")
        err = float((got - ref).abs().max() / ref.abs().max().clip(min=1e-12))
    except Exception as e:  # noqa: BLE001 - any failure means: use the reference path
        _disable(f"{type(e).__name__}: {e}")
        return False
    if not err <= CHECK_TOL[layer.algo.fused_dtype]:
        _disable(f"self-check error {err:.3g} on {layer.weight_name}")
        return False
    for name in layer.FIELDS:
        layer._buffers.pop(name, None)
    layer.register_buffer("fused_weight", q, persistable=False)
    layer.register_buffer("fused_scale", s, persistable=False)
    layer.fused = {"dtype": dtype}
    return True


def dequantize_fused(layer, dtype):
    """W in paddle layout [in, out] from the fused layout."""
    from paddle.nn.quant import weight_dequantize

    args, kwargs = weight_dequantize_args(layer)
    w = weight_dequantize(*args, **kwargs).astype(dtype)
    # paddle's kernel layout may come back [out, in]; callers get paddle's Linear layout
    return w if list(w.shape) == [layer.in_features, layer.out_features] else hf.linear_to_paddle(w)


def weight_quantize_args(w, layer):
    """(args, kwargs) passed to paddle.nn.quant.weight_quantize: w [in, out] in the compute dtype."""
    return (w,), dict(algo=layer.algo.name, group_size=_group(layer))


def weight_dequantize_args(layer):
    """(args, kwargs) passed to paddle.nn.quant.weight_dequantize (the fused path's backward)."""
    return (layer.fused_weight, layer.fused_scale, layer.algo.name), dict(group_size=_group(layer))


def weight_only_linear_args(x, layer):
    """(args, kwargs) passed to paddle.nn.quant.weight_only_linear (tests bind them)."""
    return (x, layer.fused_weight, None, layer.fused_scale, layer.algo.fused_dtype), \
        dict(group_size=_group(layer))


class _FusedMatmul(PyLayer):
    @staticmethod
    def forward(ctx, x, layer):
        from paddle.nn.quant import weight_only_linear

        ctx.layer = layer
        ops.TAKEN.add("weight_only_linear")
        args, kwargs = weight_only_linear_args(x, layer)
        return weight_only_linear(*args, **kwargs)

    @staticmethod
    def backward(ctx, dy):
        # dx = dy @ W^T with W [in, out]: arithmetic of the product, not a layout change
        return paddle.matmul(dy, dequantize_fused(ctx.layer, dy.dtype), transpose_y=True)


def try_fused(x, layer):
    """Fused product x @ W^T, or None when the reference path must be used."""
    if layer.fused is None:
        if _STATE["disabled"] or not (_eligible(x, layer) and layer.loaded and _convert(layer, x.dtype)):
            return None
    if layer.fused is not None and x.dtype != layer.fused["dtype"]:
        x = x.astype(layer.fused["dtype"])
    return _FusedMatmul.apply(x, layer)
