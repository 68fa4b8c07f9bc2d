"""PEFT and quantized layers under tensor parallelism (issue 28, deliverable 5), proven by the
collective recorder (parallel/recorder.py) on one 2-process launch of two training steps each.

Oracles: the plain (full fine-tuning, float) run's recorded collectives, with what each method
adds or removes derived by hand below from the TP math (parallel/tensor.py, parallel/vocab.py);
per-rank bytes computed from the checkpoint's config and the plan's rules (parallel/plan.py,
quant/weight_only.py docstrings), not from the code; the one-process run's losses for the
methods no other TP test compares (fp4 and int4 QLoRA; the rest: test_tensor_parallel.py).

Tiny Llama of conftest.hf_checkpoint: H 64, I 96, 2 layers, 4 heads / 2 KV heads (D 16), V 600;
TP 2; micro-batch 2, no accumulation, 2 steps (2 micro-batches of different lengths).
"""
import collections

import numpy as np
import pytest

from conftest import launch_cases

H, I, LAYERS, KV, D, V, TP = 64, 96, 2, 2, 16, 600, 2
R, ADAPTER, LOWRANK, PREFIX, BLOCK = 4, 8, 4, 3, 64   # tp_peft_cases / args defaults
COLUMNS = {"q_proj": (H, H), "k_proj": (H, KV * D), "v_proj": (H, KV * D), "gate_proj": (H, I),
           "up_proj": (H, I)}                       # (in, out), split along out
ROWS = {"o_proj": (H, H), "down_proj": (I, H)}      # split along in
QUANTS = ("nf4", "fp4", "weight_only_int8", "weight_only_int4")
METHODS = {"plain": {}, "lora": {"method": "lora"}, "prefix": {"method": "prefix"},
           "adapter": {"method": "adapter"}, "lowrank_adapter": {"method": "lowrank_adapter"},
           "bitfit": {"method": "bitfit"}, "rdrop": {"rdrop": True}, "neftune": {"neftune": True},
           **{f"qlora_{q}": {"method": "lora", "quant": q} for q in QUANTS}}
