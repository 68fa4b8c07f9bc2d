"""No host synchronisation inside the training step (issue 32, deliverable 3).

On a GPU every read of a device value on the host (Tensor.numpy / item / tolist, float() / int()
/ bool() / index use / np.asarray of a tensor) and every data-dependent shape (nonzero,
masked_select, boolean indexing) waits for the device queue to drain: the host cannot enqueue
the next kernels meanwhile. This CPU test patches all of them to count (with where they were
called) while Trainer.training_step runs; logging, evaluation and checkpoints run outside it
(_maybe_log_eval_save), where reads are allowed. Expected counts, each with its reason in the
code: 0 for one process (SFT, LoRA, QLoRA, packed rows); one per MoE layer per micro-batch
(dropless dispatch: the expert token counts size the buffers, models/moe.py); one per step under
fp16 (found-inf decides whether to update, trainer/amp.py); one per step under data parallel
(the global target count, parallel/topology.py: 2 launched ranks)."""
import contextlib
import json
import os
import traceback

import paddle
import pytest

from paddletune.trainer import Trainer

READS = ("numpy", "item", "tolist", "__float__", "__int__", "__bool__", "__index__", "__array__")


@contextlib.contextmanager
def counting():
    """Yields {what: [call sites]} of host reads made inside Trainer.training_step while the
    block runs. Clipping takes its GPU path (DEVICE_CLIP: on CPU it reads the norm, which is free
    there)."""
    found, inside, saved = {}, [False], []

    def setattr_(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def count(what):
        if inside[0]:
            frames = [f for f in traceback.extract_stack()[:-2] if "paddletune" in f.filename]
            where = f"{frames[-1].filename.split('paddletune')[-1]}:{frames[-1].lineno}" if frames else "?"
            found.setdefault(what, []).append(where)

    def wrap(owner, name):
        real = getattr(owner, name)

        def patched(*a, **k):
            count(name)
            return real(*a, **k)
        setattr_(owner, name, patched)

    setattr_(Trainer, "DEVICE_CLIP", True)
    for name in READS:
        wrap(paddle.Tensor, name)
    for name in ("nonzero", "masked_select"):
        wrap(paddle, name)
        wrap(paddle.Tensor, name)
    real_getitem = paddle.Tensor.__getitem__

    def getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, paddle.Tensor) and p.dtype == paddle.bool for p in parts):
            count("boolean indexing")
        return real_getitem(self, index)
    setattr_(paddle.Tensor, "__getitem__", getitem)
    real_step = Trainer.training_step

    def step(self, *a, **k):
        inside[0] = True
        try:
            return real_step(self, *a, **k)
        finally:
            inside[0] = False
    setattr_(Trainer, "training_step", step)
    try:
        yield found
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


@pytest.fixture
def syncs():
    with counting() as found:
        yield found


def _run(tmp_path, model="paddletune/tiny-llama", steps=3, args_name="args.json", **keys):
    args = dict(model_name_or_path=model, dataset_name_or_path="paddletune/sample-sft",
                output_dir=str(tmp_path / "out"), do_train=True, max_steps=steps, logging_steps=2,
                per_device_train_batch_size=2, gradient_accumulation_steps=2, max_length=64, src_length=32,
                save_strategy="no", disable_tqdm=True, learning_rate=1e-3, eval_with_do_generation=False)
    args.update(keys)
    path = tmp_path / args_name
    path.write_text(json.dumps(args))
    t = Trainer(str(path))
    t.train()
    return t


@pytest.mark.parametrize("case", ["sft", "lora", "qlora", "packed"])
def test_no_host_sync_in_the_step(tmp_path, syncs, case):
    keys = {"sft": {}, "lora": {"lora": True}, "packed": {"lora": True, "zero_padding": True},
            "qlora": {"lora": True, "weight_quantize_algo": "nf4"}}[case]
    t = _run(tmp_path, **keys)
    assert t.state["global_step"] == 3
    assert syncs == {}, syncs
    if case == "sft":   # the device clipping's losses are the host clipping's
        losses = [r["loss"] for r in t.state["log_history"] if "loss" in r]
        assert max(r["grad_norm"] for r in t.state["log_history"] if "loss" in r) > 1.0   # it clips
        Trainer.DEVICE_CLIP = False
        try:
            (tmp_path / "ref").mkdir()
            ref = _run(tmp_path / "ref", **keys)
        finally:
            Trainer.DEVICE_CLIP = True
        assert losses == pytest.approx([r["loss"] for r in ref.state["log_history"] if "loss" in r], rel=1e-6)
        assert syncs.get("__float__"), syncs   # (and the host path does read the norm)


def test_moe_dispatch_reads_once_per_layer_and_micro_batch(tmp_path, syncs):
    """Dropless dispatch reads the expert token counts once per MoE layer per micro-batch: they
    size the per-expert buffers (models/moe.py); nothing else reads the device."""
    t = _run(tmp_path, model="paddletune/tiny-qwen2moe", lora=True)
    layers = sum(1 for n, _ in t.model.named_sublayers() if type(_).__name__ == "SparseMoeBlock")
    micro = 3 * 2   # steps x accumulation
    total = sum(len(v) for v in syncs.values())
    assert layers >= 1 and total == layers * micro, syncs
    sites = {s for v in syncs.values() for s in v}
    assert all("moe.py" in s for s in sites), sites


def test_fp16_reads_found_inf_once_per_step(tmp_path, syncs):
    """Under fp16 the step reads the scaler's found-inf once (whether to update at all); a stub
    scaler stands in for paddle's (fp16 does not run on CPU: tests/test_amp.py)."""
    from test_amp import StubScaler

    args = dict(model_name_or_path="paddletune/tiny-llama", dataset_name_or_path="paddletune/sample-sft",
                output_dir=str(tmp_path / "out"), do_train=True, max_steps=3, logging_steps=2,
                per_device_train_batch_size=2, max_length=64, src_length=32, save_strategy="no",
                disable_tqdm=True, lora=True)
    path = tmp_path / "args.json"
    path.write_text(json.dumps(args))
    t = Trainer(str(path))
    t.precision.scaler = StubScaler(inf_at=())
    t.train()
    assert syncs == {"numpy": ["/trainer/amp.py:%d" % _found_inf_line()] * 3}, syncs


def _found_inf_line():
    import inspect

    from paddletune.trainer import amp

    src, start = inspect.getsourcelines(amp.Precision.unscale)
    return start + next(i for i, line in enumerate(src) if "found_inf.numpy()" in line)


def dp_case(out_dir):
    """(launched on 2 ranks) the reads of 3 LoRA steps on this rank: {what: [call sites]}."""
    import pathlib

    os.makedirs(out_dir, exist_ok=True)
    rank = os.environ.get("PADDLE_TRAINER_ID", "0")
    with counting() as found:
        t = _run(pathlib.Path(out_dir), lora=True, args_name=f"args-{rank}.json")
    return {"steps": t.state["global_step"], "data_degree": t.topo.data_degree, "found": found}


def test_data_parallel_reads_the_global_target_count_once_per_step(tmp_path):
    """Under data parallelism each rank reads one value per step: the target-token count summed
    over the ranks (every micro-batch divides its loss by it; parallel/topology.py)."""
    from conftest import launch_cases

    out = launch_cases([("dp", "test_host_sync:dp_case", {"out_dir": str(tmp_path / "dp")})], tmp_path)
    for rank in out["dp"]:
        assert rank["steps"] == 3 and rank["data_degree"] == 2
        sites = [s for v in rank["found"].values() for s in v]
        assert len(sites) == 3 and all("topology.py" in s for s in sites), rank["found"]
