"""Sharding offload (PaddleNLP's `sharding: "stageN offload"`), by stage and build.

Stage 3 where paddle's stage 3 runs (no TP / PP): group_sharded_parallel(level="p_g_os",
offload=True) on every build, the trainer's update running on paddle's host slices. One launch of
2 ranks (LoRA, S=2, clipping active, 3 steps, checkpoint at step 2): stage 3 with offload;
stage 3 without it (the control: same communication, no host masters); each one's checkpoint-2
resumed by the other. In this process: the reference (tests/tp_cases.py:train_case, one process,
micro 4 x accumulation 2 = 2 ranks x micro 2 x accumulation 2) and the offload checkpoint-2
resumed. One launch of 4 ranks: DP2 x stage 3 with offload (paddle's stage 3 takes the dp
group). Asserted: losses, gradient norms, eval and trained LoRA weights equal the reference at
tests/test_sharding.py's tolerances; paddle's offload path is the one running (its wrapper's and
the optimizer wrapper's offload flags; every trainable slice has a float32 master on the host and
the tensor the trainer's AdamW updates shares that master's memory; the moments and the frozen
slices on the host); offload changes nothing on the wire (the sharding group's collectives equal the
run without offload). On a CPU build host = device: cpu_compat shim 8 lets paddle's host <-> device
copies run.

Stages 1 and 2 where paddle's engine runs them: refused on a CUDA build before any work (one line
naming the key, the value and the fix), warned on a CPU build; under TP the trainer's AdamW keeps
its state in host memory (CUDA).
"""
import os
import sys

import numpy as np
import pytest

from conftest import ROOT, hf_checkpoint, launch_cases

sys.path.insert(0, os.path.join(ROOT, "tests"))

LORA = {"method": "lora", "lr": 2e-2, "steps": 3}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tp_cases import train_case

    base = tmp_path_factory.mktemp("offload")
    ck = hf_checkpoint(base / "ck", "llama", seed=3, num_hidden_layers=4)[0]
    kw = dict(LORA, ckpt=ck, micro=2)
    ckpt = lambda run: str(base / run / "checkpoint-2")   # noqa: E731
    cases = [("off", "sharding_cases:offload_case", dict(kw, sharding="stage3 offload", out_dir=str(base / "off"),
                                                         save_steps=2)),
             ("plain", "sharding_cases:offload_case", dict(kw, sharding="stage3", out_dir=str(base / "plain"),
                                                           save_steps=2)),
             ("off_to_plain", "tp_cases:train_case", dict(kw, sharding="stage3", out_dir=str(base / "off_to_plain"),
                                                          resume=ckpt("off"))),
             ("plain_to_off", "sharding_cases:offload_case", dict(kw, sharding="stage3 offload",
                                                                  out_dir=str(base / "plain_to_off"),
                                                                  resume=ckpt("plain"))),
             # the segment_size rule (S alignment units): LoRA's A / B (256 elements) stay whole,
             # the frozen backbone is sliced; paddle's offload of whole tensors (host masters)
             ("off_rule", "sharding_cases:offload_case", dict(kw, sharding="stage3 offload", segment_size=None,
                                                              out_dir=str(base / "off_rule")))]
    got = launch_cases(cases, base / "two", nproc=2, timeout=900)
    got.update(launch_cases([("dp2_off", "sharding_cases:offload_case",
                              dict(LORA, ckpt=ck, micro=1, sharding="stage3 offload", sharding_degree=2,
                                   out_dir=str(base / "dp2_off")))], base / "four", nproc=4, timeout=900))
    ref = {"single": train_case(ck, str(base / "single"), micro=4, **LORA),
           "off_to_one": train_case(ck, str(base / "off_to_one"), micro=4, resume=ckpt("off"), **LORA)}
    return base, got, ref


