"""ChatGLM2/3 checkpoints -> the layout of transformers' own GLM model (GlmForCausalLM,
model_type "glm"), which transformers loads natively (no trust_remote_code).

The architectures are the same (tests/test_chatglm2.py checks our ChatGLM2 against GlmForCausalLM
with these very maps), so the conversion only renames and splits, exactly:

    THUDM (transformer.)                          GLM
    embedding.word_embeddings.weight              model.embed_tokens.weight
    encoder.final_layernorm.weight                model.norm.weight
    output_layer.weight                           lm_head.weight
    encoder.layers.i.input_layernorm.weight       model.layers.i.input_layernorm.weight
    encoder.layers.i.post_attention_layernorm.*   model.layers.i.post_attention_layernorm.*
    ...self_attention.query_key_value.{w, b}      ...self_attn.{q,k,v}_proj.{w, b}: rows split
                                                  [N*D | G*D | G*D] (N heads, G kv groups, D dim)
    ...self_attention.dense.weight                ...self_attn.o_proj.weight
    ...mlp.dense_h_to_4h.weight                   ...mlp.gate_up_proj.weight (same [gate; up])
    ...mlp.dense_4h_to_h.weight                   ...mlp.down_proj.weight
    rotary_pos_emb.inv_freq                       (dropped: GLM computes it)

config: vocab_size = padded_vocab_size, intermediate_size = ffn_hidden_size, head_dim =
kv_channels, num_key_value_heads = multi_query_group_num (or the heads without MQA), rms_norm_eps
= layernorm_epsilon, attention_bias = add_qkv_bias, max_position_embeddings = seq_length, rope on
half of each head (partial_rotary_factor 0.5) with theta 10000 (x rope_ratio for rope_ratio_mode
"base"; "position" becomes linear rope scaling by rope_ratio).
LoRA adapters convert the same way: query_key_value's lora_A serves q, k and v, its lora_B rows
split like the weight (so the three deltas equal the fused one exactly).

The tokenizer files are copied as they are: ChatGLM's sentencepiece tokenizer is THUDM code
(tokenization_chatglm.py, `trust_remote_code=True`); transformers has no class of its own for it.
"""
import json
import os

import numpy as np

from ..io import publish_into, read_json, write_json
from . import hf

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"   # HF-PEFT

FORMATS = ("hf", "glm")
T = "transformer."
RENAME = {T + "embedding.word_embeddings": "model.embed_tokens",
          T + "encoder.final_layernorm": "model.norm", T + "output_layer": "lm_head"}
LAYER = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
         "self_attention.dense": "self_attn.o_proj", "mlp.dense_h_to_4h": "mlp.gate_up_proj",
         "mlp.dense_4h_to_h": "mlp.down_proj"}
QKV = "self_attention.query_key_value"


def check_format(fmt, model_type, where="export_format"):
    if fmt not in FORMATS:
        raise ValueError(f"{where} must be one of {list(FORMATS)}, got {fmt!r}")
    if fmt == "glm" and model_type != "chatglm":
        raise ValueError(f"{where}=glm converts ChatGLM2/3 checkpoints; this model is {model_type!r} "
                         "(its Hugging Face format already loads in transformers)")


def glm_config(conf):
    """transformers GlmConfig keys from a THUDM ChatGLM2/3 config.json dict."""
    from .chatglm2 import ChatGLM2Config

    c = ChatGLM2Config.from_dict(conf)
    theta = 10000.0 * (c.rope_ratio if c.rope_ratio_mode == "base" else 1.0)
    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.5}
    if c.rope_ratio_mode == "position" and c.rope_ratio != 1:
        rope.update(rope_type="linear", factor=c.rope_ratio)
    eos = conf.get("eos_token_id")
    return {"model_type": "glm", "architectures": ["GlmForCausalLM"], "vocab_size": c.padded_vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.ffn_hidden_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.multi_query_group_num, "head_dim": c.kv_channels,
            "hidden_act": "silu", "attention_dropout": c.attention_dropout,
            "max_position_embeddings": c.seq_length, "initializer_range": c.initializer_range,
            "rms_norm_eps": c.layernorm_epsilon, "use_cache": True, "tie_word_embeddings": False,
            "attention_bias": c.add_qkv_bias, "rope_parameters": rope,
            # transformers 4.x reads these two at the top level
            "rope_theta": theta, "partial_rotary_factor": 0.5,
            "pad_token_id": conf.get("pad_token_id"), "eos_token_id": eos,
            "bos_token_id": conf.get("bos_token_id"), "torch_dtype": conf.get("torch_dtype", "float32")}


def _qkv_rows(glm):
    n, g, d = glm["num_attention_heads"], glm["num_key_value_heads"], glm["head_dim"]
    return {"q_proj": (0, n * d), "k_proj": (n * d, (n + g) * d), "v_proj": ((n + g) * d, (n + 2 * g) * d)}


