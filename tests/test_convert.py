"""tools/convert_checkpoint.py: pickled checkpoints written here by torch and by paddle are
converted and compared with independent references (transformers' GLM logits, the files
transformers itself wrote, PEFT's LoRA forward, the exact source parameters)."""
import json
import os

import numpy as np
import paddle
import pytest
import torch

from conftest import load_script, rel_err, run_script
from test_chatglm2 import VOCAB, glm_checkpoint

from paddletune.models import build_model, get_spec, hf
from paddletune.loading import load_model
from paddletune.models.hf import SafetensorsFile

convert = load_script("tools/convert_checkpoint.py")


def thudm_bin_dir(src_dir, out_dir, shards=2, dtype=torch.float32, code=None):
    """Re-save a safetensors checkpoint dir as torch pytorch_model-*.bin shards + index."""
    os.makedirs(out_dir, exist_ok=True)
    st = SafetensorsFile(os.path.join(src_dir, "model.safetensors"))
    names = st.keys()
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fn = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({n: torch.tensor(st.get(n)).to(dtype) for n in part}, os.path.join(out_dir, fn))
        weight_map.update({n: fn for n in part})
    with open(os.path.join(out_dir, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    for name in ("config.json",):
        with open(os.path.join(src_dir, name)) as a, open(os.path.join(out_dir, name), "w") as b:
            b.write(a.read())
    with open(os.path.join(out_dir, "tokenization_chatglm.py"), "w") as f:
        f.write("# remote code is copied, never run\n")
    if code is not None:
        with open(os.path.join(out_dir, "modeling_chatglm.py"), "w") as f:
            f.write(code)
    return str(out_dir)


def test_thudm_bin_shards_convert_and_match_transformers(tmp_path):
    src, ref_model = glm_checkpoint(tmp_path / "glm")
    bin_dir = thudm_bin_dir(src, tmp_path / "thudm")
    out = str(tmp_path / "out")
    assert convert.main(["--input", bin_dir, "--output", out, "--max_shard_size", "60KB"]) == 0
    files = sorted(os.listdir(out))
    assert not any(f.endswith(".bin") for f in files)
    assert "tokenization_chatglm.py" in files and "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    ids = np.random.default_rng(0).integers(3, VOCAB, (2, 20))
    got = load_model(out)(paddle.to_tensor(ids)).logits.numpy()
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids)).logits.numpy()
    assert rel_err(got, ref) <= 1e-4


@pytest.mark.parametrize("code, mode", [("base = base * self.rope_ratio\n", "base"),
                                        ("seq_idx = torch.arange(n) / self.rope_ratio\n", "position")])
def test_bf16_bin_keeps_dtype_and_reads_rope_mode_from_code(tmp_path, code, mode):
    src, _ = glm_checkpoint(tmp_path / "glm", rope_ratio=4, rope_ratio_mode="base")
    conf = json.load(open(os.path.join(src, "config.json")))
    del conf["rope_ratio_mode"]          # as THUDM ships it: the meaning is only in the code
    json.dump(conf, open(os.path.join(src, "config.json"), "w"))
    bin_dir = thudm_bin_dir(src, tmp_path / "thudm", shards=1, dtype=torch.bfloat16, code=code)
    out = str(tmp_path / "out")
    assert convert.main(["--input", bin_dir, "--output", out]) == 0
    assert json.load(open(os.path.join(out, "config.json")))["rope_ratio_mode"] == mode
    st, sv = SafetensorsFile(os.path.join(out, "model.safetensors")), SafetensorsFile(os.path.join(src, "model.safetensors"))
    name = "transformer.encoder.layers.0.self_attention.query_key_value.weight"
    assert st.dtype(name) == "BF16"
    want = torch.tensor(sv.get(name)).bfloat16().float().numpy()
    np.testing.assert_array_equal(st.get(name), want)


def paddlenlp_state(model, old, new):
    """Our parameters renamed to PaddleNLP's names (paddle [in, out] layout, as PaddleNLP holds)."""
    return {(new + n[len(old):] if n.startswith(old) else n): paddle.to_tensor(p.numpy())
            for n, p in model.named_parameters()}