def _same(result, single, run_dir, single_dir, first=0):
    """tests/test_sharding.py's tolerances, from step `first` on (a resumed run: its own steps)."""
    from test_sharding import _tensors

    np.testing.assert_allclose(result["losses"][first:], single["losses"][first:], rtol=1e-5)
    np.testing.assert_allclose(result["grad_norms"][first:], single["grad_norms"][first:], rtol=1e-4)
    assert abs(result["eval"]["loss"] - single["eval"]["loss"]) <= 1e-5 * abs(single["eval"]["loss"])
    assert result["eval"]["accuracy"] == single["eval"]["accuracy"]
    got, one, start = _tensors(run_dir), _tensors(single_dir), _tensors(single_dir, "initial")
    assert set(got) == set(one) and all(".lora_" in k for k in one), sorted(one)[:4]
    update = max(np.abs(one[k] - start[k]).max() for k in one)
    assert update > 0 and max(np.abs(got[k] - one[k]).max() for k in one) <= 1e-4 * update


def test_stage3_offload_runs_paddles_offload_and_equals_one_process(runs):
    from test_sharding import ENGINE

    base, got, ref = runs
    single = ref["single"]
    assert len(single["losses"]) == 3 and min(single["grad_norms"]) > 0.05   # clipping active (0.05)
    for r in got["off"]:
        assert r["losses"] == got["off"][0]["losses"]
        assert r["optimizer_chain"] == ENGINE[3] and r["degrees"] == {"dp": 1, "pp": 1, "sharding": 2, "tp": 1}
        facts = r["offload_facts"]
        assert len(facts) == 3
        for f in facts:   # paddle's offload path, every step, and the trainer's update on its masters
            assert f["wrapper_offload"] and f["optimizer_offload"], f
            assert f["trainable_slices"] > 0 and f["host_masters"] == f["trainable_slices"], f
            assert f["update_on_master"] == f["trainable_slices"], f
            assert f["moments_on_host"] and f["frozen_slices_on_host"], f
        # the frozen backbone still sliced ~1/2 per rank between steps (paddle's stage 3 + release_frozen)
        held, whole, count = r["held"][-1]["frozen"]
        assert count > 0 and held < 0.6 * whole, r["held"][-1]["frozen"]
    _same(got["off"][0], single, base / "off", base / "single")


def test_stage3_offload_with_data_parallel_equals_one_process(runs):
    from test_sharding import ENGINE

    base, got, ref = runs
    for r in got["dp2_off"]:
        assert r["losses"] == got["dp2_off"][0]["losses"] and r["optimizer_chain"] == ENGINE[3]
        assert r["degrees"] == {"dp": 2, "pp": 1, "sharding": 2, "tp": 1}
        assert all(f["optimizer_offload"] and f["update_on_master"] == f["trainable_slices"] > 0
                   for f in r["offload_facts"])
    _same(got["dp2_off"][0], ref["single"], base / "dp2_off", base / "single")


def test_stage3_offload_of_whole_tensors_equals_one_process(runs):
    """With the segment_size rule paddle keeps LoRA's small matrices whole (their gradients all-
    reduced): under offload each is replaced by its float32 host master for the step, which the
    trainer's AdamW updates; the frozen backbone is still sliced."""
    base, got, ref = runs
    for r in got["off_rule"]:
        for f in r["offload_facts"]:
            assert f["trainable_slices"] == 0 and f["whole"] > 0 and f["whole_on_master"] == f["whole"], f
        held, whole, count = r["held"][-1]["frozen"]
        assert held < 0.6 * whole
    _same(got["off_rule"][0], ref["single"], base / "off_rule", base / "single")


def test_stage3_without_offload_is_the_control(runs):
    """The same run without 'offload': no host masters, offload flags off (so the facts above
    are offload's), and the same collectives over the sharding group as with offload."""
    base, got, ref = runs
    for r, o in zip(got["plain"], got["off"]):
        for f in r["offload_facts"]:
            assert not f["wrapper_offload"] and not f["optimizer_offload"], f
            assert f["host_masters"] == 0 and f["update_on_master"] == 0, f
        assert r["sharding_wire"] == o["sharding_wire"]
        assert set(o["sharding_wire"]) >= {"all_gather", "all_reduce"}
        assert "float32" in o["sharding_wire"]["all_gather"]["dtypes"]   # the slices gathered
    _same(got["plain"][0], ref["single"], base / "plain", base / "single")