SELECTION = ("lora", "prefix", "adapter", "lowrank_adapter", "bitfit") + tuple(f"qlora_{q}" for q in QUANTS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import hf_checkpoint

    tmp = tmp_path_factory.mktemp("tp_peft")
    ckpt, _ = hf_checkpoint(str(tmp / "ckpt"))
    cases = [(n, "tp_peft_cases:peft_step_case", dict(kw, ckpt=ckpt, out_dir=str(tmp / n)))
             for n, kw in METHODS.items()]
    return launch_cases(cases, tmp, nproc=2), ckpt


def _key(e):
    """(op, ranks, shapes, dtypes) of a recorded wire entry [tag, op, ranks, shapes, dtypes]."""
    return e[1], tuple(e[2]), str(e[3]), tuple(e[4])


def _ar(shape, dtype="float32"):
    return "all_reduce", (0, 1), str([list(shape)]), (dtype,)


def _forward(wire):
    """{planned module: Counter of its forward entries}."""
    out = collections.defaultdict(collections.Counter)
    for e in wire:
        if e[0].startswith("fwd:"):
            out[e[0][4:]][_key(e)] += 1
    return out


def _rest(wire):
    return collections.Counter(_key(e) for e in wire if not e[0].startswith("fwd:"))


def _micro_batches(plain):
    """[(B, S, n targets)] of the plain run's micro-batches, in order: [B, S, H] from the
    embedding's all-reduce, n from the loss's row-max all-reduce [n, 1] (one each per pass)."""
    bs = [e[3][0][:2] for e in plain if e[0] == "fwd:model.embed_tokens"]
    ns = [e[3][0][0] for e in plain if e[0] == "step" and len(e[3][0]) == 2 and e[3][0][1] == 1]
    assert len(bs) == len(ns) == 2
    return [(b, s, n) for (b, s), n in zip(bs, ns)]


def test_every_collective_is_an_all_reduce_over_the_tp_group_and_forward_ones_are_fleets(runs):
    out, _ = runs
    for name, ranks in out.items():
        for res in ranks:
            assert {(e[1], tuple(e[2])) for e in res["wire"]} == {("all_reduce", (0, 1))}, name
            # each planned module's forward all-reduces are exactly fleet's mp_ops._mp_allreduce
            # calls made inside it (g), same shapes
            fwd = collections.Counter((e[0], str(e[3][0])) for e in res["wire"] if e[0].startswith("fwd:"))
            mp = collections.Counter((c[0], str(c[2])) for c in res["mp_calls"] if c[1] == "_mp_allreduce")
            assert fwd == mp and fwd, name
            # f: one fleet _c_identity per distinct input of a column layer (and LoRA's x @ A)
            assert any(c[1] == "_c_identity" for c in res["mp_calls"]), name


def test_quantized_lora_communicates_exactly_as_float_lora(runs):
    """nf4 / fp4 / int8 / int4 QLoRA: the same collectives in the same order (ops, groups,
    shapes, dtypes, issuing module) and the same mp_ops calls as LoRA on the float layers: the
    quantized linears run the same column / row executors (no communication of their own)."""
    out, _ = runs
    for q in QUANTS:
        for lora, ql in zip(out["lora"], out[f"qlora_{q}"]):
            assert ql["wire"] == lora["wire"], q
            assert ql["mp_calls"] == lora["mp_calls"], q


def test_each_method_adds_exactly_its_stated_collectives(runs):
    out, _ = runs
    for r in range(TP):
        plain = out["plain"][r]["wire"]
        micro = _micro_batches(plain)
        pf, prest = _forward(plain), _rest(plain)
        assert set(pf) == {n for n, k in out["plain"][r]["kinds"].items() if k in ("row", "vocab")}
        for name in METHODS:
            wire = out[name][r]["wire"]
            fwd, rest = _forward(wire), _rest(wire)
            want_fwd = {m: collections.Counter(c) for m, c in pf.items()}
            want_rest = collections.Counter(prest)
            if name == "rdrop":
                # two forward passes per micro-batch; each keeps its logits: per pass the sharded
                # CE (max [n,1], sums [n,2]), argmax (max [n] f32, min index [n] f64), f on the
                # selected hidden rows (backward [n,H]) and the 4 column inputs' f (backward
                # [B,S,H]); plus the KL: two log-sum-exps (max and sum [n,1] each) and [n,2]
                want_fwd = {m: c + c for m, c in pf.items()}
                want_rest = collections.Counter({_ar([]): 2})          # grad norm, per step
                for b, s, n in micro:
                    want_rest.update({_ar([n, 1]): 2 + 4, _ar([n, 2]): 2 + 1, _ar([n]): 2,
                                      _ar([n], "float64"): 2, _ar([n, H]): 2, _ar([b, s, H]): 8})
            if name in SELECTION:
                for b, s, n in micro:   # frozen embedding + norm: block 0's attention input needs
                    want_rest[_ar([b, s, H])] -= 1    # no gradient, so its f issues nothing
            if name in ("adapter", "lowrank_adapter"):   # no split trainable tensor: no
                want_rest[_ar([])] -= 2                  # all-reduce of split squared norms
            if name == "lora" or name.startswith("qlora_"):
                for b, s, n in micro:
                    for layer in range(LAYERS):   # g on x_local @ A_local [B,S,r] (row layers)
                        for mod in ("self_attn.o_proj", "mlp.down_proj"):
                            want_fwd[f"model.layers.{layer}.{mod}"][_ar([b, s, R])] += 1
                    # f on x @ A [B,S,r] of each column layer: its backward all-reduce
                    want_rest[_ar([b, s, R])] += LAYERS * len(COLUMNS)
            assert dict(fwd) == {m: +c for m, c in want_fwd.items()}, name
            assert rest == +want_rest, (name, rest - want_rest, want_rest - rest)


def _expected_bytes(name):
    """{dtype: bytes} of one TP rank's parameters + buffers, from the config and the plan."""
    t = TP
    col = sum(i * o // t for i, o in COLUMNS.values())
    row = sum(i * o // t for i, o in ROWS.values())
    per_layer = {"float32": 4 * (col + row + 2 * H)}                # + 2 RMSNorm weights
    if name.startswith("qlora_"):
        algo = name[len("qlora_"):]
        # lines: a column layer's local output rows (blocks along in), a row layer's local
        # input columns (blocks along out); every line here is one 64-block (no double quant)
        lines = sum(o // t for _, o in COLUMNS.values()) + sum(i // t for i, _ in ROWS.values())
        assert all(i == BLOCK for i, _ in COLUMNS.values()) and all(o == BLOCK for _, o in ROWS.values())
        per_layer = {"float32": 4 * (2 * H + lines)}               # norms + scale / absmax per line
        if algo == "weight_only_int8":
            per_layer["int8"] = lines * BLOCK                      # one code a weight
        else:
            per_layer["uint8"] = lines * BLOCK // 2                # two codes a byte
    f32 = LAYERS * per_layer["float32"] + 4 * (V // t * H * 2 + H)  # embedding + head + norm
    extra = 0
    if name == "lora" or name.startswith("qlora_"):
        a = sum(i * R for i, _ in COLUMNS.values()) + sum(i // t * R for i, _ in ROWS.values())
        b = sum(R * o // t for _, o in COLUMNS.values()) + sum(R * o for _, o in ROWS.values())
        extra = LAYERS * (a + b)            # A whole / B split (column), A split / B whole (row)
    elif name == "prefix":
        extra = 2 * LAYERS * (KV // t) * PREFIX * D                  # keys + values, split by KV head
    elif name == "adapter":
        extra = 2 * LAYERS * (H * ADAPTER + ADAPTER + ADAPTER * H + H)   # on o_proj and down_proj
    elif name == "lowrank_adapter":
        r, m = LOWRANK, ADAPTER
        extra = 2 * LAYERS * (H * r + r * m + m + m * r + r * H + H)
    elif name == "bitfit":   # zero biases: split under column layers, whole under row layers
        extra = LAYERS * (sum(o // t for _, o in COLUMNS.values()) + sum(o for _, o in ROWS.values()))
    out = {k: LAYERS * v for k, v in per_layer.items() if k != "float32"}
    out["float32"] = f32 + 4 * extra
    return out


def test_each_ranks_parameter_and_buffer_bytes(runs):
    out, _ = runs
    assert _expected_bytes("plain") == {"float32": 4 * 69440}      # worked: 2*15488 + 2*19200 + 64
    for name in METHODS:
        for res in out[name]:
            assert res["bytes"] == _expected_bytes(name), name


def test_fp4_and_int4_qlora_losses_equal_one_process(runs, tmp_path):
    """The QLoRA algorithms test_tensor_parallel.py does not run under TP (it has nf4 and int8):
    two steps at TP 2 give the one-process losses (same global batch)."""
    from tp_peft_cases import peft_step_case

    out, ckpt = runs
    for q in ("fp4", "weight_only_int4"):
        one = peft_step_case(ckpt, str(tmp_path / q), method="lora", quant=q, tp=1)
        for res in out[f"qlora_{q}"]:
            np.testing.assert_allclose(res["losses"], one["losses"], rtol=2e-5, err_msg=q)
        assert one["losses"][1] != one["losses"][0]
