"""The blocked CPU attention kernel (kernels/attention.cc, the op table's CPU attention row)
against the dense reference attention (models/layers._dense_attention: [B, K, g*S, T] scores,
masked_fill + softmax): values and the gradients of q, k and v, max|d| / max|ref| <= 1e-5 per
tensor, over causal, padding, packed rows, grouped KV heads, past keys, no mask, odd lengths
across the kernel's 64-row / 256-key blocks, one-token rows and fully blocked rows, padded rows
through a per-row key window (layers.PaddedRows, no mask tensor); and a Qwen3
model (GQA) whose loss and gradients with the kernel equal the dense path's and transformers'."""
import numpy as np
import paddle
import pytest
import torch

from family_util import hf_family
from paddletune import kernels
from paddletune.models import layers, ops

pytestmark = pytest.mark.skipif(paddle.is_compiled_with_cuda(),
                                reason="CUDA build of paddle: the CPU kernels are off by design")
TOL = 1e-5


def rel(a, b):
    """max|a - b| / max|b|; an all-zero reference (dq, dk of a one-key row: softmax of one score
    is constant) is measured against 1, the scale of these inputs and output gradients."""
    top = np.abs(b).max()
    return float(np.abs(a - b).max() / (top if top > 0 else 1.0))


def qkv(B, N, K, S, T, D, seed):
    rng = np.random.default_rng(seed)
    ts = [paddle.to_tensor(rng.standard_normal(s).astype(np.float32) * 1.5)
          for s in ((B, N, S, D), (B, K, T, D), (B, K, T, D))]
    for t in ts:
        t.stop_gradient = False
    return ts


def run(fn, q, k, v, seed):
    out = fn(q, k, v)
    dout = paddle.to_tensor(np.random.default_rng(seed + 7).standard_normal(out.shape).astype(np.float32))
    grads = paddle.grad([out], [q, k, v], [dout])
    return [out.numpy()] + [g.numpy() for g in grads]


def check(q, k, v, kernel_fn, ref_bias, scale, seed=0):
    got = run(kernel_fn, q, k, v, seed)
    ref = run(lambda a, b, c: layers._dense_attention(a, b, c, ref_bias, scale=scale), q, k, v, seed)
    errs = {name: rel(g, r) for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}
    assert max(errs.values()) <= TOL, errs
    return got


def segment_mask(seg):
    """bool [B, 1, S, S], True = blocked: another example, or a later position (numpy, independent
    of PackedRows)."""
    seg = np.asarray(seg)
    S = seg.shape[1]
    ok = (seg[:, :, None] == seg[:, None, :]) & np.tril(np.ones((S, S), bool))
    return paddle.to_tensor(~ok[:, None])


# name -> (B, N, K, S, past, D)
SHAPES = {"causal_gqa_odd": (2, 4, 2, 301, 0, 16), "mha_one_block": (1, 2, 2, 37, 0, 8),
          "mqa_past_keys": (2, 4, 1, 70, 261, 16), "one_token": (3, 4, 2, 1, 0, 16)}


@pytest.mark.parametrize("name", list(SHAPES))
def test_causal_and_no_mask_equal_dense(name):
    B, N, K, S, past, D = SHAPES[name]
    q, k, v = qkv(B, N, K, S, S + past, D, seed=len(name))
    scale = 1.0 / np.sqrt(D)
    if past == 0:   # the plain causal mask: the kernel's causal flag, no mask tensor
        check(q, k, v, lambda a, b, c: ops.cpu_attention(a, b, c, layers.causal_mask(S), 0.0, True, scale)
              if S > 1 else kernels.blocked_attention(a, b, c, scale, causal=True), layers.causal_mask(S), scale)
    else:           # past keys (prefix / cache): the causal mask shifted by `past`, as a bool mask
        mask = layers.causal_mask(S, past)
        check(q, k, v, lambda a, b, c: ops.cpu_attention(a, b, c, mask, 0.0, True, scale), mask, scale)
        check(q, k, v, lambda a, b, c: kernels.blocked_attention(a, b, c, scale, causal=True), mask, scale)
    check(q, k, v, lambda a, b, c: kernels.blocked_attention(a, b, c, scale), None, scale)   # no mask


def padding_mask(am):
    """bool [B, 1, S, S], True = blocked: a later position or a padded key (numpy)."""
    S = am.shape[1]
    return paddle.to_tensor((np.triu(np.ones((S, S), bool), 1)[None] | (am == 0)[:, None, :])[:, None])


