"""Tensor parallel = one process (docs/parallel.md: how a parallel result is accepted), TP=2 on real launched ranks.

All cases run in ONE 2-rank launch (tests/launch_cases.py); the reference is the same function
in this process (world size 1, same global batch, same seed, same data order). Data: variable-
length copy examples (target counts differ per micro-batch); clipping is active (max_grad_norm
far below the gradient norm); one LoRA case has dropout 0.1. Compared: the 5 logged losses, the
trained tensors (max|d| / max|update| <= 1e-4), eval loss and accuracy. The split is asserted per
rank: local shapes are 1/TP of the global ones, eval logits are V/TP wide, our collectives are
all-reduces of activations only (no all-gather in a step), and the engine did no reshard.
"""
import json
import os
import sys

import numpy as np
import pytest

from conftest import ROOT, hf_checkpoint, launch_cases, run_script
from paddletune.models.hf import SafetensorsFile

sys.path.insert(0, os.path.join(ROOT, "tests"))

CASES = {   # name -> (checkpoint kind, train_case kwargs)
    "llama_sft": ("llama", {}),
    "llama_lora_dropout": ("llama", {"method": "lora", "lora_dropout": 0.1, "lr": 2e-2}),
    "llama_prefix": ("llama", {"method": "prefix", "lr": 2e-2, "max_grad_norm": 0.005}),
    "llama_qlora_nf4": ("llama", {"method": "qlora", "quant": "nf4", "lr": 2e-2}),
    "qwen2_tied_vocab601": ("qwen2", {}),
    "chatglm2_sft": ("chatglm", {}),
    "chatglm2_lora": ("chatglm", {"method": "lora", "lr": 2e-2}),
    "llama_lora_nodrop": ("llama", {"method": "lora", "lr": 2e-2}),   # reference for DP x TP
    "llama_rdrop_lora_dropout": ("llama", {"method": "lora", "lora_dropout": 0.1, "rdrop": True, "lr": 2e-2}),
    "llama_adapter": ("llama", {"method": "adapter", "lr": 2e-2, "max_grad_norm": 0.02}),
    "llama_lowrank_adapter": ("llama", {"method": "lowrank_adapter", "lr": 2e-2, "max_grad_norm": 0.005}),
    "llama_bitfit_neftune": ("llama", {"method": "bitfit", "neftune": True, "lr": 2e-2, "max_grad_norm": 0.01}),
    "llama_int8_lora": ("llama", {"method": "qlora", "quant": "weight_only_int8", "lr": 2e-2}),
    "chatglm2_prefix": ("chatglm", {"method": "prefix", "lr": 2e-2, "max_grad_norm": 0.005}),
    "llama_lora_recompute_full_attn": ("llama", {"method": "lora", "lr": 2e-2, "lora_dropout": 0.1,
                                                 "recompute": True, "recompute_granularity": "full_attn"}),
    "chatglm2_recompute_core_attn": ("chatglm", {"recompute": True, "recompute_granularity": "core_attn"}),
}


def _checkpoints(base):
    from paddletune.models import get_spec
    from paddletune.models.tiny import make_tiny_checkpoint

    out = {"llama": hf_checkpoint(base / "ck_llama", "llama", seed=3)[0],
           "qwen2": hf_checkpoint(base / "ck_qwen2", "qwen2", seed=4, vocab_size=601, tie_word_embeddings=True)[0]}
    glm = str(base / "ck_chatglm")
    make_tiny_checkpoint(glm, "chatglm", seed=5, padded_vocab_size=600)
    out["chatglm"] = glm
    return out


