"""paddle's hybrid-parallel engine under paddletune (issue 28): fleet.init and the topology over
fleet's HybridCommunicateGroup, the collective recorder. Oracles: the hand-worked rank grid of
topology.py's docstring (dp 2 x tp 2) and collectives whose shapes / dtypes / groups are known."""
import json
import os

import numpy as np
import pytest

from conftest import launch_cases

HERE = os.path.dirname(os.path.abspath(__file__))


def test_one_process_never_starts_fleet(monkeypatch, tmp_path):
    from paddle.distributed import fleet

    from paddletune import parallel

    monkeypatch.delenv("PADDLE_TRAINERS_NUM", raising=False)
    monkeypatch.setenv("PADDLE_LOG_DIR", str(tmp_path))

    def refuse(*a, **k):
        raise AssertionError("fleet.init called by one process")

    monkeypatch.setattr(fleet, "init", refuse)
    topo = parallel.init()
    assert topo.hcg is None and topo.world_size == 1 and not os.listdir(tmp_path)


@pytest.fixture(scope="module")
def runs4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet4")
    os.environ["PADDLETUNE_RECORD_COLLECTIVES"] = str(tmp / "rec")
    try:
        out = launch_cases([("init", "fleet_cases:init_case", {"tp": 2}),
                            ("record", "fleet_cases:recorder_case", {"tp": 2})], tmp, nproc=4)
    finally:
        del os.environ["PADDLETUNE_RECORD_COLLECTIVES"]
    return out, tmp


