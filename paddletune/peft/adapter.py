"""Bottleneck adapters (Houlsby-style) after attention and after the MLP, base frozen.

The adapter sits on the output of the layers named by ModelSpec.adapter_targets (for Llama the
attention output projection o_proj and the MLP's down_proj), so for y = base(x) [.., H]:
    y' = y + up(gelu(down(y)))          down: Linear(H, m), up: Linear(m, H)  (m = adapter_size)
`up` starts at zero (weight and bias), so a fresh adapter is the identity. Parameters per
adapted layer: H*m + m + m*H + H.

Saved in the own format (peft/common.py: paddletune_adapter.json + .safetensors): HF-PEFT has no
bottleneck-adapter layout. LowRankAdapter (lowrank_adapter.py) reuses this with factorised
projections.
"""
import logging
import math

import paddle.nn as nn
import paddle.nn.functional as F

from .common import (base_name_for_config, builtin_name, check_shapes, freeze, get_module, linear_dims,
                     match_modules, read_own, replace_module, save_own)

logger = logging.getLogger("paddletune")
PEFT_TYPE = "ADAPTER"


def _kaiming(fan_in):
    b = 1.0 / math.sqrt(fan_in)
    return nn.initializer.Uniform(-b, b)


def dense_projections(H, size):
    """(down, up) of the plain adapter: Linear(H, size) Kaiming-uniform, Linear(size, H) zero."""
    zero = nn.initializer.Constant(0.0)
    return (nn.Linear(H, size, weight_attr=_kaiming(H), bias_attr=zero),
            nn.Linear(size, H, weight_attr=zero, bias_attr=zero))


class AdapterLinear(nn.Layer):
    """base_layer(x) followed by a residual bottleneck: y + up(gelu(down(y))).

    `projections(H, size) -> (down, up)` builds the two projections (H = the base layer's output
    size); they become the sublayers adapter_down / adapter_up, whose names are the saved tensor
    names. The default is dense_projections; lowrank_adapter.py passes factorised ones."""

    def __init__(self, base_layer, size, projections=dense_projections):
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = linear_dims(base_layer)
        self.adapter_down, self.adapter_up = projections(self.out_features, size)

    def bottleneck(self, y):
        return self.adapter_up(F.gelu(self.adapter_down(y)))

    def forward(self, x):
        y = self.base_layer(x)
        # the bottleneck runs in its parameters' dtype (float32 adapters over a lower-precision base)
        dtype = self.adapter_up.parameters()[0].dtype
        return y + self.bottleneck(y.astype(dtype)).astype(y.dtype)


def targets(model):
    pats = model.spec.adapter_targets
    if not pats:
        raise ValueError(f"model type {model.config.model_type!r} declares no adapter_targets in its "
                         "ModelSpec (models/spec.py); adapters cannot be placed")
    return match_modules(model, pats, f"ModelSpec({model.config.model_type}).adapter_targets")


def inject(model, names, make):
    for name in names:
        base = get_module(model, name)
        for p in base.parameters():
            p.stop_gradient = True
        replace_module(model, name, make(base))


def adapter_state(model):
    return {n: p for n, p in model.named_parameters() if ".adapter_" in n}


def wrap_targets(model, make, what):
    """Freeze, wrap every target with make(base), return the trainable dict."""
    freeze(model)
    names = targets(model)
    inject(model, names, make)
    trainable = adapter_state(model)
    for p in trainable.values():
        p.stop_gradient = False
    logger.info("%s on %d layers (%s)", what, len(names),
                ", ".join(sorted({n.split(".")[-1] for n in names})))
    return trainable, names


def apply(model, model_args):
    size = model_args.adapter_size
    assert size > 0, f"adapter_size must be positive, got {size}"   # args.py checks argument files
    trainable, _ = wrap_targets(model, lambda base: AdapterLinear(base, size), f"adapter (size {size})")
    return trainable


def export_fn(model, model_args, tokenizer=None, peft_type=PEFT_TYPE, extra=None):
    conf = {"adapter_size": model_args.adapter_size, "target_modules": targets_of(model),
            "base_model_name_or_path": base_name_for_config(model_args.model_name_or_path),
            "paddletune_base_model": builtin_name(model_args.model_name_or_path)}
    conf.update(extra or {})
    return lambda out_dir: save_own(model, out_dir, peft_type, conf, adapter_state(model), tokenizer)


def setup(model, model_args, tokenizer=None):
    """(trainable, lr_scales, export_fn) for peft.apply."""
    return apply(model, model_args), None, export_fn(model, model_args, tokenizer)


def targets_of(model):
    return [n for n, m in model.named_sublayers() if isinstance(m, AdapterLinear)]


def load(model, path, trainable=False, peft_type=PEFT_TYPE, make=None):
    """Wrap the modules listed in the saved config and load the saved tensors; every name and
    shape is checked before the model is changed."""
    conf, tensors = read_own(model, path, peft_type)
    size = int(conf["adapter_size"])
    make = make or (lambda base: AdapterLinear(base, size))
    layers = dict(model.named_sublayers())
    wrappers = {}
    for name in conf["target_modules"]:
        if name not in layers or linear_dims(layers[name]) is None:
            raise ValueError(f"{path}: adapter on {name!r}, which this model has no Linear for")
        wrappers[name] = make(layers[name])
    shapes = {f"{name}.{pn}": list(p.shape) for name, w in wrappers.items()
              for pn, p in w.named_parameters() if pn.startswith("adapter_")}
    check_shapes(shapes, tensors, path)
    if set(tensors) != set(shapes):
        raise ValueError(f"{path}: holds {len(tensors)} adapter tensors, the model needs {len(shapes)}")
    for name, w in wrappers.items():
        for p in layers[name].parameters():
            p.stop_gradient = True
        replace_module(model, name, w)
    params = adapter_state(model)
    for n, a in tensors.items():
        params[n].set_value(a.astype("float32"))
        params[n].stop_gradient = not trainable
    return conf
