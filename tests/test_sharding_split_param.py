"""Sharding stage 1 with `sharding_parallel_config: split_param`: fleet's DygraphShardingOptimizerV2
runs the Trainer's update on flat 1/S slices of one fused buffer (parallel/data.py), with paddle's
clear_grad fixed (parallel/paddle_fixes.py) and, on gloo, cpu_compat shim 7 (alignment, the
reduce_scatter emulation). The oracle is the one-process run of the same function
(tests/tp_cases.py:train_case, micro 4 x accumulation 2 = 2 ranks x micro 2 x accumulation 2) at
the tolerances of tests/test_sharding.py's stage-1 cases, gradient clipping active.

One launch of 2 ranks runs: V2 under the collective recorder; V2 saving at step 3; V1 stage 1
resuming V2's checkpoint-3; V2 resuming it. One launch of 4 ranks: V2 x DP2 (fleet all-reduces the owned slices
over dp) and split_param under TP2 (warned: V1 runs). In this process: the reference, and V2's checkpoint-3 resumed.
Asserted besides the equalities: the optimizer chain (HybridParallelOptimizer ->
DygraphShardingOptimizerV2 -> AdamW), what crossed the sharding group (one float32 reduction of
the whole padded buffer per step — gloo's emulation of reduce_scatter — and one float32
all-gather of it; no per-tensor reduce / broadcast as in V1), per-rank AdamW state = half of the
padded buffer (each tensor padded to 128 float32 = 256 bytes x 2 ranks, computed here from the
tensors' sizes), and a checkpoint of whole tensors under full names, each written once.
"""
import os
import sys

import numpy as np
import pytest

from conftest import ROOT, hf_checkpoint, launch_cases

sys.path.insert(0, os.path.join(ROOT, "tests"))

V2 = {"sharding": "stage1", "sharding_config": "split_param", "micro": 2}
V2_CHAIN = ["HybridParallelOptimizer", "DygraphShardingOptimizerV2", "AdamW"]
UNIT = 256 // 4 * 2   # float32 elements each tensor is padded to a multiple of (256 bytes x S=2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tp_cases import train_case

    base = tmp_path_factory.mktemp("split_param")
    ck = hf_checkpoint(base / "ck", "llama", seed=3, num_hidden_layers=4)[0]
    save = str(base / "v2_save" / "checkpoint-3")
    cases = [("v2", "sharding_cases:sharding_case", dict(V2, ckpt=ck, out_dir=str(base / "v2"))),
             ("v2_save", "tp_cases:train_case", dict(V2, ckpt=ck, out_dir=str(base / "v2_save"), save_steps=3)),
             ("v2_to_v1", "tp_cases:train_case", dict(ckpt=ck, out_dir=str(base / "v2_to_v1"), micro=2,
                                                      sharding="stage1", resume=save)),
             ("v2_to_v2", "tp_cases:train_case", dict(V2, ckpt=ck, out_dir=str(base / "v2_to_v2"), resume=save))]
    got = launch_cases(cases, base / "two", nproc=2, timeout=900)
    four = [("dp2_v2", "sharding_cases:sharding_case", dict(V2, ckpt=ck, out_dir=str(base / "dp2_v2"), micro=1,
                                                            sharding_degree=2)),
            ("tp2_split", "tp_cases:train_case", dict(V2, ckpt=ck, out_dir=str(base / "tp2_split"), tp=2))]
    got.update(launch_cases(four, base / "four", nproc=4, timeout=900))
    ref = {"single": train_case(ck, str(base / "single"), micro=4),
           "v2_to_one": train_case(ck, str(base / "v2_to_one"), micro=4, resume=save)}
    return base, got, ref


