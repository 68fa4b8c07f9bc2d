"""Model loading and saving in Hugging Face format.

    model = paddletune.loading.load_model(dir)   # eval mode, weights streamed tensor by tensor
    save_pretrained(model, out_dir, tokenizer=tok)
    model = build_model(config_dict, seed=0) # random init (tests, tools)
"""
import logging
import os
import re

import numpy as np
import paddle

from ..io import CONFIG_CAP, publish_into, read_json, write_json
from . import hf
from .spec import ModelSpec, get_spec, registered_types, spec_for_config  # noqa: F401
from .tiny import BUILTIN as _BUILTIN

logger = logging.getLogger("paddletune")

BUILTIN_MODELS = tuple(_BUILTIN)   # built-in tiny model names (models/tiny.py)
FLOAT_CODES = ("F16", "BF16", "F32", "F64")


def resolve_model_path(name_or_path, key="model_name_or_path"):
    """A local HF directory, or a built-in tiny model name (generated on first use). Anything
    else is refused: there are no downloads here."""
    if name_or_path in BUILTIN_MODELS:
        from .tiny import builtin_model_dir

        return builtin_model_dir(name_or_path)
    if os.path.isdir(name_or_path):
        return name_or_path
    if os.path.exists(name_or_path):
        raise ValueError(f"{key}={name_or_path!r} is a file; give the checkpoint directory")
    raise ValueError(
        f"{key}={name_or_path!r} is not a local directory. paddletune does not download models: "
        f"download the checkpoint (config.json + *.safetensors + tokenizer files) and pass its "
        f"local path, or use a built-in model: {', '.join(BUILTIN_MODELS)}")


# config.json keys that hold sizes (positive integers; null where HF allows it) or real numbers
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
             "num_layers", "ffn_hidden_size", "padded_vocab_size", "multi_query_group_num",
             "kv_channels", "seq_length")
REAL_KEYS = ("rms_norm_eps", "layernorm_epsilon", "initializer_range", "rope_theta", "rope_ratio",
             "attention_dropout", "hidden_dropout")


# upper bounds on config.json sizes, checked before anything is built from them: ids and
# element counts must fit int32 (paddle's index type); the deepest published models have ~130
# layers and the widest MoE ~400 experts
INT32_MAX = 2 ** 31 - 1
MAX_LAYERS = 1024
MAX_EXPERTS = 4096
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "num_hidden_layer")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_SIZE_NAME = re.compile(r"(size|layers?|heads?|experts?|dim|positions|length|channels|n_embd|"
                        r"n_inner|group_num|_tok)$")


def check_bounds(d, where):
    """Refuse config.json integers out of sane bounds (file, key, value and the bound)."""
    for key, v in d.items():
        if isinstance(v, bool) or not isinstance(v, int):
            continue
        bound = (MAX_LAYERS if key in LAYER_KEYS else MAX_EXPERTS if key in EXPERT_KEYS
                 else INT32_MAX if _SIZE_NAME.search(key) else None)
        if bound is not None and v > bound:
            raise ValueError(f"{where}: '{key}' is {v}, above {bound}, the most accepted "
                             f"({'no published model comes near' if bound < INT32_MAX else 'int32 range'}): "
                             "the file is damaged or not a model's config.json")


def load_config(path):
    """(spec, config) from path/config.json. A missing key, or a string where a number belongs,
    is one error naming the file and the key."""
    where = os.path.join(path, "config.json")
    d = read_json(where, "config.json", CONFIG_CAP)
    if not isinstance(d, dict):
        raise ValueError(f"{where}: must hold one JSON object")
    if "model_type" not in d:
        raise ValueError(f"{where} has no 'model_type'; supported: {registered_types()}")
    for key in SIZE_KEYS:
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ValueError(f"{where}: '{key}' must be a positive integer, got {v!r}")
    for key in REAL_KEYS:
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not np.isfinite(v)):
            raise ValueError(f"{where}: '{key}' must be a finite number, got {v!r}")
    check_bounds(d, where)
    spec = spec_for_config(d)
    try:
        return spec, spec.config_cls.from_dict(d)
    except KeyError as e:
        raise ValueError(f"{where} lacks {e}, which a {d['model_type']} model needs; is it the "
                         "config.json of a complete checkpoint?") from None
    except (TypeError, AttributeError) as e:
        raise ValueError(f"{where}: a value has the wrong type ({e})") from None


def check_tokenizer(config, tok, model_path):
    """The tokenizer's ids must index the model's embedding: a tokenizer with more tokens than
    the model's vocab_size would fail (or read past the table) at the first rare token."""
    if len(tok) > config.vocab_size:
        raise ValueError(f"the tokenizer in {tok.path} has {len(tok)} tokens, more than the "
                         f"vocab_size {config.vocab_size} of the model in {model_path}/config.json: "
                         "they do not belong together (pass tokenizer_name_or_path of the model's "
                         "own tokenizer, or resize the model's embeddings first)")


