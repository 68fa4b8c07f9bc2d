"""Mixed precision (trainer/amp.py, issue 32): paddle.amp.decorate O2 as the Trainer applies it,
the float32 islands, float32 master weights (multi_precision), the unsupported-dtype line, and
fp16 loss scaling's skipped steps (a stub scaler reporting found-inf).

The place check is faked here, in the tests only: paddle's decorate returns the model unchanged
on a CPU place (paddle/amp/auto_cast.py, amp_decorate: `tracer._expected_place.is_gpu_place()`),
so `fake_gpu` answers that check (and the capability checks next to it) as a GPU would; the
casting, excluded layers and multi_precision are then paddle's own code, run on CPU tensors."""
import contextlib
import logging
import sys

import numpy as np
import paddle
import pytest

from amp_fakes import real_fp16_scaler
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
    gs = sys.modules["paddle.amp.grad_scaler"]   # GradScaler's own copy of the check
    monkeypatch.setattr(gs, "_dygraph_tracer", lambda: Tracer(real()))
    monkeypatch.setattr(ac, "_is_gpu_bfloat16_supported", lambda: True)
    monkeypatch.setattr(ac, "_is_gpu_float16_supported", lambda: True)
    monkeypatch.setattr(amp, "amp_settings", lambda fp16, bf16, level: (
        True, "bfloat16" if bf16 else "float16", level))
    monkeypatch.setattr(amp, "amp_unsupported", lambda dtype, capability=None: None)


def _trainer(model, tmp_path, trainable=None, **kw):
    args = training_args(tmp_path / "out", max_steps=2, **kw)
    return Trainer(model, args, train_dataset=copy_pairs(n=8, vocab=500), trainable=trainable, export_fn=lambda d: None)


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
    # paddle keys a 16-bit parameter's moments by its master: the state (and the checkpoint's
    # "<name>.master") is found for every parameter and loads back (paddle's CPU adamw kernel
    # is float32 / float64 only, so the 16-bit update itself runs on a GPU: tools/gpu_check.py)
    tensors, meta = t.optimizer.state_dict()
    assert {k.rsplit(".", 1)[1] for k in tensors} == {"exp_avg", "exp_avg_sq", "master"}
    assert {k[:-len(".master")] for k in tensors if k.endswith(".master")} == set(masters)
    tensors[f"{n}.master"] = tensors[f"{n}.master"] + 1.0
    t.optimizer.load_state_dict(tensors, meta)
    np.testing.assert_array_equal(masters[n].numpy(), params[n].astype("float32").numpy() + 1.0)


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


class StubScaler:
    """paddle.amp.GradScaler's surface as the Trainer uses it (scale, _unscale, _found_inf,
    _cache_found_inf, update, _scale). On the _unscale calls numbered in `inf_at` (1-based) it
    does what an fp16 overflow does: one gradient holds inf and found_inf is set; update() then
    halves the scale, as GradScaler with decr_every_n_nan_or_inf=1."""

    def __init__(self, inf_at, scale=1024.0):
        self.inf_at, self.calls = set(inf_at), 0
        self._scale = paddle.to_tensor(scale, "float32")
        self._cache_found_inf = False

    def scale(self, loss):   # identity: the gradients are the unscaled run's
        return loss

    def _unscale(self, view):
        self.calls += 1
        grads = [h.grad for h in view._param_groups[0]["params"]]
        found = self.calls in self.inf_at
        if found:
            with paddle.no_grad():
                grads[0].fill_(float("inf"))
        self._found_inf = paddle.to_tensor(found)

    def update(self):
        if self._cache_found_inf:
            self._scale = self._scale * 0.5


def _stub_run(tmp_path, inf_at, steps=6, scale=1024.0, **kw):
    model = tiny("llama")
    args = dict(max_steps=steps, logging_steps=2, learning_rate=1e-3, lr_scheduler_type="linear",
                per_device_train_batch_size=4)
    args.update(kw)
    t = Trainer(model, training_args(tmp_path / "out", **args), train_dataset=copy_pairs(n=8, vocab=500),
                export_fn=lambda d: None)
    t.precision.scaler = StubScaler(inf_at, scale)
    seen = []   # (step, lr, whether the weights changed in this step)
    last = {"w": model.lm_head.weight.numpy().copy()}

    def cb(trainer, info):
        w = model.lm_head.weight.numpy()
        seen.append((info["step"], info["lr"], not np.array_equal(w, last["w"])))
        last["w"] = w.copy()

    t.callbacks.append(cb)
    return t, seen


def test_skipped_steps_are_counted_logged_and_hold_the_schedule(tmp_path, caplog):
    """Steps 2 and 3 overflow: their updates are skipped (weights unchanged, AdamW's step count
    4 of 6), counted (state and log records), logged with the new scale, and not a divergence
    (their gradient norm is inf); the learning rate does not advance on them (PaddleNLP steps its
    lr_scheduler only when the optimizer ran): step 4 uses step 2's rate."""
    from paddletune.trainer.optim import lr_at

    t, seen = _stub_run(tmp_path, inf_at={2, 3})
    with caplog.at_level(logging.WARNING, logger="paddletune"):
        t.train()
    assert [changed for _, _, changed in seen] == [True, False, False, True, True, True]
    assert t.state["skipped_steps"] == 2 and t.optimizer.t == 4
    runs = [0, 1, 1, 1, 2, 3]   # updates done before each step
    assert [lr for _, lr, _ in seen] == [lr_at(r, 6, 1e-3, 0, "linear") for r in runs]
    recs = [r for r in t.state["log_history"] if "skipped_steps" in r]
    assert [(r["step"], r["skipped_steps"], r["loss_scale"]) for r in recs] == [
        (2, 1, 512.0), (4, 1, 256.0), (6, 0, 256.0)]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in recs)
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert lines[0].startswith("step 2 skipped: fp16 gradients overflowed") and "512" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("step 3 skipped")


