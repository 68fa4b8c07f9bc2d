"""The op table (models/ops.py): the gpu column's paddle ops that have CPU kernels (sdpa with
causal / padding masks, flash attention causal, F.swiglu; fused RMSNorm's forward where the
CPU has AVX-512F) give the cpu column's values and gradients for every family, in the
[B, S, N, D] layout the table passes; every gpu-column call binds to the paddle function's signature."""
import inspect
import subprocess
import sys

import numpy as np
import paddle
import pytest

from paddletune.models import build_model, get_spec, ops
from paddletune.models.layers import PackedRows, RMSNorm

FAMILIES = {   # model_type -> config overrides (small, and different q / kv head counts)
    "llama": dict(num_key_value_heads=2), "qwen2": {}, "qwen3": {}, "chatglm": {},
    "gpt2": {}, "opt": {}, "bloom": {}, "baichuan": {}, "qwen": {}, "chatglm6b": {},
    "mixtral": {}, "qwen2_moe": {},
}
TOL = 1e-5


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _model(kind):
    spec = get_spec(kind)
    cfg = dict(spec.tiny_config, **FAMILIES[kind])
    cfg["padded_vocab_size" if kind == "chatglm" else "vocab_size"] = 96
    cfg["initializer_range"] = 0.1
    return build_model(cfg, seed=0)


def _run(model, column, **inputs):
    """Logits and every parameter gradient of sum(logits * w) under op-table `column`; w is 0 on
    padded query rows (they carry no loss; a fully blocked row's gradient is left undefined:
    masked_fill stops it, an additive mask does not)."""
    ops.TAKEN.clear()
    model.clear_gradients()
    with ops.use(column):
        logits = model(**inputs).logits
        w = np.random.RandomState(1).standard_normal(logits.shape).astype("float32")
        if "attention_mask" in inputs:
            w *= inputs["attention_mask"].numpy()[:, :, None]
        (logits * paddle.to_tensor(w)).sum().backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    return logits.numpy(), grads, set(ops.TAKEN)


def _inputs(kind, case, B=2, S=12):
    ids = np.random.RandomState(0).randint(10, 90, (B, S))
    if kind == "chatglm6b":   # its layout: prompt, [gMASK] (4), sop (5), answer
        ids[:, 5:7] = [4, 5]
    out = dict(input_ids=paddle.to_tensor(ids))
    if case == "padding":   # left padding of row 0; every family takes an attention_mask
        mask = np.ones((B, S), np.int64)
        mask[0, :3] = 0
        out["attention_mask"] = paddle.to_tensor(mask)
    if case == "packed":
        out["segment_ids"] = paddle.to_tensor(np.array([[0] * 5 + [1] * 7, [0] * 12]))
    return out


ALIBI = {"bloom"}   # ALiBi: plain paddle ops in the gpu column (no fused op takes a bias slope)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_gpu_column_equals_cpu_column(kind):
    """Causal (flash_attention), padded (sdpa with the additive mask) and packed (sdpa per block)
    batches: logits and all gradients of the forced gpu column equal the cpu column's."""
    model = _model(kind)
    model.train()   # dropout is 0 in the tiny configs; train mode runs the training path
    cases = ["causal", "padding"] + ([] if kind in ("chatglm6b",) else ["packed"])
    for case in cases:
        inputs = _inputs(kind, case)
        try:
            ref, gref, _ = _run(model, "cpu", **inputs)
        except (TypeError, ValueError, NotImplementedError) as e:
            if case == "packed":   # a family without packed rows refuses them the same on both
                with pytest.raises(type(e)):
                    _run(model, "gpu", **inputs)
                continue
            raise
        out, grads, taken = _run(model, "gpu", **inputs)
        assert rel(out, ref) <= TOL, (kind, case, rel(out, ref))
        assert set(grads) == set(gref)
        # a key bias's gradient is 0 in exact arithmetic (softmax is shift-invariant): rounding
        # noise ~1e-9 on both sides; such tensors are measured against 1e-3 of the largest gradient
        floor = 1e-3 * max(np.abs(g).max() for g in gref.values())
        err = {n: np.abs(grads[n] - gref[n]).max() / max(np.abs(gref[n]).max(), floor) for n in gref}
        worst = max(err, key=err.get)
        assert err[worst] <= TOL, (kind, case, worst, err[worst])
        if kind not in ALIBI and kind != "chatglm6b":   # chatglm6b: its own 2-D mask, always sdpa
            want = "flash_attention" if case == "causal" else "scaled_dot_product_attention"
            assert want in taken, (kind, case, taken)
        if kind in ("llama", "qwen2", "qwen3", "chatglm", "baichuan", "qwen", "mixtral", "qwen2_moe"):
            assert "swiglu" in taken, (kind, taken)


