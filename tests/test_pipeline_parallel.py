"""Pipeline parallel = one process (docs/parallel.md: how a parallel result is accepted): PP=2 on 2 launched ranks
and TP2 x PP2 on 4, each launch running all its cases (tests/launch_cases.py); the reference is the
same function in this process at the same global batch. Models with a layer count that does not
divide (3 blocks on 2 stages), variable-length data (padded and packed rows), clipping active,
gradient accumulation 4. Compared: losses, grad norms, eval loss / accuracy, trained tensors
(<= 1e-4 of the update). Asserted: each stage holds only its blocks, the step is driven by fleet's
PipelineParallel, whose schedule (read through fleet's micro-step callbacks) is 1F1B with at most
P micro-batches in flight. Dropout against one process: no (each stage draws its own
layers' masks, in an order no single process follows); with dropout, TP2 x PP2 equals PP=2 (TP
ranks of a stage draw the masks the PP=2 stage draws, so masks that differ across TP ranks show).
"""
import json
import os
import sys

import numpy as np
import pytest

from conftest import ROOT, hf_checkpoint, launch_cases
from paddletune.models.hf import SafetensorsFile

sys.path.insert(0, os.path.join(ROOT, "tests"))

PP2 = {   # name -> (checkpoint, train_case kwargs); micro 2 x accumulation 4 = the reference's
    "llama3_sft": ("llama3", {"micro": 2, "accum": 4, "trace": True}),
    "llama3_lora": ("llama3", {"method": "lora", "lr": 2e-2, "micro": 2, "accum": 4}),
    "llama3_prefix": ("llama3", {"method": "prefix", "lr": 2e-2, "max_grad_norm": 0.005}),
    "llama3_nf4_lora": ("llama3", {"method": "qlora", "quant": "nf4", "lr": 2e-2}),
    "llama3_zero_padding_recompute": ("llama3", {"zero_padding": True, "recompute": True}),
    "qwen2_tied_vocab601": ("qwen2", {"p2p": True}),   # (p2p: the collectives recorded)
    "chatglm2_sft": ("chatglm", {}),
    "llama3_adapter": ("llama3", {"method": "adapter", "lr": 2e-2, "max_grad_norm": 0.02}),
    # tied embeddings as fleet's shared layer (SharedLayerDesc): trained (qwen2_tied_vocab601),
    # frozen under LoRA (nothing shared), GPT-2's positions added on the first stage (finish_embedding)
    "qwen2_tied_lora": ("qwen2", {"method": "lora", "lr": 2e-2, "p2p": True}),
    "gpt2_tied_sft": ("gpt2", {"p2p": True}),
}
TP_PP = {"llama3_sft": ("llama3", {}), "llama3_lora": ("llama3", {"method": "lora", "lr": 2e-2}),
         "qwen2_tied_vocab601": ("qwen2", {"p2p": True})}
DROPOUT = {"method": "lora", "lr": 2e-2, "lora_dropout": 0.1, "micro": 2, "accum": 4}
DP_PP = {"llama3_sft": ("llama3", {"micro": 4, "accum": 1})}   # 4 x 2 data ranks = 4 x 2 micro-batches


def _checkpoints(base):
    from paddletune.models.tiny import make_tiny_checkpoint

    glm, gpt2 = str(base / "ck_chatglm"), str(base / "ck_gpt2")
    make_tiny_checkpoint(glm, "chatglm", seed=5, padded_vocab_size=600, num_layers=3)
    make_tiny_checkpoint(gpt2, "gpt2", seed=6, vocab_size=600, n_layer=3)
    return {"gpt2": gpt2, "llama3": hf_checkpoint(base / "ck_llama3", "llama", seed=3, num_hidden_layers=3)[0],
            "qwen2": hf_checkpoint(base / "ck_qwen2", "qwen2", seed=4, vocab_size=601,
                                   tie_word_embeddings=True, num_hidden_layers=3)[0],
            "chatglm": glm}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tp_cases import train_case

    base = tmp_path_factory.mktemp("pp")
    cks = _checkpoints(base)
    cases = [(n, "tp_cases:train_case", dict(kw, ckpt=cks[k], out_dir=str(base / n / "pp2"), pp=2))
             for n, (k, kw) in PP2.items()]
    cases += [("save", "tp_cases:train_case", dict(ckpt=cks["llama3"], out_dir=str(base / "save"), pp=2,
                                                   save_steps=3)),
              ("resume", "tp_cases:train_case", dict(ckpt=cks["llama3"], out_dir=str(base / "resume"), pp=2,
                                                     resume=str(base / "save" / "checkpoint-3"))),
              ("pp2_lora_dropout", "tp_cases:train_case", dict(DROPOUT, ckpt=cks["llama3"],
                                                               out_dir=str(base / "dropout" / "pp2"), pp=2))]
    got = launch_cases(cases, base, nproc=2, timeout=900)
    ref = {n: train_case(cks[k], str(base / n / "single"), **{a: v for a, v in kw.items() if a != "trace"})
           for n, (k, kw) in PP2.items()}
    return base, cks, got, ref


