"""PaddleNLP state dicts -> Hugging Face / THUDM names and layouts (pure functions over arrays).

Used by tools/convert_checkpoint.py; nothing here reads a pickle. PaddleNLP differs from HF in:
- names: its base-model prefix ("llama.", "qwen2.", "chatglm_v2.") instead of "model." or
  "transformer."; its config model_type "chatglm_v2" is THUDM's "chatglm";
- layout: Linear weights are [in, out] (paddle) instead of [out, in];
- ChatGLM2 (PaddleNLP's tensor-parallel rewrite): attention as separate `query` [H, N·D], `key`,
  `value` [H, G·D] instead of THUDM's fused `query_key_value` [H, (N+2G)·D] (= concat of the
  three along the output axis), and dense_h_to_4h with interleaved columns: PaddleNLP computes
  silu(y[..., 0::2]) · y[..., 1::2], THUDM silu(y[..., :F]) · y[..., F:]. Older PaddleNLP
  releases kept THUDM's halves; `mlp_layout` says which the file has ("interleaved" default).
"""
import re

import numpy as np

from . import hf
from .spec import get_spec

# PaddleNLP model_type -> (HF model_type, PaddleNLP name prefix, HF name prefix)
PADDLENLP = {"chatglm_v2": ("chatglm", "chatglm_v2.", "transformer."),
             "llama": ("llama", "llama.", "model."), "qwen2": ("qwen2", "qwen2.", "model."),
             "mistral": ("mistral", "mistral.", "model.")}
_QKV = re.compile(r"^(.*\.self_attention)\.(query|key|value)\.(weight|bias)$")


def prefix_of(name):
    """The PADDLENLP row whose name prefix `name` starts with, or None."""
    return next((row for row in PADDLENLP.values() if name.startswith(row[1])), None)


def rename(name):
    row = prefix_of(name)
    return row[2] + name[len(row[1]):] if row else name


def halves_from_interleaved(arr, axis=-1):
    """Columns [a0, b0, a1, b1, ...] -> [a0, a1, ... | b0, b1, ...] along `axis`."""
    a = np.take(arr, np.arange(0, arr.shape[axis], 2), axis=axis)
    b = np.take(arr, np.arange(1, arr.shape[axis], 2), axis=axis)
    return np.concatenate([a, b], axis=axis)


def to_hf(tensors, model_type, mlp_layout="interleaved"):
    """Stream of (PaddleNLP name, array in paddle layout) -> (HF name, array in HF layout).
    Separate query/key/value of a block are held until all three arrived, then fused."""
    spec = get_spec(model_type)
    pending = {}
    for name, arr in tensors:
        name = rename(name)
        if model_type == "chatglm":
            m = _QKV.match(name)
            if m:
                key = (m.group(1), m.group(3))
                pending.setdefault(key, {})[m.group(2)] = arr
                if len(pending[key]) < 3:
                    continue
                parts = pending.pop(key)
                arr = np.concatenate([parts[p] for p in ("query", "key", "value")], axis=-1)
                name = f"{key[0]}.query_key_value.{key[1]}"
            elif name.endswith("mlp.dense_h_to_4h.weight") or name.endswith("mlp.dense_h_to_4h.bias"):
                if mlp_layout == "interleaved":
                    arr = halves_from_interleaved(arr)
        yield name, hf.to_hf_layout(spec, name, arr)
    if pending:
        (mod, kind), parts = next(iter(pending.items()))
        raise ValueError(f"{mod}: {kind} of query/key/value incomplete (only {sorted(parts)})")


def hf_config(conf):
    """PaddleNLP config.json -> HF config dict (model_type, architectures)."""
    mt = conf.get("model_type")
    if mt not in PADDLENLP:
        raise ValueError(f"PaddleNLP model_type {mt!r} is not known; known: {sorted(PADDLENLP)}")
    hf_type = PADDLENLP[mt][0]
    out = dict(conf, model_type=hf_type, architectures=list(get_spec(hf_type).architectures))
    out.pop("paddlenlp_version", None)
    if "dtype" in out:
        out.setdefault("torch_dtype", out["dtype"])
    return out


def lora_to_peft(tensors, r, mlp_layout="interleaved"):
    """PaddleNLP LoRA state (module.lora_A [in, r], module.lora_B [r, out]) -> HF-PEFT tensors
    {base_model.model.<module>.lora_A.weight [r, in], ...lora_B.weight [out, r]} and the
    sorted module names."""
    out, modules = {}, set()
    for name, arr in tensors:
        head, _, leaf = name.rpartition(".")
        if leaf not in ("lora_A", "lora_B"):
            raise ValueError(f"{name} is not a lora_A/lora_B matrix; only plain LoRA adapters "
                             "convert to HF-PEFT")
        if prefix_of(head) is None:
            raise ValueError(f"{name} has no known PaddleNLP model prefix "
                             f"({', '.join(row[1] for row in PADDLENLP.values())})")
        module = rename(head)
        if _QKV.match(module + ".weight"):
            raise ValueError(f"{name}: LoRA on PaddleNLP's separate query/key/value has no "
                             "same-rank equivalent on THUDM's fused query_key_value; merge it "
                             "into the base model with PaddleNLP first and convert the merged "
                             "model_state")
        if leaf == "lora_B" and module.endswith("mlp.dense_h_to_4h") and mlp_layout == "interleaved":
            arr = halves_from_interleaved(arr)
        modules.add(module)
        out[f"base_model.model.{module}.{leaf}.weight"] = hf.linear_to_hf(arr)
    for m in sorted(modules):
        a, b = (out.get(f"base_model.model.{m}.lora_{x}.weight") for x in "AB")
        if a is None or b is None or a.shape[0] != r or b.shape[1] != r:
            raise ValueError(f"{m}: needs lora_A [in, {r}] and lora_B [{r}, out] (r from "
                             "lora_config.json)")
    return out, sorted(modules)
