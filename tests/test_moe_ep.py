"""Expert parallel (parallel/expert.py) and data parallel for the Mixture-of-Experts models against
the one-process run with the same global batch (8 examples a step, 3 AdamW steps, clipping active,
aux loss in the loss, target counts that differ per rank).

Two launches: 2 processes (EP=2 with a checkpoint, DP=2, DP=2 with per-rank router statistics as
the negative control, LoRA under EP=2, QLoRA under EP=2 (nf4 2 steps, weight_only_int8 1 step), the full-model export of a
quantized backbone refused, the all-to-all dispatch, EP=2 vs DP=2 with gradient accumulation,
unequal micro-batch counts) and 4 processes (DP2xEP2 on Qwen2-MoE; DP2xEP2 resuming
the EP=2 checkpoint; EP=4, one expert per rank). The references run in this process (moe_ep_cases.train_case, world 1)."""
import json
import os
import shutil
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MIX, QWEN = "paddletune/tiny-mixtral", "paddletune/tiny-qwen2moe"
TOL = 1e-4


def _case(name, ckpt, out, **kw):
    return (name, "moe_ep_cases:train_case", dict(ckpt=ckpt, out_dir=str(out / name), **kw))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import launch_cases
    from moe_ep_cases import train_case

    root = tmp_path_factory.mktemp("moe_ep")
    ref = {"mix": train_case(MIX, str(root / "ref_mix"), micro=8),
           "qwen": train_case(QWEN, str(root / "ref_qwen"), micro=8),
           "lora": train_case(MIX, str(root / "ref_lora"), micro=8, lora=True),
           "qlora_nf4": train_case(MIX, str(root / "ref_qlora_nf4"), micro=8, lora=True, quant="nf4", steps=2),
           "qlora_int8": train_case(MIX, str(root / "ref_qlora_int8"), micro=8, lora=True,
                                    quant="weight_only_int8", steps=1)}
    two = launch_cases([_case("ep2", MIX, root, ep=2, micro=4, save_steps=2),
                        _case("dp2", MIX, root, ep=1, micro=4),
                        _case("dp2_local", MIX, root, ep=1, micro=4, global_router=False),
                        _case("ep2_lora", MIX, root, ep=2, micro=4, lora=True),
                        _case("ep2_qlora_nf4", MIX, root, ep=2, micro=4, lora=True, quant="nf4", steps=2),
                        _case("ep2_qlora_int8", MIX, root, ep=2, micro=4, lora=True,
                              quant="weight_only_int8", steps=1),
                        ("quant_full", "moe_ep_cases:quant_full_export_case",
                         dict(ckpt=MIX, out_dir=str(root / "quant_full"))),
                        _case("ep2_a2a", QWEN, root, ep=2, micro=4, alltoall=True),
                        _case("ep2_acc2", MIX, root, ep=2, micro=2, accum=2),
                        _case("dp2_acc2", MIX, root, ep=1, micro=2, accum=2),
                        ("uneven", "moe_ep_cases:uneven_case", dict(ckpt=MIX, out_dir=str(root / "uneven")))],
                       root / "two", nproc=2)
    shutil.copytree(root / "ep2", root / "resume")   # the EP=2 run's checkpoint-2, resumed by DP2xEP2
    four = launch_cases([_case("dp2ep2_qwen", QWEN, root, ep=2, micro=2),
                         _case("resume", MIX, root, ep=2, micro=2,
                               resume=str(root / "resume" / "checkpoint-2")),
                         _case("ep4", MIX, root, ep=4, micro=2, recompute=True,
                               recompute_granularity="full_attn")], root / "four", nproc=4)
    return root, ref, {**two, **four}


def _weights(path, name="model.safetensors"):
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, name))


def _same_weights(a, b):
    assert sorted(a) == sorted(b)
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert worst < TOL, worst


def _check_matches(ranks, ref):
    for r in ranks:
        np.testing.assert_allclose(r["losses"], ref["losses"], atol=TOL)
        np.testing.assert_allclose(r["grad_norms"], ref["grad_norms"], rtol=TOL)
        np.testing.assert_allclose(r["aux"], ref["aux"], atol=TOL)
        # eval batches are whole on one rank each (their aux over the same tokens as one process)
        assert abs(r["eval_loss"] - ref["eval_loss"]) < TOL
    assert all(g > 0.05 for g in ref["grad_norms"])   # max_grad_norm 0.05: clipping was active
    # disjoint data, together the one-process batch, with unequal target counts per rank
    for step in range(len(ref["ids"])):
        got = [i for r in ranks for i in r["ids"][step]]
        assert sorted(got) == sorted(ref["ids"][step]) and len(set(got)) == len(got)
    assert any(len({r["targets"][s] for r in ranks}) > 1 for s in range(len(ref["ids"])))