def module_map(module, glm):
    """THUDM module name -> [(GLM module name, row slice of the fused output or None)]."""
    if module in RENAME:
        return [(RENAME[module], None)]
    head = T + "encoder.layers."
    if not module.startswith(head):
        return []
    i, rest = module[len(head):].split(".", 1)
    if rest == QKV:
        return [(f"model.layers.{i}.self_attn.{p}", rows) for p, rows in _qkv_rows(glm).items()]
    if rest in LAYER:
        return [(f"model.layers.{i}.{LAYER[rest]}", None)]
    raise ValueError(f"no GLM name for {module!r}")


def convert_tensor(name, array, glm):
    """[(GLM name, array)] for one THUDM tensor (HF layout [out, in]); [] for dropped buffers."""
    module, leaf = name.rsplit(".", 1)
    if name == T + "rotary_pos_emb.inv_freq":
        return []
    return [(f"{m}.{leaf}", array if rows is None else np.ascontiguousarray(array[rows[0]:rows[1]]))
            for m, rows in module_map(module, glm)]


def model_to_glm(out_dir, max_shard_size="5GB"):
    """Rewrite the ChatGLM2/3 HF directory `out_dir` in place as a GLM directory (atomically:
    the new files replace the old ones only when complete). Returns out_dir."""
    conf = read_json(os.path.join(out_dir, "config.json"), "config.json")
    check_format("glm", conf.get("model_type"))
    glm = glm_config(conf)
    reader = hf.CheckpointReader(out_dir)
    dtype = conf.get("torch_dtype")

    def tensors():
        for name in reader.keys():
            yield from convert_tensor(name, reader.get(name), glm)

    stale = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json")
    with publish_into(out_dir, stale_patterns=stale) as tmp:
        hf.write_weights(tmp, tensors(), max_shard_size, dtype if dtype in ("bfloat16", "float16") else None)
        reader.release()
        gen = os.path.join(out_dir, "generation_config.json")
        if os.path.isfile(gen):
            write_json(os.path.join(tmp, "generation_config.json"), read_json(gen))
        write_json(os.path.join(tmp, "config.json"), glm)
    return out_dir


def lora_to_glm(adapter_dir, base_config):
    """Rewrite an HF-PEFT LoRA adapter of a ChatGLM2/3 model in place for the GLM layout."""
    # read as files (peft/ sits above models/): the adapter was written by peft.lora.save
    glm = glm_config(base_config)
    conf = read_json(os.path.join(adapter_dir, ADAPTER_CONFIG))
    st = hf.SafetensorsFile(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
    raw = {k: st.get(k) for k in st.keys()}
    st.release()
    out, targets = {}, set()
    for key, arr in raw.items():
        # base_model.model.<module>.lora_A.weight / lora_B.weight
        stem, kind = key.rsplit(".lora_", 1)
        module = stem[len("base_model.model."):]
        for new, rows in module_map(module, glm):
            part = arr if rows is None or kind.startswith("A") else arr[rows[0]:rows[1]]
            out[f"base_model.model.{new}.lora_{kind}"] = np.ascontiguousarray(part)
            targets.add(new.rsplit(".", 1)[-1])
    conf = {k: v for k, v in conf.items() if not k.startswith("_")}   # (peft's in-memory keys)
    conf["target_modules"] = sorted(targets)
    with publish_into(adapter_dir, stale_patterns=("adapter_model*.safetensors",)) as tmp:
        hf.write_safetensors(os.path.join(tmp, ADAPTER_WEIGHTS), out)
        write_json(os.path.join(tmp, ADAPTER_CONFIG), conf)
    return adapter_dir


def export_as(out_dir, fmt, base_config=None, max_shard_size="5GB"):
    """Convert the saved directory `out_dir` (a HF model, or a LoRA adapter with the base's
    config dict `base_config`) to `fmt` ('hf': as it is)."""
    if fmt == "hf":
        return out_dir
    if os.path.isfile(os.path.join(out_dir, "adapter_config.json")):
        with open(os.path.join(out_dir, "adapter_config.json")) as f:
            peft_type = json.load(f).get("peft_type")
        if peft_type != "LORA":
            raise ValueError(f"export_format=glm converts full models and LoRA adapters; "
                             f"{out_dir} holds a {peft_type} adapter")
        check_format(fmt, (base_config or {}).get("model_type"))
        return lora_to_glm(out_dir, base_config)
    if not os.path.isfile(os.path.join(out_dir, "config.json")):
        raise ValueError(f"export_format=glm: {out_dir} holds neither a model nor a LoRA adapter "
                         "(adapter/BitFit files have no transformers layout)")
    return model_to_glm(out_dir, max_shard_size)
