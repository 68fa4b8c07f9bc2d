"""tools/gpu_check.py: on this CPU build it says it needs a GPU and exits 0; its checks' code
runs here in float32 (the GPU-only parts aside), so a GPU user does not meet a Python error."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import gpu_check  # noqa: E402


def test_cpu_build_says_it_needs_a_gpu_and_exits_0():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py")], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "gpu_check: needs a GPU (paddle" in r.stdout and "CPU build" in r.stdout


def test_checks_run_in_float32_on_cpu(capsys):
    """Fused vs dense logits and gradients pass on CPU in float32 (flash / sdpa / F.swiglu have
    CPU kernels); the 'GPU choices taken' check fails here, naming the ops without a CPU kernel;
    the training helpers give finite losses for SFT and nf4 QLoRA on a small 1B-shaped config."""
    import math

    rep = gpu_check.Report()
    gpu_check.check_fused_vs_dense(rep, "float32")
    lines = capsys.readouterr().out.splitlines()
    assert [l.split()[0] for l in lines if "logits" in l] == ["PASS"] * 3, lines
    taken = [l for l in lines if "GPU choices taken" in l]
    assert taken[0].startswith("FAIL") and "fused_rotary_position_embedding" in taken[0]
    gpu_check.check_fused_vs_dense_grads(rep)   # float32 on CPU: sdpa / F.swiglu's backward
    lines = capsys.readouterr().out.splitlines()
    assert [l.split()[0] for l in lines if "gradients" in l] == ["PASS"] * 2, lines
    small = dict(gpu_check.ONE_B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    for mode in ("sft", "qlora"):
        model, params = gpu_check.make_model(small, "float32", mode)
        assert params and (mode == "sft") == (len(params) == len(list(model.parameters())))
        losses, _ = gpu_check.train_steps(model, params, gpu_check.batch(300, 2, 32), 2)
        assert all(map(math.isfinite, losses)) and losses[1] < losses[0]


def test_precision_checks_run_on_cpu(capsys):
    """check_precision's code runs here (CPU trains float32, so the AMP runs equal the float32
    one: their loss lines pass; the O2 dtype and fp16 overflow lines fail, naming what they saw)."""
    rep = gpu_check.Report()
    gpu_check.check_precision(rep, 2)
    lines = capsys.readouterr().out.splitlines()
    loss = [l for l in lines if "step 1 vs float32" in l]
    assert len(loss) == 4 and all(l.startswith("PASS") for l in loss), lines
    o2 = [l for l in lines if "float32 masters" in l]
    assert len(o2) == 2 and all(l.startswith("FAIL") and "0 16-bit" in l for l in o2), lines
    assert [l.split()[0] for l in lines if "injected overflow" in l] == ["FAIL"]
