"""Every model family under tensor parallelism TP=2 equals one process (ONE 2-rank launch for all
families): 3 logged losses (full fine-tuning; LoRA for the fused-attention families too), eval
loss and accuracy, trained tensors. The split is asserted per family: local shapes are half the
global ones along the plan's axis; GPT-2's fused c_attn holds [q_r | k_r | v_r] (each part cut by
heads) and Bloom's per-head interleaved query_key_value whole heads; each rank's ALiBi slopes are
those of its own heads."""
import os
import sys

import numpy as np
import pytest

from conftest import ROOT, launch_cases
from family_util import hf_family
from paddletune.models.hf import SafetensorsFile

sys.path.insert(0, os.path.join(ROOT, "tests"))

STEPS = {"steps": 3, "micro": 4, "accum": 1}
CASES = {   # name -> (checkpoint kind, train_case kwargs)
    "qwen3_sft": ("qwen3", {}),
    "gpt2_sft": ("gpt2", {}),
    "gpt2_lora": ("gpt2", {"method": "lora", "lr": 2e-2}),
    "opt_sft": ("opt", {}),
    "bloom_sft": ("bloom", {}),
    "bloom_lora": ("bloom", {"method": "lora", "lr": 2e-2}),
    "baichuan2_7b_sft": ("baichuan", {}),
    "baichuan2_13b_alibi_lora": ("baichuan13b", {"method": "lora", "lr": 2e-2}),
    "qwen_sft": ("qwen", {}),
    "chatglm6b_sft": ("chatglm6b", {}),
}
TARGET = {"chatglm6b": "family_tp_cases:train_glm6b"}   # its own data layout ([gMASK], sop)
# a weight per family: (name, axis split, global shape)
HALVED = {
    "qwen3": [("model.layers.0.self_attn.q_proj.weight", 1), ("model.layers.0.mlp.down_proj.weight", 0),
              ("model.embed_tokens.weight", 0)],
    "gpt2": [("transformer.h.0.attn.c_attn.weight", 1), ("transformer.h.0.attn.c_proj.weight", 0),
             ("transformer.h.0.mlp.c_fc.weight", 1), ("transformer.wte.weight", 0)],
    "opt": [("model.decoder.layers.0.self_attn.k_proj.weight", 1),
            ("model.decoder.layers.0.fc2.weight", 0), ("model.decoder.embed_tokens.weight", 0)],
    "bloom": [("transformer.h.0.self_attention.query_key_value.weight", 1),
              ("transformer.h.0.mlp.dense_4h_to_h.weight", 0), ("transformer.word_embeddings.weight", 0)],
    "baichuan": [("model.layers.0.self_attn.W_pack.weight", 1), ("lm_head.weight", 1),
                 ("model.layers.0.self_attn.o_proj.weight", 0)],
    "qwen": [("transformer.h.0.attn.c_attn.weight", 1), ("transformer.h.0.mlp.w2.weight", 1),
             ("transformer.h.0.mlp.c_proj.weight", 0), ("lm_head.weight", 1)],
    "chatglm6b": [("transformer.layers.0.attention.query_key_value.weight", 1),
                  ("transformer.layers.0.attention.dense.weight", 0), ("lm_head.weight", 1)],
}
HALVED["baichuan13b"] = HALVED["baichuan"]
FUSED = {"gpt2": ["transformer.h.1.attn.c_attn.weight", "transformer.h.1.attn.c_attn.bias"],
         "baichuan13b": ["model.layers.1.self_attn.W_pack.weight"],
         "bloom": ["transformer.h.1.self_attention.query_key_value.weight",
                   "transformer.h.1.self_attention.query_key_value.bias"]}


def _checkpoints(base):
    from paddletune.models.tiny import make_tiny_checkpoint

    out = {kind: hf_family(base / f"ck_{kind}", kind, seed=i)[0]
           for i, kind in enumerate(("qwen3", "gpt2", "opt", "bloom"))}
    for seed, (kind, mt, extra) in enumerate((("baichuan", "baichuan", {}),
                                              ("baichuan13b", "baichuan", {"position_embedding": "alibi"}),
                                              ("qwen", "qwen", {}),
                                              ("chatglm6b", "chatglm6b", {"bos_token_id": 5, "eos_token_id": 6}))):
        out[kind] = make_tiny_checkpoint(str(base / f"ck_{kind}"), mt, seed=10 + seed, **extra)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tp_cases import train_case

    base = tmp_path_factory.mktemp("families_tp")
    cks = _checkpoints(base)
    cases = [(name, TARGET.get(kind, "tp_cases:train_case"), dict(STEPS, **kw, ckpt=cks[kind],
                                                 out_dir=str(base / name / "tp2"), tp=2, eval_n=4))
             for name, (kind, kw) in CASES.items()]
    cases += [(f"held_{kind}", "family_tp_cases:held_slices", {"ckpt": cks[kind], "names": names})
              for kind, names in FUSED.items()]
    got = launch_cases(cases, base, nproc=2, timeout=900)
    from family_tp_cases import train_glm6b

    ref = {name: (train_glm6b if kind in TARGET else train_case)(
        ckpt=cks[kind], out_dir=str(base / name / "single"), eval_n=4, **STEPS, **kw)
        for name, (kind, kw) in CASES.items()}
    return base, cks, got, ref


