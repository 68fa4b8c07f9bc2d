"""Greedy decoding against transformers' generate on checkpoints saved by transformers, cached
against uncached decoding, EOS / stop strings / src_length / repetition penalty.

Oracles: transformers `generate(do_sample=False)` (single prompts, and batched with left padding),
and full recomputation of the whole sequence at every step (use_cache=False)."""
import numpy as np
import paddle
import pytest
import torch
from conftest import TINY_TOKENIZER, hf_checkpoint, rel_err

from paddletune.generation import GenerationConfig, generate
from paddletune.loading import load_model
from paddletune.tokenizer import Tokenizer

TEXTS = ["Reverse the words: apple river stone", "Sort the numbers: 5 3 9 1",
         "hi", "Add 12 and 30, then tell me a long story about a green house by the ocean"]
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory):
    from paddletune.data.builtin import generate as sample
    from paddletune.models.tiny import train_sentencepiece

    train, _ = sample()
    return train_sentencepiece(str(tmp_path_factory.mktemp("spm")),
                               [r["src"] + "\n" + r["tgt"] for r in train[:400]], vocab_size=400)


CASES = {
    # Llama-2 style: multi-head attention (kv heads = heads), sentencepiece tokenizer.model
    "llama_mha_spm": dict(kind="llama", num_key_value_heads=4, vocab_size=400, spm=True),
    # Llama-3 style: grouped-query attention, llama3 rope scaling, tokenizer.json
    "llama3_gqa": dict(kind="llama", num_attention_heads=8, num_key_value_heads=2,
                       rope_parameters=LLAMA3_ROPE),
    # Qwen2: q/k/v biases, GQA
    "qwen2": dict(kind="qwen2", num_key_value_heads=2),
}


@pytest.fixture(scope="module", params=list(CASES))
def ckpt(request, tmp_path_factory, spm_dir):
    conf = dict(CASES[request.param])
    tok_dir = spm_dir if conf.pop("spm", False) else TINY_TOKENIZER
    path, hf = hf_checkpoint(tmp_path_factory.mktemp(request.param), tokenizer_dir=tok_dir, seed=3,
                             **conf)
    if conf["kind"] == "qwen2":   # random qkv biases, or a bias bug would go unnoticed
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
        hf.save_pretrained(path)
    return load_model(path), Tokenizer(path), hf


def hf_greedy(hf, prompts, n, pad=0, **kw):
    """transformers generate on left-padded prompts -> new ids per row (cut after EOS)."""
    L = max(map(len, prompts))
    ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts])
    am = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        g = hf.generate(ids, attention_mask=am, max_new_tokens=n, do_sample=False, pad_token_id=pad,
                        **kw)
    eos = kw.get("eos_token_id", hf.generation_config.eos_token_id)
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    rows = []
    for r in g[:, L:].tolist():
        cut = next((i + 1 for i, t in enumerate(r) if t in eos), len(r))
        rows.append(r[:cut])
    return rows


def test_greedy_equals_transformers_single_and_batched(ckpt):
    model, tok, hf = ckpt
    prompts = [tok.encode(t) for t in TEXTS]
    out = generate(model, prompts, max_new_tokens=24, tokenizer=tok)
    for p, s in zip(prompts, out.sequences):          # one prompt at a time
        assert s == hf_greedy(hf, [p], 24)[0]
    assert out.sequences == hf_greedy(hf, prompts, 24, pad=tok.pad_token_id)  # left padded batch
    assert len(set(map(len, prompts))) > 1
    assert out.texts == [tok.decode(s, skip_special_tokens=True) for s in out.sequences]


def test_eos_stops_each_row_like_transformers(ckpt):
    model, tok, hf = ckpt
    prompts = [tok.encode(t) for t in TEXTS]
    free = generate(model, prompts, max_new_tokens=12).sequences
    r = max(range(len(free)), key=lambda i: len(set(free[i])))
    k = next(i for i in range(2, 12) if free[r][i] not in free[r][:i])
    eos = free[r][k]                                   # row r will stop after k+1 tokens
    out = generate(model, prompts, max_new_tokens=12, eos_token_id=eos)
    assert out.sequences[r] == free[r][:k + 1] and out.finish_reasons[r] == "eos"
    assert out.sequences == hf_greedy(hf, prompts, 12, pad=tok.pad_token_id, eos_token_id=eos)
    for s, f, r in zip(out.sequences, free, out.finish_reasons):  # others run on, unchanged
        cut = next((i + 1 for i, t in enumerate(f) if t == eos), len(f))
        assert s == f[:cut] and r == ("eos" if cut < len(f) or f[-1] == eos else "length")


