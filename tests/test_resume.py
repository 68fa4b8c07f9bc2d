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
    from paddletune.loading import load_model

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
    index = json.load(open(tmp_path / "checkpoint-2" / "shards.json"))
    assert index["version"] == 2 and set(index["model"]) == set(model_state)
    for name, arr in model_state.items():   # one process: one whole-tensor piece per tensor
        entry = index["model"][name]
        assert entry["global_shape"] == list(arr.shape)
        assert entry["pieces"] == [{"file": "model_state-00000.safetensors",
                                    "start": [0] * arr.ndim, "shape": list(arr.shape)}]
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
    assert "RESUMING from" in r.stdout + r.stderr and "checkpoint-1" in r.stdout + r.stderr
    assert not any(n.startswith(".tmp-") for n in os.listdir(out))


@pytest.fixture(scope="module")
def ck_plain(tmp_path_factory):
    """No dropout: runs under different layouts draw different dropout masks, so cross-layout
    resume is compared where the data and the weights alone decide the result."""
    path, _ = hf_checkpoint(tmp_path_factory.mktemp("resume_plain") / "ck", "llama")
    return path


def test_resume_across_data_parallel_layouts(ck, ck_plain, tmp_path):
    """One launch of 2 ranks runs every multi-process case (tests/launch_cases.py):
    - DP=2 resumed from its own checkpoint-2 equals the uninterrupted DP=2 run (dropout on: each
      rank restores its own RNG state);
    - a checkpoint written by ONE process resumes under DP=2 (global batch 4 = 2 ranks x 2), and
      one written under DP=2 resumes in one process (batch 4): steps 3-4 and the final weights
      equal the uninterrupted single-process run."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dp_worker import train_case
    from conftest import launch_cases

    single = tmp_path / "single"
    train_case(ck_plain, str(single), 4, 1, 4, None, 2)          # reference, in-process
    cases = [("dp_full", "dp_worker:train_case", dict(ckpt_dir=ck, out_dir=str(tmp_path / "dp_full"), micro=2,
                                                      accum=1, steps=4, save_steps=2)),
             ("dp_resumed", "dp_worker:train_case", dict(ckpt_dir=ck, out_dir=str(tmp_path / "dp_res"), micro=2,
                                                         accum=1, steps=4, save_steps=2,
                                                         resume=str(tmp_path / "dp_full" / "checkpoint-2"))),
             ("single_to_dp", "dp_worker:train_case", dict(ckpt_dir=ck_plain, out_dir=str(tmp_path / "s2d"),
                                                           micro=2, accum=1, steps=4,
                                                           resume=str(single / "checkpoint-2"))),
             ("dp_plain", "dp_worker:train_case", dict(ckpt_dir=ck_plain, out_dir=str(tmp_path / "dp_plain"),
                                                       micro=2, accum=1, steps=4, save_steps=2))]
    got = launch_cases(cases, tmp_path)
    assert got["dp_full"][0] == got["dp_full"][1]           # one global loss, logged on both ranks
    state = json.load(open(tmp_path / "dp_full" / "checkpoint-2" / "trainer_state.json"))
    assert len(state["rng"]) == 2 and state["rng"][0]["state"] != state["rng"][1]["state"]
    assert state["degrees"]["dp"] == 2 and state["global_batch"] == 4
    (l_full, w_full), (l_res, w_res) = result(tmp_path / "dp_full"), result(tmp_path / "dp_res")
    np.testing.assert_allclose(l_res[2:], l_full[2:], rtol=1e-6, atol=0)
    assert max(rel_err(w_res[k], w_full[k]) for k in w_full) <= 1e-6

    train_case(ck_plain, str(tmp_path / "d2s"), 4, 1, 4, str(tmp_path / "dp_plain" / "checkpoint-2"))
    l_ref, w_ref = result(single)
    for run in ("s2d", "d2s"):
        l, w = result(tmp_path / run)
        np.testing.assert_allclose(l[2:], l_ref[2:], rtol=1e-5, atol=0)
        flat = lambda d: np.concatenate([d[k].ravel() for k in sorted(d)])  # noqa: E731
        assert rel_err(flat(w), flat(w_ref)) <= 1e-5, run
    # the DP=2 checkpoint was written by rank 0 only (the ranks hold the same replica)
    files = sorted(os.listdir(tmp_path / "dp_plain" / "checkpoint-2"))
    assert files == ["model_state-00000.safetensors", "optimizer-00000.safetensors", "shards.json",
                     "trainer_state.json"]


def test_resume_with_another_global_batch_is_refused(ck_plain, tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dp_worker import train_case

    train_case(ck_plain, str(tmp_path / "a"), 4, 1, 2, None, 2)
    with pytest.raises(ValueError, match="global batch of 4 examples per step, this run has 2"):
        train_case(ck_plain, str(tmp_path / "b"), 2, 1, 4, str(tmp_path / "a" / "checkpoint-2"))


def test_reader_assembles_any_box_from_pieces(tmp_path):
    """Hand-worked: a [4, 6] tensor written as two column halves by two writers (and its optimizer
    state as row halves) is read whole, as rows [2:4), and as a box crossing both pieces."""
    from paddletune.io import write_json

    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    d = tmp_path / "checkpoint-1"
    d.mkdir()
    parts = []
    for rank, cols in ((0, slice(0, 3)), (1, slice(3, 6))):
        piece = ckpt.Piece("w", w[:, cols], [4, 6], [0, cols.start])
        rows = slice(2 * rank, 2 * rank + 2)
        opt = ckpt.Piece("w.exp_avg", w[rows] * 10, [4, 6], [rows.start, 0])
        parts.append({"model": ckpt._write_pieces(str(d), rank, "model", [piece]),
                      "optimizer": ckpt._write_pieces(str(d), rank, "optimizer", [opt])})
    write_json(str(d / "shards.json"), dict(version=2, **ckpt._merge_index(parts)))
    write_json(str(d / "trainer_state.json"), {"global_step": 1})
    r = ckpt.CheckpointReader(str(d))
    np.testing.assert_array_equal(r.read("w"), w)
    np.testing.assert_array_equal(r.read("w", start=[2, 0], shape=[2, 6]), w[2:4])
    np.testing.assert_array_equal(r.read("w", start=[1, 2], shape=[2, 3]), w[1:3, 2:5])
    np.testing.assert_array_equal(r.read("w.exp_avg", "optimizer", [1, 1], [2, 4]), w[1:3, 1:5] * 10)
    broken = json.load(open(d / "shards.json"))
    broken["model"]["w"]["pieces"].pop()
    write_json(str(d / "shards.json"), broken)
    with pytest.raises(ValueError, match="cover 12 of the 24 elements"):
        ckpt.CheckpointReader(str(d)).read("w")


def test_version1_checkpoint_is_still_read(tmp_path):
    """Checkpoints of the first format (model_state.safetensors + optimizer.safetensors, whole
    tensors) resume as before."""
    from paddletune.io import write_json
    from paddletune.models.hf import write_safetensors

    d = tmp_path / "checkpoint-3"
    d.mkdir()
    a = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    write_safetensors(str(d / "model_state.safetensors"), {"x": a})
    write_safetensors(str(d / "optimizer.safetensors"), {"x.exp_avg": a * 2, "x.exp_avg_sq": a * a})
    write_json(str(d / "shards.json"), {"files": {"model_state.safetensors": {"x": {
        "global_shape": [3, 5], "axis": None, "start": 0}}}})
    write_json(str(d / "trainer_state.json"), {"global_step": 3})
    model_state, optim, state = ckpt.load_checkpoint(str(d))
    np.testing.assert_array_equal(model_state["x"], a)
    np.testing.assert_array_equal(optim["x.exp_avg"], a * 2)
    assert state["global_step"] == 3
