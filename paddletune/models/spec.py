"""ModelSpec: every per-model fact the rest of the library needs, in one record per model type.

Code outside `models/` asks the spec (LoRA targets, TP plan, which 2-D tensors are not Linear
weights, prefix-cache layout, chat template, tiny config) instead of testing `model_type`.
"""
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple


@dataclass(frozen=True)
class ModelSpec:
    model_type: str                    # config.json "model_type"
    config_cls: type                   # has from_dict(dict) / to_dict()
    model_cls: type                    # a runner.CausalLM subclass: the family's parts only
    architectures: Tuple[str, ...]     # config.json "architectures" written on save
    # HF tensor names of 2-D weights that are NOT nn.Linear weights (embeddings): hf.py transposes
    # every other 2-D ".weight" between HF [out, in] and paddle [in, out] (but see stored_in_out).
    not_linear: Tuple[str, ...]
    # Default LoRA targets: regexes over module names (peft issue), e.g. r".*\.q_proj$".
    lora_targets: Tuple[str, ...]
    # Tensor-parallel plan, the form paddletune.parallel applies from outside the model: module-name
    # suffix -> "column" (split the output features: weight [in, out] by columns, bias too), "row"
    # (split the input features; outputs are partial sums, all-reduced) or "vocab" (an embedding
    # [V, H] split by vocabulary rows). The LM head (`lm_head` below) is "column", i.e. its
    # logits are vocabulary-parallel.
    tp_plan: Dict[str, str]
    # prefix_layout(config) -> (num_layers, num_kv_heads, head_dim): shape of learned K/V prefixes
    prefix_layout: Callable
    # Bottleneck-adapter placement (peft issue): regexes over module names of the layers whose
    # output gets an adapter: the attention output and the MLP output projections.
    adapter_targets: Tuple[str, ...] = ()
    # Module name of the LM head (kept in full precision by quantization, "vocab"-wide output)
    lm_head: str = "lm_head"
    tiny_config: Dict = field(default_factory=dict)   # small config.json used by tools and tests
    default_chat_template: Optional[str] = None        # built-in template name for chat without one
    # tp_parts(config) -> {module suffix: [(width, heads), ...]}: the output columns of a "column"
    # module as parts side by side (ChatGLM2's query_key_value = [q | k | v]; a plain q_proj is one
    # part); heads = the attention heads of the part (None: columns with no head structure, e.g.
    # gate | up halves). Tensor parallelism splits each part separately, by whole heads, and keeps
    # the rank's slices together in order; a part with fewer heads than ranks (key/value heads) is
    # replicated: each head on degree/heads consecutive ranks.
    tp_parts: Optional[Callable] = None
    # tokenizer_config.json "tokenizer_class" -> "module:Class" of a Tokenizer subclass this family
    # needs (ChatGLM numbers its special tokens after the sentencepiece vocabulary)
    tokenizer_classes: Dict[str, str] = field(default_factory=dict)
    # conversion_fixups(src_dir, config, overrides) -> {key: value}: config keys a checkpoint
    # converted by tools/convert_checkpoint.py must gain (facts the source files state elsewhere)
    conversion_fixups: Optional[Callable] = None
    # name of the attention sub-module of a decoder block (recompute_granularity full_attn)
    attention_module: Optional[str] = None
    # dotted attribute paths of the parts the runner needs, when a family's model keeps them as
    # plain attributes: {"embeddings", "layers", "norm", "head"}, e.g. GPT-2's
    # {"embeddings": "transformer.wte", "layers": "transformer.h", "norm": "transformer.ln_f",
    #  "head": "lm_head"}; the head is None while config.tie_word_embeddings is set. A family
    # with other needs overrides CausalLM's accessors instead.
    module_paths: Optional[Dict[str, str]] = None
    # regexes (full match) over HF tensor names of Linear weights the checkpoint already stores as
    # [in, out], paddle's layout (GPT-2's Conv1D c_attn / c_proj / c_fc): hf.py keeps their layout
    stored_in_out: Tuple[str, ...] = ()
    # positions come from a learned table of max_position_embeddings rows (GPT-2, OPT): a position
    # beyond it has no vector, so max_length beyond it is refused; RoPE / ALiBi families compute any
    # position and only warn (as transformers and PaddleNLP allow it)
    learned_positions: bool = False
    # config.json's model_type when two families share one (ChatGLM-6B and ChatGLM2/3 both say
    # "chatglm"): the registry key (model_type above) is then this project's own name, and
    # claims(config dict) -> bool says which config.json files are this family's
    hf_model_type: Optional[str] = None
    claims: Optional[Callable] = None
    # HF's base_model_prefix ("transformer.", "model."): a checkpoint saved from the base model
    # (no head, tied) names its tensors without it, e.g. "h.0.attn.c_attn.weight"; hf.py's reader
    # then adds it (only when no tensor name starts with it)
    base_prefix: Optional[str] = None
    # Mixture-of-Experts (models/moe.py): (block attribute, expert gate, up, down Linear names) of
    # the per-expert layout the model's modules use, e.g. ("block_sparse_moe", "w1", "w3", "w2");
    # hf.py reads transformers 5's fused layout (model.layers.N.mlp.experts.gate_up_proj
    # [E, 2I, H], .down_proj [E, H, I], mlp.gate.weight) as those per-expert tensors
    fused_experts: Optional[Tuple[str, str, str, str]] = None
    # regexes (full match) over module names kept in full precision by weight-only quantization
    # unless quant_skip_modules says otherwise: MoE routers (tiny; their top-k choice is discrete)
    quant_keep: Tuple[str, ...] = ()