def test_ops_level_attention_matches_dense_path():
    """The table's attention on q [B, N, S, D], k/v [B, K, T, D] with grouped heads: causal
    (flash), padding (sdpa) and packed rows (sdpa per block) against the cpu path."""
    from paddletune.models.layers import attention, attention_bias

    rng = np.random.RandomState(0)
    B, N, K, S, D = 2, 4, 2, 10, 8
    t = lambda *s: paddle.to_tensor(rng.standard_normal(s).astype("float32"), stop_gradient=False)  # noqa
    q, k, v = t(B, N, S, D), t(B, K, S, D), t(B, K, S, D)
    pad = np.ones((B, S), np.int64)
    pad[1, 6:] = 0   # right padding: no fully blocked query row (see _run)
    biases = {"causal": attention_bias(B, S, 0), "padding": attention_bias(B, S, 0, paddle.to_tensor(pad)),
              "packed": attention_bias(B, S, 0, segment_ids=paddle.to_tensor([[0] * 3 + [1] * 7, [0] * 10]))}
    assert isinstance(biases["packed"], PackedRows)
    for name, bias in biases.items():
        res = {}
        for col in ("cpu", "gpu"):
            for x in (q, k, v):
                x.clear_gradient()
            with ops.use(col):
                out = attention(q, k, v, bias, scale=0.3)
            (out * out).sum().backward()
            res[col] = [out.numpy()] + [x.grad.numpy() for x in (q, k, v)]
        for a, b in zip(res["gpu"], res["cpu"]):
            assert rel(a, b) <= TOL, (name, rel(a, b))


def _sig(fn, args, kwargs):
    assert fn.__module__.startswith("paddle."), fn.__module__
    inspect.signature(fn).bind(*args, **kwargs)


def test_every_gpu_entry_binds_to_the_paddle_signature():
    """The exact arguments the table passes bind to each paddle function's signature."""
    import paddle.nn.functional as F
    from paddle.incubate.nn.functional import fused_rms_norm, fused_rotary_position_embedding
    from paddle.nn.functional.flash_attention import flash_attention, flashmask_attention

    B, S, N, K, D = 2, 6, 4, 2, 8
    qs, ks = paddle.zeros([B, S, N, D]), paddle.zeros([B, S, K, D])
    bias = paddle.zeros([B, 1, S, S], "bool")
    _sig(F.scaled_dot_product_attention, *ops.sdpa_args(qs, ks, ks, bias, 0.1, True, 0.3, -1e9))
    _sig(flash_attention, *ops.flash_args(qs, ks, ks, 0.1, True, 0.3))
    layout = PackedRows(np.array([[0, 0, 1, 1, 1, 2], [0] * 6]))
    args, kwargs = ops.flashmask_args(qs, ks, ks, layout, 0.0, True, 0.3)
    _sig(flashmask_attention, args, kwargs)
    assert args[3].shape == [B, 1, S, 1] and args[3].dtype == paddle.int32
    _sig(fused_rms_norm, *ops.rms_norm_args(paddle.zeros([B, S, 16]), paddle.ones([16]), 1e-6))
    cos = paddle.zeros([B, S, D])
    _sig(fused_rotary_position_embedding, *ops.rope_args(qs, cos, cos))
    _sig(F.swiglu, *ops.swiglu_args(qs, qs))


