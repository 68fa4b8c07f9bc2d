"""recompute_granularity: exactly the named part is recomputed (forward calls counted per
sub-module), and every gradient equals the run without recompute (1e-6) with dropout on
(attention dropout 0.1: the recomputed forward replays the same masks)."""
import numpy as np
import paddle
import pytest

from conftest import lm_loss, rel_err
from paddletune.models import build_model, get_spec, layers, llama


def _grads(monkeypatch, recompute, granularity):
    calls = {"block": 0, "attention": 0, "core": 0}
    for cls, meth, key in ((llama.LlamaDecoderLayer, "forward", "block"),
                           (llama.LlamaAttention, "forward", "attention")):
        orig = getattr(cls, meth)
        monkeypatch.setattr(cls, meth, lambda self, *a, _o=orig, _k=key, **k: calls.__setitem__(_k, calls[_k] + 1) or _o(self, *a, **k))
    core = layers._dense_attention
    monkeypatch.setattr(layers, "_dense_attention",
                        lambda *a, **k: calls.__setitem__("core", calls["core"] + 1) or core(*a, **k))
    paddle.seed(0)
    model = build_model(dict(get_spec("llama").tiny_config, attention_dropout=0.1), seed=0)
    model.train()
    model.recompute, model.recompute_granularity = recompute, granularity
    x = paddle.to_tensor(np.random.default_rng(0).integers(3, 500, (2, 12)))
    paddle.seed(1)
    lm_loss(model, x, x).loss.backward()
    monkeypatch.undo()
    return calls, {n: p.grad.numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("granularity,expect", [
    ("full", {"block": 4, "attention": 4, "core": 4}),        # 2 blocks, each run again
    ("full_attn", {"block": 2, "attention": 4, "core": 4}),   # attention sub-layers only
    ("core_attn", {"block": 2, "attention": 2, "core": 4})])  # softmax(q k^T) v only
def test_recompute_granularity(monkeypatch, granularity, expect):
    base_calls, base = _grads(monkeypatch, False, granularity)
    assert base_calls == {"block": 2, "attention": 2, "core": 2}
    calls, got = _grads(monkeypatch, True, granularity)
    assert calls == expect
    assert set(got) == set(base)
    assert max(rel_err(got[n], base[n]) for n in base) <= 1e-6


def test_attention_dropout_is_active():
    """The comparison above is with dropout really on: two seeds give different losses."""
    model = build_model(dict(get_spec("llama").tiny_config, attention_dropout=0.1), seed=0)
    model.train()
    x = paddle.to_tensor(np.random.default_rng(0).integers(3, 500, (2, 12)))
    losses = []
    for seed in (1, 2):
        paddle.seed(seed)
        losses.append(float(lm_loss(model, x, x).loss))
    assert losses[0] != losses[1]