def _stage_tensors(run_dir, kind="trained"):
    out = {}
    for f in sorted(os.listdir(run_dir)):
        if f.startswith(kind) and f.endswith(".safetensors"):
            st = SafetensorsFile(os.path.join(run_dir, f))
            for k in st.keys():
                out.setdefault(k, st.get(k))
    return out


def _compare(got_ranks, single, run_dir, single_dir):
    r0 = got_ranks[0]
    assert all(r["losses"] == r0["losses"] for r in got_ranks)
    np.testing.assert_allclose(r0["losses"], single["losses"], rtol=1e-5)
    np.testing.assert_allclose(r0["grad_norms"], single["grad_norms"], rtol=1e-4)
    assert abs(r0["eval"]["loss"] - single["eval"]["loss"]) <= 1e-5 * abs(single["eval"]["loss"])
    assert r0["eval"]["accuracy"] == single["eval"]["accuracy"]
    pp, one, start = _stage_tensors(run_dir), _stage_tensors(single_dir), _stage_tensors(single_dir, "initial")
    assert set(pp) == set(one)
    update = max(np.abs(one[k] - start[k]).max() for k in one)
    assert max(np.abs(pp[k] - one[k]).max() for k in one) <= 1e-4 * update


@pytest.mark.parametrize("name", list(PP2))
def test_pp2_equals_one_process(runs, name):
    base, _, got, ref = runs
    _compare(got[name], ref[name], base / name / "pp2", base / name / "single")
    assert min(ref[name]["grad_norms"]) > PP2[name][1].get("max_grad_norm", 0.05)   # clipping active


def test_each_stage_holds_only_its_blocks(runs):
    """3 blocks on 2 stages: [0, 1] on the first (with the embedding), [2] on the last (with the
    norm and head); a tied Qwen2's embedding is on both (the head's copy)."""
    _, _, got, _ = runs
    s0, s1 = (set(r["shapes"]) for r in got["llama3_sft"])
    assert {n.split(".")[2] for n in s0 if n.startswith("model.layers.")} == {"0", "1"}
    assert {n.split(".")[2] for n in s1 if n.startswith("model.layers.")} == {"2"}
    assert "model.embed_tokens.weight" in s0 and "model.embed_tokens.weight" not in s1
    assert "lm_head.weight" in s1 and "model.norm.weight" in s1 and "lm_head.weight" not in s0
    q0, q1 = (set(r["shapes"]) for r in got["qwen2_tied_vocab601"])
    assert "model.embed_tokens.weight" in q0 and "model.embed_tokens.weight" in q1


def test_step_is_driven_by_fleets_pipeline_parallel(runs):
    _, _, got, _ = runs
    for name in PP2:
        assert {r["pp_engine"] for r in got[name]} == {
            "paddle.distributed.fleet.meta_parallel.pipeline_parallel.PipelineParallel"}, name


def test_schedule_is_1f1b_with_at_most_p_in_flight(runs):
    """Accumulation 4 on 2 stages: the first stage runs F0 F1 B0 F2 B1 F3 B2 B3 (one warm-up
    forward), the last F0 B0 F1 B1 ...; at most 2 micro-batches in flight; every send has a
    matching receive on the other stage, with the same shape. The trace is fleet's schedule as it
    ran: its micro-step callbacks (FORWARD_BEGIN / BACKWARD_BEGIN ...) write F / B events, and a
    stage input that came over p2p / an output sent on writes recv / send (pipeline.py)."""
    _, _, got, _ = runs
    t0, t1 = (r["trace"] for r in got["llama3_sft"])
    order = lambda t: [f"{e[0]}{e[1]}" for e in t if e[0] in ("F", "B")][:8]  # noqa: E731
    # (events carry a time stamp: ("F", k, t), ("F_end", k, t), sends / receives)
    assert order(t0) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"], order(t0)
    assert order(t1) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"], order(t1)
    for t in (t0, t1):
        live = peak = 0
        for e in t:
            live += {"F": 1, "B": -1}.get(e[0], 0)
            peak = max(peak, live)
        assert peak <= 2
    sends = [e[2] for e in t0 if e[0] == "send"]
    recvs = [e[2] for e in t1 if e[0] == "recv"]
    assert sends == recvs and len(sends) == 5 * 4 + 2        # 5 steps x 4 micro-batches + 2 eval batches
    assert len({tuple(x) for x in sends}) > 1                 # shapes differ per micro-batch (padded SFT)