_REGISTRY: Dict[str, ModelSpec] = {}


def require_keys(d, keys, family, hint=""):
    """config.json dict `d` must hold each of `keys`: the first missing one is a ValueError naming
    the family (as the error shows it) and the key."""
    for key in keys:
        if key not in d:
            raise ValueError(f"config.json ({family}) lacks '{key}'{hint}")


def register(spec: ModelSpec):
    _REGISTRY[spec.model_type] = spec
    return spec


# the model files, each registering its ModelSpec(s) on import
FAMILIES = ("llama", "chatglm2", "gpt2", "opt", "bloom", "baichuan", "qwen", "chatglm")


def get_spec(model_type: str) -> ModelSpec:
    import importlib

    for name in FAMILIES:
        try:
            importlib.import_module(f"{__package__}.{name}")
        except ModuleNotFoundError as e:   # a family file not written yet / an optional dependency
            if e.name != f"{__package__}.{name}" and name != "chatglm2":
                raise
    if model_type not in _REGISTRY:
        raise ValueError(
            f"model_type '{model_type}' is not supported; supported: {sorted(_REGISTRY)}")
    return _REGISTRY[model_type]


def spec_for_config(d):
    """The ModelSpec of a config.json dict: the family that claims it among those sharing its
    model_type, else the one registered under it."""
    mt = d.get("model_type", "llama")
    get_spec("llama")   # every family registered
    for spec in _REGISTRY.values():
        if spec.hf_model_type == mt and spec.claims is not None and spec.claims(d):
            return spec
    return get_spec(mt)


def registered_types():
    get_spec("llama")
    return sorted(_REGISTRY)


def tokenizer_class_for(name, path=None):
    """The Tokenizer subclass a checkpoint whose tokenizer_config.json names `name` needs, or None
    when the plain Tokenizer reads it. Several families may claim one name (ChatGLM-6B and
    ChatGLM2/3 both say "ChatGLMTokenizer"): then the family of the config.json in `path` picks,
    else the class whose `vocab_file` (e.g. ice_text.model) is in `path`, else one that names
    no such file (ChatGLM2's, reading tokenizer.model)."""
    import importlib

    get_spec("llama")   # every family registered
    found = []
    for spec in _REGISTRY.values():
        target = spec.tokenizer_classes.get(name)
        if target:
            module, _, cls = target.partition(":")
            found.append((spec, getattr(importlib.import_module(module), cls)))
    if len(found) > 1 and path is not None:
        conf = os.path.join(path, "config.json")
        if os.path.exists(conf):
            from ..io import read_json

            try:
                owner = spec_for_config(read_json(conf))
            except ValueError:
                owner = None
            for spec, cls in found:
                if spec is owner:
                    return cls
        for spec, cls in found:
            vocab = getattr(cls, "vocab_file", None)
            if vocab and os.path.exists(os.path.join(path, vocab)):
                return cls
    # not decided: a class that names no vocabulary file of its own (whatever the import order)
    plain = [cls for _, cls in found if not getattr(cls, "vocab_file", None)]
    return (plain or [cls for _, cls in found] or [None])[0]


def tokenizer_class_of(path):
    """tokenizer_class_for the tokenizer_class named in path/tokenizer_config.json (None without
    that file or name): the family's Tokenizer subclass; None means the plain Tokenizer reads it.
    loading.load_tokenizer makes the choice; the classes are named here as strings, so models/
    imports no tokenizer."""
    conf = os.path.join(path, "tokenizer_config.json")
    if not os.path.lexists(conf):   # (a dangling link is read, and refused by read_json)
        return None
    from ..io import CONFIG_CAP, read_json

    d = read_json(conf, "tokenizer_config.json", CONFIG_CAP)
    return tokenizer_class_for(d.get("tokenizer_class") if isinstance(d, dict) else None, path)


def conversion_fixups(src_dir, config, overrides=None):
    """Config keys a checkpoint converted from `src_dir` must gain ({} for most families);
    `config` is the source config.json (model_type already HF's), `overrides` the converter's
    command-line answers. Raises ValueError naming the file and the option to pass."""
    mt = config.get("model_type")
    spec = _REGISTRY.get(mt) if mt in registered_types() else None
    if spec is None or spec.conversion_fixups is None:
        return {}
    return spec.conversion_fixups(src_dir, config, overrides or {})
