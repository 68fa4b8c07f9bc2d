"""The quantized layout is slice-aligned for tensor parallelism: quantizing a slice of W [out, in]
gives, bitwise, the slice of the quantized W, for column-parallel splits (output rows, blocks
along `in`) and row-parallel splits (input columns, blocks along `out`), at widths that are not
multiples of the block size, with and without double quantization, for TP degrees 2 and 3
(uneven splits included: any contiguous range of lines works).

Oracles: quantize_weight of the numpy slice itself (what a TP rank does with the part of the
checkpoint it reads); raw bytes of every array; numpy float64 products with the dequantized W.
"""
import numpy as np
import paddle
import pytest

from paddletune.quant import (QuantConfig, QuantizedLinear, block_axis_for, quantize_model,
                              quantize_weight, slice_state, state_shapes)
from paddletune.quant import weight_only

CASES = [("weight_only_int8", False), ("weight_only_int4", False), ("weight_only_int4", True),
         ("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True)]
# (W shape [out, in], double_quant_blocksize). Neither width is a multiple of 64. [456, 360] in
# groups of 5 blocks: lines of 6 and 8 blocks, so each line has a short last group, and double
# quantization applies along both axes. [96, 160] with groups of 256: lines of 160 (3 blocks)
# are double-quantized, lines of 96 (2 blocks) keep float32 absmaxes (smaller).
SHAPES = [((96, 160), 256), ((456, 360), 5)]
BLOCK_AXIS_OF_SPLIT = {"out": "in", "in": "out"}   # blocks run along the axis not split


def bounds(n, degree):
    """Contiguous rank ranges [(start, stop)] of n lines over `degree` ranks (uneven allowed)."""
    cuts = [n * r // degree for r in range(degree + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def assert_same_bytes(got, want, what):
    assert sorted(got) == sorted(want), what
    for k in want:
        a, b = np.asarray(got[k]), np.asarray(want[k])
        assert a.dtype == b.dtype and a.shape == b.shape, (what, k, a.dtype, a.shape, b.shape)
        assert np.array_equal(a, b) and a.tobytes() == b.tobytes(), (what, k)


def layer_from_state(state, out_f, in_f, cfg, block_axis):
    return QuantizedLinear(in_f, out_f, cfg, block_axis=block_axis).load_state(state)


@pytest.mark.parametrize("shape,group", SHAPES)
@pytest.mark.parametrize("split", ["out", "in"])
@pytest.mark.parametrize("algo,dq", CASES)
def test_quantized_slice_equals_slice_of_quantized(algo, dq, split, shape, group):
    rng = np.random.default_rng(11)
    w = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    w[3] = 0.0                                        # an all-zero row: scale fallbacks too
    cfg = QuantConfig(algo, 64, dq, group)
    axis = BLOCK_AXIS_OF_SPLIT[split]
    whole = quantize_weight(w, cfg, axis)
    # the rule of the layout (module docstring of weight_only): double quantization only where a
    # line of nb blocks is smaller that way than with float32 absmaxes
    length = shape[1] if axis == "in" else shape[0]
    nb = -(-length // 64)
    expect_dq = dq and algo != "weight_only_int8" and nb + 4 * -(-nb // group) + 4 < 4 * nb
    assert ("absmax_q" in whole) == expect_dq
    whole_layer = layer_from_state(whole, *shape, cfg, axis)
    deq_whole = whole_layer.dequantize().numpy()      # paddle layout [in, out]
    n = shape[0] if split == "out" else shape[1]
    for degree in (2, 3):
        rows_held = 0
        for start, stop in bounds(n, degree):
            part = w[start:stop] if split == "out" else w[:, start:stop]
            local = quantize_weight(part, cfg, axis)
            sliced = slice_state(whole, axis, split, start, stop)
            assert_same_bytes(sliced, local, (degree, start, stop))
            assert_same_bytes(whole_layer.slice_state(split, start, stop), local, "method")
            # really a slice: the local state has the local weight's shapes, not the whole's
            want = state_shapes(*part.shape, cfg, axis)
            assert {k: list(v.shape) for k, v in local.items()} == {k: s for k, (s, _) in
                                                                     want.items()}
            rows_held += local["codes"].shape[0]
            deq = layer_from_state(sliced, *part.shape, cfg, axis).dequantize().numpy()
            # paddle layout [in, out]: HF `out` is paddle axis 1, HF `in` paddle axis 0
            ref = deq_whole[:, start:stop] if split == "out" else deq_whole[start:stop]
            assert np.array_equal(deq, ref)
        assert rows_held == n


def test_slice_state_refuses_the_block_axis_and_bad_ranges():
    w = np.random.default_rng(0).standard_normal((96, 160)).astype(np.float32)
    state = quantize_weight(w, QuantConfig("nf4"), "in")
    with pytest.raises(ValueError, match="block_axis='out'"):
        slice_state(state, "in", "in", 0, 80)
    with pytest.raises(ValueError, match="outside"):
        slice_state(state, "in", "out", 48, 97)
    with pytest.raises(ValueError, match="block_axis"):
        QuantizedLinear(160, 96, QuantConfig("nf4"), block_axis="rows")
    layer = QuantizedLinear(160, 48, QuantConfig("nf4"), block_axis="out")
    with pytest.raises(ValueError, match="does not fit"):
        layer.load_state(slice_state(state, "in", "out", 0, 48))   # blocks along the wrong axis


@pytest.mark.parametrize("chunk", [1 << 24, 64 * 7])
@pytest.mark.parametrize("algo,dq", [("weight_only_int8", False), ("nf4", True), ("fp4", False)])
def test_matmul_with_blocks_along_out(algo, dq, chunk, monkeypatch):
    """y = x @ W^T and dx = dy @ W of a layer with blocks along `out` (lines = input columns),
    against float64 products with its own dequantized W; chunk 64*7 splits the 100 lines into
    chunks of 7 (nf4/fp4 lines of 40 pad to 64) or 11 (int8), so y is summed over chunks."""
    monkeypatch.setattr(weight_only, "DEQUANT_CHUNK", chunk)
    rng = np.random.default_rng(12)
    w = (rng.standard_normal((40, 100)) * 0.1).astype(np.float32)
    layer = QuantizedLinear(100, 40, QuantConfig(algo, 64, dq, 1), block_axis="out").set_weight(w)
    assert (len(weight_only.line_chunks(layer)) > 1) == (chunk < 1 << 24)
    wq = layer.dequantize().numpy().T.astype(np.float64)      # HF layout [out, in]
    x = rng.standard_normal((2, 3, 100)).astype(np.float32)
    dy = rng.standard_normal((2, 3, 40)).astype(np.float32)
    xt = paddle.to_tensor(x, stop_gradient=False)
    y = layer(xt)
    (y * paddle.to_tensor(dy)).sum().backward()
    np.testing.assert_allclose(y.numpy(), x @ wq.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(xt.grad.numpy(), dy @ wq, rtol=1e-5, atol=1e-5)
    assert np.abs(wq - w).max() < 0.2 * np.abs(w).max()       # and it is W, quantized


@pytest.mark.parametrize("split", ["out", "in"])
def test_rank_layers_compose_to_the_whole_layer(split):
    """What TP does with the slices: column ranks' outputs side by side, row ranks' partial
    outputs summed, equal the unsplit quantized layer (up to float32 summation order)."""
    rng = np.random.default_rng(13)
    w = (rng.standard_normal((96, 160)) * 0.05).astype(np.float32)
    cfg, axis = QuantConfig("nf4", 64, True), BLOCK_AXIS_OF_SPLIT[split]
    whole = QuantizedLinear(160, 96, cfg, block_axis=axis).set_weight(w)
    x = paddle.to_tensor(rng.standard_normal((4, 160)).astype(np.float32))
    parts = []
    for start, stop in bounds(96 if split == "out" else 160, 3):
        part = w[start:stop] if split == "out" else w[:, start:stop]
        rank = QuantizedLinear(part.shape[1], part.shape[0], cfg, block_axis=axis).set_weight(part)
        parts.append(rank(x) if split == "out" else rank(x[:, start:stop]))
    got = paddle.concat(parts, axis=-1) if split == "out" else paddle.add_n(parts)
    np.testing.assert_allclose(got.numpy(), whole(x).numpy(), rtol=1e-5, atol=1e-6)


def test_model_block_axes_follow_the_tp_plan():
    """Row-plan modules (split along `in`) get blocks along `out`, everything else along `in`;
    an explicit function decides instead when given."""
    from paddletune.models import build_model
    from paddletune.models.spec import get_spec

    cfg = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    model = build_model(cfg, seed=0)
    x = paddle.to_tensor(np.arange(3, 19).reshape(2, 8))
    ref = model(x).logits.numpy()
    quantize_model(model, QuantConfig("weight_only_int8"))
    axes = {n.rsplit(".", 1)[1]: m.block_axis for n, m in model.named_sublayers()
            if isinstance(m, QuantizedLinear)}
    assert axes == {"q_proj": "in", "k_proj": "in", "v_proj": "in", "o_proj": "out",
                    "gate_proj": "in", "up_proj": "in", "down_proj": "out"}
    got = model(x).logits.numpy()
    assert np.abs(got - ref).max() / np.abs(ref).max() < 0.02
    forced = build_model(cfg, seed=0)
    quantize_model(forced, QuantConfig("nf4"), block_axis=lambda name: "in")
    forced_axes = {m.block_axis for _, m in forced.named_sublayers()
                   if isinstance(m, QuantizedLinear)}
    assert forced_axes == {"in"}
    glm = get_spec("chatglm")
    assert block_axis_for(glm, "transformer.encoder.layers.0.self_attention.dense") == "out"
    assert block_axis_for(glm, "transformer.encoder.layers.0.mlp.dense_h_to_4h") == "in"
