"""ChatGLM2/3 model against transformers' GLM (GlmForCausalLM), which has the same architecture:
partial (half-head) interleaved rotary, grouped KV heads, q/k/v bias, fused gate|up SwiGLU.

The oracle checkpoint is a random GLM built by transformers; its weights are renamed and fused
into THUDM's ChatGLM2 layout here (query_key_value = [q; k; v] rows, dense_h_to_4h = gate_up_proj)
and written with safetensors' own numpy writer. Differences found (tested around, see
test_rope_ratio_modes): ChatGLM's rope base is fixed at 10000 and `rope_ratio` scales either the
base (ChatGLM3) or the positions (ChatGLM2-32K); GLM has `rope_theta` and linear rope scaling
instead. GLM's o_proj never has a bias; ChatGLM's `dense` has one only with add_bias_linear
(False in every released ChatGLM2/3), so the oracle covers add_bias_linear=False only.
"""
import json
import os

import numpy as np
import paddle
import pytest
import torch
import transformers
from safetensors.numpy import save_file

from conftest import copy_pairs, rel_err, token_accuracy, training_args

from paddletune.models import build_model, get_spec, save_pretrained
from paddletune.loading import load_model
from paddletune.models.cache import KVCache
from paddletune.models.chatglm2 import ChatGLM2Config
from paddletune.models.hf import SafetensorsFile

VOCAB = 160