def test_padding_masks_with_fully_blocked_rows_equal_dense():
    """attention_bias with left and right padding, one row all padding: a PaddedRows (key window
    per row, no [B, 1, S, T] mask) whose kernel run equals dense attention with a numpy mask;
    left-pad queries see no key (uniform weights over all T keys, as the reference), the padded
    row everywhere. The same mask as a bool tensor (PaddedRows.dense(): the kernel's mask path)
    equals it too, and the dense mask equals the numpy one."""
    B, N, K, S, D = 4, 4, 2, 263, 16
    am = np.ones((B, S), np.int64)
    am[0, :5] = 0          # left padding: queries 0..4 see nothing (causal)
    am[1, 200:] = 0        # right padding
    am[2, :] = 0           # a row of padding only
    am[3, :130] = 0        # left padding across the kernel's 64-row and 256-key blocks
    bias = layers.attention_bias(B, S, 0, paddle.to_tensor(am))
    assert isinstance(bias, layers.PaddedRows)
    assert bias.window.numpy().tolist() == [[5, 263], [0, 200], [0, 0], [130, 263]]
    ref = padding_mask(am)
    q, k, v = qkv(B, N, K, S, S, D, seed=3)
    out = check(q, k, v, lambda a, b, c: ops.cpu_attention(a, b, c, bias, 0.0, True, 0.5), ref, 0.5)[0]
    vm = v.numpy()
    np.testing.assert_allclose(out[2].reshape(S, N, D)[:, 0], np.broadcast_to(vm[2, 0].mean(0), (S, D)), rtol=1e-5)
    assert np.array_equal(bias.dense().numpy(), ref.numpy())
    check(q, k, v, lambda a, b, c: ops.cpu_attention(a, b, c, bias.dense(), 0.0, True, 0.5), ref, 0.5)
    shared = layers.causal_mask(S).logical_or(paddle.to_tensor(np.triu(np.ones((S, S), bool), -40)[None, None]))
    check(q, k, v, lambda a, b, c: kernels.blocked_attention(a, b, c, 0.5, mask=shared), shared, 0.5)   # [1, 1, S, T]


def test_padding_window_only_for_one_run_of_ones():
    """A mask with a hole (padding inside a row) is no key window: attention_bias builds the bool
    mask, as before; one-token and odd-length padded rows through the window equal dense."""
    am = np.ones((2, 9), np.int64)
    am[1, 3] = 0
    assert kernels.padding_window(am) is None
    bias = layers.attention_bias(2, 9, 0, paddle.to_tensor(am))
    assert not isinstance(bias, layers.PaddedRows) and np.array_equal(bias.numpy(), padding_mask(am).numpy())
    am = np.ones((3, 67), np.int64)
    am[0, :66] = 0         # one real token, at the end (left padding)
    am[1, 1:] = 0          # one real token, first (right padding)
    am[2, :3] = 0
    am[2, 60:] = 0         # padding on both sides: still one run of 1s
    assert kernels.padding_window(am).tolist() == [[66, 67], [0, 1], [3, 60]]
    bias = layers.attention_bias(3, 67, 0, paddle.to_tensor(am))
    q, k, v = qkv(3, 2, 1, 67, 67, 8, seed=11)
    check(q, k, v, lambda a, b, c: ops.cpu_attention(a, b, c, bias, 0.0, True, 0.4), padding_mask(am), 0.4)


def test_packed_rows_equal_block_diagonal_dense():
    """PackedRows (zero padding) through the op table: examples of 1, 2, 70, 260 ... tokens, some
    crossing the kernel's blocks; the reference is dense attention with a numpy block-diagonal
    causal mask."""
    S = 300
    lens = [[1, 70, 1, 2, 226], [260, 1, 39]]
    seg = np.array([np.repeat(np.arange(len(r)), r) for r in lens])
    layout = layers.PackedRows(paddle.to_tensor(seg))
    q, k, v = qkv(2, 4, 2, S, S, 8, seed=5)
    check(q, k, v, lambda a, b, c: ops.cpu_attention(a, b, c, layout, 0.0, True, 0.3), segment_mask(seg), 0.3)


def test_routing_keeps_the_reference_path_where_said():
    """ALiBi, attention dropout while training, custom dropout and the decode step (S == 1) stay
    on the dense path (cpu_attention returns None); dropout at eval time takes the kernel."""
    q, k, v = qkv(1, 2, 2, 4, 4, 8, seed=1)
    mask = layers.causal_mask(4)
    assert ops.cpu_attention(q, k, v, mask, 0.0, True, 1.0, alibi=paddle.ones([2])) is None
    assert ops.cpu_attention(q, k, v, mask, 0.1, True, 1.0) is None
    assert ops.cpu_attention(q, k, v, mask, 0.0, True, 1.0, dropout_fn=lambda p, r, t: p) is None
    assert ops.cpu_attention(q[:, :, :1], k, v, None, 0.0, False, 1.0) is None
    assert ops.cpu_attention(q, k, v, mask, 0.1, False, 1.0) is not None


