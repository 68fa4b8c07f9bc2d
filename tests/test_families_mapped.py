"""Baichuan2 and Qwen (1): transformers has neither, so the oracle is a transformers checkpoint of
a family it has, mapped into the published layout by transformations that are exact:

- Baichuan2-7B from a Llama (MHA, no bias): W_pack = concat(q_proj, k_proj, v_proj) along the
  output rows (torch [3H, H]) - exact; other names equal. NormHead: our model normalises the
  head rows in every forward, so the Llama oracle gets the row-normalised head W_v / |W_v|
  (a float32 division: exact to rounding) while the Baichuan checkpoint keeps the raw rows.
- Baichuan2-13B (ALiBi, no rotary): no transformers oracle with the same block; the reference is
  the published math written here in torch (RMSNorm, W_pack, scores q·k/sqrt(D) + slope_n · j
  with the slopes computed by hand below, causal mask, SwiGLU, NormHead). ALiBi's attention
  itself is also checked against transformers' Bloom in test_families.py.
- Qwen (1) from a Qwen2 (MHA, q/k/v bias, untied): c_attn = concat(q, k, v) weights and biases
  - exact; w2 = gate_proj (Qwen applies silu to w2), w1 = up_proj, mlp.c_proj = down_proj,
  attn.c_proj = o_proj, ln_1 / ln_2 / ln_f = the RMSNorms, wte = embed_tokens - renames;
  Qwen's intermediate_size is twice the MLP width (config.json convention): 2 x Qwen2's.
All matched to <= 1e-4 (max |d| / max |ref|)."""
import json
import os

import numpy as np
import paddle
import pytest
import torch

from conftest import TINY_TOKENIZER, hf_checkpoint, rel_err
from paddletune.models import hf
from paddletune.loading import load_model
from paddletune.models.cache import KVCache

H, N, L, I = 64, 4, 2, 96


def ids_for(seq, batch=2, seed=0):
    return np.random.RandomState(seed).randint(3, 600, (batch, seq))


