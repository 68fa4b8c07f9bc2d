"""Weights in the compute dtype: the loader reads bf16 / fp16 as 16-bit words straight into
parameters of that dtype, and a float64 model trains end to end in float64 (every parameter and
activation), with the float32 run's losses."""
import json
import os

import numpy as np
import paddle
import pytest

from paddletune.loading import load_model
from paddletune.models import build_model, get_spec, hf, save_pretrained
from paddletune.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("ck") / "llama"), "llama", seed=0)


def test_bf16_checkpoint_loads_word_for_word(tmp_path, tiny):
    """A bf16 export read with dtype bfloat16: every parameter is bfloat16 and holds exactly the
    file's 16-bit words (compared with the raw bytes, not through float32)."""
    model = load_model(tiny)
    save_pretrained(model, str(tmp_path / "bf16"), dtype="bfloat16")
    m16 = load_model(str(tmp_path / "bf16"), dtype="bfloat16")
    reader = hf.CheckpointReader(str(tmp_path / "bf16"))
    spec = m16.spec
    params = dict(m16.named_parameters())
    assert params and all(p.dtype == paddle.bfloat16 for p in params.values())
    for name, p in params.items():
        view, code = reader.files[name]._raw(reader.stored_name(name))
        assert code == "BF16"
        words = hf.to_paddle_layout(spec, name, np.array(view))
        assert np.array_equal(p.numpy().view(np.uint16), words), name
    # float16 from the same bf16 file: numpy's conversion of the exact values
    m_half = load_model(str(tmp_path / "bf16"), dtype="float16")
    name = next(iter(params))
    want = hf.to_paddle_layout(spec, name, hf.bf16_to_f32(np.array(reader.files[name]._raw(name)[0])))
    got = dict(m_half.named_parameters())[name]
    assert got.dtype == paddle.float16 and np.array_equal(got.numpy(), want.astype(np.float16))


def test_unsupported_dtype_is_refused(tiny):
    with pytest.raises(ValueError, match="int8"):
        load_model(tiny, dtype="int8")


def _train(path, dtype, steps=4):
    """Full fine-tuning, SGD-free plain AdamW steps through the Trainer; returns (losses, model,
    activation dtypes seen)."""
    from conftest import copy_pairs, training_args
    from paddletune.trainer import Trainer

    paddle.seed(0)
    model = load_model(path, dtype=dtype)
    seen = set()

    def hook(layer, inputs, output):
        outs = output if isinstance(output, (tuple, list)) else [output]
        for o in outs:
            if isinstance(o, paddle.Tensor) and o.dtype.name.lower().startswith(("float", "bfloat")):
                seen.add((type(layer).__name__, str(o.dtype)))
            elif hasattr(o, "logits") and o.logits is not None:
                seen.add((type(layer).__name__, str(o.logits.dtype)))
    for layer in model.sublayers(include_self=True):
        layer.register_forward_post_hook(hook)
    trainer = Trainer(model, training_args(os.path.dirname(path) + f"/out_{dtype}", max_steps=steps,
                                           logging_steps=1, learning_rate=1e-3, per_device_train_batch_size=4),
                      train_dataset=copy_pairs(n=8), export_fn=lambda d: None)
    trainer.train()
    losses = [r["loss"] for r in trainer.state["log_history"] if "loss" in r]
    return losses, model, seen


def test_float64_training_stays_float64_and_matches_float32(tiny):
    l32, _, _ = _train(tiny, "float32")
    l64, model, seen = _train(tiny, "float64")
    assert len(l64) == 4 and len(l32) == 4
    assert {str(p.dtype) for p in model.parameters()} == {"paddle.float64"}
    assert seen and {d for _, d in seen} == {"paddle.float64"}, sorted(seen)
    np.testing.assert_allclose(l64, l32, rtol=1e-6, atol=0)
    from conftest import copy_pairs, lm_loss   # the loss itself runs in float64 (no float32 hop)

    model.train()
    ex = copy_pairs(n=2)[0]
    out = lm_loss(model, [ex["input_ids"]], [ex["labels"]])
    assert out.loss_sum.dtype == paddle.float64
    out.loss_sum.backward()
    assert {str(p.grad.dtype) for p in model.parameters()} == {"paddle.float64"}
