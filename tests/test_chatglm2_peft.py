"""LoRA and prefix tuning on ChatGLM2 (peft branch + ChatGLM2's ModelSpec).

Oracles: torch `peft` on transformers' GLM carrying the same weights (test_chatglm2's
renaming), and the copy task. A LoRA on THUDM's fused query_key_value (ΔW = B·A, B's rows
[q | k | v]) equals three PEFT LoRAs on GLM's q_proj, k_proj, v_proj sharing A with B split by
rows; dense_h_to_4h, dense and dense_4h_to_h are GLM's gate_up_proj, o_proj and down_proj.
"""
import json
import os

import numpy as np
import paddle
import torch
from safetensors.numpy import load_file, save_file

from conftest import copy_pairs, rel_err, token_accuracy, training_args
from test_chatglm2 import VOCAB, glm_checkpoint

from paddletune import peft
from paddletune.args import ModelArgument
from paddletune.models import build_model, get_spec
from paddletune.loading import load_model
from paddletune.peft import lora
from paddletune.trainer import Trainer

N, G, D = 4, 2, 16
GLM_NAMES = {"self_attention.dense": "self_attn.o_proj", "mlp.dense_h_to_4h": "mlp.gate_up_proj",
             "mlp.dense_4h_to_h": "mlp.down_proj"}


def margs(path, **kw):
    return ModelArgument(model_name_or_path=path, **kw)


def randomize(params, seed=1, scale=0.1):
    rng = np.random.default_rng(seed)
    for p in params.values():
        p.set_value((rng.standard_normal(p.shape) * scale).astype(np.float32))


def logits(model, x):
    model.eval()
    with paddle.no_grad():
        return model(paddle.to_tensor(x)).logits.numpy()


def lora_for_glm(src, dst):
    """Our ChatGLM2 adapter dir -> the equivalent torch-peft adapter for transformers' GLM."""
    conf = json.load(open(os.path.join(src, "adapter_config.json")))
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    out = {}
    for key, arr in tensors.items():
        key = key.replace("transformer.encoder.layers.", "model.layers.")
        if ".self_attention.query_key_value." in key:
            base = key.split(".self_attention.query_key_value.")[0] + ".self_attn."
            rows = {"q": (0, N * D), "k": (N * D, (N + G) * D), "v": ((N + G) * D, (N + 2 * G) * D)}
            for p, (a, b) in rows.items():
                part = arr if ".lora_A." in key else arr[a:b]
                out[key.replace(key.split(".lora_")[0] + ".", base + f"{p}_proj.")] = part
            continue
        for ours, theirs in GLM_NAMES.items():
            key = key.replace(ours, theirs)
        out[key] = arr
    os.makedirs(dst, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()},
              os.path.join(dst, "adapter_model.safetensors"))
    conf["target_modules"] = sorted({k.split("base_model.model.")[1].split(".lora_")[0] for k in out})
    json.dump(conf, open(os.path.join(dst, "adapter_config.json"), "w"))
    return dst


def test_default_lora_targets_and_torch_peft_oracle(tmp_path):
    from peft import PeftModel

    path, glm = glm_checkpoint(tmp_path / "glm")
    model = load_model(path)
    setup = peft.apply(model, margs(path, lora=True, lora_rank=4, lora_alpha=8))
    wrapped = sorted(lora.lora_layers(model))
    assert wrapped == sorted(f"transformer.encoder.layers.{i}.{m}" for i in range(2) for m in
                             ("self_attention.query_key_value", "self_attention.dense",
                              "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"))
    shapes = {n: list(p.shape) for n, p in setup.trainable.items()}
    assert shapes["transformer.encoder.layers.0.self_attention.query_key_value.lora_B.weight"] == \
        [4, (N + 2 * G) * D]
    randomize(setup.trainable)
    x = np.random.default_rng(0).integers(3, VOCAB, (2, 14))
    ours = logits(model, x)
    setup.export_fn(str(tmp_path / "adapter"))
    pm = PeftModel.from_pretrained(glm, lora_for_glm(str(tmp_path / "adapter"), str(tmp_path / "glm_adapter"))).eval()
    with torch.no_grad():
        theirs = pm(torch.tensor(x)).logits.numpy()
    assert rel_err(ours, theirs) <= 1e-4
    assert rel_err(logits(load_model(path), x), theirs) > 1e-2    # the adapter matters
    again = peft.load_adapter(load_model(path), lora_path=str(tmp_path / "adapter"))
    assert rel_err(logits(again, x), ours) < 1e-6


