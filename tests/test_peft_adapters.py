"""Adapter, LowRankAdapter, BitFit: trainable sets against hand counts, identity at start,
save -> load, bad shapes, copy-task learning. Oracles: hand counts, the base model, the copy task."""
import numpy as np
import pytest

from peft_util import tiny, ids, run
from conftest import copy_pairs, rel_err, token_accuracy, training_args
from paddletune import peft
from paddletune.args import ArgumentError, ModelArgument, build
from paddletune.trainer import Trainer

H, I, KV = 64, 512, 32
LINEARS = {"self_attn.q_proj": (H, H), "self_attn.k_proj": (H, KV), "self_attn.v_proj": (H, KV),
           "self_attn.o_proj": (H, H), "mlp.gate_proj": (H, I), "mlp.up_proj": (H, I),
           "mlp.down_proj": (I, H)}


def margs(**kw):
    return ModelArgument(model_name_or_path="paddletune/tiny-llama", **kw)


def expected(method, m=16, r=4):
    """Hand-written trainable shapes per method (paddle layout [in, out])."""
    out = {}
    for layer in range(2):
        for mod, (i, o) in LINEARS.items():
            pre = f"model.layers.{layer}.{mod}"
            if method == "bitfit":
                out[f"{pre}.bias"] = [o]
            elif mod.endswith(("o_proj", "down_proj")) and method == "adapter":
                out.update({f"{pre}.adapter_down.weight": [o, m], f"{pre}.adapter_down.bias": [m],
                            f"{pre}.adapter_up.weight": [m, o], f"{pre}.adapter_up.bias": [o]})
            elif mod.endswith(("o_proj", "down_proj")) and method == "lowrank_adapter":
                out.update({f"{pre}.adapter_down.0.weight": [o, r], f"{pre}.adapter_down.1.weight": [r, m],
                            f"{pre}.adapter_down.1.bias": [m], f"{pre}.adapter_up.0.weight": [m, r],
                            f"{pre}.adapter_up.1.weight": [r, o], f"{pre}.adapter_up.1.bias": [o]})
    return out


COUNTS = {"bitfit": 2 * (64 + 32 + 32 + 64 + 512 + 512 + 64),
          "adapter": 2 * 2 * (64 * 16 + 16 + 16 * 64 + 64),
          "lowrank_adapter": 2 * 2 * (64 * 4 + 4 * 16 + 16 + 16 * 4 + 4 * 64 + 64)}
KW = {"bitfit": dict(bitfit=True), "adapter": dict(adapter=True, adapter_size=16),
      "lowrank_adapter": dict(lowrank_adapter=True, adapter_size=16, lowrank_adapter_rank=4)}


@pytest.mark.parametrize("method", ["adapter", "lowrank_adapter", "bitfit"])
def test_trainable_set_identity_and_save_load(tmp_path, method):
    model = tiny()
    base = run(model, ids())
    setup = peft.apply(model, margs(**KW[method]))
    shapes = {n: list(p.shape) for n, p in setup.trainable.items()}
    assert shapes == expected(method)
    assert sum(int(np.prod(s)) for s in shapes.values()) == COUNTS[method]
    assert all(p.stop_gradient == (n not in shapes) for n, p in model.named_parameters())
    assert rel_err(run(model, ids()), base) == 0.0        # a fresh adapter changes nothing
    rng = np.random.default_rng(0)
    for p in setup.trainable.values():
        p.set_value((rng.standard_normal(p.shape) * 0.1).astype(np.float32))
    want = run(model, ids())
    assert rel_err(want, base) > 1e-2
    setup.export_fn(str(tmp_path / "out"))
    assert peft.adapter_type(str(tmp_path / "out")) == method.upper()
    loaded = peft.load_adapter(tiny(), str(tmp_path / "out"))
    assert rel_err(run(loaded, ids()), want) < 1e-6
    with pytest.raises(ValueError, match="other shapes|no Linear"):
        peft.load_adapter(tiny(hidden_size=32), str(tmp_path / "out"))


STEPS = {"adapter": (100, 3e-2), "lowrank_adapter": (100, 3e-2), "bitfit": (200, 1e-1)}


@pytest.mark.parametrize("method", ["adapter", "lowrank_adapter", "bitfit"])
def test_copy_task_reaches_full_accuracy(tmp_path, method):
    model = tiny(initializer_range=0.15) if method == "bitfit" else tiny()
    data = copy_pairs()
    assert token_accuracy(model, data) < 0.2
    kw = dict(KW[method], adapter_size=64, lowrank_adapter_rank=8)
    setup = peft.apply(model, margs(**kw))
    steps, lr = STEPS[method]
    Trainer(model, training_args(tmp_path, max_steps=steps, learning_rate=lr), train_dataset=data,
            trainable=setup.trainable, export_fn=lambda d: None).train()
    assert token_accuracy(model, data) == 1.0


def test_bad_combinations():
    base = {"model_name_or_path": "m", "dataset_name_or_path": "d", "output_dir": "o"}
    with pytest.raises(ArgumentError, match="adapter.*cannot be combined with lora"):
        build(dict(base, lora=True, adapter=True))
    with pytest.raises(ArgumentError, match="neftune_noise_alpha"):
        build(dict(base, neftune=True, neftune_noise_alpha=-1))
    with pytest.raises(AssertionError, match="cannot be combined"):
        peft.apply(tiny(), margs(bitfit=True, adapter=True))
