"""paddletune's CPU kernels (paddletune/kernels) against independent references: the exact
cross-entropy in float64 numpy, and paddle's own ops / autograd for the logits gradient and the
masked softmax forward and backward; large logits, fully masked rows, a per-batch and a shared
mask, and NaN propagation."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from paddletune import kernels

# The kernels are CPU-only: on a CUDA build of paddle they are off by design (tensors live on the
# GPU, every kernel entry point returns None), so nothing here can be checked there. On a CPU
# build every test runs, and a broken build fails them loudly.
pytestmark = pytest.mark.skipif(paddle.is_compiled_with_cuda(),
                                reason="CUDA build of paddle: the CPU kernels are off by design")


def test_kernels_build_on_this_machine():
    """The CPU machines this project runs on have g++: the kernels must be on (otherwise every
    speed number in benchmarks/README.md is off by the difference)."""
    assert kernels._why_not() is None   # (cpu_ops() loads once per process: no reload here)
    assert kernels.cpu_ops() is not None


@pytest.mark.parametrize("scale", [1.0, 16.0])
def test_softmax_xent_equals_paddle(scale):
    rng = np.random.default_rng(0)
    logits = paddle.to_tensor((rng.standard_normal((37, 1003)) * scale).astype(np.float32))
    targets = paddle.to_tensor(rng.integers(0, 1003, 37))
    grad = logits.clone()
    loss = kernels.softmax_xent_(grad, targets)   # grad now holds softmax - onehot
    x64, t = logits.numpy().astype(np.float64), targets.numpy()
    m = x64.max(-1)
    exact = m + np.log(np.exp(x64 - m[:, None]).sum(-1)) - x64[np.arange(37), t]
    np.testing.assert_allclose(loss.numpy(), exact, rtol=2e-6, atol=2e-5)
    if scale > 8:   # paddle's own cross-entropy saturates near 64 (it clips the probability): no oracle there
        ref = F.cross_entropy(logits, targets.unsqueeze(-1), reduction="none").numpy()
        assert ref.max() < 65 and exact.max() > 75
    ref_grad = F.softmax(logits, -1) - F.one_hot(targets, 1003)
    np.testing.assert_allclose(grad.numpy(), ref_grad.numpy(), rtol=1e-6, atol=2e-7)
    # grad is the autograd gradient of sum(loss) with respect to the logits
    x = logits.clone()
    x.stop_gradient = False
    F.cross_entropy(x, targets.unsqueeze(-1), reduction="sum").backward()
    np.testing.assert_allclose(grad.numpy(), x.grad.numpy(), rtol=1e-6, atol=2e-7)


def test_softmax_xent_propagates_nan():
    logits = paddle.zeros([3, 50])
    logits[1, 7] = float("nan")
    loss = kernels.softmax_xent_(logits, paddle.to_tensor([0, 1, 2]))
    assert np.isnan(loss.numpy()[1]) and np.isfinite(loss.numpy()[[0, 2]]).all()


def reference_masked_softmax(scores, mask):
    return F.softmax(paddle.masked_fill(scores, mask, -1e9), -1)


@pytest.mark.parametrize("mask_batch", [1, 3])
def test_masked_softmax_forward_and_backward_equal_paddle(mask_batch):
    rng = np.random.default_rng(1)
    B, H, S, T = 3, 4, 9, 13
    scores = (rng.standard_normal((B, H, S, T)) * 4).astype(np.float32)
    blocked = rng.random((mask_batch, 1, S, T)) < 0.4
    blocked[0, 0, 2, :] = True          # a row with every key blocked: uniform, as masked_fill + softmax
    dprobs = rng.standard_normal((B, H, S, T)).astype(np.float32)
    results = []
    for fn in (kernels.masked_softmax, reference_masked_softmax):
        x = paddle.to_tensor(scores)
        x.stop_gradient = False
        p = fn(x, paddle.to_tensor(blocked))
        p.backward(paddle.to_tensor(dprobs))
        results.append((p.numpy(), x.grad.numpy()))
    (p, g), (p_ref, g_ref) = results
    np.testing.assert_allclose(p, p_ref, rtol=0, atol=3e-7)
    np.testing.assert_allclose(g, g_ref, rtol=0, atol=2e-6)
    assert np.allclose(p[0, :, 2], 1.0 / T) and (p[np.broadcast_to(blocked, p.shape) & (p_ref == 0)] == 0).all()


def test_masked_softmax_declines_what_it_does_not_handle():
    x = paddle.randn([2, 2, 4, 4])
    assert kernels.masked_softmax(x, paddle.zeros([2, 1, 4, 4], "float32")) is None   # float mask
    assert kernels.masked_softmax(x, paddle.zeros([2, 2, 4, 4], "bool")) is None      # per-head mask
    assert kernels.masked_softmax(x.astype("float64"), paddle.zeros([1, 1, 4, 4], "bool")) is None


@pytest.mark.parametrize("frozen", [False, True])
def test_rms_norm_forward_and_backward_equal_paddle(frozen):
    """Against paddle's ops: x / sqrt(mean(x^2) + eps) * w and its autograd gradients."""
    rng = np.random.default_rng(2)
    x_np = (rng.standard_normal((3, 7, 48)) * 3).astype(np.float32)
    w_np = rng.standard_normal(48).astype(np.float32)
    dy = paddle.to_tensor(rng.standard_normal((3, 7, 48)).astype(np.float32))
    out = []
    for use_kernel in (True, False):
        x, w = paddle.to_tensor(x_np), paddle.to_tensor(w_np)
        x.stop_gradient, w.stop_gradient = False, frozen
        y = (kernels.rms_norm(x, w, 1e-5) if use_kernel else
             w * (x * paddle.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5)))
        y.backward(dy)
        out.append((y.numpy(), x.grad.numpy(), None if frozen else w.grad.numpy()))
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = out
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    if not frozen:
        np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)