def test_flashmask_ends_and_rope_tables_follow_the_ops_contracts():
    """Hand-worked: segments [0,0,1,1,1,2] -> each key's example end [2,2,5,5,5,6]; under
    flashmask's causal contract (query i may not see key j when i >= end_j or j > i) that is the
    PackedRows block mask. The rope arguments, under fused rope's documented contract
    (out = x*cos[pos] + rotate_half(x)*sin[pos], tables [1, L, 1, D]), give the cpu rope."""
    layout = PackedRows(np.array([[0, 0, 1, 1, 1, 2]]))
    ends = layout.key_ends()
    assert ends.tolist() == [[2, 2, 5, 5, 5, 6]]
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    blocked = (i >= ends[0][None, :]) | (j > i)
    mine = np.zeros((6, 6), bool) | True
    for _, lo, hi, m in layout.blocks:
        mine[lo:hi, lo:hi] = m.numpy()[0, 0]
    assert (blocked == mine).all()

    from paddletune.models.layers import RopeTables, rope_cos_sin, rope_inv_freq

    B, S, N, D = 2, 5, 3, 8
    x = paddle.to_tensor(np.random.RandomState(0).standard_normal((B, S, N, D)).astype("float32"))
    pos = paddle.to_tensor(np.array([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]))
    cos, sin = rope_cos_sin(pos, rope_inv_freq(D, {}))
    (xa, _, _), kw = ops.rope_args(x, cos, sin)
    p = kw["position_ids"].numpy()
    c, s = kw["cos"].numpy()[0, :, 0][p][:, :, None], kw["sin"].numpy()[0, :, 0][p][:, :, None]
    xn = xa.numpy()
    emulated = xn * c + np.concatenate([-xn[..., D // 2:], xn[..., :D // 2]], -1) * s
    with ops.use("cpu"):
        ref = RopeTables(cos, sin).apply_heads_first(x, 0.5).numpy()
    assert rel(emulated.transpose(0, 2, 1, 3) * 0.5, ref) <= TOL
    with ops.use("gpu"):   # on CPU the gpu column's rope is the plain-op fallback
        assert rel(RopeTables(cos, sin).apply_heads_first(x, 0.5).numpy(), ref) <= TOL


def test_fused_rms_norm_cpu_kernel_or_the_reason_it_is_guarded(monkeypatch):
    """paddle 3.3.1's CPU build has fused_rms_norm's forward only: one float32 kernel
    (phi::fusion::RmsNormAvxKernel<float> in libphi_core.so, AVX-512F code: on an AVX2-only CPU its
    `vmovaps %zmm0,0x80(%rsp)` raises SIGILL, docs/gpu.md) and no backward kernel. So on an
    AVX-512F CPU the table takes it for float32 without gradients and it equals the cpu column;
    with gradients (every CPU) it takes plain ops, whose values and gradients equal the cpu
    column's; without AVX-512F the fused kernel dies with SIGILL. Fails if any of this changes."""
    from paddle.base import core

    registered = core._get_all_register_op_kernels("phi")
    cpu_fwd = [k for k in registered.get("fused_rms_norm_quant", []) if "Place(cpu)" in k]
    assert len(cpu_fwd) == 1 and "data_type[float]" in cpu_fwd[0], cpu_fwd
    assert not [k for k in registered.get("fused_rms_norm_quant_grad", []) if "Place(cpu)" in k]
    code = (
        "import numpy as np, paddle\n"
        "from paddle.incubate.nn.functional import fused_rms_norm\n"
        "from paddletune.models import ops\n"
        "from paddletune.models.layers import RMSNorm\n"
        "x = paddle.to_tensor(np.random.RandomState(0).standard_normal((3, 5, 64)).astype('float32'))\n"
        "n = RMSNorm(64, 1e-6); n.weight.set_value(np.linspace(0.5, 1.5, 64).astype('float32'))\n"
        "with paddle.no_grad():\n"
        "    fused_rms_norm(x, n.weight, None, 1e-6, begin_norm_axis=2)\n"   # SIGILL without AVX-512F
        "    with ops.use('cpu'): ref = n(x).numpy()\n"
        "    ops.TAKEN.clear()\n"
        "    with ops.use('gpu'): y = n(x).numpy()\n"
        "assert 'fused_rms_norm' in ops.TAKEN\n"
        "print(float(np.abs(y - ref).max() / np.abs(ref).max()))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if ops._cpu_has_avx512():
        assert r.returncode == 0, r.stderr[-2000:]
        assert float(r.stdout.strip().splitlines()[-1]) <= TOL
    else:
        assert r.returncode == -4, (r.returncode, r.stderr[-1000:])   # -SIGILL
    # with gradients the table must not call it even on an AVX-512F CPU (forced here)
    import paddle.incubate.nn.functional as IF

    def no_backward(*a, **k):
        raise AssertionError("fused_rms_norm called on CPU with gradients: no CPU backward")

    monkeypatch.setattr(ops, "_cpu_has_avx512", lambda: True)
    monkeypatch.setattr(IF, "fused_rms_norm", no_backward)
    n = RMSNorm(64, 1e-6)
    n.weight.set_value(np.linspace(0.5, 1.5, 64).astype("float32"))
    x = paddle.to_tensor(np.random.RandomState(1).standard_normal((3, 5, 64)).astype("float32"),
                         stop_gradient=False)
    res = {}
    for col in ("cpu", "gpu"):
        x.clear_gradient(), n.weight.clear_gradient(), ops.TAKEN.clear()
        with ops.use(col):
            y = n(x)
        (y * y).sum().backward()
        res[col] = [y.numpy(), x.grad.numpy(), n.weight.grad.numpy()]
        assert "fused_rms_norm" not in ops.TAKEN   # no CPU backward kernel: plain ops
    for a, b in zip(res["gpu"], res["cpu"]):
        assert rel(a, b) <= TOL


def test_column_choice_is_logged_once_and_forced_by_env():
    code = ("import logging, paddle; logging.basicConfig(level=logging.INFO)\n"
            "from paddletune.models import ops\n"
            "print(ops.column()); ops.column()\n")
    for env, want in (("", "cpu"), ("gpu", "gpu")):
        import os

        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PADDLETUNE_OPS=env))
        assert r.returncode == 0, r.stderr[-1000:]
        assert r.stdout.split()[-1] == want
        assert r.stderr.count("op table:") == 1, r.stderr


def test_quantized_gpu_entries_bind_and_nf4_fp4_use_paddletune_dequantization(monkeypatch):
    """weight_only_linear / weight_quantize / weight_dequantize (the fused backward) get arguments
    that bind to paddle's signatures; nf4 and fp4 have no paddle kernel: never eligible for it,
    even in the gpu column on a CUDA build."""
    from types import SimpleNamespace

    from paddle.nn.quant import weight_dequantize, weight_only_linear, weight_quantize

    from paddletune.quant import ALGORITHMS, gpu

    for algo, bs in (("weight_only_int8", 64), ("weight_only_int4", 64)):
        layer = SimpleNamespace(algo=ALGORITHMS[algo], blocksize=bs, fused_weight=paddle.zeros([8, 64], "int8"),
                                fused_scale=paddle.ones([8]))
        _sig(weight_only_linear, *gpu.weight_only_linear_args(paddle.zeros([2, 64]), layer))
        _sig(weight_quantize, *gpu.weight_quantize_args(paddle.zeros([64, 8]), layer))
        _sig(weight_dequantize, *gpu.weight_dequantize_args(layer))
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    for algo in ("nf4", "fp4"):
        layer = SimpleNamespace(algo=ALGORITHMS[algo], block_axis="in", blocksize=64, in_features=64)
        with ops.use("gpu"):
            assert ALGORITHMS[algo].fused_dtype is None and not gpu._eligible(paddle.zeros([2, 64]), layer)
