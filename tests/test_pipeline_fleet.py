"""fleet's pipeline engine beyond 2 stages, in float64, and what travels between stages
(parallel/pipeline.py). The reference is the same function in this process at the same global
batch (tp_cases.train_case).

- pp=4 x virtual 2 (8 blocks, 8 micro-batches, rows padded to one length: the interleaved schedule
  keeps fleet's p2p shape cache) on 4 launched ranks = one process: losses 1e-5, trained tensors
  <= 1e-4 of the update at adam_epsilon 1e-6, eval; driven by PipelineParallelWithInterleave; each
  stage holds blocks s and s + 4.
- pp=4 1F1B on variable-length rows (no shape cache: fleet's dynamic-shape meta per hop) = one
  process; 4 stages exercise the gloo pair routing of cpu_compat.route_p2p_over_pairs.
- float64 PP=2 end to end (model, data path, AdamW) = one process in float64: losses and trained
  tensors 1e-10 (clipping off: the Trainer's norm is float32); the collective recorder shows every
  floating hop in float64, receiver dtype = sender dtype and shape on every hop, and the bytes of a
  hop <= the hidden states' + 3 x [B, S] int64 + a meta message (never a [B, 1, S, S] mask).
"""
import os
import sys

import numpy as np
import pytest

from conftest import ROOT, hf_checkpoint, launch_cases

sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_pipeline_parallel import _stage_tensors as _tensors  # noqa: E402  (one reader of a run's tensor files)

VPP = {"micro": 1, "accum": 8, "adam_epsilon": 1e-6, "fixed_length": 48, "trace": True}
PP4 = {"micro": 1, "accum": 8, "adam_epsilon": 1e-6}
F64 = {"micro": 2, "accum": 4, "adam_epsilon": 1e-6, "max_grad_norm": 0.0, "dtype": "float64"}


def _compare(ranks, single, run_dir, single_dir, loss_rtol, update_frac):
    r0 = ranks[0]
    assert all(r["losses"] == r0["losses"] for r in ranks)
    np.testing.assert_allclose(r0["losses"], single["losses"], rtol=loss_rtol)
    assert abs(r0["eval"]["loss"] - single["eval"]["loss"]) <= max(loss_rtol, 1e-7) * abs(single["eval"]["loss"])
    assert r0["eval"]["accuracy"] == single["eval"]["accuracy"]
    got, one, start = _tensors(run_dir), _tensors(single_dir), _tensors(single_dir, "initial")
    assert set(got) == set(one) and one
    update = max(np.abs(one[k] - start[k]).max() for k in one)
    assert update > 0
    assert max(np.abs(got[k] - one[k]).max() for k in one) <= update_frac * update


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tp_cases import train_case

    base = tmp_path_factory.mktemp("ppf")
    ck8 = hf_checkpoint(base / "ck_llama8", "llama", seed=3, num_hidden_layers=8)[0]
    ck3 = hf_checkpoint(base / "ck_llama3", "llama", seed=3, num_hidden_layers=3)[0]
    got = launch_cases([("vpp", "tp_cases:train_case", dict(VPP, ckpt=ck8, out_dir=str(base / "vpp"), pp=4, vpp=2)),
                        ("pp4", "tp_cases:train_case", dict(PP4, ckpt=ck8, out_dir=str(base / "pp4"), pp=4))],
                       base / "l4", nproc=4, timeout=900)
    got.update(launch_cases([("f64", "tp_cases:train_case", dict(F64, ckpt=ck3, out_dir=str(base / "f64"), pp=2,
                                                                 p2p=True))], base / "l2", nproc=2, timeout=900))
    ref = {"vpp": train_case(ck8, str(base / "vpp1"), **{k: v for k, v in VPP.items() if k != "trace"}),
           "pp4": train_case(ck8, str(base / "pp41"), **PP4),
           "f64": train_case(ck3, str(base / "f641"), **F64)}
    return base, got, ref


def test_interleaved_pp4_v2_equals_one_process(runs):
    base, got, ref = runs
    _compare(got["vpp"], ref["vpp"], base / "vpp", base / "vpp1", 1e-5, 1e-4)
    assert {r["pp_engine"] for r in got["vpp"]} == {
        "paddle.distributed.fleet.meta_parallel.pipeline_parallel.PipelineParallelWithInterleave"}
    for r in got["vpp"]:   # virtual stages: stage s holds blocks s and s + 4 (paddle's layer: rule)
        blocks = {int(n.split(".")[2]) for n in r["shapes"] if n.startswith("model.layers.")}
        assert blocks == {r["stage"], r["stage"] + 4}, (r["stage"], blocks)
        # 2 chunks x 8 micro-batches forward and backward per step, on every stage
        counts, inside = [], False
        for e in r["trace"]:
            if e[0] == "step":
                inside = True
                counts.append({"F": 0, "B": 0})
            elif e[0] == "step_end":
                inside = False
            elif inside and e[0] in ("F", "B"):
                counts[-1][e[0]] += 1
        assert counts == [{"F": 16, "B": 16}] * 5, counts