def test_swiglu_forward_and_backward_equal_paddle():
    rng = np.random.default_rng(3)
    g_np = (rng.standard_normal((5, 33)) * 6).astype(np.float32)   # large |gate|: both sigmoid branches
    u_np = rng.standard_normal((5, 33)).astype(np.float32)
    dy = paddle.to_tensor(rng.standard_normal((5, 33)).astype(np.float32))
    out = []
    for use_kernel in (True, False):
        g, u = paddle.to_tensor(g_np), paddle.to_tensor(u_np)
        g.stop_gradient = u.stop_gradient = False
        y = kernels.swiglu(g, u) if use_kernel else F.silu(g) * u
        y.backward(dy)
        out.append((y.numpy(), g.grad.numpy(), u.grad.numpy()))
    for a, b in zip(*out):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_rope_heads_first_equals_paddle():
    """Against the paddle path of RopeTables (x * cos + rotate_half(x) * sin, then the head
    transpose), forward and backward, with a score scale."""
    from paddletune.models.layers import RopeTables

    rng = np.random.default_rng(4)
    B, S, N, D = 2, 5, 3, 8
    x_np = rng.standard_normal((B, S, N, D)).astype(np.float32)
    ang = rng.standard_normal((B, S, D)).astype(np.float32)
    dy = paddle.to_tensor(rng.standard_normal((B, N, S, D)).astype(np.float32))
    tables = RopeTables(paddle.to_tensor(np.cos(ang)), paddle.to_tensor(np.sin(ang)))
    out = []
    for use_kernel in (True, False):
        x = paddle.to_tensor(x_np)
        x.stop_gradient = False
        y = (kernels.rope_heads_first(x, tables.cos, tables.sin, 0.5) if use_kernel else
             tables.apply(x, 0.5).transpose([0, 2, 1, 3]))
        y.backward(dy)
        out.append((y.numpy(), x.grad.numpy()))
    assert out[0][0].shape == (B, N, S, D)
    for a, b in zip(*out):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_without_autograd_the_kernels_skip_pylayer_and_equal_paddle(monkeypatch):
    """Under no_grad (the decode step) each kernel runs its forward op directly, not through its
    PyLayer (set to raise here); the outputs equal paddle's own ops."""
    def no_pylayer(kind, *args):
        raise AssertionError(f"{kind}: PyLayer used under no_grad")

    monkeypatch.setitem(kernels._STATE, "layers", {k: type("X", (), {"apply": staticmethod(
        lambda *a, k=k: no_pylayer(k))}) for k in ("masked_softmax", "rms_norm", "swiglu", "rope")})
    rng = np.random.default_rng(3)
    x = paddle.to_tensor(rng.standard_normal((2, 3, 4, 8)).astype(np.float32))
    w = paddle.to_tensor(rng.standard_normal(8).astype(np.float32))
    w.stop_gradient = False   # a trainable weight: no_grad alone must select the direct op
    cos, sin = (paddle.to_tensor(rng.standard_normal((2, 3, 8)).astype(np.float32)) for _ in range(2))
    mask = paddle.to_tensor(rng.random((1, 1, 4, 8)) < 0.3)
    with paddle.no_grad():
        y = kernels.rms_norm(x, w, 1e-6)
        ref = x / paddle.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
        np.testing.assert_allclose(y.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(kernels.swiglu(x, x * 2).numpy(), (F.silu(x) * x * 2).numpy(),
                                   rtol=1e-5, atol=1e-6)
        rot = paddle.concat([-x[..., 4:], x[..., :4]], axis=-1)
        ref = ((x * cos.unsqueeze(2) + rot * sin.unsqueeze(2)) * 0.5).transpose([0, 2, 1, 3])
        np.testing.assert_allclose(kernels.rope_heads_first(x, cos, sin, 0.5).numpy(), ref.numpy(),
                                   rtol=1e-5, atol=1e-6)
        scores = paddle.to_tensor(rng.standard_normal((2, 3, 4, 8)).astype(np.float32))
        ref = F.softmax(paddle.where(mask, paddle.full_like(scores, -1e9), scores), -1)
        np.testing.assert_allclose(kernels.masked_softmax(scores, mask).numpy(), ref.numpy(),
                                   rtol=1e-5, atol=1e-6)
    x.stop_gradient = False   # with autograd and an input needing a gradient: the PyLayer
    with pytest.raises(AssertionError, match="rms_norm: PyLayer used"):
        kernels.rms_norm(x, w, 1e-6)