def _big_checkpoint(path):
    """A 58M-parameter (232 MB float32) Llama for the loading-memory check."""
    from paddletune.models import build_model, save_pretrained

    cfg = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1376,
           "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
           "max_position_embeddings": 256, "tie_word_embeddings": False}
    save_pretrained(build_model(cfg, seed=0), str(path), dtype="float32")
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tp_cases import train_case

    base = tmp_path_factory.mktemp("tp")
    cks = _checkpoints(base)
    kwargs = {name: {k: v for k, v in kw.items() if not k.startswith("_")} for name, (_, kw) in CASES.items()}
    cases = [(name, "tp_cases:train_case", dict(kwargs[name], ckpt=cks[kind], out_dir=str(base / name / "tp2"), tp=2))
             for name, (kind, _) in CASES.items()]
    cases.append(("reshard_control", "tp_cases:reshard_control", {}))
    cases.append(("vocab_ops", "tp_cases:sharded_vocab_ops", {}))
    # checkpoint under TP=2 at step 3, then resumed under TP=2 (dropout on: RNG per rank restored)
    lora = dict(CASES["llama_lora_dropout"][1], ckpt=cks["llama"], tp=2)
    cases += [("save", "tp_cases:train_case", dict(lora, out_dir=str(base / "save"), save_steps=3)),
              ("resume", "tp_cases:train_case", dict(lora, out_dir=str(base / "resume"),
                                                      resume=str(base / "save" / "checkpoint-3"))),
              ("sft_save", "tp_cases:train_case", dict(ckpt=cks["llama"], tp=2, out_dir=str(base / "sft_save"),
                                                       save_steps=3))]
    big = _big_checkpoint(base / "ck_big")
    cases.insert(0, ("load_memory", "tp_cases:load_memory", {"ckpt": big}))   # first: a fresh process
    got = launch_cases(cases, base, nproc=2, timeout=900)
    ref = {name: train_case(cks[kind], str(base / name / "single"), **kwargs[name])
           for name, (kind, _) in CASES.items()}
    return base, got, ref


def _tensors(path):
    st = SafetensorsFile(str(path))
    return {k: st.get(k) for k in st.keys()}


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_equals_one_process(runs, name):
    base, got, ref = runs
    r0, r1 = got[name]
    single = ref[name]
    assert r0["losses"] == r1["losses"] and len(r0["losses"]) == 5
    np.testing.assert_allclose(r0["losses"], single["losses"], rtol=1e-5, atol=0)
    assert min(single["grad_norms"]) > CASES[name][1].get("max_grad_norm", 0.05)   # clipping active
    np.testing.assert_allclose(r0["grad_norms"], single["grad_norms"], rtol=1e-3)
    assert abs(r0["eval"]["loss"] - single["eval"]["loss"]) <= 1e-5 * abs(single["eval"]["loss"])
    assert r0["eval"]["accuracy"] == single["eval"]["accuracy"]
    tp, one = _tensors(base / name / "tp2" / "trained.safetensors"), _tensors(base / name / "single" / "trained.safetensors")
    start, start_tp = (_tensors(base / name / r / "initial.safetensors") for r in ("single", "tp2"))
    assert set(tp) == set(one) == set(start)
    # layout-independent initialisation: TP starts from exactly the one-process tensors
    assert all(np.array_equal(start_tp[k], start[k]) for k in start)
    update = max(np.abs(one[k] - start[k]).max() for k in one)
    worst = max(np.abs(tp[k] - one[k]).max() for k in one)
    assert update > 0 and worst <= 1e-4 * update, (worst, update, _worst_tensor(tp, one, start))


def _worst_tensor(tp, one, start):
    k = max(one, key=lambda k: np.abs(tp[k] - one[k]).max())
    return k, float(np.abs(tp[k] - one[k]).max()), float(np.abs(one[k] - start[k]).max())


