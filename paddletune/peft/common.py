"""Helpers shared by the PEFT methods: finding and replacing modules by name, freezing, and the
own adapter file format for methods HF-PEFT has no layout for (adapter, low-rank adapter, BitFit).

Own format (directory):
  paddletune_adapter.json         {"peft_type": ..., hyper-parameters, "base_model_name_or_path"}
  paddletune_adapter.safetensors  tensors under the base model's module names (HF names), Linear
                                  weights in torch layout [out, in] (converted by models/hf.py)
HF-PEFT's adapter_config.json is kept for what torch `peft` can load (LoRA, prefix tuning), so
torch never tries to read a file it does not understand.
"""
import os
import re

import numpy as np
import paddle
import paddle.nn as nn

from ..io import publish_into, read_json, write_json
from ..models import hf

OWN_CONFIG = "paddletune_adapter.json"
OWN_WEIGHTS = "paddletune_adapter.safetensors"


def linear_dims(layer):
    """(in_features, out_features) of a linear-like layer: paddle nn.Linear (weight [in, out]) or
    any layer exposing `in_features` / `out_features` (e.g. quant's QuantizedLinear)."""
    if hasattr(layer, "in_features") and hasattr(layer, "out_features"):
        return int(layer.in_features), int(layer.out_features)
    if isinstance(layer, nn.Linear):
        return int(layer.weight.shape[0]), int(layer.weight.shape[1])
    return None


def match_modules(model, patterns, key, need_linear=True):
    """Module names fully matching any regex in `patterns`, in model order. Every pattern must
    match at least one linear-like module; otherwise a ValueError names the pattern and a fix."""
    names = [n for n, _ in model.named_sublayers() if n]
    layers = dict(model.named_sublayers())
    chosen = []
    for pat in patterns:
        try:
            rx = re.compile(pat)
        except re.error as e:
            raise ValueError(f"{key}: {pat!r} is not a valid regex ({e})") from None
        hits = [n for n in names if rx.fullmatch(n)]
        if not hits:
            tail = [n for n in names if n.split(".")[-1] == pat or n.endswith(pat)]
            hint = (f"; regexes must match the whole module name, e.g. '.*\\.{pat}$' matches "
                    f"{tail[0]!r}" if tail else f"; module names look like {names[len(names) // 2]!r}")
            raise ValueError(f"{key}: {pat!r} matches no module of this model{hint}")
        bad = [n for n in hits if need_linear and linear_dims(layers[n]) is None]
        if bad:
            raise ValueError(f"{key}: {pat!r} matches {bad[0]!r}, a {type(layers[bad[0]]).__name__}, "
                             "not a Linear layer; narrow the regex to Linear layers")
        chosen.extend(n for n in hits if n not in chosen)
    return [n for n in names if n in chosen]


def get_module(model, name):
    layer = model
    for part in name.split("."):
        layer = getattr(layer, part)
    return layer


def replace_module(model, name, new):
    """Put `new` where module `name` was (parent attribute or LayerList slot)."""
    parent_name, _, child = name.rpartition(".")
    parent = get_module(model, parent_name) if parent_name else model
    setattr(parent, child, new)


def freeze(model):
    for p in model.parameters():
        p.stop_gradient = True


def named_trainable(model, predicate):
    """{name: parameter} for parameters whose name satisfies `predicate`; marks them trainable."""
    out = {}
    for n, p in model.named_parameters():
        if predicate(n):
            p.stop_gradient = False
            out[n] = p
    return out


BASE_RECORD = "paddletune_base_model.json"   # beside an HF-PEFT adapter trained on a built-in model


