"""paddle's group_sharded stage 3 and frozen parameters: what a rank holds, between steps and at
the end of backward, as counted by benchmarks/sharding_memory.py's `held_by_kind` (--peft mode).

    python -m paddle.distributed.launch --nproc_per_node 2 --log_dir /tmp/gslog \
        tools/probes/gs_held_probe.py [--release-frozen none|step|backward] [--steps 3] [--json OUT]

An MLP 16 -> 256 -> 256 -> 256 -> 4 (l1, l4 trainable; l2, l3 frozen: a LoRA backbone stand-in)
with a 4096-byte buffer (a quantized-codes stand-in), AdamW over the trainable parameters,
`group_sharded_parallel(level="p_g_os", segment_size=0)` on 2 gloo ranks, global batch 8 = 4 + 4;
each rank also trains the one-process reference and compares losses and the final weights.

Found (docs/notes/group_sharded_frozen.md): stage 3 slices frozen parameters at wrap time, but
backward gathers them again and nothing releases them: from the first backward on every rank
holds the whole frozen backbone, between steps and at the end of backward. --release-frozen step
puts them back to this rank's slice after each step; backward does it as each layer's backward
finishes (a PyLayer on the layer's input), so backward never holds more than the layers it is in.

The device-check shims are the ones PARALLEL_NOTES lists for stage 3 (a "cpu" custom device at the
three gates, no convert_gpu), written here for this probe only.
"""
import argparse
import json
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn as nn
from paddle.base import core

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
from sharding_memory import held_by_kind  # noqa: E402

GATES = {("group_sharded.py", "group_sharded_parallel"), ("group_sharded_optimizer_stage2.py", "__init__"),
         ("group_sharded_stage3.py", "__init__")}


def install_gates():
    def custom(orig):
        def f():
            c = sys._getframe(1).f_code
            return ["cpu"] if (os.path.basename(c.co_filename), c.co_name) in GATES else orig()
        return f
    paddle.device.get_all_custom_device_type = custom(paddle.device.get_all_custom_device_type)
    core.get_all_custom_device_type = custom(core.get_all_custom_device_type)
    get_device = paddle.get_device

    def device():
        c = sys._getframe(1).f_code
        at = (os.path.basename(c.co_filename), c.co_name)
        return "cpu:0" if at == ("group_sharded_optimizer_stage2.py", "__init__") else get_device()
    paddle.get_device = device
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_storage as gss
    add = gss.ParamStorage.add_rank_params
    gss.ParamStorage.add_rank_params = lambda self, tp, p2a, convert_gpu=True: add(self, tp, p2a, False)


H = 256


class MLP(nn.Layer):
    """l1 and l4 trainable, l2 and l3 frozen (the backbone), one buffer (quantized codes)."""
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3, self.l4 = nn.Linear(16, H), nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, 4)
        for i, p in enumerate(self.parameters()):
            p.set_value((np.random.RandomState(50 + i).randn(*p.shape) / np.sqrt(p.shape[0])).astype("float32"))
        for q in list(self.l2.parameters()) + list(self.l3.parameters()):
            q.stop_gradient = True
        self.register_buffer("codes", paddle.ones([4096], "uint8"))

    recompute = False

    def middle(self, h):
        return paddle.tanh(self.l3(paddle.tanh(self.l2(h))))

    def forward(self, x):
        h = paddle.tanh(self.l1(x))
        if self.recompute:     # as paddletune's runner does: fleet's recompute, non-reentrant
            from paddle.distributed.fleet.utils import recompute
            h = recompute(self.middle, h, use_reentrant=False)
        else:
            h = self.middle(h)
        return self.l4(h)


def batch(step, rank=None):
    r = np.random.RandomState(500 + step)
    x, y = r.randn(8, 16).astype("float32"), r.randn(8, 4).astype("float32")
    if rank is not None:
        x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
    return paddle.to_tensor(x), paddle.to_tensor(y)


def reference(steps):
    """Losses and final weights of one process at the global batch 8."""
    m = MLP()
    opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=[q for q in m.parameters() if not q.stop_gradient])
    losses = []
    for s in range(steps):
        x, y = batch(s)
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: q.numpy() for n, q in m.named_parameters()}


# the fix as paddletune runs it (parallel/group_sharded.py): this rank's slice back for every frozen
# parameter paddle's stage 3 left whole; the identity whose backward calls fn
from paddletune.parallel.group_sharded import _AfterBackward, release_frozen  # noqa: E402


