"""Generation under tensor parallelism (TP=2 on launched ranks) equals one process, id for id.

One 2-rank launch runs every case (tests/gen_tp_cases.py); the reference is the same function in
this process. Models: a GQA Llama saved by transformers (4 heads, 2 kv heads: one per rank), a
tied Qwen2 with vocabulary 601 (padded to 602: rank 1's last column never chosen) and ChatGLM2
(padded_vocab_size 600); a Llama with prefix tuning (the prefix split by kv heads into the
cache); a multi-query Llama (1 kv head, replicated on both ranks), alone and with a prefix, and a
ChatGLM2 with 1 key/value group (greedy, one sampling config and the uncached path only); their
final norms are scaled so that logits are peaked enough for top-k / top-p to cut real mass. Every configuration generates a batch of prompts of different lengths (left padding)
with the KV cache: greedy, and seeded sampling with temperature, top-k (small: candidates
gathered; large: count search), top-p, repetition penalty, all of them at once, EOS and stop
strings ending rows at different steps (finished rows dropped in lockstep). Asserted besides the
ids: each rank's logits are V/TP wide and equal the one-process logits' columns of its shard, the
KV cache holds K/TP heads, and no collective during generation had a vocabulary-sized dimension
(model.tensor_parallel.log); greedy token choice costs exactly two [B] all-reduces per step.
The sharded token choice is also checked alone on identical random logits full of ties (the
nucleus boundary inside a tie group, padding, large and small top-k), on the launched ranks and,
for degrees 3 and 4, on threads standing in for ranks. llm/predictor.py launched with
--tensor_parallel_degree 2 writes the file one process writes; alone it refuses with the launch
command; with a LoRA adapter and a prefix it equals the one-process run (LoRA merged there).
"""
import math
import os
import sys
import threading

import numpy as np
import paddle
import pytest

from conftest import ROOT, hf_checkpoint, launch_cases, write_jsonl

sys.path.insert(0, os.path.join(ROOT, "tests"))

PROMPTS = [[1, 17, 250, 3, 99, 41], [1, 5, 6, 7, 8, 9, 10, 11, 300, 12, 13], [1, 42, 7]]
S = dict(decode_strategy="sampling")
CONFIGS = {
    "greedy": dict(return_logits=True),
    "temperature": dict(S, temperature=0.7, seed=1),
    "top_k": dict(S, top_k=5, seed=2),
    "top_k_large": dict(S, top_k=400, temperature=3.0, seed=3),     # k >= V/TP: count search
    "top_p": dict(S, top_p=0.6, seed=4),
    "repetition": dict(repetition_penalty=2.0),
    "all": dict(S, temperature=0.8, top_k=40, top_p=0.8, repetition_penalty=1.3, seed=5),
}
BASE = dict(max_new_tokens=10, eos_token_id=[])
# multi-query Llama (1 key/value head < TP 2: the head replicated on both ranks): fewer configs
MQA = {"greedy": dict(BASE, return_logits=True), "all": dict(BASE, **CONFIGS["all"]),
       "uncached": dict(BASE, use_cache=False)}     # no KVCache; a prefix enters as a PrefixCache
OPS = {   # token choice alone, on the same logits
    "greedy": dict(decode_strategy="greedy_search"),
    "greedy_penalty": dict(decode_strategy="greedy_search", repetition_penalty=1.7),
    "plain": dict(S),
    "top_k": dict(S, top_k=7, temperature=0.7),
    "top_k_large": dict(S, top_k=500),
    "top_p": dict(S, top_p=0.6),
    "top_p_flat": dict(S, top_p=0.95, temperature=3.0),
    "all": dict(S, top_k=30, top_p=0.5, temperature=0.7, repetition_penalty=1.3),
    "large_k_top_p": dict(S, top_k=450, top_p=0.4, temperature=0.5),
}