def test_prefix_layout_and_torch_peft_oracle(tmp_path):
    """Our prefix (G key/value heads of kv_channels per block, real tokens at positions P...)
    exported as HF-PEFT PREFIX_TUNING gives transformers' GLM + torch peft the same logits."""
    from peft import PeftModel

    path, glm = glm_checkpoint(tmp_path / "glm")
    model = load_model(path)
    setup = peft.apply(model, margs(path, prefix_tuning=True, num_prefix_tokens=5))
    keys = [p for n, p in setup.trainable.items() if "key" in n]
    assert [list(p.shape) for p in keys] == [[2, G, 5, D]]      # [L, G, P, D]
    randomize(setup.trainable, scale=0.5)
    x = np.random.default_rng(1).integers(3, VOCAB, (2, 11))
    ours = logits(model, x)
    setup.export_fn(str(tmp_path / "prefix"))
    pm = PeftModel.from_pretrained(glm, str(tmp_path / "prefix")).eval()
    with torch.no_grad():
        theirs = pm(input_ids=torch.tensor(x), attention_mask=torch.ones(x.shape, dtype=torch.long)).logits.numpy()
    assert rel_err(ours, theirs) <= 1e-4
    assert rel_err(logits(load_model(path), x), theirs) > 1e-2


def tiny():
    """Sized like the peft branch's Llama copy-task model (hidden 64, FFN 512, 2 KV heads)."""
    paddle.seed(0)
    cfg = dict(get_spec("chatglm").tiny_config, padded_vocab_size=640, ffn_hidden_size=512,
               initializer_range=0.1)
    return build_model(cfg, seed=0)


def test_lora_learns_copy_task(tmp_path):
    model = tiny()
    data = copy_pairs()
    assert token_accuracy(model, data) < 0.2
    setup = peft.apply(model, margs("tiny", lora=True, lora_rank=8))
    Trainer(model, training_args(tmp_path, max_steps=80), train_dataset=data,
            trainable=setup.trainable, export_fn=lambda d: None).train()
    assert token_accuracy(model, data) == 1.0


def test_prefix_tuning_learns_copy_task(tmp_path):
    model = tiny()
    data = copy_pairs()
    setup = peft.apply(model, margs("tiny", prefix_tuning=True, num_prefix_tokens=32))
    assert token_accuracy(model, data) < 0.2
    Trainer(model, training_args(tmp_path, max_steps=150, learning_rate=3e-2), train_dataset=data,
            trainable=setup.trainable, export_fn=lambda d: None).train()
    assert token_accuracy(model, data) == 1.0


def test_merged_lora_checkpoint_equals_the_unmerged_model(tmp_path):
    """peft.merge_lora (llm/merge_lora_params.py) on a ChatGLM2 adapter: the merged THUDM-layout
    checkpoint gives the logits of base + adapter."""
    path, _ = glm_checkpoint(tmp_path / "glm")
    model = load_model(path)
    setup = peft.apply(model, margs(path, lora=True, lora_rank=4))
    randomize(setup.trainable, seed=2)
    x = np.random.default_rng(2).integers(3, VOCAB, (2, 10))
    ours = logits(model, x)
    setup.export_fn(str(tmp_path / "adapter"))
    out = peft.merge_lora(str(tmp_path / "adapter"), str(tmp_path / "merged"), base_path=path)
    merged = load_model(out)
    assert type(merged).__name__ == "ChatGLM2ForCausalLM"
    assert rel_err(logits(merged, x), ours) <= 1e-5