def write_mapped(path, config, tensors):
    """A HF-format directory: config.json + model.safetensors (torch layout) + the tiny tokenizer."""
    import shutil

    os.makedirs(path, exist_ok=True)
    hf.write_safetensors(os.path.join(path, "model.safetensors"),
                         {k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(TINY_TOKENIZER):
        shutil.copy(os.path.join(TINY_TOKENIZER, name), os.path.join(path, name))
    return str(path)


def _normalise_rows(w):
    return w / np.linalg.norm(w, axis=1, keepdims=True)


def baichuan_from_llama(tmp_path):
    """(baichuan dir, llama oracle with the row-normalised head)."""
    _, llama = hf_checkpoint(tmp_path / "llama", "llama", tokenizer_dir=None, num_key_value_heads=N,
                             intermediate_size=I, seed=4)
    sd = {k: v.numpy() for k, v in llama.state_dict().items() if not k.endswith("inv_freq")}
    out = {}
    for k, v in sd.items():
        if ".self_attn.k_proj." in k or ".self_attn.v_proj." in k:
            continue
        if ".self_attn.q_proj." in k:
            p = k.replace(".q_proj.weight", "")
            out[p + ".W_pack.weight"] = np.concatenate([sd[p + f".{x}_proj.weight"] for x in "qkv"], 0)
            continue
        out[k] = v
    raw_head = sd["lm_head.weight"] * 3.0 + 0.01        # rows far from unit norm
    out["lm_head.weight"] = raw_head
    with torch.no_grad():
        llama.lm_head.weight.copy_(torch.tensor(_normalise_rows(raw_head)))
    cfg = {"model_type": "baichuan", "architectures": ["BaichuanForCausalLM"], "vocab_size": 600,
           "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": N,
           "max_position_embeddings": 256, "model_max_length": 256, "rms_norm_eps": 1e-6,
           "bos_token_id": 1, "eos_token_id": 2, "norm_head": True}
    return write_mapped(tmp_path / "baichuan", cfg, out), llama


def test_baichuan2_7b_equals_mapped_llama(tmp_path):
    path, llama = baichuan_from_llama(tmp_path)
    ids = ids_for(20)
    with torch.no_grad():
        ref = llama(torch.tensor(ids)).logits.numpy()
    model = load_model(path)
    assert model.config.position_embedding == "rope" and model.config.norm_head
    assert rel_err(model(paddle.to_tensor(ids)).logits.numpy(), ref) <= 1e-4
    # greedy decoding through the KV cache equals the uncached forward's argmax chain
    cache = KVCache.for_model(model, 2, 30)
    logits = model(paddle.to_tensor(ids[:, :10]), cache=cache).logits
    seq = ids[:, :10]
    for _ in range(8):
        nxt = logits[:, -1].argmax(-1).numpy()[:, None]
        seq = np.concatenate([seq, nxt], 1)
        logits = model(paddle.to_tensor(nxt), cache=cache).logits
    with torch.no_grad():
        want = llama.generate(torch.tensor(ids[:, :10]), max_new_tokens=8, do_sample=False,
                              min_new_tokens=8, pad_token_id=0, eos_token_id=None)
    assert np.array_equal(seq, want.numpy())


HAND_SLOPES = {4: [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8],
               6: [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]}   # n=6: 4 + odd of 8


def test_alibi_slopes_by_hand():
    from paddletune.models.layers import alibi_slopes

    for n, want in HAND_SLOPES.items():
        np.testing.assert_array_equal(alibi_slopes(n), np.asarray(want, np.float32))


def _baichuan13b_reference(sd, ids, heads, eps=1e-6):
    """Baichuan2-13B's forward from its published math, in torch (float64)."""
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in sd.items()}
    slopes = torch.tensor(HAND_SLOPES[heads], dtype=torch.float64)

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w

    h = t["model.embed_tokens.weight"][torch.tensor(ids)]
    B, S, Hd = h.shape
    D = Hd // heads
    bias = slopes[:, None, None] * torch.arange(S, dtype=torch.float64)[None, None, :]   # [N, 1, S]
    causal = torch.triu(torch.full((S, S), float("-inf"), dtype=torch.float64), 1)
    for i in range(L):
        p = f"model.layers.{i}."
        x = rms(h, t[p + "input_layernorm.weight"])
        q, k, v = (x @ t[p + "self_attn.W_pack.weight"].T).split(Hd, -1)
        q, k, v = (z.reshape(B, S, heads, D).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / D ** 0.5 + bias + causal
        a = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, S, Hd)
        h = h + a @ t[p + "self_attn.o_proj.weight"].T
        x = rms(h, t[p + "post_attention_layernorm.weight"])
        gate, up = x @ t[p + "mlp.gate_proj.weight"].T, x @ t[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    head = t["lm_head.weight"] / t["lm_head.weight"].norm(dim=1, keepdim=True)
    return (rms(h, t["model.norm.weight"]) @ head.T).numpy()


@pytest.mark.parametrize("heads", [4, 6])
def test_baichuan2_13b_alibi_equals_hand_reference(tmp_path, heads):
    rng = np.random.default_rng(heads)
    hid = 16 * heads
    sd = {"model.embed_tokens.weight": rng.standard_normal((600, hid)) * 0.5,
          "model.norm.weight": 1 + 0.1 * rng.standard_normal(hid),
          "lm_head.weight": rng.standard_normal((600, hid))}
    for i in range(L):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": 1 + 0.1 * rng.standard_normal(hid),
                   p + "post_attention_layernorm.weight": 1 + 0.1 * rng.standard_normal(hid),
                   p + "self_attn.W_pack.weight": rng.standard_normal((3 * hid, hid)) * 0.15,
                   p + "self_attn.o_proj.weight": rng.standard_normal((hid, hid)) * 0.1,
                   p + "mlp.gate_proj.weight": rng.standard_normal((I, hid)) * 0.1,
                   p + "mlp.up_proj.weight": rng.standard_normal((I, hid)) * 0.1,
                   p + "mlp.down_proj.weight": rng.standard_normal((hid, I)) * 0.1})
    cfg = {"model_type": "baichuan", "vocab_size": 600, "hidden_size": hid, "intermediate_size": I,
           "num_hidden_layers": L, "num_attention_heads": heads, "model_max_length": 256,
           "rms_norm_eps": 1e-6, "norm_head": True}   # no max_position_embeddings: the 13B (ALiBi)
    path = write_mapped(tmp_path / "b13", cfg, sd)
    ids = ids_for(18)
    ref = _baichuan13b_reference(sd, ids, heads)
    model = load_model(path)
    assert model.config.position_embedding == "alibi"
    assert rel_err(model(paddle.to_tensor(ids)).logits.numpy(), ref) <= 1e-4
    # through the KV cache: prompt, then token by token
    cache = KVCache.for_model(model, 2, 18)
    steps = [model(paddle.to_tensor(ids[:, :11]), cache=cache).logits.numpy()]
    for t in range(11, 18):
        steps.append(model(paddle.to_tensor(ids[:, t:t + 1]), cache=cache).logits.numpy())
    assert rel_err(np.concatenate(steps, 1), ref) <= 1e-4


def test_baichuan_export_round_trip(tmp_path):
    """Our export writes the published names and shapes (W_pack [3H, H], raw lm_head rows as
    loaded) and records position_embedding / norm_head; it loads back to the same logits."""
    from paddletune.models import save_pretrained

    path, _ = baichuan_from_llama(tmp_path)
    model = load_model(path)
    save_pretrained(model, str(tmp_path / "out"))
    a, b = hf.CheckpointReader(path), hf.CheckpointReader(str(tmp_path / "out"))
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        np.testing.assert_array_equal(a.get(k), b.get(k), err_msg=k)
    conf = json.load(open(tmp_path / "out" / "config.json"))
    assert conf["position_embedding"] == "rope" and conf["norm_head"] is True
    ids = paddle.to_tensor(ids_for(9))
    np.testing.assert_allclose(load_model(str(tmp_path / "out"))(ids).logits.numpy(),
                               model(ids).logits.numpy(), rtol=0, atol=1e-6)


