"""LoRA merge into the base checkpoint files: the merged model equals the unmerged adapter model,
an untrained adapter merges to the identical checkpoint, dtypes and shards are kept, the CLI works
and refuses bad input before writing, and peak memory stays near one tensor, not a model copy.
Oracles: the unmerged adapter model, the base files themselves, torch's bf16 rounding, RSS."""
import json
import os
import shutil

import numpy as np
import paddle
import pytest

from conftest import TINY_TOKENIZER, hf_checkpoint, rel_err, run_script
from paddletune import peft
from paddletune.args import ModelArgument
from paddletune.models import hf
from paddletune.loading import load_model
from paddletune.trainer.checkpoint import read_tensors


def adapter_on(path, out, seed=1, **kw):
    """Train-free LoRA on the model at `path` with random A and B, saved to `out`."""
    model = load_model(path)
    setup = peft.apply(model, ModelArgument(model_name_or_path=path, lora=True, lora_rank=4, **kw))
    rng = np.random.default_rng(seed)
    for p in setup.trainable.values():
        p.set_value((rng.standard_normal(p.shape) * 0.1).astype(np.float32))
    setup.export_fn(str(out))
    return model


def logits(model, seed=0):
    x = np.random.default_rng(seed).integers(3, 600, (2, 11))
    model.eval()
    with paddle.no_grad():
        return model(paddle.to_tensor(x)).logits.numpy()


def all_tensors(path):
    r = hf.CheckpointReader(path)
    return {k: r.get(k) for k in r.keys()}


def test_merged_equals_unmerged_sharded(tmp_path):
    base, _ = hf_checkpoint(tmp_path / "base", max_shard_size="100KB")
    adapted = adapter_on(base, tmp_path / "lora", rslora=True)
    out = peft.merge_lora(str(tmp_path / "lora"), str(tmp_path / "merged"))
    assert rel_err(logits(load_model(out)), logits(adapted)) < 1e-5
    # same shard files and index as the base, tokenizer and config alongside
    shards = sorted(f for f in os.listdir(base) if f.endswith(".safetensors"))
    assert len(shards) > 1 and sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == shards
    assert json.load(open(os.path.join(out, "model.safetensors.index.json"))) == \
        json.load(open(os.path.join(base, "model.safetensors.index.json")))
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    assert json.load(open(os.path.join(out, "config.json"))) == json.load(open(os.path.join(base, "config.json")))


def test_untrained_adapter_merges_to_identity(tmp_path):
    base, _ = hf_checkpoint(tmp_path / "base")
    model = load_model(base)
    peft.apply(model, ModelArgument(model_name_or_path=base, lora=True)).export_fn(str(tmp_path / "a"))
    out = peft.merge_lora(str(tmp_path / "a"), str(tmp_path / "m"))
    ref, got = all_tensors(base), all_tensors(out)
    assert set(ref) == set(got)
    for k in ref:
        assert ref[k].dtype == got[k].dtype and np.array_equal(ref[k], got[k]), k


def test_bf16_base_keeps_dtype_and_rounds_like_torch(tmp_path):
    import torch

    base32, tm = hf_checkpoint(tmp_path / "b32")
    base = str(tmp_path / "b16")
    tm.to(torch.bfloat16).save_pretrained(base)
    for f in os.listdir(TINY_TOKENIZER):
        shutil.copy(os.path.join(TINY_TOKENIZER, f), base)
    adapter_on(base, tmp_path / "lora")
    out = peft.merge_lora(str(tmp_path / "lora"), str(tmp_path / "m"))
    st = hf.SafetensorsFile(os.path.join(out, "model.safetensors"))
    assert {st.dtype(k) for k in st.keys()} == {"BF16"}
    a = read_tensors(str(tmp_path / "lora" / "adapter_model.safetensors"))
    pre = "base_model.model.model.layers.1.self_attn.k_proj"
    conf = json.load(open(tmp_path / "lora" / "adapter_config.json"))
    scale = conf["lora_alpha"] / conf["r"]
    w = tm.state_dict()["model.layers.1.self_attn.k_proj.weight"].float()
    want = (w + scale * torch.tensor(a[pre + ".lora_B.weight"]) @ torch.tensor(a[pre + ".lora_A.weight"]))
    from safetensors.torch import load_file

    got = load_file(os.path.join(out, "model.safetensors"))["model.layers.1.self_attn.k_proj.weight"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))