def test_split_is_real(runs):
    """Per rank: every split tensor holds 1/TP of its global shape along the plan's axis; the
    eval logits are V/TP wide; a training step communicated only activation all-reduces."""
    base, got, ref = runs
    r0, r1 = got["llama_sft"]
    shapes = r0["shapes"]
    half = {"model.embed_tokens.weight": 0, "lm_head.weight": 1,
            "model.layers.0.self_attn.q_proj.weight": 1, "model.layers.0.self_attn.k_proj.weight": 1,
            "model.layers.0.self_attn.o_proj.weight": 0, "model.layers.0.mlp.gate_proj.weight": 1,
            "model.layers.0.mlp.down_proj.weight": 0}
    for n, axis in half.items():
        g, l = shapes[n]
        assert l[axis] * 2 == g[axis] and l[1 - axis] == g[1 - axis], (n, g, l)
    assert shapes["model.norm.weight"][0] == shapes["model.norm.weight"][1]
    local = sum(int(np.prod(l)) for g, l in shapes.values())
    total = sum(int(np.prod(g)) for g, l in shapes.values())
    assert local < 0.56 * total, (local, total)
    assert r0["eval_logits_width"] == 300 and ref["llama_sft"]["eval_logits_width"] == 600
    assert r0["engine_reshards"] == {} and r1["engine_reshards"] == {}
    control = got["reshard_control"][0]           # the recorder does see the engine's reshards
    assert control["calls"].get("SToR", 0) >= 1 and control["full"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    ops = {op for op, _ in r0["comm"]}   # (the final export's gathers are not in this list)
    assert ops <= {"all_reduce_sum", "all_reduce_max"}, ops
    # Megatron's count, per micro-batch (2 per step, 5 steps): forward g after the embedding and
    # after attention and MLP of each of the 2 layers, backward f at the q/k/v and gate/up inputs
    # and at the head's input: 10 all-reduces [tokens, H=64]; the loss adds a row max [n, 1] and
    # a [n, 2] sum; the step adds one scalar (the split gradients' squared norm)
    wide = [shape for op, shape in r0["comm"] if len(shape) >= 2 and shape[-1] == 64]
    rows = [shape for op, shape in r0["comm"] if len(shape) == 2 and shape[-1] in (1, 2)]
    scalars = [shape for op, shape in r0["comm"] if len(shape) == 0]
    assert (len(wide), len(rows), len(scalars)) == (5 * 2 * 10, 5 * 2 * 2, 5), (len(wide), len(rows), len(scalars))
    assert len(r0["comm"]) == len(wide) + len(rows) + len(scalars)
    # tied Qwen2, vocabulary 601 padded to 602: 301 rows per rank
    g, l = got["qwen2_tied_vocab601"][1]["shapes"]["model.embed_tokens.weight"]
    assert g == [602, 64] and l == [301, 64]
    # ChatGLM2's fused q|k|v: each rank holds its slice of q, k and v
    g, l = got["chatglm2_sft"][0]["shapes"]["transformer.encoder.layers.0.self_attention.query_key_value.weight"]
    assert l[1] * 2 == g[1]


def test_tp_checkpoint_resumes_exactly_and_in_one_process(runs, tmp_path):
    """Each TP rank writes its slices (full-model names, global boxes): resumed under TP=2 the run
    continues exactly (LoRA with dropout); the TP=2 checkpoint of a full SFT run also resumes in
    ONE process, continuing as the uninterrupted single-process run."""
    from tp_cases import train_case

    base, got, ref = runs
    full, resumed = got["save"][0], got["resume"][0]
    np.testing.assert_allclose(resumed["losses"][3:], full["losses"][3:], rtol=1e-6)
    a, b = _tensors(base / "save" / "trained.safetensors"), _tensors(base / "resume" / "trained.safetensors")
    assert max(np.abs(a[k] - b[k]).max() for k in a) <= 1e-6 * max(np.abs(a[k]).max() for k in a)
    ck = base / "sft_save" / "checkpoint-3"
    index = json.load(open(ck / "shards.json"))
    q = index["model"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["global_shape"] == [64, 64] and sorted(p["start"] for p in q["pieces"]) == [[0, 0], [0, 32]]
    norm = index["model"]["model.layers.0.input_layernorm.weight"]["pieces"]
    assert len(norm) == 1                                  # replicated: written once
    one = train_case(str(base / "ck_llama"), str(tmp_path / "one"), resume=str(ck))
    single = ref["llama_sft"]
    np.testing.assert_allclose(one["losses"][3:], single["losses"][3:], rtol=1e-5)
    w1, w2 = _tensors(tmp_path / "one" / "trained.safetensors"), _tensors(base / "llama_sft" / "single" / "trained.safetensors")
    start = _tensors(base / "llama_sft" / "single" / "initial.safetensors")
    update = max(np.abs(w2[k] - start[k]).max() for k in w2)
    assert max(np.abs(w1[k] - w2[k]).max() for k in w2) <= 1e-4 * update


DP_TP = {"llama_sft": ("llama", {}), "llama_lora": ("llama", {"method": "lora", "lr": 2e-2}),
         "llama_prefix": ("llama", {"method": "prefix", "lr": 2e-2, "max_grad_norm": 0.005}),
         "llama_qlora_nf4": ("llama", {"method": "qlora", "quant": "nf4", "lr": 2e-2}),
         "qwen2_tied_vocab601": ("qwen2", {}),
         "chatglm2_sft": ("chatglm", {}), "chatglm2_lora": ("chatglm", {"method": "lora", "lr": 2e-2})}


# 4 ranks in one gloo group on 2 cores: ~80 ms per collective, so two cases of 3 steps
TP4 = {"llama_prefix": ("llama", {"method": "prefix", "lr": 2e-2, "max_grad_norm": 0.005, "steps": 3}),
       "chatglm2_lora": ("chatglm", {"method": "lora", "lr": 2e-2, "steps": 3})}


@pytest.fixture(scope="module")
def runs4(runs):
    """DP2 x TP2 on 4 launched ranks (overlapping gloo groups: parallel/cpu_compat.py), global
    batch 8 = micro 4 x 2 data-parallel ranks (the reference: micro 4 x accumulation 2)."""
    base, _, ref = runs
    cks = {"llama": str(base / "ck_llama"), "chatglm": str(base / "ck_chatglm"), "qwen2": str(base / "ck_qwen2")}
    # micro 4 x accumulation 1 x 2 data ranks = the reference's 4 x 2: half the collectives of
    # micro 2 x 2 (4 ranks share 2 cores: a collective costs ~30-80 ms here)
    cases = [(name, "tp_cases:train_case", dict(kw, ckpt=cks[kind], out_dir=str(base / "dptp" / name),
                                                tp=2, micro=4, accum=1)) for name, (kind, kw) in DP_TP.items()]
    # TP=4 in the same launch: 4 query heads, 2 key/value heads -> each kv head on 2 ranks
    cases += [(f"tp4_{name}", "tp_cases:train_case", dict(kw, ckpt=cks[kind], out_dir=str(base / "tp4" / name),
                                                         tp=4)) for name, (kind, kw) in TP4.items()]
    return base, launch_cases(cases, base / "dptp", nproc=4, timeout=900), ref


@pytest.mark.parametrize("name", list(DP_TP))
def test_dp2_tp2_equals_one_process(runs4, name):
    base, got, ref = runs4
    single = ref["llama_lora_nodrop" if name == "llama_lora" else name]
    ranks = got[name]
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)
    np.testing.assert_allclose(ranks[0]["losses"], single["losses"], rtol=1e-5)
    assert ranks[0]["eval"]["accuracy"] == single["eval"]["accuracy"]
    assert abs(ranks[0]["eval"]["loss"] - single["eval"]["loss"]) <= 1e-5 * abs(single["eval"]["loss"])
    tp = _tensors(base / "dptp" / name / "trained.safetensors")
    sdir = base / ("llama_lora_nodrop" if name == "llama_lora" else name) / "single"
    one, start = _tensors(sdir / "trained.safetensors"), _tensors(sdir / "initial.safetensors")
    update = max(np.abs(one[k] - start[k]).max() for k in one)
    assert max(np.abs(tp[k] - one[k]).max() for k in one) <= 1e-4 * update
    # rank 3 (dp 1, tp 1) holds half of every column layer's output (LoRA B under QLoRA)
    cols = [v for k, v in ranks[3]["shapes"].items()
            if ("up_proj" in k or "dense_h_to_4h" in k) and k.endswith(("up_proj.weight", "h_to_4h.weight",
                                                                           "lora_B.weight"))]
    assert cols and all(l[1] * 2 == g[1] for g, l in cols), cols


def test_loading_memory_per_rank_is_about_half(runs):
    """Sliced loading: each TP=2 rank's peak RSS growth while loading a 232 MB model is at most
    0.6x that of one process loading it whole (each measured in a fresh process), and each rank
    holds half the numel."""
    base, got, _ = runs
    r = run_script(["-c", "import json, sys; sys.path.insert(0, 'tests'); import tp_cases; "
                    f"print(json.dumps(tp_cases.load_memory({str(base / 'ck_big')!r}, 1)))"])
    assert r.returncode == 0, r.stderr[-2000:]
    one = json.loads(r.stdout.strip().splitlines()[-1])
    assert one["growth_mb"] > 200, one   # the measurement saw the whole model's load
    for rank in got["load_memory"]:
        assert rank["growth_mb"] <= 0.6 * one["growth_mb"], (rank, one)
        assert abs(rank["local_numel"] / one["local_numel"] - 0.5) < 0.01, (rank, one)


@pytest.mark.parametrize("name", list(TP4))
def test_tp4_replicated_kv_heads_equal_one_process(runs4, name):
    """TP=4 with 2 key/value heads (Llama GQA, ChatGLM2's 2 groups): each kv head is held by 2
    ranks, whose partial gradients are summed; losses, eval and trained tensors equal one
    process, and the checkpointed / exported tensors hold each head once."""
    base, got, ref = runs4
    from tp_cases import train_case

    ranks = got[f"tp4_{name}"]
    kind, kw = TP4[name]
    single = train_case(str(base / f"ck_{kind}"), str(base / "tp4" / name / "single"), **kw)
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)
    np.testing.assert_allclose(ranks[0]["losses"], single["losses"], rtol=1e-5)
    assert abs(ranks[0]["eval"]["loss"] - single["eval"]["loss"]) <= 1e-5 * abs(single["eval"]["loss"])
    tp = _tensors(base / "tp4" / name / "trained.safetensors")
    one, start = (_tensors(base / "tp4" / name / "single" / f) for f in ("trained.safetensors", "initial.safetensors"))
    assert set(tp) == set(one)
    update = max(np.abs(one[k] - start[k]).max() for k in one)
    assert max(np.abs(tp[k] - one[k]).max() for k in one) <= 1e-4 * update, _worst_tensor(tp, one, start)
    kv = [(k, v) for k, v in ranks[2]["shapes"].items()
          if ("k_proj" in k or "query_key_value" in k) and k.endswith("weight") and "lora_A" not in k]
    assert kv, ranks[2]["shapes"].keys()
    for k, (g, l) in kv:   # rank 2 holds one query head and one (shared) kv head per projection
        assert l[-1] < g[-1], (k, g, l)


