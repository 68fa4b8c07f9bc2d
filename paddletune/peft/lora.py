"""LoRA: low-rank updates on frozen linear layers, saved in the Hugging Face PEFT layout.

For a wrapped layer with input x [.., in] and frozen base y = base(x) [.., out]:
    y' = base(x) + s * dropout(x) @ A @ B      A [in, r], B [r, out] (paddle layout)
    s  = alpha / r        (alpha / sqrt(r) with rslora)
A starts Kaiming-uniform (bound 1/sqrt(in), as torch's default Linear init), B starts at zero,
so a fresh adapter is the identity. Only A and B get gradients and optimizer state.

The wrapper keeps HF-PEFT's module names (q_proj.base_layer, q_proj.lora_A, q_proj.lora_B), so the
adapter files are HF-PEFT's:
  adapter_config.json        peft_type LORA, r, lora_alpha, lora_dropout, use_rslora, target_modules
  adapter_model.safetensors  base_model.model.<module>.lora_A.weight [r, in],
                             base_model.model.<module>.lora_B.weight [out, r]   (torch layout)
and torch `peft` loads them as they are. The base layer may be paddle nn.Linear or any layer with
`in_features` / `out_features` (quantized backbones, QLoRA).

Merging (W [in, out] += s * A @ B) happens only when `merge()` is called, never in eval().
`with adapters_disabled(model):` runs the base model alone (the frozen reference of DPO / KTO:
no second copy of the weights).
"""
import contextlib
import json
import logging
import math
import os

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from ..io import publish_into, write_json
from ..models import hf
from ..models.owned import as_forward
from .common import (base_name_for_config, builtin_name, write_base_record, freeze, get_module, linear_dims, match_modules,
                     read_config, replace_module)

logger = logging.getLogger("paddletune")
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def lora_scaling(r, alpha, rslora=False):
    return alpha / (math.sqrt(r) if rslora else r)


class LoRALinear(nn.Layer):
    """base_layer + s * lora_B(lora_A(dropout(x))); see the module docstring for shapes."""

    def __init__(self, base_layer, r, alpha, dropout=0.0, rslora=False):
        super().__init__()
        dims = linear_dims(base_layer)
        if dims is None:
            raise TypeError(f"LoRA needs a linear layer, got {type(base_layer).__name__}")
        self.in_features, self.out_features = dims
        self.base_layer = base_layer
        self.r, self.alpha, self.rslora, self.dropout = r, alpha, rslora, dropout
        self.scaling = lora_scaling(r, alpha, rslora)
        bound = 1.0 / math.sqrt(self.in_features)
        self.lora_A = nn.Linear(self.in_features, r, bias_attr=False,
                                weight_attr=nn.initializer.Uniform(-bound, bound))
        self.lora_B = nn.Linear(r, self.out_features, bias_attr=False,
                                weight_attr=nn.initializer.Constant(0.0))
        self.merged = False
        self.disabled = False   # adapters_disabled(): the base layer alone
        # set by paddletune.parallel under tensor parallelism (None: one device): `between(z)` runs
        # the collective on the rank-r activation z = x @ A, `input_dropout(x, p, training)` draws
        # the one-process mask for an input split across ranks
        self.between = None
        self.input_dropout = None

    def forward(self, x):
        y = self.base_layer(x)
        if self.merged or self.disabled:
            return y
        h = x
        if self.dropout > 0:
            h = (self.input_dropout(x, self.dropout, self.training) if self.input_dropout is not None
                 else F.dropout(x, self.dropout, training=self.training))
        a, b = self.lora_A, self.lora_B
        if h.dtype != a.weight.dtype:
            h = h.astype(a.weight.dtype)
        # A and B are read inside their own layers' calls (models/owned.py: sharding stage 3
        # gathers them there); without hooks these are the two matmuls themselves
        z = as_forward(a, lambda x: paddle.matmul(x, a.weight), h)
        if self.between is not None:
            z = self.between(z)
        # (h A)(s B): the scale goes on the small [r, out] matrix, not on the [tokens, out] output
        delta = as_forward(b, lambda x: paddle.matmul(x, b.weight * self.scaling), z)
        return y + (delta if delta.dtype == y.dtype else delta.astype(y.dtype))

    def delta_weight(self):
        """s * A @ B: [in, out], the change merge() adds to the paddle-layout base weight."""
        return paddle.matmul(self.lora_A.weight, self.lora_B.weight) * self.scaling

    @paddle.no_grad()
    def merge(self):
        if self.merged:
            return
        w = getattr(self.base_layer, "weight", None)
        if w is None or not isinstance(self.base_layer, nn.Linear):
            raise TypeError(f"cannot merge LoRA into a {type(self.base_layer).__name__} in memory "
                            "(quantized weights); merge into the full-precision base checkpoint with "
                            "llm/merge_lora_params.py")
        w.set_value((w.astype("float32") + self.delta_weight()).astype(w.dtype))
        self.merged = True

    @paddle.no_grad()
    def unmerge(self):
        if not self.merged:
            return
        w = self.base_layer.weight
        w.set_value((w.astype("float32") - self.delta_weight()).astype(w.dtype))
        self.merged = False


