"""Launched cases of tests/test_fleet_hybrid.py: data parallel with tensor / pipeline parallel,
its gradient reduction done by fleet's HybridParallelOptimizer.step.

hybrid_case runs tp_cases.train_case (tiny Llama, copy data of unequal target lengths, clipping
active) with three probes installed from outside:
- fleet's fused_allreduce_gradients, as HybridParallelOptimizer calls it, wrapped: each call
  counted, run under recorder.tag("fleet_dp"), and the gradients it was given fingerprinted before
  and after (equal across the dp ranks after, different before: different data per rank);
- Topology.all_reduce_grads wrapped: every call's axis recorded (paddletune's own gradient sum);
- the collective recorder around training: every all-reduce of >= 64 elements over the dp group.
amp=True: fp16 loss scaling with paddle's GradScaler under fleet.distributed_scaler (its GPU place
check faked, as tests/test_amp.py does; compute stays float32): scaled by a power of two, the
gradients and weights equal the unscaled run's.
"""
import contextlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _fingerprint(arrays):
    """Two float64 sums per array (plain and position-weighted)."""
    import numpy as np

    out = []
    for a in arrays:
        a = np.asarray(a, np.float64).reshape(-1)
        out += [float(a.sum()), float((a * np.arange(1, a.size + 1)).sum())]
    return out


def _grad_of(p):
    g = p.main_grad if hasattr(p, "main_grad") else p._grad_ivar()
    return g.numpy() if g is not None else [0.0]


@contextlib.contextmanager
def _probes(calls, own):
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import hybrid_parallel_optimizer as hpo

    from paddletune.parallel import recorder
    from paddletune.parallel.topology import Topology

    fused, ours = hpo.fused_allreduce_gradients, Topology.all_reduce_grads

    def fused_probe(params, hcg):
        before = _fingerprint([_grad_of(p) for p in params])
        with recorder.tag("fleet_dp"):
            fused(params, hcg)
        calls.append({"n": len(params), "before": before,
                      "after": _fingerprint([_grad_of(p) for p in params])})

    def ours_probe(self, grads, axis="data", **kw):
        own.append(axis)
        return ours(self, grads, axis, **kw)

    hpo.fused_allreduce_gradients, Topology.all_reduce_grads = fused_probe, ours_probe
    try:
        yield
    finally:
        hpo.fused_allreduce_gradients, Topology.all_reduce_grads = fused, ours


@contextlib.contextmanager
def _fp16_scaler(scale):
    """Trainers built inside get paddle's fp16 GradScaler (under fleet.distributed_scaler with
    fleet's topology), its place check faked; the forward stays float32."""
    import paddle  # noqa: F401

    from amp_fakes import real_fp16_scaler
    from paddletune.trainer import amp

    real_init = amp.Precision.__init__
    state = sys.modules["paddle.amp.auto_cast"].amp_global_state()

    def init(self, args, topo=None):
        real_init(self, args, topo)
        args.scale_loss = scale
        self.scaler = real_fp16_scaler(self, topo)
        self.autocast = contextlib.nullcontext

    before = state.amp_dtype
    amp.Precision.__init__, state.amp_dtype = init, "float16"
    try:
        yield
    finally:
        amp.Precision.__init__, state.amp_dtype = real_init, before


def hybrid_case(ckpt, out_dir, amp=False, **kw):
    from paddletune.parallel import recorder
    from tp_cases import train_case

    calls, own, seen = [], [], {}
    scaler = _fp16_scaler(2.0 ** 10) if amp else contextlib.nullcontext()

    import paddletune.trainer.trainer as trainer_mod
    real_update = trainer_mod.Trainer._update

    def update(self, named, grads, lr):   # what the trainer's update was handed, and its scaler
        seen.setdefault("optimizer", type(self.par.hybrid.hybrid).__name__ if self.par.hybrid else None)
        seen.setdefault("scaler", type(self.precision.scaler).__name__ if self.precision.scaler else None)
        seen.setdefault("scaler_enabled", bool(self.precision.scaler and self.precision.scaler.is_enable()))
        return real_update(self, named, grads, lr)

    trainer_mod.Trainer._update = update
    try:
        with _probes(calls, own), scaler, recorder.record() as log:
            result = train_case(ckpt, out_dir, record=False, **kw)
    finally:
        trainer_mod.Trainer._update = real_update
    from paddletune.parallel.topology import group_ranks

    dp = group_ranks(result["rank"], result["degrees"], "dp")
    big = [e for e in log if e["level"] == "pg" and e["op"].startswith("all_reduce")
           and e["ranks"] == dp and sum(_numel(s) for s in e["shapes"]) >= 64]
    return {"losses": result["losses"], "grad_norms": result["grad_norms"], "eval": result["eval"],
            "rank": result["rank"], "dp_group": dp, "fused": calls, "ours": own, "seen": seen,
            "big_dp_tags": sorted({str(e["tag"]) for e in big}), "n_big_dp": len(big)}


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n