def test_vocabulary_shard_operations_equal_whole_vocabulary(runs):
    """Per-token log-probabilities (with their gradient), argmax and R-Drop's symmetric KL from
    two ranks' vocabulary shards (V=601: rank 1's last column is padding) equal numpy over the
    whole vocabulary."""
    _, got, _ = runs
    r0, r1 = got["vocab_ops"]
    z, z2, t = np.array(r0["full"], np.float64), np.array(r0["full2"], np.float64), np.array(r0["t"])
    lp = z - z.max(1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(1, keepdims=True))
    lp2 = z2 - z2.max(1, keepdims=True)
    lp2 = lp2 - np.log(np.exp(lp2).sum(1, keepdims=True))
    want = lp[np.arange(len(t)), t]
    for r in (r0, r1):
        np.testing.assert_allclose(r["logprobs"], want, rtol=1e-5)
        assert r["argmax"] == z.argmax(1).tolist()
        np.testing.assert_allclose(r["kl"], ((np.exp(lp) - np.exp(lp2)) * (lp - lp2)).sum(1), rtol=1e-4)
    grad = -np.exp(lp)                                   # d(sum log p_t)/dz = onehot - softmax
    grad[np.arange(len(t)), t] += 1
    got_grad = np.concatenate([np.array(r0["grad"]), np.array(r1["grad"])], axis=1)
    np.testing.assert_allclose(got_grad, grad, atol=1e-6)
    # the KL's gradient (rows weighted 1..n) against torch autograd over the whole vocabulary
    import torch

    t1, t2 = (torch.tensor(x, requires_grad=True) for x in (z, z2))
    l1, l2 = torch.log_softmax(t1, -1), torch.log_softmax(t2, -1)
    kl = ((l1.exp() - l2.exp()) * (l1 - l2)).sum(-1)
    (kl * torch.arange(1, len(t) + 1, dtype=kl.dtype)).sum().backward()
    for key, ref in (("kl_grad1", t1.grad.numpy()), ("kl_grad2", t2.grad.numpy())):
        got_kl = np.concatenate([np.array(r0[key]), np.array(r1[key])], axis=1)
        np.testing.assert_allclose(got_kl, ref, atol=2e-6)
