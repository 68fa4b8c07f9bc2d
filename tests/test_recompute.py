"""recompute_granularity: exactly the named part is recomputed (forward calls counted per
sub-module), and every gradient equals the run without recompute (1e-6) with dropout on
(attention dropout 0.1: the recomputed forward replays the same masks)."""
import numpy as np
import paddle
import pytest

from conftest import lm_loss, rel_err
from paddletune.models import build_model, get_spec, layers, llama


def _count_core_attention(monkeypatch, calls):
    """calls["core"] += 1 per core attention computed: the dense path or the CPU column's blocked
    kernel (ops.cpu_attention returns None when it leaves a case to the dense path)."""
    core = layers._dense_attention
    monkeypatch.setattr(layers, "_dense_attention",
                        lambda *a, **k: calls.__setitem__("core", calls["core"] + 1) or core(*a, **k))
    blocked = layers.ops.cpu_attention

    def count_blocked(*a, **k):
        out = blocked(*a, **k)
        calls["core"] += out is not None
        return out

    monkeypatch.setattr(layers.ops, "cpu_attention", count_blocked)


def _grads(monkeypatch, recompute, granularity):
    calls = {"block": 0, "attention": 0, "core": 0}
    for cls, meth, key in ((llama.LlamaDecoderLayer, "forward", "block"),
                           (llama.LlamaAttention, "forward", "attention")):
        orig = getattr(cls, meth)
        monkeypatch.setattr(cls, meth, lambda self, *a, _o=orig, _k=key, **k: calls.__setitem__(_k, calls[_k] + 1) or _o(self, *a, **k))
    _count_core_attention(monkeypatch, calls)
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


FAMILIES = ("qwen2", "chatglm", "qwen3", "gpt2", "opt", "bloom", "baichuan", "qwen", "chatglm6b")


def _family_grads(monkeypatch, kind, recompute, granularity):
    """(core attention calls, attention-module calls, gradients) of one loss on the tiny model."""
    spec = get_spec(kind)
    paddle.seed(0)
    conf = dict(spec.tiny_config)
    if kind == "chatglm":
        conf["padded_vocab_size"] = 128
    model = build_model(conf, seed=0)
    model.train()
    model.recompute, model.recompute_granularity = recompute, granularity
    calls = {"core": 0, "attention": 0}
    _count_core_attention(monkeypatch, calls)
    cls = type(getattr(model.decoder_layers()[0], spec.attention_module))
    orig = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, *a, **k: calls.__setitem__(
        "attention", calls["attention"] + 1) or orig(self, *a, **k))
    x = np.random.default_rng(0).integers(8, 90, (2, 12))
    if kind == "chatglm6b":   # rows are prompt, [gMASK], sop, answer
        x[:, 5], x[:, 6] = conf["gmask_token_id"], conf["bos_token_id"]
    x = paddle.to_tensor(x)
    lm_loss(model, x, x).loss.backward()
    monkeypatch.undo()
    return calls, len(model.decoder_layers()), {n: p.grad.numpy() for n, p in model.named_parameters()
                                                if p.grad is not None}


@pytest.mark.parametrize("kind", FAMILIES)
def test_recompute_attention_granularities_in_every_family(monkeypatch, kind):
    """full_attn recomputes the family's attention module (ModelSpec.attention_module), core_attn
    softmax(q k^T) v: each runs twice per block, and the gradients equal the plain run's."""
    base_calls, n, base = _family_grads(monkeypatch, kind, False, "full")
    assert base_calls == {"core": n, "attention": n}
    for granularity, expect in (("full_attn", {"core": 2 * n, "attention": 2 * n}),
                                ("core_attn", {"core": 2 * n, "attention": n})):
        calls, _, got = _family_grads(monkeypatch, kind, True, granularity)
        assert calls == expect, granularity
        assert set(got) == set(base)
        assert max(rel_err(got[n_], base[n_]) for n_ in base) <= 1e-6, granularity


def _kernel_run(monkeypatch, recompute, granularity, reuse, mask):
    """(kernel forward calls, loss, gradients) of one loss on the tiny Llama without dropout (the
    CPU column's blocked kernel takes every attention call)."""
    from paddletune import kernels
    from paddletune.kernels import attention as kattn

    ops_ = kernels.cpu_ops()
    assert ops_ is not None, "the CPU kernels must build on a CPU test machine"
    calls = {"fwd": 0}
    fwd = ops_.pt_flash_attn
    monkeypatch.setattr(ops_, "pt_flash_attn", lambda *a: calls.__setitem__("fwd", calls["fwd"] + 1) or fwd(*a))
    monkeypatch.setattr(kattn.ReuseOutputs, "enabled", reuse)
    slots, init = [], kattn.ReuseOutputs.__init__
    monkeypatch.setattr(kattn.ReuseOutputs, "__init__", lambda self: init(self) or slots.append(self))
    conf = get_spec("llama").tiny_config
    model = build_model(conf, seed=0)
    model.train()
    model.recompute, model.recompute_granularity = recompute, granularity
    x = np.random.default_rng(0).integers(3, 500, (2, 12))
    loss = lm_loss(model, x, x, attention_mask=mask).loss
    if recompute and reuse:   # between forward and backward each block's slot holds out and lse only
        D = conf["hidden_size"] // conf["num_attention_heads"]
        assert len(slots) == conf["num_hidden_layers"]
        for slot in slots:
            (key, (out, lse)), = slot.records
            assert out.shape == [2, 12, conf["num_attention_heads"] * D]
            assert lse.shape == [2, conf["num_attention_heads"], 12]
    loss.backward()
    assert all(slot.records == [] and slot.passes == 2 for slot in slots)   # handed over, let go
    monkeypatch.undo()
    assert kattn._STATE.get("reuse") is None   # no region left open
    return calls["fwd"], float(loss), {n: p.grad.numpy() for n, p in model.named_parameters()}


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="CUDA build: the CPU kernels are off by design")
@pytest.mark.parametrize("granularity", ["full", "full_attn"])
@pytest.mark.parametrize("padded", [False, True])
def test_recompute_reuses_the_attention_kernel_forward(monkeypatch, granularity, padded):
    """Recomputed regions hand the kernel's (out, lse) from the forward to the pass run again in
    backward (kernels.attention.ReuseOutputs): the kernel forward runs once per block, as without
    recompute (twice when the kernel runs again), and loss and every gradient equal the run that
    runs the kernel again exactly, and the recompute-off run to 1e-6 (causal, and left-padded
    rows through the kernel's key window). Between forward and backward each block's slot holds
    one (out [B, S, N*D], lse [B, N, S]); after backward none holds anything."""
    mask = np.ones((2, 12), np.int64)
    if padded:
        mask[1, :5] = 0
    n = get_spec("llama").tiny_config["num_hidden_layers"]
    fwd_off, loss_off, off = _kernel_run(monkeypatch, False, granularity, True, mask)
    fwd_again, loss_again, again = _kernel_run(monkeypatch, True, granularity, False, mask)
    fwd_reuse, loss_reuse, reuse = _kernel_run(monkeypatch, True, granularity, True, mask)
    assert (fwd_off, fwd_again, fwd_reuse) == (n, 2 * n, n)
    assert loss_reuse == loss_again
    assert set(reuse) == set(again) == set(off)
    for name in off:
        np.testing.assert_array_equal(reuse[name], again[name], err_msg=name)
    assert abs(loss_reuse - loss_off) <= 1e-6 * abs(loss_off)
    assert max(rel_err(reuse[k], off[k]) for k in off) <= 1e-6
