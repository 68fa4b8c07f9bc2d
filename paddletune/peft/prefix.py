"""Prefix tuning: learned per-layer key/value prefixes in front of every attention, base frozen.

Shapes (L layers, K key/value heads, P prefix tokens, D head_dim; from ModelSpec.prefix_layout,
so MHA, GQA and MQA are the same code):
    keys, values  [L, K, P, D]      layer l attends to concat(keys[l], k_real) along positions
The prefixes reach the model through models/cache.py `PrefixCache` (installed as the model's
`cache_hook`): real tokens take positions P, P+1, ... (the cache length) and a given attention
mask [B, S] is extended with P ones in front. Prefix keys are used as they are (no rotary
embedding is applied to them), as HF-PEFT does.

With `prefix_projection` the prefixes are an MLP of a smaller embedding (training only):
    E [P, H] -> tanh(E W1 + b1) W2 + b2 -> [P, L*2*K*D] -> viewed [P, L, 2, K, D] -> keys, values
Saving folds the MLP away: the files hold the resulting keys and values only.

Files: HF-PEFT's PREFIX_TUNING format, which torch `peft` loads as it is:
  adapter_config.json        peft_type PREFIX_TUNING, num_virtual_tokens P, num_layers L,
                             num_attention_heads K, token_dim K*D, prefix_projection false
  adapter_model.safetensors  prompt_embeddings [P, L*2*K*D] (layout converted in models/hf.py)
For generation, `prefix_kv(model)` gives per-layer lists for KVCache.fill_prefix(keys, values)
(`fill_cache(model, cache)` does both); the hook is bypassed whenever a cache is passed.
"""
import logging
import os

import numpy as np
import paddle
import paddle.nn as nn

from ..io import publish_into, write_json
from ..models import hf
from ..models.cache import PrefixCache
from .common import base_name_for_config, builtin_name, freeze, read_config, write_base_record

logger = logging.getLogger("paddletune")
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


class PrefixEncoder(nn.Layer):
    """Holds the prefixes (directly, or as embedding + MLP); `kv()` -> keys, values [L, K, P, D]."""

    def __init__(self, num_layers, kv_heads, head_dim, num_tokens, projection=False,
                 embed_dim=None, hidden=None, init_std=0.5):
        super().__init__()
        self.layout = (num_layers, kv_heads, head_dim)
        self.num_tokens, self.projection = num_tokens, projection
        L, K, D, P = num_layers, kv_heads, head_dim, num_tokens
        init = nn.initializer.Normal(0.0, init_std)
        if projection:
            self.embedding = self.create_parameter([P, embed_dim], default_initializer=init)
            self.proj_in = nn.Linear(embed_dim, hidden)
            self.proj_out = nn.Linear(hidden, L * 2 * K * D)
        else:
            self.key_prefix = self.create_parameter([L, K, P, D], default_initializer=init)
            self.value_prefix = self.create_parameter([L, K, P, D], default_initializer=init)

    def kv(self):
        if not self.projection:
            return self.key_prefix, self.value_prefix
        L, K, D = self.layout
        flat = self.proj_out(paddle.tanh(self.proj_in(self.embedding)))    # [P, L*2*K*D]
        kv = flat.reshape([self.num_tokens, L, 2, K, D]).transpose([2, 1, 3, 0, 4])
        return kv[0], kv[1]                                                  # [L, K, P, D] each

    def prefix_kv(self):
        """Per-layer lists of [K, P, D] keys and values (KVCache.fill_prefix's arguments)."""
        keys, values = self.kv()
        return list(keys.unbind(0)), list(values.unbind(0))

    def cache(self, attention_mask=None):
        """The model's cache_hook: a PrefixCache, and the mask extended by P ones in front."""
        keys, values = self.prefix_kv()
        if attention_mask is not None:
            ones = paddle.ones([attention_mask.shape[0], self.num_tokens], attention_mask.dtype)
            attention_mask = paddle.concat([ones, attention_mask], axis=1)
        return PrefixCache(keys, values), attention_mask


def attach(model, encoder):
    """Register the encoder on the model (its parameters count as the model's) and route every
    forward without an explicit cache through it."""
    model.prefix_encoder = encoder
    model.cache_hook = encoder.cache
    return encoder


def prefix_kv(model):
    """Per-layer (keys, values) of the model's prefix, for KVCache.fill_prefix; None if absent."""
    enc = getattr(model, "prefix_encoder", None)
    return None if enc is None else enc.prefix_kv()


def fill_cache(model, cache):
    """Start a generation KVCache from the model's prefix, if it has one (else leave it empty).
    The caller's attention mask must then cover cache.length + new tokens ([B, P+S])."""
    kv = prefix_kv(model)
    if kv is not None:
        with paddle.no_grad():
            cache.fill_prefix(*kv)
    return cache


