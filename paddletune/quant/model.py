"""Putting QuantizedLinear layers into a model, and counting what they hold.

    quantize_model_lazily(model, quant_args)   # before load_weights: Linears become empty
                                               # QuantizedLinears, filled tensor by tensor at load
    quantize_model(model, quant_args)          # an in-memory model: quantize its current weights
    report = quant_report(model)               # bytes held vs float32, per quantized part and whole

Which Linears are kept in full precision: `quant_skip_modules` (regexes, full match over module
names such as "model.layers.0.mlp.down_proj"); by default (None) the LM head named by
ModelSpec.lm_head (and ModelSpec.quant_keep: MoE routers). Embeddings are not Linear layers and are never quantized. Quantized weights are frozen (no parameter exists for them).

Block axis (weight_only.py): quantization blocks run along the axis a tensor-parallel split never
cuts, so a TP rank can quantize just its slice and hold exactly the slice of the whole quantized
weight. block_axis_for reads it from ModelSpec.tp_plan: "row" modules (split along `in`) get
blocks along "out"; every other Linear ("column", the LM head, unplanned) along "in". This holds
in a single process too, so one checkpoint quantizes to the same codes with or without TP.
"""
import logging
import re

import numpy as np
import paddle.nn as nn

from ..models import hf
from .weight_only import QuantConfig, QuantizedLinear

logger = logging.getLogger("paddletune")


def quant_config(quant_args):
    """QuantConfig from a QuantArgument (or None when weight_quantize_algo is unset)."""
    if quant_args is None or isinstance(quant_args, QuantConfig):
        return quant_args
    algo = getattr(quant_args, "weight_quantize_algo", None)
    if not algo:
        return None
    return QuantConfig(algo, quant_args.weight_blocksize, bool(quant_args.weight_double_quant),
                       quant_args.weight_double_quant_block_size)


def _skip_fn(model, quant_args):
    patterns = getattr(quant_args, "quant_skip_modules", None)
    if patterns is None:
        head = model.spec.lm_head   # the LM head stays full precision (embeddings are not Linear)
        keep = [re.compile(p) for p in getattr(model.spec, "quant_keep", ())]   # MoE routers
        return lambda name, layer: name == head or any(r.fullmatch(name) for r in keep)
    try:
        regs = [re.compile(p) for p in patterns]
    except re.error as e:
        raise ValueError(f"quant_skip_modules: bad regex ({e}); give full-match regexes over "
                         "module names, e.g. \".*lm_head\"") from None
    return lambda name, layer: any(r.fullmatch(name) for r in regs)


def block_axis_for(spec, module_name):
    """"out" for a module the TP plan splits along its input features ("row", matched by the
    name's last component, e.g. "model.layers.0.mlp.down_proj" -> "down_proj"), else "in"."""
    return "out" if spec.tp_plan.get(module_name.rpartition(".")[2]) == "row" else "in"


def _replace(model, quant_args, from_weights, block_axis=None):
    cfg = quant_config(quant_args)
    if cfg is None:
        return []
    axis_of = block_axis or (lambda name: block_axis_for(model.spec, name))
    skip = _skip_fn(model, quant_args)
    targets = [(n, m) for n, m in model.named_sublayers()
               if type(m) is nn.Linear and not skip(n, m)]
    if not targets:
        raise ValueError(f"weight_quantize_algo={cfg.algo}: no Linear layer left to quantize "
                         f"(quant_skip_modules={getattr(quant_args, 'quant_skip_modules', None)})")
    parents = dict(model.named_sublayers(include_self=True))
    for name, lin in targets:
        parent_name, _, child = name.rpartition(".")
        in_f, out_f = lin.weight.shape
        q = QuantizedLinear(in_f, out_f, cfg, bias=lin.bias, weight_name=name + ".weight",
                            block_axis=axis_of(name))
        if from_weights:
            q.set_weight(hf.linear_to_hf(lin.weight.numpy()))   # QuantizedLinear holds [out, in]
        parents[parent_name]._sub_layers[child] = q
    model.quant_config = cfg
    return [n for n, _ in targets]


def quantize_model_lazily(model, quant_args, block_axis=None):
    """Swap every Linear (except skipped ones) for an empty QuantizedLinear, without touching
    its weight: under paddle.LazyGuard (models.build_model) that weight was never allocated.
    models.load_weights then streams each checkpoint tensor into QuantizedLinear.set_weight.
    `block_axis`: None (from the TP plan: block_axis_for) or a function module name -> "in" /
    "out" that decides instead. Returns the replaced module names."""
    return _replace(model, quant_args, from_weights=False, block_axis=block_axis)


def quantize_model(model, quant_args, block_axis=None):
    """Quantize an in-memory model's Linear weights in place (same selection and block_axis)."""
    return _replace(model, quant_args, from_weights=True, block_axis=block_axis)


def quantized_layers(model):
    return [(n, m) for n, m in model.named_sublayers() if isinstance(m, QuantizedLinear)]


def quant_report(model):
    """Bytes: held by quantized linears (codes + scales) vs their float32 size, and the whole
    model (parameters in their dtype + quantized weights) vs the whole model in float32."""
    qs = quantized_layers(model)
    q_held = sum(m.nbytes() for _, m in qs)
    q_fp32 = sum(4 * m.in_features * m.out_features for _, m in qs)
    p_held = sum(int(np.prod(p.shape)) * p.element_size() for p in model.parameters())
    p_fp32 = sum(4 * int(np.prod(p.shape)) for p in model.parameters())
    return {"quantized_layers": len(qs), "quantized_bytes": q_held, "quantized_fp32_bytes": q_fp32,
            "quantized_ratio": q_held / max(q_fp32, 1), "model_bytes": p_held + q_held,
            "model_fp32_bytes": p_fp32 + q_fp32,
            "model_ratio": (p_held + q_held) / max(p_fp32 + q_fp32, 1)}


def format_report(model):
    r = quant_report(model)
    cfg = getattr(model, "quant_config", None)
    what = cfg.algo if cfg else "none"
    return (f"quantized backbone ({what}): {r['quantized_layers']} linears hold "
            f"{r['quantized_bytes'] / 2**20:.2f} MiB vs {r['quantized_fp32_bytes'] / 2**20:.2f} MiB "
            f"float32 ({r['quantized_ratio']:.3f}x); whole model {r['model_bytes'] / 2**20:.2f} MiB vs "
            f"{r['model_fp32_bytes'] / 2**20:.2f} MiB float32 ({r['model_ratio']:.3f}x)")