def test_paddlenlp_chatglm2_pdparams_roundtrip(tmp_path):
    """Older PaddleNLP layout: THUDM's fused query_key_value and dense_h_to_4h halves."""
    spec = get_spec("chatglm")
    cfg = dict(spec.tiny_config, padded_vocab_size=96)
    model = build_model(cfg, seed=3)
    src = tmp_path / "pnlp"
    os.makedirs(src)
    state = paddlenlp_state(model, "transformer.", "chatglm_v2.")
    assert "chatglm_v2.encoder.layers.0.self_attention.query_key_value.weight" in state
    paddle.save(state, str(src / "model_state.pdparams"))
    json.dump(dict(cfg, model_type="chatglm_v2", architectures=["ChatGLMv2ForCausalLM"],
                   dtype="float32"), open(src / "config.json", "w"))
    out = str(tmp_path / "out")
    assert convert.main(["--input", str(src), "--output", out, "--paddlenlp_mlp", "halves"]) == 0
    conf = json.load(open(os.path.join(out, "config.json")))
    assert conf["model_type"] == "chatglm" and conf["architectures"] == ["ChatGLMModel"]
    st = SafetensorsFile(os.path.join(out, "model.safetensors"))
    qkv = "transformer.encoder.layers.1.self_attention.query_key_value.weight"
    assert st.shape(qkv) == [(4 + 2 * 2) * 16, 64]      # HF [out, in]
    back = dict(load_model(out).named_parameters())
    for n, p in model.named_parameters():
        np.testing.assert_array_equal(back[n].numpy(), p.numpy())


def test_paddlenlp_tensor_parallel_chatglm2_layout(tmp_path):
    """PaddleNLP's tensor-parallel ChatGLM2 layout, written here by paddle as safetensors (its
    unified checkpoint) and as .pdparams: separate query [H, N*D], key/value [H, G*D], and an
    MLP that computes silu(y[..., 0::2]) * y[..., 1::2] with y = x @ dense_h_to_4h. The
    converted model's MLP output must equal that rule evaluated on the PaddleNLP weights, and
    its fused query_key_value must be [query | key | value]."""
    from safetensors.numpy import save_file

    cfg = dict(get_spec("chatglm").tiny_config, padded_vocab_size=96)
    rng = np.random.default_rng(7)
    H, F, N, G, D = 64, cfg["ffn_hidden_size"], 4, 2, 16
    state = {}
    for n, p in build_model(cfg, seed=5).named_parameters():
        n = n.replace("transformer.", "chatglm_v2.")
        if "query_key_value" in n:
            arr = rng.standard_normal(p.shape).astype(np.float32) * 0.1
            for part, (a, b) in zip(("query", "key", "value"),
                                    ((0, N * D), (N * D, (N + G) * D), ((N + G) * D, (N + 2 * G) * D))):
                state[n.replace("query_key_value", part)] = arr[..., a:b]
        else:
            state[n] = rng.standard_normal(p.shape).astype(np.float32) * 0.1
    for fmt in ("safetensors", "pdparams"):
        src = tmp_path / f"tp-{fmt}"
        os.makedirs(src)
        if fmt == "safetensors":
            save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(src / "model.safetensors"))
        else:
            paddle.save({k: paddle.to_tensor(v) for k, v in state.items()}, str(src / "model_state.pdparams"))
        json.dump(dict(cfg, model_type="chatglm_v2"), open(src / "config.json", "w"))
        out = str(tmp_path / f"out-{fmt}")
        assert convert.main(["--input", str(src), "--output", out]) == 0
        model = load_model(out)
        blk = model.transformer.encoder.layers[1]
        pre = "chatglm_v2.encoder.layers.1."
        qkv = np.concatenate([state[pre + f"self_attention.{p}.weight"] for p in ("query", "key", "value")], 1)
        np.testing.assert_array_equal(blk.self_attention.query_key_value.weight.numpy(), qkv)
        x = rng.standard_normal((3, H)).astype(np.float32)
        y = x @ state[pre + "mlp.dense_h_to_4h.weight"]
        silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
        ref = (silu(y[:, 0::2]) * y[:, 1::2]) @ state[pre + "mlp.dense_4h_to_h.weight"]
        got = blk.mlp(paddle.to_tensor(x)).numpy()
        assert rel_err(got, ref) <= 1e-5