def test_topology_is_fleets_hybrid_group(runs4):
    out, tmp = runs4
    # topology.py docstring, dp 2 x tp 2: rank = dp_rank * 2 + tp_rank
    for r, res in enumerate(out["init"]):
        assert res["rank"] == r and res["hcg"] == "HybridCommunicateGroup"
        assert res["coords"] == {"dp": r // 2, "pp": 0, "sharding": 0, "tp": r % 2}
        assert res["groups"]["tp"] == [r - r % 2, r - r % 2 + 1]
        assert res["groups"]["dp"] == [r % 2, r % 2 + 2]
        assert res["is_fleets"] == {"dp": True, "tp": True}
        assert res["fleet_log"]
    logs = tmp / "launch" / "log"
    fleet_log = open(logs / "fleet.rank0.log").read()
    worker_log = open(logs / "workerlog.0").read()
    # fleet's own lines (its group table) went to the fleet log, not the worker's terminal
    assert "comm group(s) create successfully" in fleet_log
    assert "comm group(s) create successfully" not in worker_log
    assert "Modified FLAGS detected" not in worker_log


def test_recorder_sees_ops_groups_shapes_dtypes(runs4):
    out, tmp = runs4
    for r, res in enumerate(out["record"]):
        pg = [e for e in res["log"] if e["level"] == "pg"]
        api = [e for e in res["log"] if e["level"] == "api"]
        tp, dp = [r - r % 2, r - r % 2 + 1], [r % 2, r % 2 + 2]
        assert [(e["op"], e["ranks"], e["shapes"], e["dtypes"], e["bytes"], e["tag"]) for e in pg] == [
            ("all_reduce", tp, [[2, 3]], ["float64"], 48, None),
            ("broadcast", dp, [[4]], ["int64"], 32, "bcast"),
            # paddle fills the empty output list with 4 buffers, then passes (list, input)
            ("all_gather", [0, 1, 2, 3], [[3]] * 5, ["float32"] * 5, 60, None)]
        assert [e["op"] for e in api] == ["all_reduce", "broadcast", "all_gather"]
        # the env-var recorder of the launched worker wrote the same entries (and more: init)
        lines = [json.loads(x) for x in open(tmp / "rec" / f"rank{r}.jsonl")]
        assert all(e in lines for e in res["log"])
        assert any(e["op"] == "all_reduce" and e["shapes"] == [[5]] for e in lines)   # outside


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    from conftest import hf_checkpoint

    tmp = tmp_path_factory.mktemp("fleet_tp2")
    ckpt, _ = hf_checkpoint(str(tmp / "ckpt"))
    return launch_cases([("mp_ops", "fleet_cases:mp_ops_case", {"ckpt": ckpt}),
                         ("nf4", "fleet_cases:mp_ops_case", {"ckpt": ckpt, "quant": "nf4"})],
                        tmp, nproc=2)


FLEET = {"column": "ColumnParallelLinear", "row": "RowParallelLinear", "vocab": "VocabParallelEmbedding"}


def _check_mp_ops(res):
    kinds, counts = res["kinds"], res["counts"]
    assert {"column", "row", "vocab"} <= set(kinds.values()), kinds
    # cpu_compat's shims stand in for paddle's on this CPU build
    assert res["shims"] == {"_c_identity": "paddletune.parallel.cpu_compat",
                            "_mp_allreduce": "paddletune.parallel.cpu_compat"}
    for name, kind in kinds.items():
        c = counts[name]
        if kind in ("row", "vocab"):    # g: one fleet all-reduce of the partial output
            assert (c["_c_identity"], c["_mp_allreduce"]) == (0, 1), (name, c)
        else:                           # f once per distinct input (q/k/v share one)
            assert c["_mp_allreduce"] == 0 and c["_c_identity"] in (0, 1), (name, c)
        # fleet's class forward ran once per pass for each fleet layer, never for the others;
        # the loss step uses the LM head's weight directly (parallel/vocab.py's row-blocked
        # cross-entropy): its forward runs in the plain forward to the logits
        step = 0 if name == "lm_head" else 1
        assert c["fleet_forward"] == (step if res["is_fleet"][name] else 0), (name, c)
        assert res["logits_pass"][name] == (1 if res["is_fleet"][name] else 0), name
    n_f = sum(counts[n]["_c_identity"] for n, k in kinds.items() if k == "column")
    assert n_f == res["distinct_column_inputs"] > 0
    # fleet's layers hold the loaded slices under the former names (checkpoints, exports)
    assert res["params"] == res["ours_params"] and res["uninitialized"] == []
    # the comparison model ran on our former executors: no fleet layer in it
    assert set(res["ours_types"]) == set(kinds)
    assert not set(res["ours_types"].values()) & set(FLEET.values())


def test_tp2_every_planned_float_module_is_fleets_layer(tp2):
    """Float model: every planned module (all plain float Linear / Embedding) IS fleet's class
    for its kind and runs that class's forward, its communication through fleet's mp_ops."""
    for res in tp2["mp_ops"]:
        _check_mp_ops(res)
        assert res["types"] == {n: FLEET[k] for n, k in res["kinds"].items()}, res["types"]
        assert all(res["is_fleet"].values())


def test_tp2_quantized_linears_keep_the_patched_forward_over_mp_ops(tp2):
    """nf4 model: the quantized linears cannot be fleet's float layers; they keep the patched
    forward over the same mp_ops; the float embedding and head are fleet's."""
    for res in tp2["nf4"]:
        _check_mp_ops(res)
        quantized = {n for n, t in res["types"].items() if t not in FLEET.values()}
        assert quantized and all(".layers." in n for n in quantized), res["types"]
        assert not any(res["is_fleet"][n] for n in quantized)
        fleet = {n: t for n, t in res["types"].items() if n not in quantized}
        assert fleet == {n: FLEET[res["kinds"][n]] for n in fleet} and "model.embed_tokens" in fleet


def test_tp2_fleet_layers_move_what_our_executors_moved(tp2):
    """Fleet's layers and mp_ops vs our former patched forwards over our PyLayers, same
    checkpoint and batch: equal loss, gradients and wire, exactly."""
    for res in tp2["mp_ops"] + tp2["nf4"]:
        loss_f, grads_f, wire_f = res["fleet"]
        loss_o, grads_o, wire_o = res["ours"]
        assert wire_f == wire_o and any(op == "all_reduce" for op, *_ in wire_f)
        assert loss_f == loss_o and grads_f.keys() == grads_o.keys()
        for n in grads_f:
            assert grads_f[n] == grads_o[n], n


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    from conftest import hf_checkpoint

    tmp = tmp_path_factory.mktemp("fleet_dp2")
    # ~3.5 MB of float32 parameters: several 1 MB buckets (fuse_grad_size_in_MB takes whole MB)
    ckpt, _ = hf_checkpoint(str(tmp / "ckpt"), hidden_size=128, intermediate_size=256,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    return launch_cases([("dp", "fleet_cases:dp_reducer_case",
                          {"ckpt": ckpt, "out_dir": str(tmp / "out")})], tmp, nproc=2)


def test_pure_dp_reduces_in_buckets_during_backward(dp2):
    r0, r1 = dp2["dp"]
    assert r0["wrapped"] == r1["wrapped"] == "DataParallel" and r0["find_unused"] is False
    assert r0["buckets"] >= 2
    # micro-batch 1 (no_sync): the last block's gradients are this rank's own, different data
    # -> they differ (the control); micro-batch 2 (reduced): when block 0's input gradient is
    # formed, the last block's summed gradients have already been all-reduced -> equal
    assert len(r0["snaps"]) == len(r1["snaps"]) == 2
    assert r0["snaps"][0] != r1["snaps"][0]
    assert r0["snaps"][1] == r1["snaps"][1]
    assert r0["final"] == r1["final"]                    # and the step left equal weights
    # no gradient all-reduce issued from Python by paddletune (only scalars: token counts)
    assert r0["big_all_reduces"] == [] and r1["big_all_reduces"] == []


def test_pure_dp_moe_with_an_expert_no_token_reaches(tmp_path):
    from fleet_cases import moe_dead_expert_case

    ref = moe_dead_expert_case(str(tmp_path / "one"), micro=4)      # one process, same global batch
    two = launch_cases([("moe", "fleet_cases:moe_dead_expert_case",
                         {"out_dir": str(tmp_path / "two")})], tmp_path, nproc=2)["moe"]
    assert ref["routed_to_dead"] == 0 and all(r["routed_to_dead"] == 0 for r in two)
    assert [r["find_unused"] for r in two] == [True, True]
    assert len(ref["losses"]) == 2 and all(v is not None for v in ref["losses"])
    np.testing.assert_allclose(two[0]["losses"], ref["losses"], rtol=1e-5)


def test_pure_dp_qlora_nf4_on_dataparallel_equals_one_process(tmp_path):
    """The DataParallel wrapper broadcasts parameters and buffers at start (the nf4 codes are
    uint8 buffers) and reduces only LoRA's gradients: same losses / norms as one process with
    the same global batch (unequal target tokens per rank, clipping active)."""
    from conftest import hf_checkpoint
    from tp_cases import train_case

    ckpt, _ = hf_checkpoint(str(tmp_path / "ckpt"))
    kw = dict(ckpt=ckpt, method="qlora", quant="nf4", accum=2, steps=3, record=False)
    two = launch_cases([("dp2", "tp_cases:train_case", dict(kw, micro=2, out_dir=str(tmp_path / "dp2")))],
                       tmp_path, nproc=2)["dp2"]
    one = train_case(out_dir=str(tmp_path / "one"), micro=4, **kw)
    assert "data parallel: paddle.DataParallel over 2 ranks" in \
        open(tmp_path / "launch" / "log" / "workerlog.0").read()
    np.testing.assert_allclose(two[0]["losses"], one["losses"], rtol=2e-5)
    np.testing.assert_allclose(two[0]["grad_norms"], one["grad_norms"], rtol=1e-4)
    assert two[0]["grad_norms"][0] > 0.05          # max_grad_norm 0.05: clipping active