def _checkpoints(base):
    from paddletune.models.tiny import make_tiny_checkpoint

    glm = str(base / "ck_chatglm")
    make_tiny_checkpoint(glm, "chatglm", seed=5, padded_vocab_size=600)
    glm_mqa = str(base / "ck_chatglm_mqa")     # fused [q | k | v] with 1 key/value group
    make_tiny_checkpoint(glm_mqa, "chatglm", seed=8, padded_vocab_size=600, multi_query_group_num=1)
    out = {"llama": hf_checkpoint(base / "ck_llama", "llama", seed=3)[0],
           "qwen2": hf_checkpoint(base / "ck_qwen2", "qwen2", seed=4, vocab_size=601,
                                  tie_word_embeddings=True)[0],
           "chatglm": glm,
           "mqa": hf_checkpoint(base / "ck_mqa", "llama", seed=7, num_key_value_heads=1)[0],
           "glm_mqa": glm_mqa}
    # tied Qwen2 less: its logits already favour the last input token (h holds its embedding)
    for kind, norm, factor in (("llama", "model.norm.weight", 20), ("qwen2", "model.norm.weight", 3),
                               ("mqa", "model.norm.weight", 20),
                               ("glm_mqa", "transformer.encoder.final_layernorm.weight", 20),
                               ("chatglm", "transformer.encoder.final_layernorm.weight", 20)):
        _sharpen(os.path.join(out[kind], "model.safetensors"), norm, factor)
    return out


def _sharpen(path, norm, factor):
    """Scale the final norm's weight, so the logits: random init gives near-flat logits (std
    ~0.16), where every sampler picks about index u * V; std ~3 makes top-k / top-p cut real
    probability mass. (Not the tied embedding: it would also dominate the residual stream.)"""
    from paddletune.models.hf import SafetensorsFile, write_safetensors

    st = SafetensorsFile(path)
    tensors = {k: np.array(st.get(k)) for k in st.keys()}
    tensors[norm] = tensors[norm] * factor
    write_safetensors(path, tensors)


STOP_RUN = dict(BASE, decode_strategy="sampling", seed=6)


def _configs(ckpt, free):
    """CONFIGS plus rows ending at different steps, chosen from runs without an end (`free`):
    greedy with EOS ids that end row 0 after its 3rd token and row 1 after its 6th, and sampling
    with a stop string that row 0's 3rd token completes."""
    from paddletune.tokenizer import Tokenizer

    out = {n: dict(BASE, **kw) for n, kw in CONFIGS.items()}
    g = free["greedy"]["ids"]
    out["eos"] = dict(BASE, eos_token_id=sorted({g[0][2], g[1][5]}))
    tok, row = Tokenizer(ckpt), free["stop"]["ids"][0]
    text = next(t for t in (tok.decode([i]).strip() for i in row[2:]) if t and "\ufffd" not in t)
    out["stop"] = dict(STOP_RUN, stop=[text])
    return out