def test_paddlenlp_llama_pdparams_equal_the_transformers_files(tiny_llama, tmp_path):
    """transformers wrote tiny_llama; PaddleNLP's copy (llama.* names, [in, out]) converts back to
    exactly the tensors transformers wrote."""
    model = load_model(tiny_llama)
    src = tmp_path / "pnlp"
    os.makedirs(src)
    paddle.save(paddlenlp_state(model, "model.", "llama."), str(src / "model_state.pdparams"))
    conf = json.load(open(os.path.join(tiny_llama, "config.json")))
    json.dump(conf, open(src / "config.json", "w"))
    out = str(tmp_path / "out")
    assert convert.main(["--input", str(src), "--output", out]) == 0
    ref = hf.CheckpointReader(tiny_llama)
    got = hf.CheckpointReader(out)
    assert sorted(got.keys()) == sorted(ref.keys())
    for name in ref.keys():
        np.testing.assert_array_equal(got.get(name), ref.get(name))


def test_paddlenlp_lora_to_peft_matches_merged_weights(tiny_llama, tmp_path):
    """PEFT loads the converted adapter on transformers' Llama; its logits must equal the base
    model with W += alpha/r · (A_p B_p)^T merged by hand (A_p [in, r], B_p [r, out] as PaddleNLP
    stores them)."""
    import transformers
    from peft import PeftModel

    r, alpha = 4, 16
    rng = np.random.default_rng(0)
    src = tmp_path / "lora"
    os.makedirs(src)
    state, merged = {}, {}
    for i in range(2):
        for proj, out_dim in (("q_proj", 64), ("v_proj", 32)):
            a = rng.standard_normal((64, r)).astype(np.float32) * 0.1
            b = rng.standard_normal((r, out_dim)).astype(np.float32) * 0.1
            base = f"llama.layers.{i}.self_attn.{proj}"
            state[base + ".lora_A"], state[base + ".lora_B"] = paddle.to_tensor(a), paddle.to_tensor(b)
            merged[f"model.layers.{i}.self_attn.{proj}.weight"] = (alpha / r) * (a @ b).T
    paddle.save(state, str(src / "lora_model_state.pdparams"))
    json.dump({"r": r, "lora_alpha": alpha, "lora_dropout": 0.0, "rslora": False,
               "target_modules": [".*q_proj.*", ".*v_proj.*"], "merge_weights": False,
               "base_model_name_or_path": "tiny"}, open(src / "lora_config.json", "w"))
    out = str(tmp_path / "adapter")
    assert convert.main(["--input", str(src), "--output", out]) == 0
    conf = json.load(open(os.path.join(out, "adapter_config.json")))
    assert conf["target_modules"][0] == "model.layers.0.self_attn.q_proj" and conf["r"] == r

    ids = torch.tensor(rng.integers(3, 600, (2, 12)))
    base = transformers.LlamaForCausalLM.from_pretrained(tiny_llama).eval()
    with torch.no_grad():
        for n, p in base.named_parameters():
            if n in merged:
                p += torch.tensor(merged[n])
        ref = base(ids).logits.numpy()
    peft_model = PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(tiny_llama), out).eval()
    with torch.no_grad():
        got = peft_model(ids).logits.numpy()
    assert rel_err(got, ref) <= 1e-5
    with torch.no_grad():   # and the adapter really changes the model
        plain = transformers.LlamaForCausalLM.from_pretrained(tiny_llama).eval()(ids).logits.numpy()
    assert rel_err(plain, ref) > 1e-3


