"""Adapter, LowRankAdapter, BitFit: trainable sets against hand counts, identity at start,
each wrapped layer's forward and the whole model's logits against the documented formulas in
numpy (non-zero adapter weights), save -> load, bad shapes, copy-task learning.
Oracles: hand counts, numpy formulas, the base model, the copy task."""
import math

import numpy as np
import paddle
import pytest

from peft_util import tiny, ids, run
from conftest import copy_pairs, hf_checkpoint, rel_err, token_accuracy, training_args
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


# ---------------------------------------------------------------- forwards against numpy formulas
_erf = np.frompyfunc(math.erf, 1, 1)


def gelu(x):
    """Exact gelu: x * Phi(x) = x/2 * (1 + erf(x / sqrt 2)), in float64."""
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


def gelu_tanh(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def np_bottleneck(method, w, y, act=gelu):
    """The documented bottleneck in numpy (paddle layout [in, out]); w: {parameter tail: array}.
    adapter:          up(act(down(y)))   down(y) = y @ Wd + bd,  up(z) = z @ Wu + bu
    lowrank_adapter:  down(y) = (y @ Da) @ Db + bd,  up(z) = (z @ Ua) @ Ub + bu"""
    y = np.asarray(y, np.float64)
    if method == "adapter":
        z = act(y @ w["adapter_down.weight"] + w["adapter_down.bias"])
        return z @ w["adapter_up.weight"] + w["adapter_up.bias"]
    z = act(y @ w["adapter_down.0.weight"] @ w["adapter_down.1.weight"] + w["adapter_down.1.bias"])
    return z @ w["adapter_up.0.weight"] @ w["adapter_up.1.weight"] + w["adapter_up.1.bias"]


def np_layer(method, w, x, act=gelu):
    """The wrapped layer's output for input x: base y = x @ W (+ b); adapters y + bottleneck(y);
    BitFit x @ W + b with the trained bias."""
    x = np.asarray(x, np.float64)
    y = x @ w["W"] + w.get("b", 0.0)
    return y if method == "bitfit" else y + np_bottleneck(method, w, y, act)


def randomized(method, scale=0.3, seed=0):
    """A tiny model with `method` applied and every trainable tensor set to N(0, scale) values
    (so the up projections and the BitFit biases are non-zero), and the trainable dict."""
    model = tiny()
    setup = peft.apply(model, margs(**KW[method]))
    rng = np.random.default_rng(seed)
    for p in setup.trainable.values():
        p.set_value((rng.standard_normal(p.shape) * scale).astype(np.float32))
    return model, setup.trainable


def layer_weights(method, model, trainable, name):
    """numpy copies of one wrapped layer's tensors: W (and b) of the base Linear, the adapter's."""
    layer = dict(model.named_sublayers())[name]
    base = layer if method == "bitfit" else layer.base_layer
    w = {"W": base.weight.numpy().astype(np.float64)}
    if base.bias is not None:
        w["b"] = base.bias.numpy().astype(np.float64)
    pre = name + "."
    w.update({n[len(pre):]: p.numpy().astype(np.float64) for n, p in trainable.items()
              if n.startswith(pre) and n != pre + "bias"})
    return w


def targets(trainable):
    """Names of the wrapped layers, from the trainable tensors' names."""
    return sorted({n.split(".adapter_")[0] if ".adapter_" in n else n[:-len(".bias")]
                   for n in trainable})


TOL = 1e-6   # float32 layer vs float64 numpy: observed <= 4e-7; erf vs tanh gelu differ by >= 1.5e-5


@pytest.mark.parametrize("method", ["adapter", "lowrank_adapter", "bitfit"])
def test_each_wrapped_layer_forward_equals_numpy_formula(method):
    model, trainable = randomized(method)
    names = targets(trainable)
    assert len(names) == (14 if method == "bitfit" else 4)
    rng = np.random.default_rng(1)
    for name in names:
        layer = dict(model.named_sublayers())[name]
        w = layer_weights(method, model, trainable, name)
        x = rng.standard_normal((2, 5, w["W"].shape[0])).astype(np.float32) * 2.0
        with paddle.no_grad():
            out = layer(paddle.to_tensor(x)).numpy()
        assert rel_err(out, np_layer(method, w, x)) <= TOL, name
        base_only = x.astype(np.float64) @ w["W"]
        assert rel_err(out, base_only) > 1e-2, name      # the adapter / bias really contributes
        if method != "bitfit":   # tight enough to tell exact (erf) gelu from the tanh form
            assert rel_err(out, np_layer(method, w, x, gelu_tanh)) > 10 * TOL, name


@pytest.mark.parametrize("method", ["adapter", "lowrank_adapter"])
def test_adapter_class_on_a_biased_linear_equals_numpy_formula(method):
    """The wrapper classes on a base Linear that has a bias (Qwen2's q/k/v style), weights
    all random: y = x @ W + b, then y + up(gelu(down(y)))."""
    from paddletune.peft.adapter import AdapterLinear
    from paddletune.peft.lowrank_adapter import LowRankAdapterLinear

    paddle.seed(0)
    base = paddle.nn.Linear(12, 10)
    layer = AdapterLinear(base, 6) if method == "adapter" else LowRankAdapterLinear(base, 6, 3)
    rng = np.random.default_rng(2)
    w = {}
    for n, p in layer.named_parameters():
        p.set_value((rng.standard_normal(p.shape) * 0.5).astype(np.float32))
        w[{"base_layer.weight": "W", "base_layer.bias": "b"}.get(n, n)] = p.numpy().astype(np.float64)
    x = rng.standard_normal((3, 12)).astype(np.float32)
    with paddle.no_grad():
        out = layer(paddle.to_tensor(x)).numpy()
    assert rel_err(out, np_layer(method, w, x)) <= TOL
    assert rel_err(out, x @ w["W"] + w["b"]) > 1e-2


@pytest.mark.parametrize("method", ["adapter", "lowrank_adapter", "bitfit"])
def test_whole_model_logits_equal_transformers_with_numpy_layers(tmp_path, method):
    """Logits of our model with a random adapter (every adapted layer non-zero) equal the
    transformers model of the same checkpoint (torch, never wrapped) in which each adapted
    layer's output y is replaced, through a forward hook, by the numpy formula:
    y + up(gelu(down(y))) for the adapters, y + b for BitFit."""
    import torch

    from paddletune.loading import load_model

    path, ref = hf_checkpoint(tmp_path / "ck", "llama")
    model = load_model(path)
    setup = peft.apply(model, margs(**KW[method]))
    rng = np.random.default_rng(0)
    for p in setup.trainable.values():
        p.set_value((rng.standard_normal(p.shape) * 0.3).astype(np.float32))
    x = ids()
    ours = run(model, x)
    with torch.no_grad():
        plain = ref(torch.tensor(x)).logits.numpy()
    torch_layers = dict(ref.named_modules())
    hooks = []
    for name in targets(setup.trainable):
        w = layer_weights(method, model, setup.trainable, name)

        def hook(module, inputs, output, w=w):
            y = output.detach().numpy().astype(np.float64)
            new = y + (w["b"] if method == "bitfit" else np_bottleneck(method, w, y))
            return torch.from_numpy(new.astype(np.float32))

        hooks.append(torch_layers[name].register_forward_hook(hook))
    with torch.no_grad():
        want = ref(torch.tensor(x)).logits.numpy()
    for h in hooks:
        h.remove()
    assert len(hooks) == (14 if method == "bitfit" else 4)
    assert rel_err(ours, want) <= 1e-5
    assert rel_err(ours, plain) > 1e-2       # the adapters change the output a lot


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