@pytest.mark.parametrize("name", ["off_to_plain", "plain_to_off", "off_to_one"])
def test_checkpoints_cross_offload(runs, name):
    """A checkpoint written under offload resumes without it (2 ranks, one process) and one
    written without it resumes under offload (paddle's host masters take the loaded values):
    step 3 and the final weights equal the uninterrupted run."""
    base, got, ref = runs
    result = ref[name] if name in ref else got[name][0]
    assert len(result["losses"]) == 3
    _same(result, ref["single"], base / name, base / "single", first=2)
    if name == "plain_to_off":
        assert all(f["host_masters"] == f["trainable_slices"] > 0 for f in result["offload_facts"])


def _build(monkeypatch, cuda, **kw):
    """The arguments' check (before anything is loaded) on a 4-process job, CUDA or CPU build."""
    import paddle

    from paddletune import args as A

    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "4")
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: cuda)
    base = {"model_name_or_path": "m", "dataset_name_or_path": "d", "output_dir": "o"}
    return A.build(dict(base, **kw), warn=lambda m: None)[-1]


@pytest.mark.parametrize("value, layout, fix", [
    ("stage1 offload", {}, "has no offload.*offload_opt_buffer_size.*drop 'offload'.*'stage3 offload'"),
    ("stage1 offload", {"pipeline_parallel_degree": 2}, "has no offload"),
    ("stage2 offload", {}, "float16 parameters \\(AMP O2\\) without a data-parallel group.*use 'stage3 offload'"),
    ("stage2 offload", {"sharding_parallel_degree": 2}, "GroupShardedOptimizerStage2"),   # x DP2
])
def test_offload_without_a_paddle_path_is_one_error_line_on_cuda(monkeypatch, value, layout, fix):
    """Where paddle's engine runs stage 1 / stage 2 it has no offload the trainer's update can
    run on: a CUDA build stops at the arguments with one line naming the key, the value and the
    fix; parallel.init's check (a Trainer built in Python) says the same."""
    from paddletune.args import ArgumentError
    from paddletune.parallel.sharding import check_offload, stage_of

    with pytest.raises(ArgumentError, match=fix) as e:
        _build(monkeypatch, True, sharding=value, **layout)
    msg = str(e.value)
    assert msg.startswith(f"arguments: 'sharding' '{value}': ") and "\n" not in msg, msg
    args = type("A", (), {"sharding": value})
    deg = {"dp": 1, "pp": layout.get("pipeline_parallel_degree", 1), "sharding": 2, "tp": 1}
    with pytest.raises(ValueError, match=fix):
        check_offload(args, deg)
    assert stage_of(value) in (1, 2)


@pytest.mark.parametrize("value, layout", [
    ("stage3 offload", {}),                                  # paddle's stage 3 offload
    ("stage3 offload", {"sharding_parallel_degree": 2}),     # x DP2 (paddle's stage 3 takes a dp group)
    ("stage2 offload", {"tensor_parallel_degree": 2}),       # TP x stage 2: ours, AdamW state on the host
    ("stage3 offload", {"tensor_parallel_degree": 2}),       # TP x stage 3: ours, likewise
])
def test_offload_with_a_path_is_accepted_on_cuda(monkeypatch, value, layout):
    args = _build(monkeypatch, True, sharding=value, **layout)
    assert args.sharding == value


@pytest.mark.parametrize("value", ["stage1 offload", "stage2 offload", "stage3 offload"])
def test_offload_on_a_cpu_build_is_accepted_and_warned(monkeypatch, value):
    """A CPU build never refuses (host and device memory are one): warned once by the layout;
    'stage3 offload' still runs paddle's offload path (the launch above)."""
    from paddletune import runtime
    from paddletune.parallel.sharding import for_trainer
    from paddletune.parallel.topology import Topology

    args = _build(monkeypatch, False, sharding=value)
    logs = []
    monkeypatch.setattr(runtime, "warn_once", lambda key, msg, *a: logs.append((key, msg)))
    topo = Topology(world_size=2, degrees={"dp": 1, "pp": 1, "sharding": 2, "tp": 1})   # (no fleet here)
    shard = for_trainer(args, topo, [])
    assert logs == [("sharding_offload", logs[0][1])] and "host and device memory are the same" in logs[0][1]
    assert shard is not None and not shard.offload and not shard.paddle_offload   # (ours without fleet)