def test_repetition_penalty_equals_transformers(ckpt):
    model, tok, hf = ckpt
    for text in TEXTS[:2]:
        p = tok.encode(text)
        ours = generate(model, [p], max_new_tokens=20, repetition_penalty=1.5).sequences[0]
        assert ours == hf_greedy(hf, [p], 20, repetition_penalty=1.5)[0]
        assert ours != generate(model, [p], max_new_tokens=20).sequences[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = hf_checkpoint(tmp_path_factory.mktemp("gen_tiny"), seed=5)
    return load_model(path), Tokenizer(path)


def random_prefix(model, P, seed=0):
    rng = np.random.default_rng(seed)
    layers, kv, d = model.spec.prefix_layout(model.config)
    mk = lambda: [paddle.to_tensor(rng.standard_normal((kv, P, d)).astype("float32")) for _ in range(layers)]
    return mk(), mk()


@pytest.mark.parametrize("with_prefix", [False, True])
def test_cached_equals_uncached_64_tokens(tiny, with_prefix):
    model, tok = tiny
    prompts = [tok.encode(t) for t in TEXTS]
    prefix = random_prefix(model, 5) if with_prefix else None
    kw = dict(max_new_tokens=64, eos_token_id=[], return_logits=True, prefix=prefix)
    a = generate(model, prompts, use_cache=True, **kw)
    b = generate(model, prompts, use_cache=False, **kw)
    assert a.sequences == b.sequences and all(len(s) == 64 for s in a.sequences)
    for la, lb in zip(a.logits, b.logits):
        assert la.shape == (64, model.config.vocab_size)
        assert rel_err(la, lb) < 1e-5
    if with_prefix:   # the prefix really changes the output
        plain = generate(model, prompts, max_new_tokens=64, eos_token_id=[])
        assert plain.sequences != a.sequences


def test_batched_rows_equal_single_rows_with_prefix(tiny):
    model, tok = tiny
    prompts = [tok.encode(t) for t in TEXTS]
    prefix = random_prefix(model, 3, seed=1)
    batch = generate(model, prompts, max_new_tokens=16, prefix=prefix, return_logits=True)
    for i, p in enumerate(prompts):
        one = generate(model, [p], max_new_tokens=16, prefix=prefix, return_logits=True)
        assert one.sequences[0] == batch.sequences[i]
        assert rel_err(batch.logits[i], one.logits[0]) < 1e-5


def test_src_length_cuts_from_the_left(tiny):
    model, tok = tiny
    p = tok.encode(TEXTS[3])
    a = generate(model, [p], max_new_tokens=8, src_length=6)
    b = generate(model, [p[-6:]], max_new_tokens=8)
    assert a.sequences == b.sequences and a.prompt_lengths == [6]
    assert a.sequences != generate(model, [p], max_new_tokens=8).sequences


def test_stop_strings_end_generation_and_cut_text(tiny):
    model, tok = tiny
    p = [tok.encode(TEXTS[0])]
    free = generate(model, p, max_new_tokens=20, tokenizer=tok, eos_token_id=[])
    text = free.texts[0]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop.strip()) > 0
    out = generate(model, p, max_new_tokens=20, tokenizer=tok, eos_token_id=[], stop=[stop])
    assert out.finish_reasons == ["stop"]
    assert out.texts[0] == text[:text.find(stop)]
    n = len(out.sequences[0])   # stops at the first token whose text completes the stop string
    assert out.sequences[0] == free.sequences[0][:n]
    assert stop in tok.decode(free.sequences[0][:n]) and stop not in tok.decode(free.sequences[0][:n - 1])


def test_bad_generation_arguments_are_clear(tiny):
    model, tok = tiny
    for kw, word in ((dict(temperature=0), "temperature"), (dict(top_p=0), "top_p"),
                     (dict(max_new_tokens=0), "max_new_tokens"), (dict(top_k=-1), "top_k"),
                     (dict(decode_strategy="beam"), "decode_strategy"), (dict(stop=[""]), "stop"),
                     (dict(repetition_penalty=0), "repetition_penalty")):
        with pytest.raises(ValueError, match=word):
            generate(model, [[1, 2]], **kw)
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[1, 2], []])
    with pytest.raises(TypeError, match="max_len"):
        generate(model, [[1, 2]], max_len=3)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, [[1, 2]], stop=["x"])
    assert GenerationConfig(stop="ab", eos_token_id=2).validate().stop == ["ab"]
