"""Peer comparison and CPU-ceiling benchmarks: 1-step smoke runs (timings never asserted), and the
FLOP count they divide by, checked against torch's own FLOP counter.

A peer that is not installed (PaddleFormers lives in its own venv made by `compare_peers.py
--setup`) is reported as skipped with its reason: that is not a failure here.
"""
import json
import os
import sys

import pytest

from conftest import ROOT, run_script

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "peers"))
from cpu_ceiling import step_flops  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_step_flops_hand_worked_example():
    cfg = dict(vocab_size=8, hidden_size=2, intermediate_size=4, num_hidden_layers=1, num_attention_heads=1,
               num_key_value_heads=1)
    # Linears 40 weights: 6*40*3 tokens = 720; causal pairs 6 -> 3 * 4*6*2 = 144; head 3 * 2*2*8*2 = 192
    assert step_flops(cfg, [3], 2, "full") == 720 + 144 + 192
    # full score matrix: 9 pairs instead of 6
    assert step_flops(cfg, [3], 2, "full", causal=False) == 720 + 3 * 4 * 9 * 2 + 192


@pytest.mark.parametrize("method", ["full", "lora"])
def test_step_flops_equals_torch_flop_counter(method):
    """Oracle: torch.utils.flop_counter on a transformers(+peft) Llama forward+backward, with eager
    attention (full score matrix) and logits at every position, as that model computes them."""
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, attn_implementation="eager"))
    if method == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    model.train()
    ids = torch.randint(0, TINY["vocab_size"], (2, 10))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    expect = step_flops(TINY, [10, 10], 2 * 10, method, lora_rank=4, causal=False)
    assert counter.get_total_flops() == expect


def test_skipped_peer_names_the_fix(tmp_path, monkeypatch):
    import harness

    monkeypatch.setattr(harness, "VENVS", str(tmp_path))
    monkeypatch.setattr(harness, "_has", lambda py, mods: False)
    py, why = harness.interpreter("paddleformers")
    assert py is None and "--setup" in why
    os.makedirs(tmp_path / "paddleformers")
    (tmp_path / "paddleformers" / "SETUP_FAILED.txt").write_text("`pip install paddleformers==1.2.0` exited 1\nboom")
    py, why = harness.interpreter("paddleformers")
    assert py is None and why.startswith("install failed:") and "exited 1" in why


def test_compare_peers_smoke(tmp_path):
    out = tmp_path / "runs.json"
    r = run_script([os.path.join(ROOT, "benchmarks", "compare_peers.py"), "--smoke", "--modes", "lora-sft,full",
                    "--json", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| full | paddletune | padding |" in r.stdout and "target tokens/s" in r.stdout
    runs = {k: v[0] for k, v in json.loads(out.read_text()).items()}
    for key, res in runs.items():
        assert res["status"] in ("ok", "skipped"), (key, res)
        if res["status"] == "skipped":
            assert res["reason"], key
    for key in ("full / paddletune / padded", "lora-sft / paddletune / padded", "lora-sft / paddletune / zero_padding"):
        assert runs[key]["status"] == "ok", runs[key]
    assert runs["full / hf / padded"]["status"] == "ok"   # torch/transformers/peft are test dependencies
    # the same weights and data: every peer's step-1 loss agrees (independent implementations)
    for mode in ("full", "lora-sft"):
        ref = runs[f"{mode} / paddletune / padded"]["loss_first"]
        for peer in ("hf", "paddleformers"):
            res = runs[f"{mode} / {peer} / padded"]
            if res["status"] == "ok":
                assert abs(res["loss_first"] - ref) < 1e-4 * abs(ref), (mode, peer, res["loss_first"], ref)
                assert res["trainable_params"] == runs[f"{mode} / paddletune / padded"]["trainable_params"]
    # zero padding keeps every example its own segment, in order (the packer's rows, not one blob)
    import harness

    lens = [len(e["input_ids"]) for e in harness.sft_examples(harness.SMOKE, 1)]
    step = runs["lora-sft / paddletune / zero_padding"]["timed_batches"][0]
    assert len(step["seq_lens"]) >= harness.SMOKE["batch"] and step["seq_lens"] == lens[:len(step["seq_lens"])]
    assert step["targets"] > 0


def test_cpu_ceiling_smoke():
    r = run_script([os.path.join(ROOT, "benchmarks", "cpu_ceiling.py"), "--smoke", "--modes", "full,lora-sft"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Ceiling (best paddle rate)" in r.stdout and "numpy" in r.stdout
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| full |") or ln.startswith("| lora-sft |")]
    assert len(rows) == 2 and all("% |" in ln for ln in rows), r.stdout


def test_profile_paddletune_smoke():
    r = run_script([os.path.join(ROOT, "benchmarks", "peers", "profile_paddletune.py"), "--smoke", "--method", "lora"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| matmul (fwd + grad) |" in r.stdout and "| Forward |" in r.stdout, r.stdout


def test_setup_refuses_a_cuda_torch(tmp_path, monkeypatch):
    """--setup asks pip what torch==2.13.0 resolves to before installing; a non-+cpu build is refused."""
    import harness

    py = tmp_path / "venv" / "bin" / "python"

    def fake_pip(python, args, log):
        report = args[args.index("--report") + 1]
        with open(report, "w") as f:
            json.dump({"install": [{"metadata": {"version": version},
                                    "download_info": {"url": "https://example.invalid/torch-2.13.0-cp311.whl"}}]}, f)
        return ["pip", *args], 0

    monkeypatch.setattr(harness, "_pip", fake_pip)
    os.makedirs(py.parent)
    version = "2.13.0"
    why = harness._cpu_torch_guard(str(py), None)
    assert why and "not a CPU build" in why and "refusing" in why
    version = "2.13.0+cpu"
    assert harness._cpu_torch_guard(str(py), None) is None
