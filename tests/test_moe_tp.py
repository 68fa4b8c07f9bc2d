"""Mixture-of-Experts under tensor parallelism TP=2 equals one process (ONE 2-rank launch):
tiny Mixtral and tiny Qwen2-MoE (output_router_logits true: the load-balancing loss is in every
logged loss), full fine-tuning and LoRA on the experts. Per-step losses equal on both ranks (the
aux loss too: every rank routes the same replicated hidden state) and the one-process losses
(rtol 1e-5); trained tensors within 1e-4 of the update. The split is real: each rank holds half
of every expert's gate/up output columns and down input rows (the shared expert's too); the
router (`gate`) and `shared_expert_gate` are whole on every rank."""
import os
import sys

import numpy as np
import pytest

from conftest import ROOT, launch_cases
from paddletune.models.hf import SafetensorsFile

sys.path.insert(0, os.path.join(ROOT, "tests"))

STEPS = {"steps": 3, "micro": 4, "accum": 1}
MODELS = {"mixtral": "paddletune/tiny-mixtral", "qwen2_moe": "paddletune/tiny-qwen2moe"}
CASES = {   # name -> (model, train_case kwargs)
    "mixtral_sft": ("mixtral", {}),
    "mixtral_lora": ("mixtral", {"method": "lora", "lr": 2e-2}),
    "qwen2moe_sft": ("qwen2_moe", {}),
    "qwen2moe_lora": ("qwen2_moe", {"method": "lora", "lr": 2e-2}),
}
# per model: (block attribute, gate, up, down, shared expert?)
NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2", False),
         "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj", True)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from paddletune.models import resolve_model_path
    from tp_cases import train_case

    base = tmp_path_factory.mktemp("moe_tp")
    cks = {k: resolve_model_path(v) for k, v in MODELS.items()}
    cases = [(name, "tp_cases:train_case", dict(STEPS, **kw, ckpt=cks[kind],
                                               out_dir=str(base / name / "tp2"), tp=2, eval_n=4))
             for name, (kind, kw) in CASES.items()]
    got = launch_cases(cases, base, nproc=2, timeout=600)
    ref = {name: train_case(ckpt=cks[kind], out_dir=str(base / name / "single"), eval_n=4, **STEPS, **kw)
           for name, (kind, kw) in CASES.items()}
    return base, got, ref


def _tensors(path):
    st = SafetensorsFile(str(path))
    return {k: st.get(k) for k in st.keys()}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_tp2_equals_one_process(runs, name):
    base, got, ref = runs
    r0, r1 = got[name]
    single = ref[name]
    assert r0["losses"] == r1["losses"] and len(r0["losses"]) == 3   # aux loss identical per rank
    np.testing.assert_allclose(r0["losses"], single["losses"], rtol=1e-5, atol=0)
    assert abs(r0["eval"]["loss"] - single["eval"]["loss"]) <= 1e-5 * abs(single["eval"]["loss"])
    assert r0["eval"]["accuracy"] == single["eval"]["accuracy"]
    tp, one = (_tensors(base / name / r / "trained.safetensors") for r in ("tp2", "single"))
    start = _tensors(base / name / "single" / "initial.safetensors")
    assert set(tp) == set(one)
    update = max(np.abs(one[k] - start[k]).max() for k in one)
    worst = max(np.abs(tp[k] - one[k]).max() for k in one)
    assert update > 0 and worst <= 1e-4 * update, (worst, update)
    if CASES[name][1].get("method") == "lora":   # adapters on the experts were trained
        assert any(".experts." in k and "lora_B" in k for k in one)