def lora_layers(model):
    return {n: m for n, m in model.named_sublayers() if isinstance(m, LoRALinear)}


@contextlib.contextmanager
def adapters_disabled(model):
    """Within the block every LoRALinear of `model` returns its base layer's output (the model
    without adapters); refused for merged adapters, whose base weight already holds them."""
    layers = list(lora_layers(model).values())
    if any(m.merged for m in layers):
        raise ValueError("adapters_disabled: the adapters are merged into the base weights; unmerge first")
    for m in layers:
        m.disabled = True
    try:
        yield model
    finally:
        for m in layers:
            m.disabled = False


def merge(model):
    """Fold every adapter into its base weight (in place); forward then skips the adapters."""
    for layer in lora_layers(model).values():
        layer.merge()
    return model


def unmerge(model):
    for layer in lora_layers(model).values():
        layer.unmerge()
    return model


def inject(model, names, r, alpha, dropout=0.0, rslora=False):
    """Wrap each module in `names` (linear-like) with LoRALinear; base parameters frozen."""
    wrapped = {}
    for name in names:
        base = get_module(model, name)
        if isinstance(base, LoRALinear):
            raise ValueError(f"{name} already has a LoRA adapter")
        for p in base.parameters():
            p.stop_gradient = True
        layer = LoRALinear(base, r, alpha, dropout, rslora)
        replace_module(model, name, layer)
        wrapped[name] = layer
    return wrapped


def lora_state(model):
    """{paddle name: tensor} of every LoRA A/B weight (paddle layout)."""
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


# ------------------------------------------------------------------------------ files

def target_modules_for_config(model, names):
    """HF-PEFT `target_modules`: the short names (["q_proj", "v_proj"]) when they select exactly
    `names` under torch peft's suffix matching, else one regex matching exactly `names`."""
    names = set(names)
    leaves = sorted({n.split(".")[-1] for n in names})
    selected = {n for n, m in model.named_sublayers()
                if n.split(".")[-1] in leaves and (linear_dims(m) is not None)}
    selected = {n for n in selected if not n.endswith(".base_layer")}
    if selected == names:
        return leaves
    return "(?:" + "|".join(sorted(n.replace(".", r"\.") for n in names)) + ")"