def test_norm_head_chunked_loss_and_gradients_equal_full_logits(tmp_path):
    """Training computes the head + CE chunk by chunk from the normalised head weight; loss and
    every gradient (the head's through the normalisation) equal the eval path's full logits."""
    from conftest import lm_loss

    path, _ = baichuan_from_llama(tmp_path)
    ids = ids_for(12, batch=3)
    labels = ids.copy()
    labels[:, :4] = -100
    got = {}
    for mode in ("chunked", "full"):
        model = load_model(path)
        model.train() if mode == "chunked" else model.eval()
        out = lm_loss(model, ids, labels)
        assert (out.label_logits is None) == (mode == "chunked")
        out.loss_sum.backward()
        got[mode] = (float(out.loss_sum), {n: p.grad.numpy() for n, p in model.named_parameters()})
    (l1, g1), (l2, g2) = got["chunked"], got["full"]
    assert abs(l1 - l2) <= 1e-5 * abs(l2)
    assert max(rel_err(g1[k], g2[k]) for k in g2) <= 1e-5 and np.abs(g2["lm_head.weight"]).max() > 0


def qwen_from_qwen2(tmp_path):
    """(qwen (1) dir, qwen2 oracle): the published Qwen layout from a transformers Qwen2."""
    _, q2 = hf_checkpoint(tmp_path / "qwen2", "qwen2", tokenizer_dir=None, num_key_value_heads=N,
                          intermediate_size=I, tie_word_embeddings=False, seed=6)
    with torch.no_grad():   # non-zero q/k/v biases and norms
        for name, p in q2.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    sd = {k: v.numpy() for k, v in q2.state_dict().items() if not k.endswith("inv_freq")}
    out = {"transformer.wte.weight": sd["model.embed_tokens.weight"],
           "transformer.ln_f.weight": sd["model.norm.weight"], "lm_head.weight": sd["lm_head.weight"]}
    for i in range(L):
        s, t = f"model.layers.{i}.", f"transformer.h.{i}."
        for leaf in ("weight", "bias"):
            out[t + f"attn.c_attn.{leaf}"] = np.concatenate(
                [sd[s + f"self_attn.{x}_proj.{leaf}"] for x in "qkv"], 0)
        out.update({t + "attn.c_proj.weight": sd[s + "self_attn.o_proj.weight"],
                    t + "ln_1.weight": sd[s + "input_layernorm.weight"],
                    t + "ln_2.weight": sd[s + "post_attention_layernorm.weight"],
                    t + "mlp.w1.weight": sd[s + "mlp.up_proj.weight"],
                    t + "mlp.w2.weight": sd[s + "mlp.gate_proj.weight"],
                    t + "mlp.c_proj.weight": sd[s + "mlp.down_proj.weight"]})
    cfg = {"model_type": "qwen", "architectures": ["QWenLMHeadModel"], "vocab_size": 600,
           "hidden_size": H, "intermediate_size": 2 * I, "num_hidden_layers": L,
           "num_attention_heads": N, "kv_channels": H // N, "layer_norm_epsilon": 1e-6,
           "rotary_emb_base": 10000, "rotary_pct": 1.0, "seq_length": 64, "use_dynamic_ntk": True,
           "use_logn_attn": True, "no_bias": True, "bos_token_id": 1, "eos_token_id": 2}
    return write_mapped(tmp_path / "qwen", cfg, out), q2


def test_qwen1_equals_mapped_qwen2(tmp_path):
    path, q2 = qwen_from_qwen2(tmp_path)
    ids = ids_for(20)
    with torch.no_grad():
        ref = q2(torch.tensor(ids)).logits.numpy()
    model = load_model(path)
    assert rel_err(model(paddle.to_tensor(ids)).logits.numpy(), ref) <= 1e-4
    cache = KVCache.for_model(model, 2, 30)
    logits = model(paddle.to_tensor(ids[:, :10]), cache=cache).logits
    seq = ids[:, :10]
    for _ in range(8):
        nxt = logits[:, -1].argmax(-1).numpy()[:, None]
        seq = np.concatenate([seq, nxt], 1)
        logits = model(paddle.to_tensor(nxt), cache=cache).logits
    with torch.no_grad():
        want = q2.generate(torch.tensor(ids[:, :10]), max_new_tokens=8, do_sample=False,
                           min_new_tokens=8, pad_token_id=0, eos_token_id=None)
    assert np.array_equal(seq, want.numpy())
    with pytest.raises(ValueError, match="seq_length"):   # past seq_length: NTK / logn not built
        model(paddle.to_tensor(ids_for(70)))