def test_pp_checkpoint_resumes_exactly(runs):
    _, _, got, _ = runs
    full, resumed = got["save"][0], got["resume"][0]
    np.testing.assert_allclose(resumed["losses"][3:], full["losses"][3:], rtol=1e-6)


@pytest.fixture(scope="module")
def runs4(runs):
    """TP2 x PP2 on 4 launched ranks."""
    base, cks, _, ref = runs
    cases = [(n, "tp_cases:train_case", dict(kw, ckpt=cks[k], out_dir=str(base / "tppp" / n), pp=2, tp=2))
             for n, (k, kw) in TP_PP.items()]
    cases += [(f"dp_{n}", "tp_cases:train_case", dict(kw, ckpt=cks[k], out_dir=str(base / "dppp" / n), pp=2))
              for n, (k, kw) in DP_PP.items()]
    cases += [("tppp_lora_dropout", "tp_cases:train_case", dict(DROPOUT, ckpt=cks["llama3"], pp=2, tp=2,
                                                                out_dir=str(base / "dropout" / "tppp")))]
    got = launch_cases(cases, base / "tppp", nproc=4, timeout=900)
    single = {n: ref.get(n) for n in TP_PP}
    return base, cks, got, single


@pytest.mark.parametrize("name", list(TP_PP))
def test_tp2_pp2_equals_one_process(runs4, name):
    from tp_cases import train_case

    base, cks, got, single = runs4
    kind, kw = TP_PP[name]
    if single[name] is None or PP2.get(name, (None, {}))[1] != kw:
        single[name] = train_case(cks[kind], str(base / "tppp" / f"{name}-single"), **kw)
        sdir = base / "tppp" / f"{name}-single"
    else:
        sdir = base / name / "single"
    _compare(got[name], single[name], base / "tppp" / name, sdir)
    shapes = got[name][3]["shapes"]                    # rank 3: last stage, second TP rank
    assert all(n.startswith(("model.layers.2", "model.norm", "lm_head", "model.embed_tokens"))
               for n in shapes)


def test_dp2_pp2_equals_one_process(runs4):
    base, _, got, single = runs4
    _compare(got["dp_llama3_sft"], single["llama3_sft"], base / "dppp" / "llama3_sft", base / "llama3_sft" / "single")


def test_tp2_pp2_with_dropout_equals_pp2(runs, runs4):
    """LoRA dropout 0.1: TP2 x PP2 = PP=2 (losses, grad norms, eval, trained tensors), and the
    dropout is really on (the losses differ from the same run without it)."""
    base, _, got_pp, _ = runs
    _, _, got, _ = runs4
    pp = got_pp["pp2_lora_dropout"][0]
    _compare(got["tppp_lora_dropout"], pp, base / "dropout" / "tppp", base / "dropout" / "pp2")
    assert pp["losses"][1:] != got_pp["llama3_lora"][0]["losses"][1:]


def test_tied_embedding_is_fleets_shared_layer(runs, runs4):
    """A tied embedding under PP is fleet's shared layer: one SharedLayerDesc item on the first
    stage (it embeds) and one on the last (the loss's head), built as PipeSharedEmbedding over the
    embedding's own weight (TP: the storage of its local shard); fleet's shared comm joins the two
    stages of each pipeline in a group of its own (not the pipeline group, though PP=2 gives the
    same ranks) and all-reduces the weight's gradient over it once per step, float32, the
    local shape (5 steps; evaluation sends none). Frozen (LoRA) nothing is shared or reduced.
    (PP=2 = one process for these cases: test_pp2_equals_one_process.)"""
    _, _, got, _ = runs
    _, _, got4, _ = runs4
    cases = [(got["qwen2_tied_vocab601"], [601, 64], lambda r: [0, 1]),
             (got["gpt2_tied_sft"], [600, 64], lambda r: [0, 1]),
             # TP2 x PP2: ranks 0 / 2 (first TP rank of each stage) and 1 / 3; 301 rows each
             (got4["qwen2_tied_vocab601"], [301, 64], lambda r: [r % 2, r % 2 + 2])]
    for ranks, shape, pair in cases:
        for rank, r in enumerate(ranks):
            sh = r["shared"]
            assert sh["descs"] == ["tied_embedding", "tied_embedding"]
            assert sh["built"] == {"tied_embedding": "PipeSharedEmbedding"}
            (c,) = sh["comm"].values()
            assert c["ranks"] == pair(rank) and c["attrs"] == ["weight"] and c["is_tied_weight"] == [True]
            assert c["group"] != sh["pp_group"]
            assert [(x["op"], x["group"], x["ranks"], x["shapes"], x["dtypes"]) for x in sh["reduces"]] == \
                [("all_reduce", c["group"], pair(rank), [shape], ["float32"])] * 5
    for r in got["qwen2_tied_lora"]:
        (c,) = r["shared"]["comm"].values()
        assert c["attrs"] == [] and r["shared"]["reduces"] == []