def base_name_for_config(name_or_path):
    """What to write as base_model_name_or_path: a built-in model's portable name
    (paddletune/tiny-llama: paddletune's loaders and merge tools regenerate it on any machine;
    this machine's cache path would mean nothing elsewhere), else a local absolute path, so the
    merge tools find the base from any working directory. peft's AutoPeftModelForCausalLM needs
    the base as a directory: PeftModel.from_pretrained(base_model, adapter_dir) on the resolved
    built-in (paddletune.models.resolve_model_path) loads it."""
    from ..models import BUILTIN_MODELS

    if name_or_path is None:
        return None
    if name_or_path in BUILTIN_MODELS:
        return name_or_path
    return os.path.abspath(name_or_path)


def builtin_name(name_or_path):
    """The built-in model name (paddletune/tiny-llama, ...) an adapter was trained on, else None."""
    from ..models import BUILTIN_MODELS

    return name_or_path if name_or_path in BUILTIN_MODELS else None


def write_base_record(out_dir, builtin):
    """HF-PEFT adapters: the built-in base name goes into a file of its own (adapter_config.json
    keeps exactly PEFT's keys, which every peft version loads without complaint); it lets a copy
    of the adapter on another machine regenerate its base (llm/merge_lora_params.py)."""
    if builtin:
        write_json(os.path.join(out_dir, BASE_RECORD), {"paddletune_base_model": builtin})


def read_builtin_name(adapter_dir, conf):
    """The built-in base name of a saved adapter: own-format config field, or BASE_RECORD."""
    if conf.get("paddletune_base_model"):
        return conf["paddletune_base_model"]
    path = os.path.join(adapter_dir, BASE_RECORD)
    if os.path.lexists(path):
        return read_json(path, BASE_RECORD).get("paddletune_base_model")
    return None


def save_own(model, out_dir, peft_type, config, state, tokenizer=None):
    """Write the own adapter format: state {paddle name: tensor} -> safetensors (HF layout)."""
    arrays = {n: np.asarray(t.numpy() if isinstance(t, paddle.Tensor) else t, np.float32)
              for n, t in state.items()}
    hf_state = {n: hf.to_hf_layout(model.spec, n, a) for n, a in arrays.items()}
    conf = dict(config, peft_type=peft_type, model_type=model.config.model_type)
    with publish_into(out_dir, stale_patterns=(OWN_WEIGHTS,)) as tmp:
        hf.write_safetensors(os.path.join(tmp, OWN_WEIGHTS), hf_state)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_json(os.path.join(tmp, OWN_CONFIG), conf)
    return out_dir


def read_config(path, config_name, peft_type, what):
    """The JSON config of an adapter directory, after checking the directory exists and its
    peft_type is `peft_type`; errors name the file and what it should hold."""
    where = os.path.join(path, config_name)
    if not os.path.isdir(path):
        raise ValueError(f"{what} directory not found: {path}")
    conf = read_json(where, f"{what} config ({config_name})")
    if conf.get("peft_type") != peft_type:
        raise ValueError(f"{where}: peft_type is {conf.get('peft_type')!r}; a {what} has {peft_type!r}")
    return conf


def read_own(model, path, peft_type):
    """(config, {paddle name: np.ndarray paddle layout}) of an own-format adapter directory."""
    conf = read_config(path, OWN_CONFIG, peft_type, "adapter")
    st = hf.SafetensorsFile(os.path.join(path, OWN_WEIGHTS))
    return conf, {k: hf.to_paddle_layout(model.spec, k, st.get(k)) for k in st.keys()}


def check_shapes(shapes, tensors, where):
    """Every tensor must be named in `shapes` ({name: shape}) with that shape; run before the
    model is changed."""
    missing = [n for n in tensors if n not in shapes]
    if missing:
        raise ValueError(f"{where}: tensor {missing[0]!r} has no counterpart in this model "
                         f"({len(missing)} such); was the adapter trained on another model?")
    for n, a in tensors.items():
        if list(a.shape) != list(shapes[n]):
            raise ValueError(f"{where}: {n} has shape {list(a.shape)}, this model needs "
                             f"{list(shapes[n])} (paddle layout): the adapter belongs to "
                             "a base model of other shapes")
