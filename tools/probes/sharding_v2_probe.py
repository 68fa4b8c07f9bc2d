"""Why does fleet's DygraphShardingOptimizerV2 (split_param) differ from one process on gloo?

    python -m paddle.distributed.launch --nproc_per_node 2 --log_dir /tmp/v2log \
        tools/probes/sharding_v2_probe.py [v1|v2] [--rs copy|slice] [--clip 0.05]

A 3-layer MLP, AdamW (weight decay 0.01, eps 1e-6), global batch 8 split 4 + 4 over a sharding
group of 2 (fleet hybrid, sharding_degree 2). Each rank also trains the one-process reference at
the same global batch and prints, after every step, the max |param - reference| per tensor, so
the first step and tensor that diverge are visible. Before training it checks the gloo
reduce_scatter emulation against a hand-computed reduction, once writing into a plain tensor and
once into a `_slice` view of the input (the way V2's FusedCommBuffer calls it).

Emulations ("--rs"): gloo has no reduce_scatter. All all-reduce a copy of the input and keep this
rank's part; "copy" writes the part with `Tensor.copy_` (the probe in /work/shared did this),
"slice" writes it through `paddle.assign` into the output view's own memory, "shim" (default) is
paddletune's cpu_compat shim 7 (what the Trainer runs). `--fix zero` is paddletune's fix
(parallel/paddle_fixes.py) on the V2 instance.
The finding is in docs/notes/sharding_v2.md.
"""
import argparse
import json
import sys

import os

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn as nn
from paddle.distributed import ReduceOp, fleet

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from paddletune.parallel import recorder  # noqa: E402

H_IN, H, OUT, GB, STEPS = 16, 32, 4, 8, 3


class MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(H_IN, H), nn.Linear(H, H), nn.Linear(H, OUT)
        for i, p in enumerate(self.parameters()):
            p.set_value((np.random.RandomState(50 + i).randn(*p.shape) * 0.3).astype("float32"))

    def forward(self, x):
        return self.l3(paddle.tanh(self.l2(paddle.tanh(self.l1(x)))))


def batch(step):
    r = np.random.RandomState(500 + step)
    return (paddle.to_tensor(r.randn(GB, H_IN).astype("float32")),
            paddle.to_tensor(r.randn(GB, OUT).astype("float32")))


def optimizer(params, clip, like=False):
    """like=True: paddletune's per-tensor settings on a flat list (V2 refuses parameter groups,
    dygraph_sharding_optimizer.py:621-624): no weight decay on biases (apply_decay_param_fun by
    name) and an lr scale of 2 on biases through optimize_attr (what a LoRA+ scale would use)."""
    c = nn.ClipGradByGlobalNorm(clip) if clip else None
    kw = {}
    if like:
        params = list(params)
        decay = {p.name for p in params if len(p.shape) == 2}
        for p in params:
            if len(p.shape) == 1:
                p.optimize_attr = {"learning_rate": 2.0}
        kw["apply_decay_param_fun"] = lambda name: name in decay
    return paddle.optimizer.AdamW(learning_rate=0.01, parameters=params, weight_decay=0.01, epsilon=1e-6,
                                  grad_clip=c, **kw)


def reference(clip, like=False):
    """{step: {name: array}} of the one-process run at the global batch."""
    m = MLP()
    opt = optimizer(m.parameters(), clip, like)
    snaps, grads = [], []
    for s in range(STEPS):
        x, y = batch(s)
        ((m(x) - y) ** 2).mean().backward()
        if s == 0:
            norm = float(np.sqrt(sum(float((p.grad ** 2).sum()) for p in m.parameters())))
            print(f"reference: global grad norm at step 0 = {norm:.3f}"
                  + (f" (clip {clip}: coefficient {min(1.0, clip / norm):.3f})" if clip else ""), flush=True)
        grads.append({n: p.grad.numpy().reshape(-1).copy() for n, p in m.named_parameters()})
        opt.step()
        opt.clear_grad()
        snaps.append({n: p.numpy().copy() for n, p in m.named_parameters()})
    return snaps, grads


class _Done:
    def wait(self):
        return True

    def is_completed(self):
        return True


