"""Exact resume: checkpoint-2 + resume reproduces the uninterrupted run (losses and weights to
1e-6), with and without gradient accumulation, with dropout on (so RNG state matters). A save
killed by SIGKILL never leaves a checkpoint-N that resume would pick up."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, hf_checkpoint, lm_loss, rel_err, run_script
from paddletune.models.hf import SafetensorsFile
from paddletune.trainer import checkpoint as ckpt

WORKER = os.path.join(ROOT, "tests", "dp_worker.py")


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    path, _ = hf_checkpoint(tmp_path_factory.mktemp("resume") / "ck", "llama", attention_dropout=0.1)
    return path


def result(run):
    st = SafetensorsFile(str(run / "weights.safetensors"))
    return json.load(open(run / "losses.json")), {k: st.get(k) for k in st.keys()}


def test_dropout_is_active(ck):
    import paddle
    from paddletune.models import load_model

    model = load_model(ck)
    model.train()
    x = paddle.to_tensor(np.arange(3, 19)[None])
    assert float(lm_loss(model, x, x).loss) != float(lm_loss(model, x, x).loss)


@pytest.mark.parametrize("micro,accum", [(4, 1), (2, 2)])
def test_resume_reproduces_uninterrupted_run(ck, tmp_path, micro, accum):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    r = run_script([WORKER, ck, str(full), str(micro), str(accum), "4", "-", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert ckpt.latest_checkpoint(str(full)).endswith("checkpoint-4")
    r = run_script([WORKER, ck, str(resumed), str(micro), str(accum), "4", str(full / "checkpoint-2"), "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    (l_full, w_full), (l_res, w_res) = result(full), result(resumed)
    assert len(l_full) == len(l_res) == 4
    np.testing.assert_allclose(l_res[2:], l_full[2:], rtol=1e-6, atol=0)
    assert max(rel_err(w_res[k], w_full[k]) for k in w_full) <= 1e-6


def test_checkpoint_contents(ck, tmp_path):
    r = run_script([WORKER, ck, str(tmp_path), "4", "1", "2", "-", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    model_state, optim, state = ckpt.load_checkpoint(str(tmp_path / "checkpoint-2"))
    assert state["global_step"] == 2 and state["optimizer"]["step"] == 2
    assert set(optim) == {f"{n}.{s}" for n in model_state for s in ("exp_avg", "exp_avg_sq")}
    shards = json.load(open(tmp_path / "checkpoint-2" / "shards.json"))["files"]["model_state.safetensors"]
    assert set(shards) == set(model_state) and all(v["axis"] is None for v in shards.values())
    assert not any(name.endswith(".pdparams") or name.endswith(".pkl") for name in os.listdir(tmp_path / "checkpoint-2"))


def test_sigkill_during_save_leaves_no_partial_checkpoint(ck, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PT_SLOW_SAVE="1", PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, WORKER, ck, str(out), "4", "1", "6", "-", "1"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    writes = 0
    for line in proc.stdout:
        if line.startswith("WRITING"):
            writes += 1
            if writes == 3:   # first file of checkpoint-2 (checkpoint-1 wrote 2 files)
                os.kill(proc.pid, signal.SIGKILL)
                break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    names = os.listdir(out)
    assert "checkpoint-2" not in names and any(n.startswith(".tmp-checkpoint-2") for n in names)
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(out))] == ["checkpoint-1"]
    # resume_from_checkpoint=true picks checkpoint-1 and training completes
    r = run_script([WORKER, ck, str(out), "4", "1", "6", "true", "1"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout + r.stderr and "checkpoint-1" in r.stdout + r.stderr
    assert not any(n.startswith(".tmp-") for n in os.listdir(out))


def test_resume_under_data_parallel(ck, tmp_path):
    """DP=2 (two real processes): resume from checkpoint-2 reproduces the uninterrupted DP run; each
    rank restores its own RNG state (dropout masks differ per rank)."""
    from conftest import launch

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    r = launch([WORKER, ck, str(full), "2", "1", "4", "-", "2"], log_dir=tmp_path / "log1")
    assert r.returncode == 0, open(tmp_path / "log1" / "workerlog.0").read()[-3000:]
    state = json.load(open(full / "checkpoint-2" / "trainer_state.json"))
    assert len(state["rng"]) == 2 and state["rng"][0] != state["rng"][1]
    r = launch([WORKER, ck, str(resumed), "2", "1", "4", str(full / "checkpoint-2"), "2"], log_dir=tmp_path / "log2")
    assert r.returncode == 0, open(tmp_path / "log2" / "workerlog.0").read()[-3000:]
    (l_full, w_full), (l_res, w_res) = result(full), result(resumed)
    np.testing.assert_allclose(l_res[2:], l_full[2:], rtol=1e-6, atol=0)
    assert max(rel_err(w_res[k], w_full[k]) for k in w_full) <= 1e-6