def glm_to_thudm(sd, num_layers):
    """transformers GLM state dict (numpy, [out, in]) -> THUDM ChatGLM2 names and fusions."""
    T = "transformer."
    out = {T + "embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           T + "encoder.final_layernorm.weight": sd["model.norm.weight"],
           T + "output_layer.weight": sd["lm_head.weight"],
           T + "rotary_pos_emb.inv_freq": np.ones(4, np.float32)}  # THUDM ships a dead buffer
    for i in range(num_layers):
        s, d = f"model.layers.{i}.", f"{T}encoder.layers.{i}."
        out[d + "input_layernorm.weight"] = sd[s + "input_layernorm.weight"]
        out[d + "post_attention_layernorm.weight"] = sd[s + "post_attention_layernorm.weight"]
        for t in ("weight", "bias"):
            out[d + f"self_attention.query_key_value.{t}"] = np.concatenate(
                [sd[s + f"self_attn.{p}_proj.{t}"] for p in "qkv"], 0)
        out[d + "self_attention.dense.weight"] = sd[s + "self_attn.o_proj.weight"]
        out[d + "mlp.dense_h_to_4h.weight"] = sd[s + "mlp.gate_up_proj.weight"]
        out[d + "mlp.dense_4h_to_h.weight"] = sd[s + "mlp.down_proj.weight"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def glm_checkpoint(path, heads=4, kv_heads=2, rope_theta=10000.0, rope_scaling=None, seed=0,
                   **thudm):
    """Random GLM (oracle) and the same weights as a THUDM-layout checkpoint dir at `path`.
    Norm weights and biases are randomised too, so a dropped or misplaced one shows."""
    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": 0.5}
    rope.update(rope_scaling or {})
    cfg = transformers.GlmConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=heads,
                                 num_key_value_heads=kv_heads, head_dim=16, rms_norm_eps=1e-5,
                                 attention_bias=True, max_position_embeddings=512,
                                 rope_parameters=rope, pad_token_id=0, eos_token_id=2)
    model = transformers.GlmForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in n:
                p.normal_(1.0, 0.2)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    os.makedirs(path, exist_ok=True)
    save_file(glm_to_thudm(sd, 2), os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    conf = dict(model_type="chatglm", architectures=["ChatGLMModel"],
                auto_map={"AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration"},
                num_layers=2, hidden_size=64, ffn_hidden_size=96, kv_channels=16,
                num_attention_heads=heads, multi_query_attention=kv_heads != heads,
                multi_query_group_num=kv_heads, layernorm_epsilon=1e-5, add_qkv_bias=True,
                add_bias_linear=False, rmsnorm=True, apply_residual_connection_post_layernorm=False,
                post_layer_norm=True, padded_vocab_size=VOCAB, seq_length=512, original_rope=True,
                torch_dtype="float32", eos_token_id=2, pad_token_id=0)
    conf.update(thudm)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(conf, f)
    return str(path), model


def ours_and_ref(model, torch_model, ids, mask=None):
    got = model(paddle.to_tensor(ids), attention_mask=None if mask is None else paddle.to_tensor(mask)).logits.numpy()
    with torch.no_grad():
        ref = torch_model(torch.tensor(ids), attention_mask=None if mask is None else torch.tensor(mask)).logits.numpy()
    return got, ref


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return glm_checkpoint(tmp_path_factory.mktemp("glm"))


def test_logits_match_transformers_glm(glm):
    path, ref_model = glm
    model = load_model(path)
    assert type(model).__name__ == "ChatGLM2ForCausalLM"
    ids = np.random.default_rng(0).integers(3, VOCAB, (2, 24))
    got, ref = ours_and_ref(model, ref_model, ids)
    assert got.shape == (2, 24, VOCAB)
    assert rel_err(got, ref) <= 1e-4
    # left padding (ChatGLM's padding side): compare the real positions
    mask = np.ones_like(ids)
    mask[1, :5] = 0
    got, ref = ours_and_ref(model, ref_model, ids, mask)
    assert rel_err(got[0], ref[0]) <= 1e-4 and rel_err(got[1, 5:], ref[1, 5:]) <= 1e-4


def test_multi_head_attention_without_mqa(tmp_path):
    path, ref_model = glm_checkpoint(tmp_path / "mha", heads=4, kv_heads=4, seed=1)
    model = load_model(path)
    assert model.config.multi_query_group_num == 4
    ids = np.random.default_rng(1).integers(3, VOCAB, (1, 16))
    got, ref = ours_and_ref(model, ref_model, ids)
    assert rel_err(got, ref) <= 1e-4


def test_rope_ratio_modes(tmp_path):
    """rope_ratio=50 'base' = GLM with rope_theta 500000; rope_ratio=16 'position' = GLM with
    linear scaling factor 16. Long enough inputs that the modes give different logits."""
    ids = np.random.default_rng(2).integers(3, VOCAB, (1, 96))
    outs = {}
    for name, kw, ours in (("base", dict(rope_theta=500000.0), dict(rope_ratio=50, rope_ratio_mode="base")),
                           ("position", dict(rope_scaling={"rope_type": "linear", "factor": 16.0}),
                            dict(rope_ratio=16, rope_ratio_mode="position")),
                           ("plain", {}, {})):
        path, ref_model = glm_checkpoint(tmp_path / name, seed=3, **kw, **ours)
        got, ref = ours_and_ref(load_model(path), ref_model, ids)
        assert rel_err(got, ref) <= 1e-4, name
        outs[name] = got
    assert rel_err(outs["base"], outs["plain"]) > 1e-3
    assert rel_err(outs["position"], outs["plain"]) > 1e-3


def test_kv_cache_decoding_matches_full_forward(glm):
    """Prefill 7 tokens, then 5 single-token steps through KVCache: each step's logits equal
    transformers' logits of the full sequence at that position."""
    path, ref_model = glm
    model = load_model(path)
    ids = np.random.default_rng(4).integers(3, VOCAB, (2, 12))
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids)).logits.numpy()
    cache = KVCache.for_model(model, batch_size=2, max_length=12)
    assert cache.keys[0].shape == [2, 2, 12, 16]       # [B, multi_query_group_num, T, kv_channels]
    with paddle.no_grad():
        steps = [model(paddle.to_tensor(ids[:, :7]), cache=cache).logits.numpy()]
        for t in range(7, 12):
            steps.append(model(paddle.to_tensor(ids[:, t:t + 1]), cache=cache).logits.numpy())
    assert rel_err(np.concatenate(steps, 1), ref) <= 1e-4


