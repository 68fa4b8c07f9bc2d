"""The folded LoRA path (peft/lora.py _FoldedLoRA: y = x (W + s A B) + b in one GEMM, a hand
backward) against two independent references: the same formula written out in torch with
autograd, and the unfolded paddle branch base(x) + s (x A) B. Values and gradients of x, A and B
agree to float32 rounding (1e-5 relative). Also asserted: the folded path is really taken where
it should be and left where it must be (dropout in training, tensor-parallel collective, few
tokens, quantized or hooked bases), and it runs under recompute with the same gradients."""
import numpy as np
import paddle
import pytest
import torch

from conftest import lm_loss, rel_err
from paddletune.models import build_model, get_spec
from paddletune.peft import lora


def _layer(i, o, bias, r=8, alpha=16, dropout=0.0, seed=0):
    paddle.seed(seed)
    base = paddle.nn.Linear(i, o, bias_attr=None if bias else False)
    for p in base.parameters():
        p.stop_gradient = True
    layer = lora.LoRALinear(base, r, alpha, dropout)
    layer.lora_B.weight.set_value(paddle.randn([r, o]) * 0.1)   # B starts at zero: make it count
    return layer


def _count_folded(monkeypatch):
    calls = {"n": 0}
    orig = lora._FoldedLoRA.apply
    monkeypatch.setattr(lora._FoldedLoRA, "apply",
                        lambda *a, **k: calls.__setitem__("n", calls["n"] + 1) or orig(*a, **k))
    return calls


def _paddle_run(layer, x_np, g_np, x_grad=True):
    x = paddle.to_tensor(x_np)
    x.stop_gradient = not x_grad
    y = layer(x)
    paddle.autograd.backward([y], [paddle.to_tensor(g_np)])
    out = {"y": y.numpy(), "A": layer.lora_A.weight.grad.numpy(), "B": layer.lora_B.weight.grad.numpy()}
    if x_grad:
        out["x"] = x.grad.numpy()
    layer.lora_A.weight.clear_gradient()
    layer.lora_B.weight.clear_gradient()
    return out


def _torch_run(layer, x_np, g_np):
    """y = x W + b + s (x A) B in float64 torch autograd (paddle layouts: W [in, out], A [in, r])."""
    t = lambda p: torch.tensor(p.numpy(), dtype=torch.float64)
    x = torch.tensor(x_np, dtype=torch.float64, requires_grad=True)
    a = t(layer.lora_A.weight).requires_grad_()
    b = t(layer.lora_B.weight).requires_grad_()
    y = x @ t(layer.base_layer.weight) + layer.scaling * (x @ a) @ b
    if layer.base_layer.bias is not None:
        y = y + t(layer.base_layer.bias)
    y.backward(torch.tensor(g_np, dtype=torch.float64))
    return {"y": y.detach().numpy(), "x": x.grad.numpy(), "A": a.grad.numpy(), "B": b.grad.numpy()}


@pytest.mark.parametrize("shape,i,o,bias", [((2, 150, 64), 64, 96, False), ((300, 96), 96, 64, True),
                                            ((1, 257, 48), 48, 48, True)])
def test_folded_equals_torch_and_the_unfolded_branch(monkeypatch, shape, i, o, bias):
    layer = _layer(i, o, bias)
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal(shape[:-1] + (i,)).astype("float32")
    g_np = rng.standard_normal(shape[:-1] + (o,)).astype("float32")
    calls = _count_folded(monkeypatch)
    folded = _paddle_run(layer, x_np, g_np)
    assert calls["n"] == 1
    ref = _torch_run(layer, x_np, g_np)
    monkeypatch.setattr(layer, "_fusable", lambda x: False)
    branch = _paddle_run(layer, x_np, g_np)
    assert calls["n"] == 1                      # the unfolded branch ran the second time
    for k in ("y", "x", "A", "B"):
        assert rel_err(folded[k], ref[k]) < 1e-5, k
        assert rel_err(folded[k], branch[k]) < 1e-5, k
        assert rel_err(branch[k], ref[k]) < 1e-5, k


def test_folded_without_input_gradient(monkeypatch):
    """x that needs no gradient (the first layer's input under LoRA): A and B still get theirs."""
    layer = _layer(64, 80, False)
    rng = np.random.default_rng(1)
    x_np, g_np = rng.standard_normal((200, 64)).astype("float32"), rng.standard_normal((200, 80)).astype("float32")
    calls = _count_folded(monkeypatch)
    got = _paddle_run(layer, x_np, g_np, x_grad=False)
    assert calls["n"] == 1
    ref = _torch_run(layer, x_np, g_np)
    for k in ("y", "A", "B"):
        assert rel_err(got[k], ref[k]) < 1e-5, k


def test_where_the_fold_is_taken(monkeypatch):
    calls = _count_folded(monkeypatch)
    x = paddle.randn([4, 64, 64])

    def taken(layer, x=x):
        before = calls["n"]
        layer(x)
        return calls["n"] - before

    assert taken(_layer(64, 64, False)) == 1
    assert taken(_layer(64, 64, False), paddle.randn([1, 4, 64])) == 0    # decode-size: the branch
    drop = _layer(64, 64, False, dropout=0.1)
    assert taken(drop) == 0                                            # training with a dropout mask
    drop.eval()
    assert taken(drop) == 1                                            # eval: dropout is the identity
    tp = _layer(64, 64, False)
    tp.between = lambda z: z
    assert taken(tp) == 0                                              # tensor parallel collective
    hooked = _layer(64, 64, False)
    hooked.base_layer.register_forward_post_hook(lambda layer, inp, out: out)
    assert taken(hooked) == 0
    trained = _layer(64, 64, False)
    trained.base_layer.weight.stop_gradient = False                    # a base weight that trains
    assert taken(trained) == 0
    merged = _layer(64, 64, False)
    merged.merge()
    assert taken(merged) == 0


@pytest.mark.parametrize("granularity", ["full", "full_attn"])
def test_folded_under_recompute(monkeypatch, granularity):
    """A LoRA model with recompute: loss and LoRA gradients equal the run without recompute
    (1e-6), and the folded path ran in both passes of the recomputed layers."""
    def grads(recompute):
        paddle.seed(0)
        model = build_model(get_spec("llama").tiny_config, seed=0)
        names = [n for n, m in model.named_sublayers() if n.split(".")[-1] in ("q_proj", "v_proj", "up_proj")]
        for p in model.parameters():
            p.stop_gradient = True
        wrapped = lora.inject(model, names, 8, 16)
        for layer in wrapped.values():
            layer.lora_B.weight.set_value(paddle.randn(layer.lora_B.weight.shape) * 0.1)
        model.train()
        model.recompute, model.recompute_granularity = recompute, granularity
        x = paddle.to_tensor(np.random.default_rng(0).integers(3, 500, (2, 64)))
        loss = lm_loss(model, x, x).loss
        loss.backward()
        return float(loss), {n: p.grad.numpy() for n, p in lora.lora_state(model).items()}

    calls = _count_folded(monkeypatch)
    loss_off, off = grads(False)
    n_off = calls["n"]
    assert n_off > 0
    loss_on, on = grads(True)
    assert calls["n"] - n_off > n_off             # the recomputed forward folded again
    assert abs(loss_on - loss_off) <= 1e-6 * abs(loss_off)
    for n in off:
        assert rel_err(on[n], off[n]) < 1e-6, n
