"""Everything in one run (PaddleNLP's claim): sharding stages 1, 2 and 3 on 8 launched processes,
four cases in ONE launch (each launch costs seconds before any work; issue 30's acceptance):

pp4     nf4 QLoRA, DP2 x PP4 with a checkpoint (below).
stage1  nf4 QLoRA under TP2 x PP2 x sharding stage1 (fleet's DygraphShardingOptimizer) through
        the script (below).
stage2_dp4, stage3_dp4_lora
        paddle's group_sharded_parallel "os_g" (full fine-tune) and "p_g_os" (LoRA, so the frozen
        backbone is sliced too) over sharding 2 x dp 4 on a 2-block Llama, 3 steps: the dp group
        (paddle's dp_group) beside the sharding one, which the 2- and 4-rank launches of
        test_sharding.py reach only at dp 2. Checked with test_sharding's own functions (_compare,
        _check_split, ENGINE) against the one-process run at the same global batch.
(TP2 x PP2 x sharding stage3 ran here until issue 29: fleet has no pipeline path for sharding
stages 2 / 3, so PP x stage 2/3 is refused; test_sharding.py tests the refusal. Stage 2/3 under
TP is ours, not paddle's: test_sharding's 4-rank cases.)

stage1  (llm/finetune_generation.py's main, issue 36's command on a 3-block GQA Llama): the
        script's whole path — evaluation during training and at the end with a dev set whose one
        eval batch leaves the second data rank without any (the replicas then exchange unequal
        numbers of pipeline activations: this deadlocked the final export when the sends shared
        the world group's gloo tag counter), a checkpoint at save_steps written also as an HF-PEFT
        adapter (unified_checkpoint), and the final adapter export through the checkpoint merge.
        Losses, eval losses, the checkpoint's and the final adapter equal the one-process run of
        the same command at the same global batch; transformers + peft load the adapter, and its
        merge (llm/merge_lora_params.py) into the base gives the same logits in transformers.
"""
import json
import os
import sys

import numpy as np
import pytest

from conftest import ROOT, hf_checkpoint, launch_cases, run_script

sys.path.insert(0, os.path.join(ROOT, "tests"))

SCRIPT = "llm/finetune_generation.py"
# sharding stages 2 / 3 on paddle's group_sharded_parallel (os_g / p_g_os) over sharding 2 x dp 4
# (8 data ranks x micro 1 x accumulation 2 = 16 sequences a step; one process: micro 8 x 2).
# Stage 2 fine-tunes test_sharding's 4-block Llama in full (paddle partitions whole tensors: with
# 2 blocks the two 38400-element embedding / head tensors leave one rank 63% of the gradients and
# state, above _check_split's 60% bound); stage 3 (flat slices) LoRA on 2 blocks.
GS = {"stage2_dp4": {"sharding": "stage2", "sharding_degree": 2},
      "stage3_dp4_lora": {"sharding": "stage3", "sharding_degree": 2, "method": "lora", "lr": 2e-2}}
GS_CKPT = {"stage2_dp4": "ck4", "stage3_dp4_lora": "ck2"}
GS_RUN, GS_ONE = {"micro": 1, "accum": 2, "steps": 3}, {"micro": 8, "accum": 2, "steps": 3}


def _stage1_argv(model, data, out, micro, parallel):
    argv = [os.path.join(ROOT, "llm/llama/sft_argument.json"), "--model_name_or_path", model,
            "--dataset_name_or_path", data, "--max_steps", "3", "--logging_steps", "1",
            "--learning_rate", "0.001", "--warmup_steps", "0", "--gradient_accumulation_steps", "2",
            "--src_length", "32", "--max_length", "64", "--do_eval", "true", "--evaluation_strategy", "steps",
            "--eval_steps", "2", "--per_device_eval_batch_size", "16", "--load_best_model_at_end", "false",
            "--save_strategy", "steps", "--save_steps", "2", "--unified_checkpoint", "true",
            "--fp16", "false", "--bf16", "false", "--zero_padding", "false", "--seed", "7",
            "--output_dir", out, "--per_device_train_batch_size", str(micro), "--lora", "true",
            "--weight_quantize_algo", "nf4", "--disable_tqdm", "true", "--adam_epsilon", "1e-4"]
    if parallel:
        argv += ["--tensor_parallel_degree", "2", "--pipeline_parallel_degree", "2", "--sharding", "stage1",
                 "--sharding_parallel_degree", "2"]
    return argv


