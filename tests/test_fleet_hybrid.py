"""Data parallel with tensor / pipeline parallel on fleet's HybridParallelOptimizer (issue 28):
its step() reduces the data-parallel gradients, paddletune issues none. One launch of 4 ranks:
TP2 x DP2, the same with fp16 loss scaling (fleet.distributed_scaler), PP2 x DP2. Oracles: one
process with the same global batch (losses, grad norms, eval, trained tensors), the dp peers'
gradients (equal after fleet's reduction, different before: different data), the collective
recorder (every gradient-sized all-reduce over the dp group issued inside fleet's
fused_allreduce_gradients), and the unscaled run for fp16 (power-of-two scaling is exact)."""
import os

import numpy as np
import pytest

from conftest import launch_cases

STEPS = 3
# per rank micro 2 x accumulation 2, 2 data ranks = the reference's micro 2 x accumulation 4
KW = dict(micro=2, accum=2, steps=STEPS)
CASES = {"tp2dp2": dict(KW, tp=2), "tp2dp2_fp16": dict(KW, tp=2, amp=True), "pp2dp2": dict(KW, pp=2)}


def _tensors(path):
    from safetensors.numpy import load_file

    return load_file(str(path))


def _trained(d, pp=False):
    if not pp:
        return _tensors(d / "trained.safetensors")
    out = {}
    for s in (0, 1):
        out.update(_tensors(d / f"trained-stage{s}.safetensors"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import hf_checkpoint
    from tp_cases import train_case

    base = tmp_path_factory.mktemp("hybrid")
    ckpt, _ = hf_checkpoint(str(base / "ckpt"))
    cases = [(n, "fleet_hybrid_cases:hybrid_case", dict(kw, ckpt=ckpt, out_dir=str(base / n)))
             for n, kw in CASES.items()]
    got = launch_cases(cases, base / "four", nproc=4, timeout=1200)
    one = train_case(ckpt, str(base / "one"), micro=2, accum=4, steps=STEPS, record=False)
    return base, got, one


@pytest.mark.parametrize("name", ["tp2dp2", "pp2dp2"])
def test_hybrid_dp_equals_one_process(runs, name):
    base, got, one = runs
    ranks = got[name]
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)
    np.testing.assert_allclose(ranks[0]["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(ranks[0]["grad_norms"], one["grad_norms"], rtol=1e-4)
    assert one["grad_norms"][0] > 0.05                     # max_grad_norm 0.05: clipping active
    assert abs(ranks[0]["eval"]["loss"] - one["eval"]["loss"]) <= 1e-5 * abs(one["eval"]["loss"])
    mine = _trained(base / name, pp=name.startswith("pp"))
    ref, start = _tensors(base / "one" / "trained.safetensors"), _tensors(base / "one" / "initial.safetensors")
    assert mine.keys() == ref.keys()
    update = max(np.abs(ref[k] - start[k]).max() for k in ref)
    assert max(np.abs(mine[k] - ref[k]).max() for k in ref) <= 1e-4 * update


@pytest.mark.parametrize("name", list(CASES))
def test_fleets_optimizer_step_reduces_and_paddletune_does_not(runs, name):
    _, got, _ = runs
    ranks = got[name]
    for r in ranks:
        assert r["seen"]["optimizer"] == "HybridParallelOptimizer"
        assert len(r["fused"]) == STEPS and all(c["n"] > 0 for c in r["fused"])   # once per step
        assert r["ours"] == []                             # Topology.all_reduce_grads never called
        # every gradient-sized all-reduce over the dp group came from fleet's reduction
        assert r["n_big_dp"] >= STEPS and r["big_dp_tags"] == ["fleet_dp"], r["big_dp_tags"]
    for r in ranks:
        peer = got[name][[x for x in r["dp_group"] if x != r["rank"]][0]]
        for step, (a, b) in enumerate(zip(r["fused"], peer["fused"])):
            assert a["after"] == b["after"], (name, r["rank"], step)   # equal after the reduction
        assert r["fused"][0]["before"] != peer["fused"][0]["before"]   # different data before


def test_fp16_scaler_over_fleets_optimizer(runs):
    """fleet.distributed_scaler's GradScaler with the wrapped optimizer: the gradients fleet
    reduced are the unscaled run's x 2^10 (scaled loss), unscaled after the reduction: losses,
    norms and trained tensors equal the unscaled TP2 x DP2 run."""
    base, got, _ = runs
    amp, plain = got["tp2dp2_fp16"], got["tp2dp2"]
    for a, p in zip(amp, plain):
        assert a["seen"]["scaler"] == "GradScaler" and a["seen"]["scaler_enabled"]
        assert p["seen"]["scaler"] is None
        for ca, cp in zip(a["fused"], p["fused"]):
            np.testing.assert_allclose(ca["after"], np.asarray(cp["after"]) * 2.0 ** 10, rtol=1e-6)
    np.testing.assert_allclose(amp[0]["losses"], plain[0]["losses"], rtol=1e-6)
    np.testing.assert_allclose(amp[0]["grad_norms"], plain[0]["grad_norms"], rtol=1e-6)
    x, y = _tensors(base / "tp2dp2_fp16" / "trained.safetensors"), _tensors(base / "tp2dp2" / "trained.safetensors")
    for k in y:
        np.testing.assert_allclose(x[k], y[k], rtol=0, atol=1e-7, err_msg=k)


def test_which_layouts_reduce_through_fleets_optimizer():
    """FleetDataParallel applies to dp > 1 with TP or PP, and to sharding stage 1 without PP
    (fleet's DygraphShardingOptimizer); pure DP is paddle.DataParallel's, stages 2-3, PP x
    sharding and expert-parallel groups stay paddletune's (layout.py docstring)."""
    import types

    from paddletune.parallel.data import FleetDataParallel
    from paddletune.parallel.topology import Topology

    def topo(dp=1, tp=1, pp=1, sharding=1):
        return Topology(world_size=dp * tp * pp * sharding, hcg=object(),
                        degrees={"dp": dp, "pp": pp, "sharding": sharding, "tp": tp})

    on = types.SimpleNamespace()
    assert FleetDataParallel.for_layout(topo(dp=2, tp=2), on, None, None, None).degree == 2
    assert FleetDataParallel.for_layout(topo(dp=4, pp=2), None, on, None, None).degree == 4
    assert FleetDataParallel.for_layout(topo(dp=2), None, None, None, None) is None          # pure DP
    assert FleetDataParallel.for_layout(topo(tp=2), on, None, None, None) is None            # no DP
    assert FleetDataParallel.for_layout(topo(dp=2, tp=2, sharding=2), on, None, on, None) is None
    # sharding stage 1 on fleet (sharding.on_fleet): its optimizer reduces over sharding x dp
    stage1 = types.SimpleNamespace(fleet=True)
    hdp = FleetDataParallel.for_layout(topo(dp=2, tp=2, sharding=2), on, None, stage1, None)
    assert (hdp.degree, hdp.sharding) == (4, True)
    assert FleetDataParallel.for_layout(topo(sharding=2), None, None, stage1, None).degree == 2
    from paddletune.parallel.sharding import on_fleet

    assert on_fleet(1, topo(dp=2, sharding=2)) and on_fleet(1, topo(tp=2, sharding=2))
    assert on_fleet(2, topo(dp=2, sharding=2))   # group_sharded_parallel's stage 2 (group_sharded.py)
    assert not on_fleet(2, topo(tp=2, sharding=2)) and not on_fleet(3, topo(tp=2, sharding=2))   # ours, for now
    # stage 3 without TP / PP is group_sharded_parallel("p_g_os") since issue 30 (was: `not on_fleet(3, ...)`)
    assert on_fleet(3, topo(sharding=2)) and on_fleet(3, topo(dp=2, sharding=2))
    # PP x stage 1 is fleet's since issue 29 (was: `not on_fleet(1, ...)`, the pipeline's own path)
    assert on_fleet(1, topo(pp=2, sharding=2)) and not on_fleet(2, topo(pp=2, sharding=2))
    assert FleetDataParallel.for_layout(topo(dp=2, tp=2), on, None, None, on) is None        # experts
    alone = topo(dp=2, tp=2)
    alone.hcg = None
    assert FleetDataParallel.for_layout(alone, on, None, None, None) is None                 # no fleet