def _check_split(ranks, ref, ep, num_experts=4):
    for r in ranks:
        el = num_experts // ep
        assert r["experts"] == list(range(r["ep_rank"] * el, (r["ep_rank"] + 1) * el))
        assert r["read_experts"] == r["experts"]   # only its experts' tensors read from the files
        assert r["read_count"] < ref["read_count"]
        assert r["expert_numel"] * ep == ref["expert_numel"]
        assert r["trainable_expert_numel"] * ep == ref["trainable_expert_numel"]


def _check_comm(r, ranks, ep, H, k, sparse_layers):
    """Bytes the dispatch moved in training = the all-gather fallback's formula (module doc of
    parallel/expert.py) from each step's padded token count; nothing wider than [x | w | idx]."""
    group = [x for x in ranks if x["rank"] // ep == r["rank"] // ep]
    want = 0.0
    for step in range(len(r["tokens"])):
        tm = max(x["tokens"][step][0] for x in group)
        ring = 2.0 * (ep - 1) / ep
        want += sparse_layers * 4 * tm * ((ep - 1) * (H + 2 * k) + ring * ep * H       # forward
                                          + ring * ep * (H + 2 * k) + (ep - 1) * H)    # backward
    got = r["comm"]["all_gather"] + r["comm"]["all_reduce"]
    assert abs(got - want) < 1e-6 * want, (got, want)
    assert max(r["widths"]) == H + 2 * k
    assert r["comm"]["router_all_reduce"] == 3 * 4 * (2 * 4 + 2)   # 3 steps, [counts | probs | rows | n]


def test_ep2_matches_one_process(runs):
    """EP=2 (Mixtral, 2 processes): losses, grad norms, aux, the exported full model (all experts,
    HF layout) equal the one-process run; each rank holds experts [0, 1] or [2, 3]; the dispatch
    moved the bytes of the formula; the checkpoint lists every expert, written by both ranks."""
    root, ref, out = runs
    _check_matches(out["ep2"], ref["mix"])
    _check_split(out["ep2"], ref["mix"], 2)
    for r in out["ep2"]:
        _check_comm(r, out["ep2"], 2, H=128, k=2, sparse_layers=4)
    _same_weights(_weights(root / "ep2"), _weights(root / "ref_mix"))
    shards = json.load(open(root / "ep2" / "checkpoint-2" / "shards.json"))
    experts = [n for n in shards["model"] if ".experts." in n]
    assert {n.split(".experts.")[1].split(".")[0] for n in experts} == {"0", "1", "2", "3"}
    files = {p["file"] for n in experts for p in shards["model"][n]["pieces"]}
    assert len(files) == 2   # each rank wrote its own experts


def test_dp2_moe_matches_one_process_and_needs_global_router_stats(runs):
    """Plain DP=2 on an MoE model matches one process because the router statistics are summed
    over the data ranks; with per-rank statistics (the negative control) the losses differ."""
    _, ref, out = runs
    _check_matches(out["dp2"], ref["mix"])
    local = out["dp2_local"][0]["losses"]
    assert max(abs(a - b) for a, b in zip(local, ref["mix"]["losses"])) > 5 * TOL   # (measured 9e-4)


def test_ep2_with_accumulation_matches_dp2(runs):
    """2 micro-batches per step (each rank's micro-batch m together forms global micro-batch m,
    whose aux is one number: parallel/expert.py): EP=2 equals DP=2, which holds every expert."""
    root, _, out = runs
    ep, dp = out["ep2_acc2"], out["dp2_acc2"]
    for r in ep:
        np.testing.assert_allclose(r["losses"], dp[0]["losses"], atol=TOL)
        np.testing.assert_allclose(r["grad_norms"], dp[0]["grad_norms"], rtol=TOL)
        assert len(r["tokens"][0]) == 2
    _same_weights(_weights(root / "ep2_acc2"), _weights(root / "dp2_acc2"))


def test_dp2_ep2_matches_one_process_on_four_ranks(runs):
    """DP2xEP2 (Qwen2-MoE with its shared expert, 4 processes): expert groups [0, 1] and [2, 3],
    expert gradients summed over [0, 2] / [1, 3]; matches one process, weights included."""
    root, ref, out = runs
    _check_matches(out["dp2ep2_qwen"], ref["qwen"])
    _check_split(out["dp2ep2_qwen"], ref["qwen"], 2)
    _same_weights(_weights(root / "dp2ep2_qwen"), _weights(root / "ref_qwen"))


def test_alltoall_dispatch_logic_under_ep2(runs):
    """The all-to-all dispatch written for NCCL (parallel/expert.py: alltoall_dispatch), run here
    through cpu_compat's exact all-gather emulation of alltoall_single (Qwen2-MoE, EP=2): matches
    one process; what it records is the all-to-all's traffic (rows leaving the rank only)."""
    root, ref, out = runs
    _check_matches(out["ep2_a2a"], ref["qwen"])
    _check_split(out["ep2_a2a"], ref["qwen"], 2)
    for r in out["ep2_a2a"]:
        assert set(r["comm"]) >= {"alltoall", "router_all_reduce"} and "all_reduce" not in r["comm"]
        assert max(r["widths"]) == 128   # hidden rows only
    _same_weights(_weights(root / "ep2_a2a"), _weights(root / "ref_qwen"))


def test_ep4_one_expert_per_rank(runs):
    """EP=4 on 4 processes (the expert group is the whole job), attention recomputed in backward
    (full_attn): rank r holds expert r only; matches one process."""
    root, ref, out = runs
    _check_matches(out["ep4"], ref["mix"])
    _check_split(out["ep4"], ref["mix"], 4)
    for r in out["ep4"]:
        _check_comm(r, out["ep4"], 4, H=128, k=2, sparse_layers=4)
    _same_weights(_weights(root / "ep4"), _weights(root / "ref_mix"))


def test_lora_under_ep2(runs):
    """LoRA on attention, every expert and the router under EP=2: each rank trains only its
    experts' adapters; losses and the exported adapter (every expert's LoRA) equal one process."""
    root, ref, out = runs
    _check_matches(out["ep2_lora"], ref["lora"])
    _check_split(out["ep2_lora"], ref["lora"], 2)
    got, want = (_weights(p, "adapter_model.safetensors") for p in (root / "ep2_lora", root / "ref_lora"))
    assert any(".experts.3." in n for n in got) and any("gate.lora" in n for n in got)
    _same_weights(got, want)


@pytest.mark.parametrize("algo", ["nf4", "int8"])
def test_qlora_under_ep2(runs, algo):
    """QLoRA under EP=2 (nf4: 2 steps; weight_only_int8: 1 step; LoRA on attention and every
    expert; experts quantized, routers float and unadapted as in one process): each rank holds
    only its experts' quantized codes (half of one process's bytes); losses, the
    exported adapter, every expert's quantized weight as the export's gather gave it to rank 0
    (parameters AND buffers gathered: parallel/expert.py _gathered_copies), and the adapter merged
    into the full-precision base (the merged HF model, peft.merge_lora) equal one process."""
    from paddletune import peft

    root, ref, out = runs
    run, one = f"ep2_qlora_{algo}", f"ref_qlora_{algo}"
    ranks, want = out[run], ref[f"qlora_{algo}"]
    _check_matches(ranks, want)
    _check_split(ranks, want, 2)
    for r in ranks:
        np.testing.assert_allclose(r["losses"], want["losses"], rtol=1e-5)
        assert r["quant_expert_bytes"] * 2 == want["quant_expert_bytes"] > 0
        assert r["routers"] == want["routers"] == ["Linear"] * 4   # float routers, 4 layers
    got, exp = (_weights(p, "adapter_model.safetensors") for p in (root / run, root / one))
    assert any(".experts.3." in n for n in got) and not any("gate.lora" in n for n in got)
    assert max(float(np.abs(exp[n]).max()) for n in exp if "experts.3" in n and "lora_B" in n) > 10 * TOL
    _same_weights(got, exp)
    deq = [_weights(p, "experts_dequantized.safetensors") for p in (root / run, root / one)]
    assert len(deq[0]) == 4 * 4 * 3   # 4 layers x 4 experts x (w1, w2, w3)
    assert sorted(deq[0]) == sorted(deq[1]) and all(np.array_equal(deq[0][k], deq[1][k]) for k in deq[1])
    merged = [peft.merge_lora(str(root / n), str(root / (n + "_merged"))) for n in (run, one)]
    _same_weights(_weights(merged[0]), _weights(merged[1]))


def test_quantized_full_export_refused_under_ep2(runs):
    """The default (full-model) export of a quantized backbone under EP=2: every rank refuses
    before its first step, naming the keys (one process refuses it at the export)."""
    _, _, out = runs
    for r in out["quant_full"]:
        assert r["steps"] == 0
        assert "weight_quantize_algo nf4 with expert_parallel_degree 2" in r["error_message"]
        assert "lora: true" in r["error_message"] and "merge_lora_params" in r["error_message"]


def test_resume_ep2_checkpoint_under_dp2_ep2(runs):
    """The EP=2 checkpoint-2 (2 ranks) resumed on 4 ranks (DP2xEP2, other expert groups): step 3's
    loss and the final weights equal the uninterrupted one-process run."""
    root, ref, out = runs
    for r in out["resume"]:
        assert abs(r["losses"][-1] - ref["mix"]["losses"][-1]) < TOL
    _same_weights(_weights(root / "resume"), _weights(root / "ref_mix"))


def test_unequal_micro_batch_counts_fail_on_every_rank(runs):
    """A last step that gives one rank no example: both ranks stop with the same error after
    step 1 (the dispatch's collectives would otherwise wait for the rank that has no batch)."""
    _, _, out = runs
    for r in out["uneven"]:
        assert r["steps"] == 1 and "different numbers of micro-batches" in r["error_message"]


def test_refusals(tmp_path):
    """ep not dividing the experts or the data-parallel degree: one error naming both numbers."""
    from conftest import training_args
    from paddletune.loading import load_model
    from paddletune.parallel import Topology
    from paddletune.parallel.topology import TopologyError, expert_degree_from_args

    topo = Topology(world_size=3, rank=0, degrees={"dp": 3, "pp": 1, "sharding": 1, "tp": 1}, ep_degree=3)
    with pytest.raises(ValueError, match=r"expert_parallel_degree \(3\) does not divide the number of experts \(4\)"):
        load_model(MIX, topology=topo)
    with pytest.raises(ValueError, match="recompute_granularity full .* expert_parallel_degree 2"):
        from paddletune.parallel.expert import ExpertParallel, finalize

        ep = ExpertParallel(Topology())
        ep.degree = 2
        finalize(None, ep, {}, training_args("/tmp/unused", recompute=True))
    from paddletune.args import ArgumentError, parse_args

    path = os.path.join(str(tmp_path), "a.json")
    json.dump({"model_name_or_path": MIX, "dataset_name_or_path": "paddletune/sample-sft",
               "output_dir": str(tmp_path), "expert_parallel_degree": 2,
               "recompute": True}, open(path, "w"))
    with pytest.raises(ArgumentError, match="recompute_granularity.*full_attn"):
        parse_args([path], warn=lambda m: None)
    args = training_args("/tmp/unused", expert_parallel_degree=4)
    with pytest.raises(TopologyError, match="expert_parallel_degree 4 does not divide the data-parallel degree 6"):
        expert_degree_from_args(args, {"dp": 6, "pp": 1, "sharding": 1, "tp": 1})


def test_expert_groups_hand_worked():
    """ep groups are consecutive data ranks, ep_data groups the ranks holding the same experts;
    with tensor parallel inside (8 ranks as dp 4 x tp 2) they are carved from the data ranks."""
    from paddletune.parallel.topology import group_ranks

    d4 = {"dp": 4, "pp": 1, "sharding": 1, "tp": 1}
    assert [group_ranks(r, d4, "ep", 2) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [group_ranks(r, d4, "ep_data", 2) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    d8 = {"dp": 4, "pp": 1, "sharding": 1, "tp": 2}   # rank = dp * 2 + tp
    assert group_ranks(5, d8, "ep", 2) == [5, 7] and group_ranks(5, d8, "ep_data", 2) == [1, 5]
    assert group_ranks(5, d8, "ep", 4) == [1, 3, 5, 7]