def _sft_data(path):
    """16 training rows of unequal lengths (unequal target tokens per micro-batch and rank) and
    16 dev rows: one eval batch of 16, so the second data rank evaluates nothing."""
    words = "apple river stone cloud green house music paper".split()
    os.makedirs(path, exist_ok=True)
    for split, shift in (("train", 0), ("dev", 3)):
        with open(os.path.join(path, f"{split}.json"), "w") as f:
            for i in range(16):
                n = 1 + (i + shift) % 8
                f.write(json.dumps({"src": "Count the words: " + " ".join(words[:n]) + " x" * (i % 5),
                                    "tgt": " ".join([str(n)] * (1 + i % 3))}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tp_cases import train_case

    base = tmp_path_factory.mktemp("all8")
    ck3 = hf_checkpoint(base / "ck4", "llama", seed=3, num_hidden_layers=4)[0]
    ck1 = hf_checkpoint(base / "ck3", "llama", seed=3, num_hidden_layers=3)[0]
    data = _sft_data(base / "data")
    ck2 = hf_checkpoint(base / "ck2", "llama", seed=3)[0]   # 2 blocks, hidden 64
    cks = {n: {"ck4": ck3, "ck2": ck2}[GS_CKPT[n]] for n in GS}
    kw = {"method": "qlora", "quant": "nf4", "lr": 2e-2}
    # (tp2 x pp2 x sharding stage3 is refused since issue 29: fleet has no pipeline path for
    # stages 2 / 3; tests/test_sharding.py::test_pipeline_with_sharding_stage2_3_is_refused)
    got = launch_cases([("pp4", "tp_cases:train_case", dict(kw, ckpt=ck3, out_dir=str(base / "pp4"), micro=2,
                                                            pp=4, save_steps=2)),
                        ("stage1", "tp_cases:script_main",
                         {"relpath": SCRIPT, "argv": _stage1_argv(ck1, data, str(base / "s1"), 2, True)})]
                      + [(n, "sharding_cases:sharding_case", dict(k, ckpt=cks[n], out_dir=str(base / n), **GS_RUN))
                         for n, k in GS.items()],
                       base / "eight", nproc=8, timeout=1200)
    ref3 = train_case(ck3, str(base / "s3_single"), micro=4, **kw)
    # the one-process references of the stage 2 / 3 cases: micro 8 x accumulation 2 (16 a step)
    gs_ref = {n: train_case(cks[n], str(base / f"single_{n}"), **GS_ONE,
                            **{k: v for k, v in kw2.items() if not k.startswith("sharding")})
              for n, kw2 in GS.items()}
    r = run_script([os.path.join(ROOT, SCRIPT)] + _stage1_argv(ck1, data, str(base / "s1_single"), 4, False))
    assert r.returncode == 0, r.stderr[-3000:]
    return base, got, ref3, ck1, gs_ref


def test_qlora_dp2_pp4_with_a_checkpoint_on_eight_processes(runs):
    """4 stages x 2 data ranks, a checkpoint at step 2 (a world-group all_gather after the
    steps): the middle stages send and receive twice as often as the end ones, which hung the
    checkpoint while activations went over the world group. Equals the one-process run."""
    from test_sharding import _compare

    base, got, ref, _, _ = runs
    got = got["pp4"]
    _compare(got, ref, base / "pp4", base / "s3_single")
    assert got[0]["degrees"] == {"dp": 2, "pp": 4, "sharding": 1, "tp": 1}
    assert len({frozenset(r["shapes"]) for r in got}) == 4   # four stages' tensors
    assert os.path.isfile(base / "pp4" / "checkpoint-2" / "shards.json")


def _log(d):
    recs = [json.loads(line) for line in open(os.path.join(d, "train_log.jsonl"))]
    return [r["loss"] for r in recs if "loss" in r], [r["eval_loss"] for r in recs if "eval_loss" in r]


def _adapter(d):
    from safetensors.numpy import load_file

    return load_file(os.path.join(d, "adapter_model.safetensors"))


def _assert_adapters_equal(got, one):
    """<= 1e-4 of the update: lora_B starts at zero, so |B| is its update; A's update is below
    B's scale here, so the same bound is stricter for A. (AdamW at adam_epsilon 1e-4, as
    tp_cases: at 1e-6 float32 summation-order noise in near-zero gradients of the TP-split
    nf4 layers becomes update-sized, measured 3.3e-4 of the update after 2 steps.)"""
    assert set(got) == set(one) and got
    update = max(np.abs(v).max() for k, v in one.items() if "lora_B" in k)
    assert update > 0
    assert max(np.abs(got[k] - one[k]).max() for k in one) <= 1e-4 * update


def test_qlora_tp2_pp2_sharding_stage1_script_on_eight_processes(runs):
    import torch
    import transformers
    from peft import PeftModel

    base, got, _, ck, _ = runs
    assert got["stage1"] == [0] * 8                        # every rank's main() returned 0
    s1, one = base / "s1", base / "s1_single"
    (losses, evals), (ref_losses, ref_evals) = _log(s1), _log(one)
    assert len(losses) == 3 and len(evals) >= 1
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(evals, ref_evals, rtol=1e-5)
    # the checkpoint at save_steps: layout recorded, optimizer state split between the two
    # sharding ranks of each tensor/pipeline coordinate, its unified adapter = one process's
    ck2 = s1 / "checkpoint-2"
    state = json.load(open(ck2 / "trainer_state.json"))
    assert state["degrees"] == {"dp": 1, "pp": 2, "sharding": 2, "tp": 2}
    index = json.load(open(ck2 / "shards.json"))["optimizer"]
    writers = {}
    for name, entry in index.items():
        for piece in entry["pieces"]:
            writers.setdefault(name, set()).add(int(piece["file"].rsplit("-", 1)[1].split(".")[0]))
    from paddletune.parallel.topology import coordinates

    by_coord = {}
    for name, ranks in writers.items():
        for r in ranks:
            c = coordinates(r, state["degrees"])
            by_coord.setdefault((c["pp"], c["tp"]), {}).setdefault(c["sharding"], set()).add(name)
    assert len(by_coord) == 4
    for shares in by_coord.values():   # each owner writes its own tensors' moments, once
        assert set(shares) == {0, 1} and not (shares[0] & shares[1]), shares
    _assert_adapters_equal(_adapter(ck2), _adapter(one / "checkpoint-2"))
    # the final export (through the checkpoint merge under pipeline stages) = one process
    _assert_adapters_equal(_adapter(s1), _adapter(one))
    merged = base / "s1_merged"
    r = run_script([os.path.join(ROOT, "llm", "merge_lora_params.py"), "--lora_path", str(s1),
                    "--model_name_or_path", ck, "--merge_lora_model_path", str(merged)])
    assert r.returncode == 0, r.stderr[-2000:]
    ids = torch.tensor([[1, 5, 77, 300, 12, 9, 41]])
    with torch.no_grad():
        base_model = transformers.AutoModelForCausalLM.from_pretrained(ck)
        plain = base_model(ids).logits
        peft_logits = PeftModel.from_pretrained(base_model, str(s1)).eval()(ids).logits
        merged_logits = transformers.AutoModelForCausalLM.from_pretrained(str(merged))(ids).logits
    assert (peft_logits - plain).abs().max() > 1e-4         # the adapter changes the model
    assert (merged_logits - peft_logits).abs().max() <= 1e-4 * plain.abs().max()


@pytest.mark.parametrize("name", list(GS))
def test_group_sharded_stage2_3_with_dp4_on_eight_processes(runs, name):
    """Stage 2 (full fine-tune) and stage 3 (LoRA) over sharding 2 x dp 4 in the same launch:
    equal to one process at the same global batch (test_sharding's tolerances); paddle's wrapper /
    optimizer chain ran (test_sharding.ENGINE); data, optimizer state, gradients (stage 3: the
    resident slices too) split ~1/2 in each sharding pair and the sharding group's traffic as
    test_sharding asserts it (_check_split); the dp group's traffic float32 gradient all-reduces
    (stage 2: the owners' reduced gradients at each step; stage 3: each full gradient in every
    backward); stage 3 holds about half of the frozen float backbone per rank between steps."""
    from test_sharding import ENGINE, _check_split, _compare, _padded

    base, got, _, _, gs_ref = runs
    kw, ranks, one = dict(GS[name], **GS_RUN), got[name], gs_ref[name]
    stage = int(kw["sharding"][-1])
    _compare(ranks, one, base / name, base / f"single_{name}", steps=kw["steps"])
    assert min(one["grad_norms"]) > 0.05                          # clipping active
    assert all(r["degrees"] == {"dp": 4, "pp": 1, "sharding": 2, "tp": 1} for r in ranks)
    assert all(r["optimizer_chain"] == ENGINE[stage] for r in ranks)
    _check_split(ranks, one, kw, S_want=2)
    backwards = kw["accum"] * kw["steps"]
    for r in ranks:
        dp = r["dp_wire"]
        assert dp["all_reduce"]["dtypes"] == ["float32"], dp
        if stage == 2:   # the owner's reduced gradients, once per step (paddle's _dp_allreduce)
            owned = r["held"][0]["shard"]["grad_numel"]
            assert dp["all_reduce"]["calls"] % kw["steps"] == 0, dp
            assert dp["all_reduce"]["numel"] >= kw["steps"] * owned, (dp, owned)
        else:            # each full gradient in every backward, after the sharding all-reduce
            assert dp["all_reduce"]["numel"] >= backwards * r["trainable_numel"], dp
            for h in r["held"]:   # the frozen float backbone: ~1/2 per rank between steps
                now, whole, count = h["frozen"]
                assert whole > r["trainable_numel"] and _padded(now, whole, count, 2), h["frozen"]