def position_limit(config):
    """(positions the model was trained for, whether config.json sets a rope scaling that
    stretches them, whether they are a learned table (ModelSpec.learned_positions: GPT-2, OPT)):
    max_position_embeddings (ChatGLM: seq_length); rope_scaling or a rope_ratio."""
    raw = getattr(config, "raw", {}) or {}
    scaled = bool(raw.get("rope_scaling")) or raw.get("rope_ratio", 1) not in (1, None)
    learned = get_spec(config.model_type).learned_positions
    return getattr(config, "max_position_embeddings", None), scaled, learned


def build_model(config, seed=None, dtype="float32"):
    """Model from a config dict (or config object); random N(0, initializer_range) when `seed`
    is given, otherwise lazily created parameters that must be loaded before use.

    `dtype` (float32 / float64 / float16 / bfloat16): every parameter is created in it, norm
    weights, biases, embeddings and MoE routers included (as transformers' torch_dtype does).
    No parameter is kept in float32: the float32 islands are computations, not weights — RMSNorm
    statistics and attention / router softmax run in float32 for 16-bit inputs (layers.wide),
    rope cos / sin are computed in float32 from the positions, then cast; the LM loss runs on
    float32 logits for 16-bit models. Parameters added later are float32 islands: LoRA A / B
    (peft/lora.py casts the input to them and the update back), so adapters train in float32
    on a 16-bit base."""
    if isinstance(config, dict):
        spec = spec_for_config(config)
        config = spec.config_cls.from_dict(config)
    spec = get_spec(config.model_type)
    if dtype not in hf.COMPUTE_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported ({', '.join(hf.COMPUTE_DTYPES)})")
    before = paddle.get_default_dtype()
    paddle.set_default_dtype(dtype)   # lazily created parameters take the default dtype
    try:
        with paddle.LazyGuard():
            model = spec.model_cls(config)
    finally:
        paddle.set_default_dtype(before)
    if seed is not None:
        from .layers import init_weights

        init_weights(model, config.initializer_range, seed)
    return model


def check_checkpoint_shapes(model, path, spec, reader, params, quantized):
    """Every tensor the model needs is in the checkpoint with the model's (global) shape."""
    missing = [n for n in list(params) + list(quantized) if n not in reader]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} tensors the model needs, e.g. "
                         f"{missing[:3]}; is config.json from the same model?")
    for name in list(params) + list(quantized):
        code = reader.dtype(name) if hasattr(reader, "dtype") else "F32"
        if code not in FLOAT_CODES:
            raise ValueError(f"{reader.file_of(name)}: tensor {name} is stored as {code}, but it is a "
                             "floating-point weight of the model: refusing to load integers as "
                             "float (a quantized or foreign checkpoint? convert it to float first)")
    for name, p in params.items():
        shape = hf.paddle_shape(spec, name, reader.shape(name))
        expect = list(p.shape)
        if shape != expect:
            raise ValueError(f"{path}: tensor {name} has shape {reader.shape(name)} in the "
                             f"checkpoint, the model expects {expect} (paddle layout)")
    for name, m in quantized.items():
        if hf.paddle_shape(spec, name, reader.shape(name)) != [m.in_features, m.out_features]:
            raise ValueError(f"{path}: tensor {name} has shape {reader.shape(name)} in the "
                             f"checkpoint, the model expects "
                             f"{hf.hf_shape(spec, name, [m.in_features, m.out_features])} (HF layout)")


def check_checkpoint(path, config=None):
    """Headers only, nothing loaded: every weight file of the checkpoint at `path` is readable
    (safetensors headers against the file sizes, index entries inside the directory) and holds
    every tensor the model of `config` (default: path/config.json) needs, with its shape and a
    floating-point dtype. The scripts run it before any work, so a truncated download or a
    hostile index fails before the model is built."""
    spec, config = load_config(path) if config is None else (get_spec(config.model_type), config)
    model = build_model(config)   # lazy: parameters have shapes, no memory
    reader = hf.CheckpointReader(path)
    check_checkpoint_shapes(model, path, spec, reader, dict(model.named_parameters()), {})


