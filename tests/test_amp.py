"""Mixed precision (trainer/amp.py, issue 32): paddle.amp.decorate O2 as the Trainer applies it,
the float32 islands, float32 master weights (multi_precision), the unsupported-dtype line, and
fp16 loss scaling's skipped steps (a stub scaler reporting found-inf).

The place check is faked here, in the tests only: paddle's decorate returns the model unchanged
on a CPU place (paddle/amp/auto_cast.py, amp_decorate: `tracer._expected_place.is_gpu_place()`),
so `fake_gpu` answers that check (and the capability checks next to it) as a GPU would; the
casting, excluded layers and multi_precision are then paddle's own code, run on CPU tensors."""
import logging
import sys

import numpy as np
import paddle
import pytest

from conftest import copy_pairs, training_args
from paddletune import peft
from paddletune.args import ArgumentError, ModelArgument
from paddletune.models import build_model, get_spec
from paddletune.trainer import Trainer, amp


def tiny(kind):
    config = dict(get_spec(kind).tiny_config)
    config.setdefault("model_type", kind)
    return build_model(config, seed=0)


@pytest.fixture
def fake_gpu(monkeypatch):
    """paddle's place / capability checks answered as on a GPU (see the module docstring), and
    our device switch saying gpu to the Trainer's precision settings."""
    ac = sys.modules["paddle.amp.auto_cast"]   # (paddle.amp.auto_cast, the attribute, is the function)
    real = ac._dygraph_tracer

    class Place:
        def is_gpu_place(self):
            return True

        def is_xpu_place(self):
            return False

        def is_custom_place(self):
            return False

    class Tracer:
        _expected_place = Place()

        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, key):
            return getattr(self._inner, key)

    monkeypatch.setattr(ac, "_dygraph_tracer", lambda: Tracer(real()))
    monkeypatch.setattr(ac, "_is_gpu_bfloat16_supported", lambda: True)
    monkeypatch.setattr(ac, "_is_gpu_float16_supported", lambda: True)
    monkeypatch.setattr(amp, "amp_settings", lambda fp16, bf16, level: (
        True, "bfloat16" if bf16 else "float16", level))
    monkeypatch.setattr(amp, "amp_unsupported", lambda dtype, capability=None: None)


def _trainer(model, tmp_path, trainable=None, **kw):
    args = training_args(tmp_path / "out", max_steps=2, **kw)
    return Trainer(model, args, train_dataset=copy_pairs(n=8), trainable=trainable, export_fn=lambda d: None)


def _is_island(name):
    return (name.endswith("norm.weight") or ".lora_A." in name or ".lora_B." in name
            or name.endswith("mlp.gate.weight") or "shared_expert_gate" in name
            or ".ln_" in name or name.endswith(("ln_f.weight", "ln_f.bias")))


@pytest.mark.parametrize("kind,dtype", [("llama", "bf16"), ("qwen2_moe", "fp16"), ("gpt2", "bf16")])
def test_o2_decorate_casts_all_but_the_float32_islands(fake_gpu, tmp_path, kind, dtype):
    """Full fine-tuning under O2: every parameter in the compute dtype except RMSNorm / LayerNorm
    weights and MoE routers (float32); the same parameter objects (the optimizer and the
    checkpoint map hold them); paddle's AdamW with multi_precision and a float32 master per
    16-bit parameter, none for the float32 ones."""
    model = tiny(kind)
    before = dict(model.named_parameters())
    want = paddle.bfloat16 if dtype == "bf16" else paddle.float16
    t = _trainer(model, tmp_path, fp16_opt_level="O2", **{dtype: True})
    params = dict(model.named_parameters())
    assert all(params[n] is before[n] for n in params)
    islands = {n for n in params if _is_island(n)}
    assert islands and len(islands) < len(params)
    if kind == "qwen2_moe":
        assert any(n.endswith("mlp.gate.weight") for n in islands)
        assert any("shared_expert_gate" in n for n in islands)
    for n, p in params.items():
        assert p.dtype == (paddle.float32 if n in islands else want), (n, p.dtype)
    assert t.optimizer.opt._multi_precision is True
    masters = t.optimizer.masters()
    assert set(masters) == set(params) - islands
    assert all(m.dtype == paddle.float32 for m in masters.values())
    n = next(iter(masters))   # the master holds the weight's value (the 16-bit one widened)
    np.testing.assert_array_equal(masters[n].numpy(), params[n].astype("float32").numpy())


def test_o2_lora_adapters_stay_float32(fake_gpu, tmp_path):
    """LoRA on a bf16 base: A / B (the trainable ones) float32, the base weights bfloat16; the
    trainable set has no 16-bit parameter, so no master copies."""
    model = tiny("llama")
    setup = peft.apply(model, ModelArgument(model_name_or_path="x", lora=True, lora_rank=4))
    t = _trainer(model, tmp_path, trainable=setup.trainable, bf16=True, fp16_opt_level="O2")
    params = dict(model.named_parameters())
    lora = [n for n in params if ".lora_" in n]
    assert lora and all(params[n].dtype == paddle.float32 for n in lora)
    assert params["model.layers.0.self_attn.q_proj.base_layer.weight"].dtype == paddle.bfloat16
    assert t.optimizer.masters() == {}


def test_o1_keeps_float32_weights(fake_gpu, tmp_path):
    """O1: decorate leaves the weights float32 (ops are cast by auto_cast); no masters."""
    model = tiny("llama")
    t = _trainer(model, tmp_path, bf16=True, fp16_opt_level="O1")
    assert {p.dtype for p in model.parameters()} == {paddle.float32}
    assert t.optimizer.masters() == {} and not t.optimizer.opt._multi_precision


def test_cpu_runs_float32_without_decorating(tmp_path):
    """On this CPU build nothing is faked: bf16 O2 trains float32 (today's behaviour)."""
    model = tiny("llama")
    t = _trainer(model, tmp_path, bf16=True, fp16_opt_level="O2")
    assert not t.precision.enabled and not t.precision.decorated and t.precision.scaler is None
    assert {p.dtype for p in model.parameters()} == {paddle.float32}


def test_unsupported_dtype_is_one_line():
    from paddletune.runtime import amp_unsupported

    with pytest.raises(ArgumentError) as e:
        amp.check_supported("bfloat16", (7, 5))
    msg = str(e.value)
    assert "\n" not in msg and "bf16" in msg and ">= 8.0" in msg and "7.5" in msg and "--fp16" in msg
    with pytest.raises(ArgumentError, match="'fp16' needs compute capability >= 7.0"):
        amp.check_supported("float16", (6, 1))
    assert amp_unsupported("bfloat16", (8, 0)) is None and amp_unsupported("float16", (7, 0)) is None
    assert amp_unsupported("bfloat16") is None   # CPU: no check (float32, warned)
