"""ModelSpec: every per-model fact the rest of the library needs, in one record per model type.

Code outside `models/` asks the spec (LoRA targets, TP plan, which 2-D tensors are not Linear
weights, prefix-cache layout, chat template, tiny config) instead of testing `model_type`.
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple


@dataclass(frozen=True)
class ModelSpec:
    model_type: str                    # config.json "model_type"
    config_cls: type                   # has from_dict(dict) / to_dict()
    model_cls: type                    # causal LM: model(input_ids, ...) -> CausalLMOutput
    architectures: Tuple[str, ...]     # config.json "architectures" written on save
    # HF tensor names of 2-D weights that are NOT nn.Linear weights (embeddings): hf.py transposes
    # every other 2-D ".weight" between HF [out, in] and paddle [in, out].
    not_linear: Tuple[str, ...]
    # Default LoRA targets: regexes over module names (peft issue), e.g. r".*\.q_proj$".
    lora_targets: Tuple[str, ...]
    # Tensor-parallel plan by module-name suffix: "column" (split out features), "row" (split in
    # features, all-reduce output), "vocab" (split embedding rows). Applied by paddletune.parallel.
    tp_plan: Dict[str, str]
    # prefix_layout(config) -> (num_layers, num_kv_heads, head_dim): shape of learned K/V prefixes
    prefix_layout: Callable
    # Bottleneck-adapter placement (peft issue): regexes over module names of the layers whose
    # output gets an adapter: the attention output and the MLP output projections.
    adapter_targets: Tuple[str, ...] = ()
    tiny_config: Dict = field(default_factory=dict)   # small config.json used by tools and tests
    default_chat_template: Optional[str] = None        # built-in template name (data issue)


_REGISTRY: Dict[str, ModelSpec] = {}


def register(spec: ModelSpec):
    _REGISTRY[spec.model_type] = spec
    return spec


def get_spec(model_type: str) -> ModelSpec:
    from . import llama  # noqa: F401  (registers llama, qwen2, mistral)

    try:
        from . import chatglm2  # noqa: F401
    except ImportError:
        pass
    if model_type not in _REGISTRY:
        raise ValueError(
            f"model_type '{model_type}' is not supported; supported: {sorted(_REGISTRY)}")
    return _REGISTRY[model_type]


def registered_types():
    get_spec("llama")
    return sorted(_REGISTRY)