def test_consecutive_skips_stop_the_run(tmp_path):
    """K = amp_skip_limit skips in a row stop the run with one clear error (here K=3)."""
    t, seen = _stub_run(tmp_path, inf_at=range(1, 10), amp_skip_limit=3)
    with pytest.raises(FloatingPointError, match="step 3 under fp16: 3 consecutive steps skipped"):
        t.train()
    assert len(seen) == 2 and t.optimizer.t == 0


def test_scale_below_one_stops_the_run(tmp_path):
    t, _ = _stub_run(tmp_path, inf_at={1}, scale=1.0)
    with pytest.raises(FloatingPointError, match=r"step 1 under fp16: the loss scale fell to 0.5 \(< 1\)"):
        t.train()


class _Topo:
    world_size, degrees = 2, {"pp": 1}


def test_fp16_scaler_is_paddles_and_distributed_over_ranks(fake_gpu, monkeypatch):
    """fp16: a paddle.amp.GradScaler from scale_loss and the amp_* keys; with two ranks (and
    fleet's topology) wrapped by fleet.distributed_scaler, so every rank agrees on a skip. bf16:
    no scaler."""
    from paddle.distributed import fleet

    calls = []
    monkeypatch.setattr(fleet, "distributed_scaler", lambda s: calls.append(s) or s)
    monkeypatch.setattr(fleet.fleet, "_hcg", object(), raising=False)
    args = training_args("/tmp/unused", fp16=True, scale_loss=4096.0, amp_incr_ratio=3.0,
                         amp_decr_ratio=0.25, amp_incr_every_n_steps=7, amp_decr_every_n_nan_or_inf=5)
    p = amp.Precision(args, _Topo())
    assert isinstance(p.scaler, paddle.amp.GradScaler) and calls == [p.scaler]
    s = p.scaler
    assert (s._init_loss_scaling, s._incr_ratio, s._decr_ratio, s._incr_every_n_steps,
            s._decr_every_n_nan_or_inf) == (4096.0, 3.0, 0.25, 7, 5)
    assert amp.Precision(args).scaler is not None and len(calls) == 1   # one process: as is
    assert amp.Precision(training_args("/tmp/unused", bf16=True)).scaler is None


def test_paddles_scaler_skips_a_real_overflow_and_unscales_exactly(tmp_path, monkeypatch):
    """paddle's own GradScaler (its place check faked, as in fake_gpu; compute stays float32):
    scale_loss 2^127 overflows the first step's scaled loss, the step is skipped and the scale
    drops to 2^27 (amp_decr_ratio 2^-100); the later steps are scaled and unscaled by powers of
    two, exactly, so the weights equal a run whose stub skips step 1 and never scales."""
    kw = dict(scale_loss=2.0 ** 127, amp_decr_ratio=2.0 ** -100, amp_decr_every_n_nan_or_inf=1,
              max_steps=4)
    t, _ = _stub_run(tmp_path / "real", inf_at=(), **kw)
    t.precision.scaler = real_fp16_scaler(t.precision)
    # GradScaler.scale turns itself off unless auto_cast ran in float16 (it reads the global AMP
    # dtype, which auto_cast(dtype="float16") sets on a GPU: amp/auto_cast.py amp_guard); here the
    # forward runs float32 without auto_cast (it is disabled on CPU anyway) and the dtype is set
    monkeypatch.setattr(sys.modules["paddle.amp.auto_cast"].amp_global_state(), "amp_dtype", "float16")
    t.precision.autocast = contextlib.nullcontext
    assert t.precision.scaler.is_enable()
    t.train()
    ref, _ = _stub_run(tmp_path / "ref", inf_at={1}, **kw)
    ref.train()
    assert t.state["skipped_steps"] == 1 and t.optimizer.t == 3
    assert [r["loss_scale"] for r in t.state["log_history"] if "loss_scale" in r] == [2.0 ** 27] * 2
    for (n, p), (_, q) in zip(t.model.named_parameters(), ref.model.named_parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=n)


def test_o2_checkpoint_round_trip(fake_gpu, tmp_path):
    """An O2 checkpoint holds the 16-bit weights' values (widened, not their raw words) and the
    float32 masters; a fresh O2 Trainer resuming from it gets both back exactly."""
    from paddletune.trainer import resume

    t = _trainer(tiny("llama"), tmp_path / "a", bf16=True, fp16_opt_level="O2")
    name = "model.layers.0.self_attn.q_proj.weight"
    p, m = t.trainable[name], t.optimizer.masters()[name]
    p.set_value((p.astype("float32") + 0.5).astype("bfloat16"))
    m.set_value(m + 0.25)
    path = t.save_checkpoint() or t.checkpoint_path(0)
    t2 = _trainer(tiny("llama"), tmp_path / "b", bf16=True, fp16_opt_level="O2")
    assert not np.array_equal(t2.trainable[name].astype("float32").numpy(), p.astype("float32").numpy())
    resume.resume(t2, path)
    np.testing.assert_array_equal(t2.trainable[name].astype("float32").numpy(), p.astype("float32").numpy())
    assert t2.trainable[name].dtype == paddle.bfloat16
    np.testing.assert_array_equal(t2.optimizer.masters()[name].numpy(), m.numpy())