def test_qwen3_loss_and_grads_with_kernel_equal_dense_and_transformers(tmp_path, monkeypatch):
    """A GQA model end to end: the loss equals transformers' (torch CPU), and loss and every
    parameter gradient with the kernel equal the dense path's (cpu_attention forced off)."""
    from paddletune.loading import load_model

    path, ref_model = hf_family(tmp_path / "ck", "qwen3")
    ids = np.random.RandomState(0).randint(3, 600, (2, 150))
    am = np.ones_like(ids)
    am[1, 120:] = 0
    with torch.no_grad():
        labels = torch.tensor(np.where(am == 1, ids, -100))
        ref_loss = float(ref_model(torch.tensor(ids), attention_mask=torch.tensor(am), labels=labels).loss)

    def loss_and_grads():
        paddle.seed(0)
        model = load_model(path)
        logits = model(paddle.to_tensor(ids), attention_mask=paddle.to_tensor(am)).logits
        lab = paddle.to_tensor(np.where(am == 1, ids, -100)[:, 1:])
        per = paddle.nn.functional.cross_entropy(logits[:, :-1], lab.unsqueeze(-1), ignore_index=-100,
                                                 reduction="none")
        loss = per.sum() / float((lab != -100).astype("float32").sum())   # HF: mean over labelled
        loss.backward()
        return float(loss), {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}

    calls = []
    real = ops.cpu_attention
    monkeypatch.setattr(ops, "cpu_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    loss, grads = loss_and_grads()
    assert calls and all(c is not None for c in calls)
    monkeypatch.setattr(ops, "cpu_attention", lambda *a, **kw: None)
    dense_loss, dense_grads = loss_and_grads()
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss, dense_loss)
    assert abs(loss - dense_loss) <= 1e-6 * abs(dense_loss)
    assert grads.keys() == dense_grads.keys() and len(grads) > 5
    errs = {n: rel(grads[n], dense_grads[n]) for n in grads}
    assert max(errs.values()) <= 1e-5, sorted(errs.items(), key=lambda x: -x[1])[:3]


def test_all_ones_attention_mask_is_the_plain_causal_mask():
    """A batch without padding takes the kernel's causal path (no [B, 1, S, T] mask); one pad
    token keeps the mask."""
    ones = paddle.ones([2, 9], "int64")
    assert layers.is_plain_causal(layers.attention_bias(2, 9, 0, ones), 9)
    ones[1, 8] = 0
    bias = layers.attention_bias(2, 9, 0, ones)
    assert not layers.is_plain_causal(bias, 9) and bool(bias.dense()[1, 0, :, 8].all())


def test_reuse_outputs_hands_each_record_to_the_matching_call_once(monkeypatch):
    """kernels.attention.ReuseOutputs (recompute): pass 2 of a region takes pass 1's (out, lse)
    for the call with the same key -- no kernel forward, and out and the gradients equal a fresh
    kernel call's exactly; a call whose key differs (another length), and any third pass, run
    the kernel; the dense reference still holds for the reused result (<= 1e-5)."""
    from paddletune.kernels.attention import ReuseOutputs

    ops_ = kernels.cpu_ops()
    calls = {"fwd": 0}
    fwd = ops_.pt_flash_attn
    monkeypatch.setattr(ops_, "pt_flash_attn", lambda *a: calls.__setitem__("fwd", calls["fwd"] + 1) or fwd(*a))
    scale = 1 / np.sqrt(16)
    causal = paddle.to_tensor(np.triu(np.ones((70, 70), bool), 1)[None, None])
    fresh = run(lambda a, b, c: kernels.blocked_attention(a, b, c, scale, causal=True), *qkv(1, 4, 2, 70, 70, 16, 3), 3)
    assert calls["fwd"] == 1
    slot = ReuseOutputs()
    with slot:   # pass 1: two calls recorded
        kernels.blocked_attention(*qkv(1, 4, 2, 70, 70, 16, 3), scale, causal=True)
        kernels.blocked_attention(*qkv(1, 4, 2, 33, 33, 16, 4), scale, causal=True)
    assert calls["fwd"] == 3
    with slot:   # pass 2: the first call reuses, the second (other length) computes
        got = check(*qkv(1, 4, 2, 70, 70, 16, 3),
                    lambda a, b, c: kernels.blocked_attention(a, b, c, scale, causal=True), causal, scale, seed=3)
        assert calls["fwd"] == 3
        kernels.blocked_attention(*qkv(1, 4, 2, 40, 40, 16, 4), scale, causal=True)
        assert calls["fwd"] == 4
    for g, f in zip(got, fresh):
        np.testing.assert_array_equal(g, f)
    with slot:   # pass 3: the records were handed over in pass 2
        kernels.blocked_attention(*qkv(1, 4, 2, 70, 70, 16, 3), scale, causal=True)
    assert calls["fwd"] == 5 and slot.records == []