def save(model, out_dir, base_model_name_or_path=None, tokenizer=None, builtin=None):
    """Write the adapter (HF-PEFT layout) into out_dir; other files there are kept. `builtin`:
    the built-in base name, recorded beside (common.write_base_record)."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters to save")
    first = next(iter(layers.values()))
    state = {n: p.numpy().astype(np.float32) for n, p in lora_state(model).items()}
    conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.r, "lora_alpha": first.alpha,
            "lora_dropout": first.dropout, "use_rslora": first.rslora,
            "target_modules": target_modules_for_config(model, layers), "bias": "none",
            "fan_in_fan_out": False, "modules_to_save": None, "init_lora_weights": True,
            "inference_mode": True, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {},
            "base_model_name_or_path": base_model_name_or_path}
    with publish_into(out_dir, stale_patterns=("adapter_model*.safetensors",)) as tmp:
        hf.write_safetensors(os.path.join(tmp, WEIGHTS), hf.peft_state_to_hf(model.spec, state))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_base_record(tmp, builtin)
        write_json(os.path.join(tmp, CONFIG), conf)
    return out_dir


class _Declared:
    """A tensor's shape as its safetensors header declares it (nothing read yet)."""

    def __init__(self, shape):
        self.shape, self.ndim = tuple(shape), len(shape)