@pytest.mark.parametrize("name", list(CASES))
def test_moe_tp2_split_is_real(runs, name):
    """Every expert's gate/up weight: local [H, I/2] of global [H, I]; down: [I/2, H] of [I, H]
    (numel halved); LoRA B of gate/up and LoRA A of down split too; routers whole."""
    _, got, _ = runs
    kind, kw = CASES[name]
    block, gate, up, down, shared = NAMES[kind]
    lora = kw.get("method") == "lora"
    for r in got[name]:
        shapes = r["shapes"]
        w = (lambda p: p + ".base_layer.weight") if lora else (lambda p: p + ".weight")
        experts = {n.split(".experts.")[1].split(".")[0] for n in shapes if ".experts." in n}
        sparse = sorted({int(n.split(".")[2]) for n in shapes if ".experts." in n})
        assert len(experts) == 4 and sparse == ([1, 2, 3] if shared else [0, 1, 2, 3])
        mods = [f"model.layers.{i}.{block}.experts.{e}" for i in sparse for e in sorted(experts)]
        if shared:   # Qwen2-MoE: the shared expert, and layer 0's dense MLP (mlp_only_layers)
            mods += [f"model.layers.{i}.{block}.shared_expert" for i in sparse] + ["model.layers.0.mlp"]
        for m in mods:
            for lin, axis in ((gate, 1), (up, 1), (down, 0)):
                g, l = shapes[w(f"{m}.{lin}")]
                assert l[axis] * 2 == g[axis] and l[1 - axis] == g[1 - axis], (m, lin, g, l)
                assert np.prod(l) * 2 == np.prod(g)
                if lora:
                    part = "lora_B" if axis == 1 else "lora_A"
                    g, l = shapes[f"{m}.{lin}.{part}.weight"]
                    assert l[axis] * 2 == g[axis], (m, lin, part, g, l)
        for i in sparse:
            routers = [f"model.layers.{i}.{block}.gate.weight"]
            if shared:
                routers.append(f"model.layers.{i}.{block}.shared_expert_gate.weight")
            for n in routers:
                g, l = shapes[n]
                assert g == l and g[1] in (4, 1), (n, g, l)
        assert r["engine_reshards"] == {}
        # what the training steps communicated: all-reduces only (never an all-gather), of
        # vectors / scalars, the vocabulary-parallel loss's [targets, 1 or 2] and [tokens, H]
        # activations (LoRA: [tokens, r = 4]); no 2-D
        # tensor with an expert-width axis (a gate/up weight or its slice, [H, I] / [H, I/2])
        H = shapes[f"model.layers.1.{block}.gate.weight"][0][0]
        assert r["comm"] and all(op.startswith("all_reduce") for op, _ in r["comm"]), r["comm"][:5]
        assert all(len(s) < 2 or s[-1] in (H, 4, 2, 1) for _, s in r["comm"]), sorted({tuple(s) for _, s in r["comm"]})


def test_layout_checks():
    """check_layout names the expert widths it cannot split; TP with EP is refused."""
    import dataclasses

    from paddletune.models import load_config, resolve_model_path
    from paddletune.parallel.plan import check_layout

    spec, cfg = load_config(resolve_model_path("paddletune/tiny-mixtral"))
    check_layout(spec, cfg, 2)
    bad = dataclasses.replace(cfg, moe=dict(cfg.moe, expert_size=63), intermediate_size=63)
    with pytest.raises(ValueError, match=r"intermediate_size \(63.*tensor_parallel_degree \(2\)"):
        check_layout(spec, bad, 2)
    spec, cfg = load_config(resolve_model_path("paddletune/tiny-qwen2moe"))
    check_layout(spec, cfg, 2)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(65"):
        check_layout(spec, dataclasses.replace(cfg, moe=dict(cfg.moe, expert_size=65)), 2)
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size \(129"):
        check_layout(spec, dataclasses.replace(cfg, moe=dict(cfg.moe, shared_size=129)), 2)

    class TPEP:
        tp_degree, pp_degree, ep_degree = 2, 1, 2
    from paddletune.loading import load_model
    with pytest.raises(ValueError, match="tensor_parallel_degree 2 with expert_parallel_degree 2"):
        load_model("paddletune/tiny-mixtral", topology=TPEP())