def _tensors(path):
    st = SafetensorsFile(str(path))
    return {k: st.get(k) for k in st.keys()}


@pytest.mark.parametrize("name", list(CASES))
def test_family_tp2_equals_one_process(runs, name):
    base, _, got, ref = runs
    r0, r1 = got[name]
    single = ref[name]
    assert r0["losses"] == r1["losses"] and len(r0["losses"]) == 3
    np.testing.assert_allclose(r0["losses"], single["losses"], rtol=1e-5, atol=0)
    assert abs(r0["eval"]["loss"] - single["eval"]["loss"]) <= 1e-5 * abs(single["eval"]["loss"])
    assert r0["eval"]["accuracy"] == single["eval"]["accuracy"]
    tp, one = (_tensors(base / name / r / "trained.safetensors") for r in ("tp2", "single"))
    start = _tensors(base / name / "single" / "initial.safetensors")
    update = max(np.abs(one[k] - start[k]).max() for k in one)
    worst = max(np.abs(tp[k] - one[k]).max() for k in one)
    assert update > 0 and worst <= 1e-4 * update, (worst, update)
    kind = CASES[name][0]
    for pname, axis in HALVED[kind]:        # the split is real: half along the plan's axis
        if pname not in r0["shapes"]:       # under LoRA: the wrapped base layer
            pname = pname.replace(".weight", ".base_layer.weight")
        for r in (r0, r1):
            g, l = r["shapes"][pname]
            assert l[axis] * 2 == g[axis] and l[1 - axis] == g[1 - axis], (pname, g, l)
    assert r0["eval_logits_width"] == 300 and single["eval_logits_width"] == 600
    assert r0["engine_reshards"] == {} and r1["engine_reshards"] == {}


def test_fused_attention_slices_and_alibi_slopes(runs):
    """GPT-2's c_attn [H, 3H] (paddle layout = the checkpoint's Conv1D layout): rank r holds
    columns [q heads of r | k heads of r | v heads of r]. Bloom's query_key_value (HF [3H, H],
    rows per head [q, k, v]): rank r holds the rows of heads 2r, 2r+1, whole; its first head
    (head_offset) is 2r and its attention's ALiBi slopes are layers.alibi_slopes(4)[2r:2r+2]."""
    from paddletune.models.hf import CheckpointReader
    from paddletune.models.layers import alibi_slopes

    base, cks, got, _ = runs
    H, N, D = 64, 4, 16
    gpt = CheckpointReader(cks["gpt2"])
    w, b = gpt.get("transformer.h.1.attn.c_attn.weight"), gpt.get("transformer.h.1.attn.c_attn.bias")
    assert list(w.shape) == [H, 3 * H]      # Conv1D: [in, out] in the checkpoint too
    for r, res in enumerate(got["held_gpt2"]):
        cols = np.concatenate([np.arange(p * H + r * H // 2, p * H + (r + 1) * H // 2) for p in range(3)])
        np.testing.assert_array_equal(np.array(res["local"]["transformer.h.1.attn.c_attn.weight"], np.float32), w[:, cols])
        np.testing.assert_array_equal(np.array(res["local"]["transformer.h.1.attn.c_attn.bias"], np.float32), b[cols])
    bl = CheckpointReader(cks["bloom"])
    w = bl.get("transformer.h.1.self_attention.query_key_value.weight")       # HF [3H, H]
    for r, res in enumerate(got["held_bloom"]):
        rows = np.arange(r * 3 * H // 2, (r + 1) * 3 * H // 2)               # heads 2r, 2r+1 whole
        np.testing.assert_array_equal(np.array(res["local"]["transformer.h.1.self_attention.query_key_value.weight"], np.float32),
                                      w[rows].T)
        assert set(res["offsets"].values()) == {2 * r}
        assert res["slopes"] and all(np.allclose(s, alibi_slopes(N)[2 * r:2 * r + 2]) for s in res["slopes"].values())
        assert len(res["slopes"]) == 2      # every block's attention
    # Baichuan2-13B: W_pack (HF [3H, H]) = [q | k | v] rows, each part cut by heads, ALiBi slopes
    # of the rank's heads
    bc = CheckpointReader(cks["baichuan13b"])
    w = bc.get("model.layers.1.self_attn.W_pack.weight")
    for r, res in enumerate(got["held_baichuan13b"]):
        rows = np.concatenate([np.arange(p * H + r * H // 2, p * H + (r + 1) * H // 2) for p in range(3)])
        np.testing.assert_array_equal(np.array(res["local"]["model.layers.1.self_attn.W_pack.weight"], np.float32),
                                      w[rows].T)
        assert set(res["offsets"].values()) == {2 * r}
        assert len(res["slopes"]) == 2 and all(np.allclose(s, alibi_slopes(N)[2 * r:2 * r + 2])
                                               for s in res["slopes"].values())
    assert D * N == H