def make_reduce_scatter(how):
    def reduce_scatter(tensor, tensor_or_tensor_list, op=ReduceOp.SUM, group=None, sync_op=True):
        src = tensor_or_tensor_list
        full = (paddle.concat([t.reshape([-1]) for t in src]) if isinstance(src, (list, tuple))
                else src.reshape([-1]).clone())
        n, r = (group.nranks, group.rank) if group is not None else (dist.get_world_size(), dist.get_rank())
        dist.all_reduce(full, op=ReduceOp.SUM if op == ReduceOp.AVG else op, group=group)
        if op == ReduceOp.AVG:
            full = full / n
        part = full[r * (full.shape[0] // n):(r + 1) * (full.shape[0] // n)].reshape(tensor.shape)
        if how == "copy":
            tensor.copy_(part, False)
        else:
            paddle.assign(part, output=tensor)
        return _Done()
    return reduce_scatter


def install(how):
    if how == "shim":
        from paddletune.parallel import cpu_compat

        cpu_compat.install_split_param()
        return
    from paddle.distributed.communication import reduce_scatter as mod
    from paddle.distributed.fleet.utils import tensor_fusion_helper as tfh
    rs = make_reduce_scatter(how)
    dist.reduce_scatter = rs
    mod.reduce_scatter = rs
    tfh.alignment["cpu"] = 256               # the gpu value; cpu has no entry
    tfh.__current_device_type__ = "cpu"      # skips the gpu/npu/xpu assert


def check_emulation(rank, how):
    """The emulation against a hand-worked reduction, into a plain tensor and into a _slice view."""
    if how == "shim":
        from paddletune.parallel.cpu_compat import reduce_scatter as rs
    else:
        rs = make_reduce_scatter(how)
    x = paddle.arange(8, dtype="float32") + 100 * rank          # rank0: 0..7, rank1: 100..107
    want = (np.arange(8) * 2 + 100).astype("float32")[rank * 4:(rank + 1) * 4]
    out = paddle.zeros([4], "float32")
    rs(out, x.clone(), group=None)
    plain = float(np.abs(out.numpy() - want).max())
    buf = x.clone()
    view = buf._slice(rank * 4, rank * 4 + 4)
    rs(view, buf, group=None)
    in_buffer = float(np.abs(buf.numpy()[rank * 4:rank * 4 + 4] - want).max())
    print(rank, f"EMULATION[{how}] plain out: max|err|={plain:.1e}; into a _slice view of the input: "
          f"view max|err|={float(np.abs(view.numpy() - want).max()):.1e}, "
          f"the buffer behind it max|err|={in_buffer:.1e}", flush=True)
    return in_buffer


def watch_v2(rank, opt, ref_grads, step):
    """Wrap V2's call of the inner AdamW: compare each (slice param, grad) with the reference's grad
    at the same flat offsets, and print the moments AdamW holds for it."""
    v2 = opt._inner_opt
    views = {n: b._sharding_param_grad_view[n] for b in v2._comm_buffer_list for n in b._sharding_param_grad_view}

    inner = v2._inner_opt
    orig = inner._apply_optimize

    def apply(loss, startup_program, params_grads):
        for sp, g in params_grads:
            v = views[sp.name]
            lo, hi = v._param_begin - v._index, v._param_end - v._index
            ref = np.zeros(v._padded_size, "float32")
            key = PNAME[sp.name]
            ref[:ref_grads[step[0]][key].size] = ref_grads[step[0]][key]
            gn = g.numpy().reshape(-1)
            m1 = inner._accumulators.get("moment1", {}).get(sp.name)
            b1 = inner._accumulators.get("beta1_pow_acc", {}).get(sp.name)
            print(rank, f"step {step[0]} {key} slice [{lo},{hi}) shape {sp.shape} grad max|g - ref|="
                  f"{float(np.abs(gn - ref[lo:hi]).max()):.1e} max|g|={float(np.abs(gn).max()):.1e}"
                  f" moment1 {None if m1 is None else m1.shape} beta1_pow {None if b1 is None else b1.numpy()}",
                  flush=True)
        return orig(loss=loss, startup_program=startup_program, params_grads=params_grads)
    inner._apply_optimize = apply


PNAME = {}


def linked(rank, opt, when):
    """Does each parameter's .grad still live in V2's fused gradient buffer?"""
    out = []
    for b in opt._inner_opt._comm_buffer_list:
        for q in b.params:
            out.append((PNAME[q.name], q.grad is not None and q.grad._is_shared_buffer_with(b.grad_storage)))
    if when:
        print(rank, when, "grad in the fused buffer:", " ".join(f"{n}={v}" for n, v in out), flush=True)
    return all(v for _, v in out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["v1", "v2"])
    p.add_argument("--rs", choices=["copy", "slice", "shim"], default="shim")
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--like", action="store_true", help="paddletune-like per-tensor decay / lr scales")
    p.add_argument("--accum", type=int, default=1, choices=[1, 2, 4], help="gradient accumulation steps")
    p.add_argument("--fix", choices=["none", "release", "zero"], default="none",
                   help="release: sharding_configs.release_gradients (grads copied into the buffer each step); "
                        "zero: V2.clear_grad zeroes p.grad in place (as V1 does for its fused buffer)")
    p.add_argument("--json", help="write this rank's results to JSON+'.rank<r>' (the test reads them)")
    p.add_argument("--debug", action="store_true", help="per step: the grads V2 hands AdamW vs the reference's")
    a = p.parse_args()
    ref, ref_grads = reference(a.clip, a.like)
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 2}
    strategy.hybrid_configs["sharding_configs"].split_param = a.mode == "v2"
    if a.fix == "release":
        strategy.hybrid_configs["sharding_configs"].release_gradients = True
    fleet.init(is_collective=True, strategy=strategy)
    install(a.rs)
    rank = dist.get_rank()
    emulation = check_emulation(rank, a.rs)
    model = MLP()
    opt = optimizer(model.parameters(), a.clip, a.like)
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(opt)
    inner = getattr(opt, "_inner_opt", opt)
    if a.fix == "zero":   # paddletune's fix, on this V2 instance
        from paddletune.parallel.paddle_fixes import fix_v2_clear_grad

        fix_v2_clear_grad(inner)
    PNAME.update({q.name: n.replace("_layers.", "") for n, q in model.named_parameters()})
    print(rank, "optimizer:", type(opt).__name__, "->", type(inner).__name__, flush=True)
    worst, still_linked = 0.0, []
    step = [0]
    if a.debug and a.mode == "v2":
        watch_v2(rank, opt, ref_grads, step)
    wire = []
    for s in range(STEPS):
        step[0] = s
        x, y = batch(s)
        n = 4 // a.accum            # micro-batches of this rank's 4 samples, each loss / accum
        for m in range(a.accum):
            lo = rank * 4 + m * n
            loss = ((model(x[lo:lo + n]) - y[lo:lo + n]) ** 2).mean() / a.accum
            loss.backward()
        if a.mode == "v2":
            still_linked.append(linked(rank, opt, f"step {s} after backward" if a.debug else ""))
        with recorder.record() as log:
            opt.step()
        wire.append([(e["op"], e["bytes"], e["dtypes"]) for e in log if e["level"] == "pg"])
        if a.debug and a.mode == "v2":
            linked(rank, opt, f"step {s} after step")
        opt.clear_grad()
        if a.debug and a.mode == "v2":
            linked(rank, opt, f"step {s} after clear_grad")
        diffs = {n.replace("_layers.", ""): float(np.abs(q.numpy() - ref[s][n.replace("_layers.", "")]).max())
                 for n, q in model.named_parameters()}
        worst = max(worst, max(diffs.values()))
        print(rank, f"step {s} max|param - one process| per tensor:",
              " ".join(f"{k}={v:.1e}" for k, v in diffs.items()), flush=True)
    moments = sum(int(np.prod(t.shape)) for t in inner._inner_opt._accumulators["moment1"].values())
    total = sum(int(np.prod(q.shape)) for q in model.parameters())
    print(rank, f"AdamW moment1 elements on this rank: {moments} of {total} parameters", flush=True)
    print(rank, "collectives of the optimizer step (pg level: op, bytes, dtypes):", wire[-1], flush=True)
    print(rank, f"RESULT {a.mode} rs={a.rs} fix={a.fix} clip={a.clip} accum={a.accum} like={a.like} max|dparam|={worst:.3e}", flush=True)
    if a.json:
        with open(f"{a.json}.rank{rank}", "w") as f:
            json.dump({"optimizer": [type(opt).__name__, type(inner).__name__], "max_dparam": worst,
                       "emulation_err": emulation, "moment1": moments, "total": total,
                       "grads_in_buffer_after_backward": still_linked, "wire": wire}, f)


if __name__ == "__main__":
    sys.exit(main())