def test_cli_alias_default_base_and_bad_input(tmp_path):
    base, _ = hf_checkpoint(tmp_path / "base")
    adapted = adapter_on(base, tmp_path / "lora")
    r = run_script(["llm/merge_lora_params.py", "--lora_path", str(tmp_path / "lora"),
                    "--merge_model_path", str(tmp_path / "merged"), "--device", "cpu"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert rel_err(logits(load_model(str(tmp_path / "merged"))), logits(adapted)) < 1e-5
    # a base of other shapes: refused, nothing written
    other, _ = hf_checkpoint(tmp_path / "other", intermediate_size=80)
    r = run_script(["llm/merge_lora_params.py", "--lora_path", str(tmp_path / "lora"),
                    "--merge_lora_model_path", str(tmp_path / "bad"), "--model_name_or_path", other])
    assert r.returncode == 2 and "base model of other shapes" in r.stderr
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match="adapter or base directory"):
        peft.merge_lora(str(tmp_path / "lora"), base)


RSS_SCRIPT = r"""
import json, sys
import paddletune
from paddletune.peft import merge_lora

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

try:
    with open("/proc/self/clear_refs", "w") as f:   # reset the peak to the current RSS
        f.write("5")
except OSError:
    pass
before = status("VmRSS:")
merge_lora(sys.argv[1], sys.argv[2])
print(json.dumps({"before": before, "peak": status("VmHWM:")}))
"""


def test_merge_peak_memory_stays_near_one_tensor(tmp_path):
    """A ~300 MB float32 Llama written directly with numpy; the merge runs in a subprocess."""
    H, I, L, V, r = 1024, 2816, 6, 1000, 8
    base = tmp_path / "base"
    base.mkdir()
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": V,
           "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L,
           "num_attention_heads": 8, "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 512, "tie_word_embeddings": False}
    json.dump(cfg, open(base / "config.json", "w"))
    shapes = {"model.embed_tokens.weight": [V, H], "lm_head.weight": [V, H], "model.norm.weight": [H]}
    lin = {"self_attn.q_proj": (H, H), "self_attn.k_proj": (H, H), "self_attn.v_proj": (H, H),
           "self_attn.o_proj": (H, H), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H),
           "mlp.down_proj": (H, I)}
    for i in range(L):
        shapes[f"model.layers.{i}.input_layernorm.weight"] = [H]
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = [H]
        for m, s in lin.items():
            shapes[f"model.layers.{i}.{m}.weight"] = list(s)
    rng = np.random.default_rng(0)
    hf.stream_safetensors(str(base / "model.safetensors"),
                          {k: {"dtype": "F32", "shape": s} for k, s in shapes.items()},
                          ((k, rng.standard_normal(s, np.float32) * 0.02) for k, s in shapes.items()))
    size = sum(int(np.prod(s)) * 4 for s in shapes.values())
    assert size > 250e6
    lora_dir = tmp_path / "lora"
    lora_dir.mkdir()
    ad = {}
    for i in range(L):
        for m, (o, n_in) in lin.items():
            key = f"base_model.model.model.layers.{i}.{m}"
            ad[key + ".lora_A.weight"] = rng.standard_normal((r, n_in), np.float32) * 0.01
            ad[key + ".lora_B.weight"] = rng.standard_normal((o, r), np.float32) * 0.01
    hf.write_safetensors(str(lora_dir / "adapter_model.safetensors"), ad)
    json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 16, "target_modules": ["q_proj"],
               "base_model_name_or_path": str(base)}, open(lora_dir / "adapter_config.json", "w"))
    out = tmp_path / "merged"
    res = run_script(["-c", RSS_SCRIPT, str(lora_dir), str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads(res.stdout.strip().splitlines()[-1])
    growth = m["peak"] - m["before"]
    print(f"model {size / 1e6:.0f} MB, merge peak RSS growth {growth / 1e6:.0f} MB "
          f"({growth / size:.2f}x the model)")
    assert growth < 1.5 * size      # the bound
    # streaming: without releasing each memory-mapped tensor the growth was measured at ~1.2x
    # (the whole base file resident); with it, ~0.2x (a few copies of the largest tensors)
    assert growth < 0.5 * size
    got = hf.SafetensorsFile(str(out / "model.safetensors")).get("model.layers.3.mlp.down_proj.weight")
    w = hf.SafetensorsFile(str(base / "model.safetensors")).get("model.layers.3.mlp.down_proj.weight")
    k = "base_model.model.model.layers.3.mlp.down_proj"
    want = w + 2.0 * ad[k + ".lora_B.weight"] @ ad[k + ".lora_A.weight"]
    assert rel_err(got, want) < 1e-6