def test_save_writes_thudm_names_and_layout(glm, tmp_path):
    path, ref_model = glm
    model = load_model(path)
    out = save_pretrained(model, str(tmp_path / "saved"))
    st = SafetensorsFile(os.path.join(out, "model.safetensors"))
    src = SafetensorsFile(os.path.join(path, "model.safetensors"))
    want = sorted(k for k in src.keys() if not k.endswith("inv_freq"))
    assert sorted(st.keys()) == want
    for name in ("transformer.encoder.layers.1.self_attention.query_key_value.weight",   # [(N+2G)D, H]
                 "transformer.encoder.layers.0.mlp.dense_h_to_4h.weight",
                 "transformer.output_layer.weight", "transformer.embedding.word_embeddings.weight"):
        assert st.shape(name) == src.shape(name)
        np.testing.assert_array_equal(st.get(name), src.get(name))
    conf = json.load(open(os.path.join(out, "config.json")))
    assert conf["model_type"] == "chatglm" and conf["architectures"] == ["ChatGLMModel"]
    assert conf["padded_vocab_size"] == VOCAB and conf["multi_query_group_num"] == 2
    assert conf["auto_map"]["AutoModel"].startswith("modeling_chatglm")
    ids = np.random.default_rng(5).integers(3, VOCAB, (1, 10))
    np.testing.assert_array_equal(load_model(out)(paddle.to_tensor(ids)).logits.numpy(),
                                  model(paddle.to_tensor(ids)).logits.numpy())


@pytest.mark.parametrize("change, words", [
    ({"position_encoding_2d": True}, "ChatGLM-6B (v1"),
    ({"rope_ratio": 50}, "rope_ratio_mode"),
    ({"rmsnorm": False}, "'rmsnorm: False' is not supported"),
    ({"multi_query_group_num": 3}, "multiple of multi_query_group_num"),
    ({"quantization_bit": 4}, "quantization_bit=4"),
    ({"kv_channels": 18}, "multiple of 4"),
])
def test_config_errors_name_the_key(change, words):
    d = dict(get_spec("chatglm").tiny_config, padded_vocab_size=64)
    d.update(change)
    with pytest.raises(ValueError) as e:
        ChatGLM2Config.from_dict(d)
    assert words in str(e.value)


def test_spec_facts_match_the_module_tree():
    spec = get_spec("chatglm")
    model = build_model(dict(spec.tiny_config, padded_vocab_size=64), seed=0)
    import re
    linears = [n for n, m in model.named_sublayers() if isinstance(m, paddle.nn.Linear)]
    hit = [n for n in linears if any(re.match(p, n) for p in spec.lora_targets)]
    assert len(hit) == 4 * 2 and "transformer.output_layer" not in hit   # 4 Linears per block
    assert all(any(n.endswith("." + k) for k in spec.tp_plan) for n in linears)
    cfg = model.config
    parts = {k: [w for w, _ in v] for k, v in spec.tp_parts(cfg).items()}
    blk = model.transformer.encoder.layers[0]
    assert sum(parts["query_key_value"]) == blk.self_attention.query_key_value.weight.shape[1]
    assert sum(parts["dense_h_to_4h"]) == blk.mlp.dense_h_to_4h.weight.shape[1]
    assert spec.prefix_layout(cfg) == (2, 2, 16)


def test_sft_learns_copy_task(tmp_path):
    from paddletune.trainer import Trainer

    cfg = dict(get_spec("chatglm").tiny_config, padded_vocab_size=640)
    model = build_model(cfg, seed=0)
    model.train()
    data = copy_pairs(16, length=8, vocab=600)
    before = token_accuracy(model, data)
    Trainer(model, training_args(tmp_path, max_steps=120), train_dataset=data).train()
    acc = token_accuracy(model, data)
    assert before < 0.1 and acc == 1.0, (before, acc)