def test_pp4_1f1b_variable_lengths_equals_one_process(runs):
    base, got, ref = runs
    _compare(got["pp4"], ref["pp4"], base / "pp4", base / "pp41", 1e-5, 1e-4)
    assert {r["pp_engine"] for r in got["pp4"]} == {
        "paddle.distributed.fleet.meta_parallel.pipeline_parallel.PipelineParallel"}
    for r in got["pp4"]:
        blocks = {int(n.split(".")[2]) for n in r["shapes"] if n.startswith("model.layers.")}
        assert blocks == {2 * r["stage"], 2 * r["stage"] + 1}


def test_float64_pp2_equals_one_process_float64(runs):
    base, got, ref = runs
    _compare(got["f64"], ref["f64"], base / "f64", base / "f641", 1e-10, 1e-10)
    np.testing.assert_allclose(got["f64"][0]["grad_norms"], ref["f64"]["grad_norms"], rtol=1e-6)  # float32 norm
    assert {d for r in got["f64"] for n, d in r["held_dtypes"].items()} == {"paddle.float64"}


def _hops(log, op):
    """(shape, dtype, bytes) of each point-to-point send / receive (2 ranks: all between them)."""
    return [(tuple(e["shapes"][0]), e["dtypes"][0], e["bytes"]) for e in log if e["op"] == op]


def test_float64_hops_carry_float64_small_and_matched(runs):
    """Every floating tensor stage 0 sends (activations) and stage 1 sends (gradients) is float64;
    each send is received in the sender's dtype and shape; a hop moves the hidden states plus
    [B, S] tensors and a meta message: no 4-D tensor, bytes <= hidden + 3 x B x S x 8 + 512."""
    _, got, _ = runs
    logs = [r["p2p"] for r in got["f64"]]
    sent0, recv1 = _hops(logs[0], "send"), _hops(logs[1], "recv")
    sent1, recv0 = _hops(logs[1], "send"), _hops(logs[0], "recv")
    assert sent0 and sent1
    # (fleet sends the meta message's length as a 0-d tensor into a [1] buffer: numel compared)
    assert [(int(np.prod(x[0])), x[1]) for x in sent0] == [(int(np.prod(x[0])), x[1]) for x in recv1]
    assert [(int(np.prod(x[0])), x[1]) for x in sent1] == [(int(np.prod(x[0])), x[1]) for x in recv0]
    assert [x[0] for x in sent0 if len(x[0]) > 1] == [x[0] for x in recv1 if len(x[0]) > 1]
    floats = [x for x in sent0 + sent1 if x[1].startswith(("float", "bfloat"))]
    assert floats and {x[1] for x in floats} == {"float64"}
    assert all(len(x[0]) <= 3 for x in sent0 + sent1)
    hidden = [x for x in sent0 if x[1] == "float64"]
    allowance = sum(x[2] + 3 * x[0][0] * x[0][1] * 8 + 512 for x in hidden)
    assert sum(x[2] for x in sent0) <= allowance
    assert all(len(x[0]) == 3 for x in hidden)   # [B, S, H]
    assert sum(x[2] for x in sent0) > sum(x[2] for x in hidden)   # the [B, S] tensors travel too


# ---------------------------------------------------------------- paddle's rules, refused up front

@pytest.mark.parametrize("extra, rule", [
    ({"pipeline_parallel_degree": 2}, "pipeline_parallel_degree >= 3"),
    ({"pipeline_parallel_degree": 4, "gradient_accumulation_steps": 2},
     "gradient_accumulation_steps >= pipeline_parallel_degree"),
    ({"pipeline_parallel_degree": 4, "gradient_accumulation_steps": 8}, "pad_to_max_length"),
])
def test_virtual_pp_rules_are_refused_in_one_line(tmp_path, extra, rule):
    from paddletune.args import ArgumentError, parse_args
    from test_args import BASE, write

    with pytest.raises(ArgumentError) as e:
        parse_args([write(tmp_path, dict(BASE, virtual_pp_degree=2, **extra))])
    msg = str(e.value)
    assert "'virtual_pp_degree' 2" in msg and rule in msg and "\n" not in msg


def test_virtual_pp_block_count_is_refused_before_loading():
    from types import SimpleNamespace

    from paddletune.parallel.pipeline import check_stages, stage_layers

    with pytest.raises(ValueError, match=r"num_hidden_layers \(6\) must be divisible by .* \(8;"):
        check_stages(SimpleNamespace(num_hidden_layers=6), 4, 2)
    check_stages(SimpleNamespace(num_hidden_layers=8), 4, 2)
    # paddle's interleaved placement: chunk c of L / (P v) blocks on stage c mod P
    assert [stage_layers(8, 4, s, 2) for s in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_layers(5, 2, s) for s in range(2)] == [[0, 1, 2], [3, 4]]
