"""Sampling: logits processors against transformers' processors, the sampler against known
distributions, seeded determinism."""
import numpy as np
import paddle
import pytest
import torch
from conftest import hf_checkpoint

from paddletune.generation import (filter_top_k_top_p, generate, penalize_repetition,
                                   sample_from)
from paddletune.loading import load_model


def _hf_processed(logits, **kw):
    from transformers.generation import logits_process as lp

    t = torch.tensor(logits)
    ids = torch.zeros((t.shape[0], 1), dtype=torch.long)
    if "top_k" in kw:
        t = lp.TopKLogitsWarper(kw["top_k"])(ids, t)
    if "top_p" in kw:
        t = lp.TopPLogitsWarper(kw["top_p"])(ids, t)
    return t.numpy()


@pytest.mark.parametrize("kw", [dict(top_k=5), dict(top_p=0.3), dict(top_p=0.9),
                                dict(top_k=20, top_p=0.5), dict(top_k=1)])
def test_top_k_top_p_equal_transformers(kw):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((4, 50)) * 2).astype(np.float32)
    hf = _hf_processed(logits, **kw)
    ours = filter_top_k_top_p(paddle.to_tensor(logits), kw.get("top_k", 0), kw.get("top_p", 1.0)).numpy()
    assert np.array_equal(np.isinf(ours), np.isinf(hf))
    assert np.allclose(ours[~np.isinf(ours)], hf[~np.isinf(hf)])
    assert (~np.isinf(ours)).sum(-1).min() >= 1


def test_repetition_penalty_equals_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 30)).astype(np.float32)
    ids = rng.integers(0, 30, size=(3, 7))
    seen = np.zeros((3, 30), np.float32)
    np.put_along_axis(seen, ids, 1.0, axis=1)
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor(ids), torch.tensor(logits)).numpy()
    ours = penalize_repetition(paddle.to_tensor(logits), paddle.to_tensor(seen), 1.7).numpy()
    assert np.allclose(ours, hf, atol=1e-6)


def test_sampler_follows_the_distribution():
    probs = np.array([[0.1, 0.0, 0.6, 0.3]] * 20000, np.float32)
    u = 1.0 - np.random.default_rng(0).random((20000, 1))
    ids = sample_from(paddle.to_tensor(probs), paddle.to_tensor(u.astype(np.float32))).numpy()
    freq = np.bincount(ids, minlength=4) / len(ids)
    assert freq[1] == 0
    assert np.abs(freq - probs[0]).max() < 0.015
    # u = 1 (the largest value) picks the last token with mass; a tiny u the first
    edge = sample_from(paddle.to_tensor(np.array([[0.2, 0.8, 0.0]], np.float32)),
                       paddle.to_tensor([[1.0]])).numpy()
    assert edge.tolist() == [1]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, _ = hf_checkpoint(tmp_path_factory.mktemp("sampling"), seed=7)
    m = load_model(path)
    w = m.lm_head.weight   # random init gives near-flat logits; sharpen them (std ~2)
    w.set_value(w.numpy() * 40)
    return m


def _expected_first_token_probs(model, prompt, temperature, top_k, top_p):
    """First-step distribution computed in numpy from the model's logits (independent code)."""
    with paddle.no_grad():
        z = model(paddle.to_tensor([prompt])).logits[0, -1].numpy().astype(np.float64) / temperature
    keep = np.ones_like(z, bool)
    if top_k:
        keep &= z >= np.sort(z)[-top_k]
    p = np.exp(z - z.max()) * keep
    p /= p.sum()
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    nucleus = np.zeros_like(keep)
    nucleus[order[before < top_p]] = True
    p = p * nucleus
    return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8)])
def test_first_token_frequencies_match_processed_softmax(model, temperature, top_k, top_p):
    prompt = [1, 17, 250, 3, 99]
    n = 3000
    out = generate(model, [prompt] * n, max_new_tokens=1, decode_strategy="sampling",
                   temperature=temperature, top_k=top_k, top_p=top_p, seed=0, eos_token_id=[])
    freq = np.bincount([s[0] for s in out.sequences], minlength=model.config.vocab_size) / n
    p = _expected_first_token_probs(model, prompt, temperature, top_k, top_p)
    assert freq[p == 0].sum() == 0                 # nothing outside top_k / the nucleus
    # total variation distance; its expected sampling noise is ~0.4 * sum(sigma_i), sigma_i the
    # binomial std of frequency i; allow twice that
    tol = 0.8 * np.sqrt(p * (1 - p) / n).sum()
    tv = 0.5 * np.abs(freq - p).sum()
    assert tv < tol
    # ...and the check can fail: the distribution at another temperature is far away
    wrong = _expected_first_token_probs(model, prompt, temperature * 1.5, top_k, top_p)
    assert 0.5 * np.abs(freq - wrong).sum() > tol


def test_seeded_sampling_is_deterministic(model):
    prompts = [[1, 5, 6, 7], [1, 9]]
    kw = dict(max_new_tokens=24, decode_strategy="sampling", temperature=1.0, eos_token_id=[])
    a = generate(model, prompts, seed=11, **kw).sequences
    assert a == generate(model, prompts, seed=11, **kw).sequences
    assert a != generate(model, prompts, seed=12, **kw).sequences
    # a row's draws depend on (seed, row, step), not on how far other rows got
    assert generate(model, prompts[:1], seed=11, **kw).sequences[0] == a[0]
    # top_k=1 sampling and a near-zero temperature are greedy
    greedy = generate(model, prompts, max_new_tokens=24, eos_token_id=[]).sequences
    assert generate(model, prompts, seed=3, top_k=1, **kw).sequences == greedy
    kw["temperature"] = 1e-4
    assert generate(model, prompts, seed=3, **kw).sequences == greedy