def load_weights(model, path, spec=None, reader=None, params=None, only=None, dtype="float32"):
    """Stream tensors from the checkpoint at `path` into `model` (or into `params`, a
    {hf_name: parameter} map), checking every shape first against the checkpoint header.

    Quantized linears (quant.QuantizedLinear, put in by quant.quantize_model_lazily) receive
    their tensor in HF layout [out, in] and quantize it at once, so at most one full-precision
    matrix is resident at a time. The memory map of a file is dropped after each tensor: pages
    read through a map count in the process RSS until it is unmapped. `dtype`: the parameters'
    dtype (build_model's); a tensor stored in it is read word for word (hf.read_as)."""
    spec = spec or model.spec
    reader = reader or hf.CheckpointReader(path)
    params = params if params is not None else dict(model.named_parameters())
    quantized = {m.weight_name: m for m in model.sublayers()
                 if getattr(m, "weight_name", None) and hasattr(m, "set_weight")}
    if only is not None:   # a pipeline stage reads its own tensors only
        params = {n: p for n, p in params.items() if only(n)}
        quantized = {n: m for n, m in quantized.items() if only(n)}
    check_checkpoint_shapes(model, path, spec, reader, params, quantized)
    for name, p in params.items():
        p.set_value(check_finite(hf.read_as(reader, spec, name, dtype), name, reader))
        _unmap(reader, name)
    for name, m in quantized.items():
        m.set_weight(check_finite(hf.read_torch_linear(reader, spec, name), name, reader))
        _unmap(reader, name)
    # saved rope tables (HF rotary_emb.inv_freq, THUDM rotary_pos_emb.inv_freq) are recomputed
    extra = [k for k in reader.keys() if k not in params and k not in quantized
             and not k.endswith("inv_freq")]
    if extra and only is None:   # (a pipeline stage reads its own part only)
        logger.warning("%s: %d checkpoint tensors unused, e.g. %s", path, len(extra), extra[:3])
    return model


def check_finite(arr, name, reader=None, where=None):
    """`arr` unchanged, or an error naming the tensor and file when it holds NaN or Inf (a
    damaged file, or weights saved after training diverged): refused at load, not at step 1."""
    if arr.dtype == np.uint16:   # bfloat16 words: Inf / NaN have all 8 exponent bits set
        bad = int(np.count_nonzero((arr & 0x7F80) == 0x7F80))
    else:
        bad = int(arr.size - np.isfinite(arr).sum()) if arr.dtype.kind == "f" else 0
    if bad:
        where = where or (reader.file_of(name) if hasattr(reader, "file_of") else "checkpoint")
        raise ValueError(f"{where}: tensor {name} holds {bad} non-finite values (NaN or Inf) of "
                         f"{arr.size}: the file is damaged, or was saved after training diverged; "
                         "use an earlier checkpoint")
    return arr


def _unmap(reader, name):
    files = getattr(reader, "files", None)
    f = files.get(name) if isinstance(files, dict) else None
    if f is not None and hasattr(f, "release"):
        f.release()   # remapped on the next read; unmapping returns the read pages


def declared_dtype(config):
    raw = config.raw if hasattr(config, "raw") else {}
    d = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return d if d in hf.DTYPE_NAMES else "float32"


def save_pretrained(model, out_dir, tokenizer=None, state=None, max_shard_size="5GB", dtype=None,
                    extra_config=None):
    """Write `model` (or `state`: {hf_name: np.ndarray in paddle layout}, or an iterable of such
    pairs consumed one at a time) as a HF directory:
    config.json, generation_config.json, model*.safetensors (+ index), tokenizer files.
    Files appear in out_dir only when complete; config.json is moved in last."""
    spec, cfg = model.spec, model.config
    dtype = dtype or declared_dtype(cfg)
    if state is None and getattr(model, "quant_config", None) is not None:
        raise ValueError("this model has a quantized backbone, which is not saved as a HF "
                         "checkpoint: save the adapter, then merge it into the original "
                         "full-precision weights with llm/merge_lora_params.py")
    if state is None:
        state = {n: p for n, p in model.named_parameters()}

    def tensors():
        for name, t in (state.items() if hasattr(state, "items") else state):
            arr = t.numpy() if isinstance(t, paddle.Tensor) else np.asarray(t)
            yield name, hf.to_hf_layout(spec, name, arr)

    conf = cfg.to_dict()
    conf["architectures"] = list(spec.architectures)
    conf.update(extra_config or {})
    # the stale files of an earlier export: HF's names only (never a checkpoint's model_state-*)
    stale = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json")
    with publish_into(out_dir, stale_patterns=stale) as tmp:
        hf.write_weights(tmp, tensors(), max_shard_size, dtype)
        src = os.path.join(getattr(model, "name_or_path", "") or "", "generation_config.json")
        if os.path.isfile(src):
            gen = read_json(src)
        else:
            gen = {k: conf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                   if conf.get(k) is not None}
        write_json(os.path.join(tmp, "generation_config.json"), gen)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_json(os.path.join(tmp, "config.json"), conf)
    return out_dir