def release_frozen_in_backward(stage3, layers, seen=None):
    """Release each layer's frozen slices as soon as its backward is done, so backward holds only
    the layers it is in (not the whole backbone by its end). seen: a list that gets the frozen
    bytes held just before each release (the probe's peak)."""
    byname = {q.name: q for q in stage3._layer.parameters()}

    def hook(layer, inputs):
        x = inputs[0]

        def done():
            if seen is not None:   # + prefetched full buffers not yet handed to their parameter
                pending = sum(int(np.prod(full.shape)) * full.element_size()
                              for n, (full, _) in stage3._task_flow.full_param.items()
                              if getattr(byname[n], "status", None) != "all")
                seen.append([held_by_kind(stage3._layer)["frozen"][0], pending])
            release_frozen(stage3, {id(layer)})
        if isinstance(x, paddle.Tensor) and not x.stop_gradient:
            return (_AfterBackward.apply(x, done),) + tuple(inputs[1:])
        return None
    for layer in layers:
        layer.register_forward_pre_hook(hook)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--segment-size", type=int, default=0)
    p.add_argument("--json")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--recompute", action="store_true", help="l2, l3 under fleet's recompute (non-reentrant)")
    p.add_argument("--release-frozen", choices=["none", "step", "backward"], default="none",
                   help="release frozen slices after every step / after each layer's backward (+ after the step)")
    p.add_argument("--debug", action="store_true", help="each parameter's status / storage at each point")
    a = p.parse_args()
    ref_losses, ref_params = reference(a.steps)
    dist.init_parallel_env()
    rank = dist.get_rank()
    install_gates()
    from paddle.distributed.sharding import group_sharded_parallel

    MLP.recompute = a.recompute
    model = MLP()
    inner = model
    opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=[q for q in model.parameters() if not q.stop_gradient])
    in_backward = []
    model, opt, _ = group_sharded_parallel(model, opt, level="p_g_os", segment_size=a.segment_size)
    if a.release_frozen == "backward":
        release_frozen_in_backward(model, [inner.l2, inner.l3], in_backward)
    def show(when):
        if a.debug:
            print(rank, when, [(n, getattr(q, "status", None), q._is_initialized(),
                                None if getattr(q, "fw_storage", None) is None else
                                (q.fw_storage._is_initialized() and int(q.fw_storage._numel())))
                               for n, q in inner.named_parameters()], flush=True)
    show("after wrap")
    after_wrap = held_by_kind(inner)
    steps, backward_end = [], []
    losses = []
    for s in range(a.steps):
        x, y = batch(s, rank)
        loss = ((model(x) - y) ** 2).mean()
        show(f"step {s} after forward")
        loss.backward()
        show(f"step {s} after backward")
        peak = held_by_kind(inner)
        opt.step()
        opt.clear_grad()
        if a.release_frozen != "none":
            release_frozen(model)
        show(f"step {s} after step")
        steps.append(held_by_kind(inner))
        backward_end.append(peak)
        lv = loss.detach().clone()
        dist.all_reduce(lv)
        losses.append(float(lv) / 2)
    model.get_all_parameters(with_freeze_param=True)
    dparam = max(float(np.abs(q.numpy().reshape(ref_params[n].shape) - ref_params[n]).max())
                 for n, q in inner.named_parameters())
    dloss = max(abs(u - v) for u, v in zip(losses, ref_losses))
    if in_backward:
        print(rank, "[frozen bytes held, prefetched bytes pending] just before each layer's release in backward:", in_backward, flush=True)
    print(rank, f"RESULT release_frozen={a.release_frozen} recompute={a.recompute} max|dloss|={dloss:.2e} max|dparam|={dparam:.2e}", flush=True)
    for when, kinds in ([("after wrap", after_wrap)] + [(f"after step {s}", k) for s, k in enumerate(steps)]
                        + [(f"end of backward {s}", k) for s, k in enumerate(backward_end)]):
        print(rank, type(model).__name__, when, "held bytes [now, whole]:", kinds,
              {k: round(v[0] / v[1], 3) for k, v in kinds.items() if v[1]}, flush=True)
    if a.json:
        with open(f"{a.json}.rank{rank}", "w") as f:
            json.dump({"wrapper": type(model).__name__, "after_wrap": after_wrap, "steps": steps, "backward_end": backward_end, "in_backward": in_backward,
                       "dloss": dloss, "dparam": dparam}, f)


if __name__ == "__main__":
    main()