def _padded(sizes):
    return sum(-(-n // UNIT) * UNIT for n in sizes)


def test_split_param_equals_one_process(runs):
    from test_sharding import _compare, _tensors

    base, got, ref = runs
    ranks = got["v2"]
    _compare(ranks, ref["single"], base / "v2", base / "single")
    assert min(ref["single"]["grad_norms"]) > 0.05   # clipping active (max_grad_norm 0.05)
    for r in ranks:
        assert r["optimizer_chain"] == V2_CHAIN, r["optimizer_chain"]
        assert r["degrees"] == {"dp": 1, "pp": 1, "sharding": 2, "tp": 1}


def test_split_param_holds_half_the_padded_state_and_sends_one_buffer(runs):
    from test_sharding import _tensors

    base, got, _ = runs
    ranks = got["v2"]
    sizes = [a.size for a in _tensors(base / "single", "initial").values()]
    total, padded = sum(sizes), _padded(sizes)
    assert ranks[0]["trainable_numel"] == total and padded > total
    steps = len(ranks[0]["losses"])
    for r in ranks:
        for h in r["held"]:
            # AdamW's two moments over this rank's range: exactly half the padded buffer, and
            # within one alignment unit per tensor of half the model
            assert h["optimizer_numel"] == padded, (h["optimizer_numel"], padded)
            assert abs(h["optimizer_numel"] / 2 - total / 2) <= UNIT * len(sizes)
        wire = r["sharding_wire"]
        assert "reduce" not in wire and "broadcast" not in wire, wire   # not V1's per-tensor ops
        # per step one float32 all_gather of the updated buffer (this rank's half in, the whole
        # out) and nothing else float over all_gather (the trainer's bookkeeping is integers)
        assert wire["all_gather"]["float32_numels"] == [padded // 2 + padded] * steps, wire
        # the reduce_scatter emulation: the whole padded buffer all-reduced once per step; the
        # other float32 all-reduces are scalars (the gradient norm, token counts)
        big = [n for n in wire["all_reduce"]["float32_numels"] if n > 8]
        assert big == [padded] * steps, wire


def test_split_param_checkpoint_resumes_in_one_process_and_under_v1(runs):
    """V2's checkpoint-3 holds whole tensors (moments gathered from the slices): one process,
    V1 stage 1 and V2 itself continue it; steps 4-5 and the final weights equal the uninterrupted
    run."""
    import json

    from test_sharding import _tensors

    base, got, ref = runs
    np.testing.assert_allclose(got["v2_save"][0]["losses"], ref["single"]["losses"], rtol=1e-5)
    index = json.load(open(base / "v2_save" / "checkpoint-3" / "shards.json"))
    one = _tensors(base / "single")
    for kind, suffixes in (("model", ("",)), ("optimizer", (".exp_avg", ".exp_avg_sq"))):
        for n, a in one.items():
            for sfx in suffixes:
                e = index[kind][n + sfx]
                assert e["global_shape"] == list(a.shape) and len(e["pieces"]) == 1, (n + sfx, e)
    start = _tensors(base / "single", "initial")
    update = max(np.abs(one[k] - start[k]).max() for k in one)
    for name, resumed in (("v2_to_one", ref["v2_to_one"]), ("v2_to_v1", got["v2_to_v1"][0]),
                          ("v2_to_v2", got["v2_to_v2"][0])):   # (V2 cuts the whole state to its slices)
        assert len(resumed["losses"]) == 5
        np.testing.assert_allclose(resumed["losses"][3:], ref["single"]["losses"][3:], rtol=1e-4)
        res = _tensors(base / name)
        assert set(res) == set(one) and max(np.abs(res[k] - one[k]).max() for k in one) <= 1e-4 * update, name
    assert got["v2_to_v1"][0]["optimizer_chain"] == ["HybridParallelOptimizer", "DygraphShardingOptimizer", "AdamW"]


def test_split_param_with_data_parallel_equals_one_process(runs):
    from test_sharding import _compare

    base, got, ref = runs
    ranks = got["dp2_v2"]
    _compare(ranks, ref["single"], base / "dp2_v2", base / "single")
    for r in ranks:
        assert r["optimizer_chain"] == V2_CHAIN and r["degrees"] == {"dp": 2, "pp": 1, "sharding": 2, "tp": 1}
        assert all(h["optimizer_numel"] == got["v2"][0]["held"][0]["optimizer_numel"] for h in r["held"])


def test_split_param_under_tensor_parallel_runs_v1(runs):
    """V2 moves each parameter into its fused buffer, which a TP slice cannot follow: V1 runs
    (warned once), and equals one process as the stage-1 TP case does."""
    from test_sharding import _compare

    base, got, ref = runs
    ranks = got["tp2_split"]
    _compare(ranks, ref["single"], base / "tp2_split", base / "single")
    assert all(r["optimizer_chain"] == ["HybridParallelOptimizer", "DygraphShardingOptimizer", "AdamW"]
               for r in ranks)


def test_split_param_flags_are_honoured_or_warned(monkeypatch):
    """split_param with stage 1: no warning (it runs V2); with stage 2 / 3 it has no effect
    (warned); PaddleNLP's other sharding flags are warned naming the flag; in Python, the layout
    asks for V2 only with stage 1 and without tensor parallel (warned once under TP)."""
    from paddletune import args as A, runtime
    from paddletune.parallel.sharding import wants_split_param
    from paddletune.parallel.topology import Topology

    base = {"model_name_or_path": "m", "dataset_name_or_path": "d", "output_dir": "o",
            "sharding_parallel_config": "split_param"}
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    warned = []
    args = A.build(dict(base, sharding="stage1"), warn=warned.append)[-1]
    assert not any("sharding_parallel_config" in w for w in warned), warned
    A.build(dict(base, sharding="stage2"), warn=warned.append)
    assert any("split_param' has no effect with sharding 'stage2'" in w for w in warned), warned
    warned.clear()
    A.build(dict(base, sharding="stage1", sharding_parallel_config="split_param enable_stage1_overlap"),
            warn=warned.append)
    assert [w for w in warned if "sharding_parallel_config" in w] == [
        w for w in warned if "enable_stage1_overlap' has no effect" in w] and warned
    logs = []
    monkeypatch.setattr(runtime, "warn_once", lambda key, msg, *a: logs.append(msg))
    assert wants_split_param(args, Topology(world_size=2, degrees={"dp": 1, "pp": 1, "sharding": 2, "tp": 1}))
    assert not logs
    assert not wants_split_param(args, Topology(world_size=4, degrees={"dp": 1, "pp": 1, "sharding": 2, "tp": 2}))
    assert len(logs) == 1 and "V1" in logs[0] and "tensor_parallel_degree" in logs[0]
    args.sharding_parallel_config = ""
    assert not wants_split_param(args, Topology(world_size=2, degrees={"dp": 1, "pp": 1, "sharding": 2, "tp": 1}))