def test_chatglm_lora_names_and_mlp_columns(tmp_path):
    """ChatGLM2 LoRA: names to THUDM's; dense_h_to_4h's lora_B columns from PaddleNLP's
    interleaved order [a0 b0 a1 b1 ...] to THUDM's halves [a0 a1 ... | b0 b1 ...]."""
    src = tmp_path / "lora"
    os.makedirs(src)
    q = "chatglm_v2.encoder.layers.0.self_attention.query_key_value"
    h4 = "chatglm_v2.encoder.layers.1.mlp.dense_h_to_4h"
    a, b = np.ones((64, 2), np.float32), np.full((2, 128), 2.0, np.float32)
    b4 = np.arange(2 * 8, dtype=np.float32).reshape(2, 8)       # columns 0..7 in row 0
    paddle.save({q + ".lora_A": paddle.to_tensor(a), q + ".lora_B": paddle.to_tensor(b),
                 h4 + ".lora_A": paddle.to_tensor(a), h4 + ".lora_B": paddle.to_tensor(b4)},
                str(src / "lora_model_state.pdparams"))
    json.dump({"r": 2, "lora_alpha": 4}, open(src / "lora_config.json", "w"))
    out = str(tmp_path / "out")
    assert convert.main(["--input", str(src), "--output", out]) == 0
    st = SafetensorsFile(os.path.join(out, "adapter_model.safetensors"))
    m = "base_model.model.transformer.encoder.layers.0.self_attention.query_key_value"
    m4 = "base_model.model.transformer.encoder.layers.1.mlp.dense_h_to_4h"
    assert sorted(st.keys()) == sorted([m + ".lora_A.weight", m + ".lora_B.weight",
                                        m4 + ".lora_A.weight", m4 + ".lora_B.weight"])
    assert st.shape(m + ".lora_A.weight") == [2, 64] and st.shape(m + ".lora_B.weight") == [128, 2]
    assert st.get(m4 + ".lora_B.weight")[:, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_errors_are_clear_and_write_nothing(tmp_path, capsys):
    empty = tmp_path / "empty"
    os.makedirs(empty)
    (empty / "README.md").write_text("x")
    assert convert.main(["--input", str(empty), "--output", str(tmp_path / "o1")]) == 2
    assert "no pytorch_model*.bin" in capsys.readouterr().err and not os.path.exists(tmp_path / "o1")

    src, _ = glm_checkpoint(tmp_path / "glm", rope_ratio=4, rope_ratio_mode="base")
    conf = json.load(open(os.path.join(src, "config.json")))
    del conf["rope_ratio_mode"]
    json.dump(conf, open(os.path.join(src, "config.json"), "w"))
    bin_dir = thudm_bin_dir(src, tmp_path / "thudm", shards=1)
    assert convert.main(["--input", bin_dir, "--output", str(tmp_path / "o2")]) == 2
    assert "--rope_ratio_mode" in capsys.readouterr().err and not os.path.exists(tmp_path / "o2")

    busy = tmp_path / "busy"
    os.makedirs(busy)
    (busy / "keep.txt").write_text("mine")
    assert convert.main(["--input", bin_dir, "--output", str(busy), "--rope_ratio_mode", "base"]) == 2
    assert "--overwrite" in capsys.readouterr().err and os.listdir(busy) == ["keep.txt"]

    lora = tmp_path / "lora"
    os.makedirs(lora)
    paddle.save({"llama.layers.0.self_attn.q_proj.weight": paddle.zeros([2, 2])},
                str(lora / "lora_model_state.pdparams"))
    json.dump({"r": 2}, open(lora / "lora_config.json", "w"))
    assert convert.main(["--input", str(lora), "--output", str(tmp_path / "o3")]) == 2
    assert "not a lora_A/lora_B" in capsys.readouterr().err and not os.path.exists(tmp_path / "o3")

    paddle.save({"chatglm_v2.encoder.layers.0.self_attention.query.lora_A": paddle.zeros([4, 2])},
                str(lora / "lora_model_state.pdparams"))
    assert convert.main(["--input", str(lora), "--output", str(tmp_path / "o4")]) == 2
    assert "separate query/key/value" in capsys.readouterr().err

    assert convert.main(["--input", src, "--output", str(tmp_path / "o5")]) == 2
    assert "already holds Hugging Face safetensors" in capsys.readouterr().err


def test_command_line_warns_about_pickle(tmp_path):
    src, _ = glm_checkpoint(tmp_path / "glm")
    bin_dir = thudm_bin_dir(src, tmp_path / "thudm", shards=1)
    res = run_script(["tools/convert_checkpoint.py", "--input", bin_dir, "--output", str(tmp_path / "o")])
    assert res.returncode == 0, res.stderr
    assert "pickle file(s) with torch.load(weights_only=True) (tensors and plain containers only)" in res.stderr
    assert os.path.exists(tmp_path / "o" / "model.safetensors")