def new_encoder(model, num_tokens, projection=False, hidden=-1):
    L, K, D = model.spec.prefix_layout(model.config)
    H = model.config.hidden_size
    return PrefixEncoder(L, K, D, num_tokens, projection, embed_dim=H,
                         hidden=hidden if hidden and hidden > 0 else H)


# ------------------------------------------------------------------------------ files

def save(model, out_dir, base_model_name_or_path=None, tokenizer=None, builtin=None):
    enc = model.prefix_encoder
    keys, values = (t.numpy().astype(np.float32) for t in enc.kv())
    L, K, D = enc.layout
    conf = {"peft_type": "PREFIX_TUNING", "task_type": "CAUSAL_LM",
            "num_virtual_tokens": enc.num_tokens, "num_layers": L, "num_attention_heads": K,
            "token_dim": K * D, "encoder_hidden_size": K * D, "num_transformer_submodules": 1,
            "prefix_projection": False, "inference_mode": True,
            "base_model_name_or_path": base_model_name_or_path}
    with publish_into(out_dir, stale_patterns=("adapter_model*.safetensors",)) as tmp:
        hf.write_safetensors(os.path.join(tmp, WEIGHTS),
                             {"prompt_embeddings": hf.prefix_to_peft(keys, values)})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_base_record(tmp, builtin)
        write_json(os.path.join(tmp, CONFIG), conf)
    return out_dir


def read(model, path):
    """(config, keys, values [L, K, P, D]) of a saved prefix, checked against this model."""
    where = os.path.join(path, CONFIG)
    conf = read_config(path, CONFIG, "PREFIX_TUNING", "prefix")
    if conf.get("prefix_projection"):
        raise ValueError(f"{where}: prefix_projection is true, so the file holds the MLP input, "
                         "not the prefixes; save with torch peft's inference mode or re-export it")
    L, K, D = model.spec.prefix_layout(model.config)
    theirs = (conf.get("num_layers"), conf.get("num_attention_heads"))
    if theirs != (L, K) or conf.get("token_dim") not in (None, K * D):
        raise ValueError(f"{where}: prefix for {theirs[0]} layers x {theirs[1]} kv heads x token_dim "
                         f"{conf.get('token_dim')}; this model needs {L} x {K} x {K * D}: the prefix "
                         "belongs to a base model of other shapes")
    st = hf.SafetensorsFile(os.path.join(path, WEIGHTS))
    if "prompt_embeddings" not in st.keys():
        raise ValueError(f"{path}/{WEIGHTS} has no 'prompt_embeddings' tensor")
    keys, values = hf.prefix_from_peft(st.get("prompt_embeddings"), L, K, D)
    return conf, keys, values


def load(model, path, trainable=False):
    """Attach the prefix saved at `path` (direct parameters). Returns the encoder."""
    _, keys, values = read(model, path)
    L, K, D = model.spec.prefix_layout(model.config)
    enc = PrefixEncoder(L, K, D, keys.shape[2])
    enc.key_prefix.set_value(keys.astype(np.float32))
    enc.value_prefix.set_value(values.astype(np.float32))
    for p in enc.parameters():
        p.stop_gradient = not trainable
    return attach(model, enc)


# ------------------------------------------------------------------------------ training setup

def apply(model, model_args):
    """Freeze the model, attach new (or `prefix_path`) prefixes. Returns the trainable dict."""
    freeze(model)
    if model_args.prefix_path:
        if model_args.prefix_projection:
            logger.warning("prefix_path holds folded prefixes; prefix_projection is ignored")
        enc = load(model, model_args.prefix_path, trainable=True)
    else:
        enc = attach(model, new_encoder(model, model_args.num_prefix_tokens,
                                        model_args.prefix_projection,
                                        model_args.prefix_projection_hidden_size))
    for p in enc.parameters():
        p.stop_gradient = False
    logger.info("prefix tuning: %d tokens x %d layers x %d kv heads x head_dim %d%s",
                enc.num_tokens, *enc.layout, " (MLP projection)" if enc.projection else "")
    return {n: p for n, p in model.named_parameters() if n.startswith("prefix_encoder.")}


def export_fn(model, model_args, tokenizer=None):
    base = base_name_for_config(model_args.model_name_or_path)
    builtin = builtin_name(model_args.model_name_or_path)
    return lambda out_dir: save(model, out_dir, base, tokenizer, builtin)


def setup(model, model_args, tokenizer=None):
    """(trainable, lr_scales, export_fn) for peft.apply."""
    return apply(model, model_args), None, export_fn(model, model_args, tokenizer)
