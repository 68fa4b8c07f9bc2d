"""The shipped argument files run end to end (one step each) on the built-in model and data, print
the right `trainable params` line (counts written out from config.json by hand), and write the
expected adapter files; the LoRA output merges with llm/merge_lora_params.py into a model that
loads. Oracles: hand counts from the built-in config, the files' formats, the unmerged model."""
import json
import os

import numpy as np
import paddle
import pytest

from conftest import rel_err, run_script
from paddletune import peft
from paddletune.models import resolve_model_path
from paddletune.loading import load_model


def counts():
    c = json.load(open(os.path.join(resolve_model_path("paddletune/tiny-llama"), "config.json")))
    H, I, L, N, K = (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                     c["num_attention_heads"], c["num_key_value_heads"])
    D, V = H // N, c["vocab_size"]
    kv = K * D
    base = V * H * 2 + H + L * (2 * H + H * H * 2 + H * kv * 2 + 3 * H * I)
    linears = [(H, H), (H, kv), (H, kv), (H, H), (H, I), (H, I), (I, H)]
    lora = L * 8 * sum(i + o for i, o in linears)
    return base, {
        "lora": lora, "rdrop": lora, "neftune": base,
        "pt": 2 * L * K * 64 * D,
        "adapter": L * 2 * (H * 64 + 64 + 64 * H + H),
        "lowrank_adapter": L * 2 * (H * 8 + 8 * 64 + 64 + 64 * 8 + 8 * H + H),
        "bitfit": L * sum(o for _, o in linears)}


MARKER = {"lora": "adapter_config.json", "rdrop": "adapter_config.json", "pt": "adapter_config.json",
          "adapter": "paddletune_adapter.json", "lowrank_adapter": "paddletune_adapter.json",
          "bitfit": "paddletune_adapter.json", "neftune": "config.json"}


@pytest.mark.parametrize("name", ["lora", "pt", "adapter", "lowrank_adapter", "bitfit", "rdrop",
                                  "neftune"])
def test_argument_file_runs(tmp_path, name):
    base, train = counts()
    out = tmp_path / "out"
    r = run_script(["llm/finetune_generation.py", f"llm/llama/{name}_argument.json", "--output_dir",
                    str(out), "--max_steps", "1", "--max_evaluate_steps", "1", "--disable_tqdm",
                    "true"])
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    total = base + (0 if name == "neftune" else train[name])
    want = "trainable params: {:,} / {:,} ({:.2%})".format(train[name], total, train[name] / total)
    assert want in r.stdout, r.stdout[-3000:]
    assert os.path.exists(out / MARKER[name])
    if MARKER[name] == "adapter_config.json":
        kind = json.load(open(out / "adapter_config.json"))["peft_type"]
        assert kind == ("PREFIX_TUNING" if name == "pt" else "LORA")
        assert os.path.exists(out / "adapter_model.safetensors")
    if name == "lora":
        _merge_and_compare(tmp_path, out)


def _merge_and_compare(tmp_path, out):
    merged = tmp_path / "merged"
    r = run_script(["llm/merge_lora_params.py", "--lora_path", str(out), "--merge_lora_model_path",
                    str(merged)])
    assert r.returncode == 0, r.stderr[-3000:]
    x = paddle.to_tensor(np.random.default_rng(0).integers(3, 500, (2, 9)))
    adapted = peft.load_adapter(load_model("paddletune/tiny-llama"), lora_path=str(out))
    with paddle.no_grad():
        want = adapted(x).logits.numpy()
        got = load_model(str(merged))(x).logits.numpy()
    assert rel_err(got, want) < 1e-5
    assert os.path.exists(merged / "tokenizer.json")