def read(path, model=None):
    """(config, {module name: (A [r, in], B [out, r])} in torch layout, raw {key: array}) of an HF-PEFT LoRA directory, validated; nothing is loaded into a model here.
    Every check runs on the header's shapes (and, given `model`, check_against) before any tensor
    is read, so a header declaring a huge tensor is refused without allocating it."""
    where = os.path.join(path, CONFIG)
    conf = read_config(path, CONFIG, "LORA", "LoRA adapter")
    unsupported = [(k, v) for k, v in (("use_dora", conf.get("use_dora")),
                                       ("rank_pattern", conf.get("rank_pattern")),
                                       ("alpha_pattern", conf.get("alpha_pattern")),
                                       ("modules_to_save", conf.get("modules_to_save")),
                                       ("fan_in_fan_out", conf.get("fan_in_fan_out")),
                                       ("lora_bias", conf.get("lora_bias"))) if v]
    if conf.get("bias", "none") != "none":
        unsupported.append(("bias", conf["bias"]))
    if unsupported:
        k, v = unsupported[0]
        raise ValueError(f"{where}: '{k}: {v}' is not supported here (plain LoRA only)")
    r, alpha = conf.get("r", 8), conf.get("lora_alpha", 8)
    for key, v in (("r", r), ("lora_alpha", alpha), ("lora_dropout", conf.get("lora_dropout") or 0.0)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{where}: '{key}' must be a number, got {json.dumps(v)}")
    if r <= 0 or r != int(r):
        raise ValueError(f"{where}: r must be a positive integer, got {r}")
    r = int(r)
    wpath = os.path.join(path, WEIGHTS)
    if not os.path.exists(wpath):
        if os.path.exists(os.path.join(path, "adapter_model.bin")):
            raise ValueError(f"{path} holds adapter_model.bin (pickle), which paddletune never loads; "
                             "re-save it with safe_serialization=True (torch peft's default)")
        raise FileNotFoundError(f"{wpath} not found")
    st = hf.SafetensorsFile(wpath)
    modules = {}
    for key, arr in ((k, _Declared(st.shape(k))) for k in st.keys()):
        body = key[len(hf.PEFT_KEY_PREFIX):] if key.startswith(hf.PEFT_KEY_PREFIX) else None
        if body is None or not (body.endswith(".lora_A.weight") or body.endswith(".lora_B.weight")):
            raise ValueError(f"{wpath}: unexpected tensor {key!r}; only LoRA A/B weights of Linear "
                             "layers are supported (no embedding LoRA, DoRA or extra modules)")
        module, kind = body[:-len(".lora_A.weight")], body[-len("A.weight")]
        modules.setdefault(module, {})[kind] = (key, arr)
    out = {}
    for module, ab in modules.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{wpath}: {module} has only lora_{''.join(ab)}; both A and B are needed")
        (ka, A), (kb, B) = ab["A"], ab["B"]
        if A.ndim != 2 or B.ndim != 2 or A.shape[0] != r or B.shape[1] != r:
            raise ValueError(f"{wpath}: {module} has lora_A {list(A.shape)}, lora_B {list(B.shape)}; "
                             f"expected [r, in] and [out, r] with r = {r}")
        out[module] = (A, B, ka, kb)
    if not out:
        raise ValueError(f"{wpath} holds no LoRA tensors")
    conf["_scaling"] = lora_scaling(r, alpha, bool(conf.get("use_rslora")))
    if model is not None:
        check_against(model, {m: ab[:2] for m, ab in out.items()}, wpath)
    raw = {k: st.get(k) for k in st.keys()}
    return conf, {m: (raw[ka], raw[kb]) for m, (_, _, ka, kb) in out.items()}, raw


def check_against(model, modules, path):
    """Each adapted module must exist here, be linear-like, and have the adapter's in/out sizes."""
    layers = dict(model.named_sublayers())
    for name, (A, B) in modules.items():
        layer = layers.get(name)
        if layer is None:
            raise ValueError(f"{path}: adapter targets {name!r}, which this model does not have "
                             "(adapter from another architecture?)")
        if isinstance(layer, LoRALinear):
            layer = layer.base_layer
        dims = linear_dims(layer)
        if dims is None:
            raise ValueError(f"{path}: adapter targets {name!r}, a {type(layer).__name__}, not a Linear")
        if (A.shape[1], B.shape[0]) != dims:
            raise ValueError(f"{path}: {name} adapter is for a base layer of in={A.shape[1]}, "
                             f"out={B.shape[0]}, but this model's layer has in={dims[0]}, "
                             f"out={dims[1]}: the adapter belongs to a base model of other shapes")


def load(model, path, trainable=False):
    """Wrap the modules named by the adapter at `path` and load its weights. Returns the config."""
    conf, modules, raw = read(path, model)
    inject(model, list(modules), int(conf["r"]), conf.get("lora_alpha", 8),
           float(conf.get("lora_dropout") or 0.0), bool(conf.get("use_rslora")))
    params = dict(model.named_parameters())
    for name, arr in hf.peft_state_from_hf(model.spec, raw, path).items():
        params[name].set_value(arr.astype(np.float32))
        params[name].stop_gradient = not trainable
    return conf


# ------------------------------------------------------------------------------ training setup

def apply(model, model_args):
    """Wrap the targets (or load `lora_path`), freeze the rest. Returns (trainable, lr_scales)."""
    freeze(model)
    if model_args.lora_path:
        conf = load(model, model_args.lora_path, trainable=True)
        logger.info("LoRA: continuing from %s (r=%s, alpha=%s)", model_args.lora_path, conf["r"],
                    conf.get("lora_alpha"))
    else:
        patterns = model_args.lora_target_modules or list(model.spec.lora_targets)
        names = match_modules(model, patterns, "lora_target_modules")
        r = model_args.lora_rank
        assert r > 0, f"lora_rank must be positive, got {r}"   # args.py checks argument files
        alpha = model_args.lora_alpha if model_args.lora_alpha > 0 else 2 * r
        inject(model, names, r, alpha, model_args.lora_dropout, model_args.rslora)
        logger.info("LoRA: r=%d alpha=%s on %d layers (%s)", r, alpha, len(names),
                    ", ".join(sorted({n.split(".")[-1] for n in names})))
    trainable = lora_state(model)
    for p in trainable.values():
        p.stop_gradient = False
    scale = getattr(model_args, "lora_plus_scale", 1.0)
    lr_scales = {n: scale for n in trainable if ".lora_B." in n} if scale != 1.0 else None
    return trainable, lr_scales


def export_fn(model, model_args, tokenizer=None):
    base = base_name_for_config(model_args.model_name_or_path)
    builtin = builtin_name(model_args.model_name_or_path)
    return lambda out_dir: save(model, out_dir, base, tokenizer, builtin)


def setup(model, model_args, tokenizer=None):
    """(trainable, lr_scales, export_fn) for peft.apply."""
    trainable, lr_scales = apply(model, model_args)
    return trainable, lr_scales, export_fn(model, model_args, tokenizer)