def _adapters(ckpt, base):
    """(LoRA dir, prefix dir) for `ckpt`: LoRA r=4 on the default targets with random B (a zero B
    would change nothing), and 3 random prefix tokens."""
    from paddletune import peft, runtime
    from paddletune.args import ModelArgument
    from paddletune.loading import load_model

    runtime.set_seed(0)
    model = load_model(ckpt)
    peft.apply(model, ModelArgument(model_name_or_path=ckpt, lora=True, lora_rank=4))
    rng = np.random.default_rng(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.set_value(rng.standard_normal(p.shape).astype(np.float32) * 0.3)
    lora = peft.lora.save(model, str(base / "lora"), ckpt)
    model = load_model(ckpt)
    peft.apply(model, ModelArgument(model_name_or_path=ckpt, prefix_tuning=True, num_prefix_tokens=3))
    return lora, peft.prefix.save(model, str(base / "prefix"), ckpt)


def _predictor_args(ckpt, data, out, *extra):
    return ["--model_name_or_path", ckpt, "--data_file", data, "--output_file", out,
            "--batch_size", "2", "--max_length", "8", "--chat_template", "none", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from gen_tp_cases import generate_case, predictor_case

    base = tmp_path_factory.mktemp("gen_tp")
    cks = _checkpoints(base)
    ref, cases = {}, []
    for name, ck, prefix in (("llama", cks["llama"], 0), ("qwen2", cks["qwen2"], 0),
                             ("chatglm", cks["chatglm"], 0), ("llama_prefix", cks["llama"], 3)):
        free = generate_case(ck, {"greedy": BASE, "stop": STOP_RUN}, PROMPTS, prefix_tokens=prefix)
        configs = _configs(ck, free)
        ref[name] = generate_case(ck, configs, PROMPTS, prefix_tokens=prefix)
        cases.append((name, "gen_tp_cases:generate_case",
                      dict(ckpt=ck, configs=configs, prompts=PROMPTS, tp=2, prefix_tokens=prefix)))
    for name, ck, prefix in (("mqa", cks["mqa"], 0), ("mqa_prefix", cks["mqa"], 3),
                             ("glm_mqa", cks["glm_mqa"], 0)):
        ref[name] = generate_case(ck, MQA, PROMPTS, prefix_tokens=prefix)
        cases.append((name, "gen_tp_cases:generate_case",
                      dict(ckpt=ck, configs=MQA, prompts=PROMPTS, tp=2, prefix_tokens=prefix)))
    cases.append(("ops", "gen_tp_cases:ops_case", dict(tp=2, configs=OPS)))
    data = write_jsonl(str(base / "dev.json"), [{"src": "Reverse the words: apple river"},
                                                {"src": "hi"}, {"src": "Sort the numbers: 3 1 2"}])
    lora, prefix = _adapters(cks["llama"], base)
    for mode, extra in (("greedy", ["--decode_strategy", "greedy_search"]),
                        ("sampling", []),          # the defaults: top_p 0.7, temperature 0.95
                        # adapters sliced under TP (LoRA unmerged there, merged in one process)
                        ("adapters", ["--lora_path", lora, "--prefix_path", prefix, "--top_k", "20"])):
        one = str(base / f"pred_{mode}_one.json")
        ref["pred_" + mode] = predictor_case(_predictor_args(cks["llama"], data, one, *extra))
        cases.append(("pred_" + mode, "gen_tp_cases:predictor_case",
                      dict(argv=_predictor_args(cks["llama"], data, str(base / f"pred_{mode}_tp.json"),
                                                "--tensor_parallel_degree", "2", *extra))))
    got = launch_cases(cases, base, nproc=2, timeout=900)
    return base, got, ref


MODELS = ["llama", "qwen2", "chatglm", "llama_prefix"]


@pytest.mark.parametrize("model", MODELS)
def test_tp2_generates_the_one_process_ids(runs, model):
    base, got, ref = runs
    one, ranks = ref[model], got[model]
    for name in list(CONFIGS) + ["eos", "stop"]:
        assert ranks[0][name]["ids"] == ranks[1][name]["ids"], (model, name)
        assert ranks[0][name]["ids"] == one[name]["ids"], (model, name)
        assert ranks[0][name]["reasons"] == one[name]["reasons"], (model, name)
    # the cases exercise what they name: rows ending at different steps, sampling not greedy
    for name, reason in (("eos", "eos"), ("stop", "stop")):
        lengths = {len(s) for s in one[name]["ids"]}
        assert reason in one[name]["reasons"] and len(lengths) > 1, (name, one[name])
    assert one["temperature"]["ids"] != one["greedy"]["ids"]
    assert one["repetition"]["ids"] != one["greedy"]["ids"]


@pytest.mark.parametrize("model", MODELS)
def test_the_split_is_real(runs, model):
    """Logits V/TP wide (each rank's columns of the one-process logits), KV cache K/TP heads,
    no vocabulary-sized collective, greedy choice = 2 all-reduces of [B] per step."""
    base, got, ref = runs
    one, ranks = ref[model], got[model]
    V, H, K = one["_"]["vocab"], one["_"]["hidden"], one["_"]["kv_heads"]
    vl = math.ceil(V / 2)
    for r, res in enumerate(ranks):
        g = res["greedy"]
        assert g["width"] == vl and one["greedy"]["width"] == V
        n = min(vl, V - r * vl)                            # this shard's real (unpadded) columns
        for row_tp, row_one in zip(g["logits"], one["greedy"]["logits"]):
            np.testing.assert_allclose(np.asarray(row_tp)[:, :n], np.asarray(row_one)[:, r * vl:r * vl + n],
                                       atol=2e-5 * np.abs(row_one).max())
        for name in list(CONFIGS) + ["eos", "stop"]:
            assert [c[1] for c in res[name]["cache"]] == [K // 2], (name, res[name]["cache"])
            assert [c[1] for c in one[name]["cache"]] == [K]
            comm = res[name]["comm"]
            assert comm and all(max(shape, default=1) < vl for _, shape in comm), (name, comm)
        steps = max(len(s) for s in g["ids"])
        choice = [c for c in g["comm"] if c[1][-1:] != [H]]      # the rest: model activations [.., H]
        assert choice == [["all_reduce_max", [len(PROMPTS)]]] * (2 * steps), choice


@pytest.mark.parametrize("model", ["mqa", "mqa_prefix", "glm_mqa"])
def test_one_kv_head_replicated_on_both_ranks_generates_the_one_process_ids(runs, model):
    """num_key_value_heads 1 at TP 2 (Llama; ChatGLM2 multi_query_group_num 1, its k/v inside the
    fused query_key_value): each rank's attention computes the one (replicated) key/value head, so
    its KV cache holds 1 head, not 1 // 2 = 0; with prefix tuning the prefix [L, 1, P, D] is whole
    on both ranks (in the KVCache, and as a PrefixCache when uncached)."""
    base, got, ref = runs
    one, ranks = ref[model], got[model]
    V = one["_"]["vocab"]
    vl = math.ceil(V / 2)
    assert one["_"]["kv_heads"] == 1
    for name in MQA:
        assert ranks[0][name]["ids"] == ranks[1][name]["ids"] == one[name]["ids"], (model, name)
        assert ranks[0][name]["reasons"] == one[name]["reasons"], (model, name)
    for r, res in enumerate(ranks):
        assert [c[1] for c in res["greedy"]["cache"]] == [1] == [c[1] for c in one["greedy"]["cache"]]
        assert res["uncached"]["cache"] == []                  # the recomputing path really ran
        assert res["uncached"]["ids"] == res["greedy"]["ids"]
        n = min(vl, V - r * vl)
        for row_tp, row_one in zip(res["greedy"]["logits"], one["greedy"]["logits"]):
            np.testing.assert_allclose(np.asarray(row_tp)[:, :n], np.asarray(row_one)[:, r * vl:r * vl + n],
                                       atol=2e-5 * np.abs(row_one).max())
    assert one["all"]["ids"] != one["greedy"]["ids"]
    assert ref["mqa_prefix"]["greedy"]["ids"] != ref["mqa"]["greedy"]["ids"]   # the prefix counts


def test_sharded_token_choice_equals_one_process_on_the_same_logits(runs):
    base, got, ref = runs
    want = _ops_reference(2)
    assert got["ops"][0] == got["ops"][1] == want


def _ops_reference(tp, seeds=3, batch=4, vocab=601):
    from gen_tp_cases import op_inputs
    from paddletune.generation import GenerationConfig, choose_tokens

    out = {}
    for name, kw in OPS.items():
        cfg = GenerationConfig(**kw).validate()
        out[name] = []
        for seed in range(seeds):
            z, seen, u = op_inputs(seed, batch, vocab, math.ceil(vocab / tp) * tp)
            ids = choose_tokens(paddle.to_tensor(z[:, :vocab]), cfg, paddle.to_tensor(seen[:, :vocab]),
                                paddle.to_tensor(u))
            out[name].append(ids.numpy().tolist())
    return out


def test_predictor_launched_with_tp2_writes_the_one_process_file(runs):
    base, got, ref = runs
    for mode in ("greedy", "sampling", "adapters"):
        one, (r0, r1) = ref["pred_" + mode], got["pred_" + mode]
        assert one["rc"] == r0["rc"] == r1["rc"] == 0
        a = open(base / f"pred_{mode}_one.json").read()
        b = open(base / f"pred_{mode}_tp.json").read()
        assert a == b and len(a.splitlines()) == 3
        assert r0["printed"].startswith("3 answers written to") and r1["printed"] == ""   # rank 0 speaks
    outputs = {m: open(base / f"pred_{m}_one.json").read() for m in ("sampling", "adapters")}
    assert outputs["sampling"] != outputs["adapters"]          # the adapters changed the answers


def test_predictor_alone_with_tp_degree_names_the_launch_command(tmp_path, monkeypatch, capsys):
    from conftest import load_script
    import paddletune.loading as gen

    path, _ = hf_checkpoint(tmp_path / "ck", seed=1)
    monkeypatch.setattr(gen, "load_for_generation", lambda *a, **k: pytest.fail("model was loaded"))
    predictor = load_script("llm/predictor.py")
    rc = predictor.main(["--model_name_or_path", path, "--tensor_parallel_degree", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: tensor_parallel_degree=2 needs 2 processes" in err
    assert "python -m paddle.distributed.launch --nproc_per_node 2 llm/predictor.py" in err


# ------------------------------------------------------------------------------ threads as ranks

class _Exchange:
    def __init__(self, n):
        self.n, self.barrier, self.slots = n, threading.Barrier(n, timeout=120), [None] * n

    def __call__(self, rank, arr):
        self.slots[rank] = arr
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class _ThreadTP:
    """TensorParallel's interface for rank `rank` of `n` threads (all_reduce and, through the
    patched dist.all_gather, gathers exchange numpy copies)."""

    def __init__(self, exchange, rank):
        self.exchange, self.degree, self.rank, self.group, self.log = exchange, exchange.n, rank, None, None

    def all_reduce(self, t, op="sum"):
        parts = self.exchange(self.rank, t.numpy())
        t.set_value(paddle.to_tensor(np.maximum.reduce(parts) if op == "max" else np.sum(parts, axis=0)))
        return t


@pytest.mark.parametrize("tp", [3, 4])
def test_sharded_token_choice_on_threads_as_ranks(tp, monkeypatch):
    """Degrees 3 and 4 (exclusive prefixes over several ranks, padding 2 at 601 / 3): the same ids
    as one process."""
    from gen_tp_cases import op_inputs
    from paddletune.generation import GenerationConfig, choose_tokens
    from paddletune.parallel import sampling

    exchange, local = _Exchange(tp), threading.local()
    monkeypatch.setattr(sampling.dist, "all_gather", lambda out, x, group=None: out.extend(
        paddle.to_tensor(p) for p in exchange(local.tp.rank, x.numpy())))
    vocab, vl = 601, math.ceil(601 / tp)
    results, logs, errors = [None] * tp, [None] * tp, []

    def rank_main(r):
        local.tp = _ThreadTP(exchange, r)
        local.tp.log = []
        try:
            res = {}
            for name, kw in OPS.items():
                cfg = GenerationConfig(**kw).validate()
                res[name] = []
                for seed in range(3):
                    z, seen, u = op_inputs(seed, 4, vocab, vl * tp)
                    cols = slice(r * vl, (r + 1) * vl)
                    res[name].append(choose_tokens(paddle.to_tensor(z[:, cols]), cfg, paddle.to_tensor(
                        seen[:, cols]), paddle.to_tensor(u), local.tp, vocab).numpy().tolist())
            results[r], logs[r] = res, local.tp.log
        except BaseException as e:   # noqa: BLE001  (reported below; the others must not wait)
            errors.append(e)
            exchange.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    want = _ops_reference(tp)
    assert all(res == want for res in results)
    # the nucleus boundary fell inside a tie group at least once (its extra gather of tie counts)
    sampled = sum(len(v) for n, v in want.items() if "greedy" not in n)
    assert logs[0].count(("all_gather", [4, 1])) > sampled
