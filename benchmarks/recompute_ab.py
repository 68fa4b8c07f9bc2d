"""Where recompute's cost goes: paddletune's long-context LoRA step with recompute off and on,
in ONE process, alternating, timed in CPU time (time.process_time) -- usable on a loaded machine
(single-threaded, PADDLETUNE_NUM_THREADS=1 by default), unlike wall time.

    PYTHONPATH=. python benchmarks/recompute_ab.py [--seqs 1024,2048] [--rounds 3] [--steps 2]
                                                  [--threads 1] [--smoke]

Model and step as benchmarks/long_context.py (the 4-layer, hidden-256 Llama, batch 1, LoRA r=8 on
every linear, Trainer.training_step: forward, backward, clip, AdamW). Per step and mode it
reports CPU ms of:
  step          the whole training_step;
  fwd layers    the decoder layers' first forward (all layers);
  again layers  the decoder layers run again in backward (recompute on only: the forward-again);
  kernel fwd    the blocked attention kernel's forward calls (first pass + again), inside the above;
  linears       the LoRA linears' forward calls (first pass + again), inside the layers;
  kernel bwd    the blocked attention kernel's backward calls;
  head+loss     the LM head and cross-entropy (models/linear_ce.py: logits, loss and the head's
                input gradient, all in the forward);
and "machinery" = (step on - step off) - (again layers): the rest of recompute's cost (paddle's
RNG save/restore, the saved-tensor hooks, the autograd graph built twice, allocator effects).
"""
import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(0, os.path.dirname(HERE))


KEYS = ("step", "fwd layers", "again layers", "kernel fwd", "linears", "kernel bwd", "head+loss")
MODES = ("off", "on, rerun", "on, reuse")   # recompute off; on, kernel run again; on, (out, lse) reused


class Clock:
    """CPU-time accumulators keyed by name; calls nested in a timed call are counted in both."""

    def __init__(self):
        self.t = {}

    def add(self, key, dt):
        self.t[key] = self.t.get(key, 0.0) + dt

    def wrap(self, fn, key_of):
        def timed(*a, **kw):
            t0 = time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                self.add(key_of(), time.process_time() - t0)
        return timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1024,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", default="1")
    ap.add_argument("--smoke", action="store_true", help="tiny model, sequence 32, 1 round of 1 step (script check)")
    o = ap.parse_args()
    if o.smoke:
        o.seqs, o.rounds, o.steps = "32", 1, 1
    os.environ.setdefault("PADDLETUNE_NUM_THREADS", o.threads)

    import harness
    import paddletune  # noqa: F401  (threads before paddle)
    import paddletune_train
    from paddletune import kernels
    from paddletune.kernels import attention as kattn
    from paddletune.models import linear_ce

    work = tempfile.mkdtemp(prefix="recompute-ab-")
    cfg = dict(harness.SMOKE if o.smoke else harness.DESIGN)
    harness.write_checkpoint(os.path.join(work, "checkpoint"), dict(cfg, seq=max(map(int, o.seqs.split(",")))))
    clock = Clock()
    phase = {"name": "fwd"}
    print(f"threads {os.environ.get('OMP_NUM_THREADS')}, kernels {'on' if kernels.cpu_ops() else 'off'}, "
          f"{o.rounds} rounds x {o.steps} steps per mode, CPU ms per step")
    print("median (min) over the steps")
    print("| S | recompute | " + " | ".join(KEYS) + " | loss first / last |")
    print("|---|---|" + "---|" * len(KEYS) + "---|")
    for S in map(int, o.seqs.split(",")):
        c = dict(cfg, seq=S, batch=1)
        data = harness.write_data(os.path.join(work, f"data-{S}.safetensors"),
                                  harness.uniform_batches(c, 1))
        spec = dict(harness.LORA, method="lora", layout="padded", data=data, checkpoint=os.path.join(work, "checkpoint"),
                    steps=o.steps, warmup=0, lr=1e-3, max_grad_norm=1.0, seed=0, batch=1, seq=S, workdir=work)
        trainer, batches = paddletune_train.build(spec)
        model = trainer.model
        # layer calls: the first L of a step are the forward, any later ones the forward-again
        layers = list(model.decoder_layers())
        count = {"n": 0}
        for layer in layers:
            fwd = layer.forward

            def key(fwd=fwd):
                count["n"] += 1
                return "fwd layers" if count["n"] <= len(layers) else "again layers"
            layer.forward = clock.wrap(fwd, key)
            for sub in layer.sublayers():   # the LoRA linears: "linears" (both passes)
                if type(sub).__name__ == "LoRALinear":
                    sub.forward = clock.wrap(sub.forward, lambda: "linears")
        ops = kernels.cpu_ops()
        base, base_bwd, base_head = ops.pt_flash_attn, ops.pt_flash_attn_bwd, linear_ce._blocks
        ops.pt_flash_attn = clock.wrap(base, lambda: "kernel fwd")
        ops.pt_flash_attn_bwd = clock.wrap(base_bwd, lambda: "kernel bwd")
        linear_ce._blocks = clock.wrap(base_head, lambda: "head+loss")
        per = {}
        losses = {}
        trainer.training_step([batches[0]], spec["lr"])   # warm-up (kernel build, allocator)
        for r in range(o.rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                model.recompute = mode != "off"
                kattn.ReuseOutputs.enabled = mode != "on, rerun"
                for _ in range(o.steps):
                    clock.t.clear()
                    count["n"] = 0
                    t0 = time.process_time()
                    loss, *_ = trainer.training_step([batches[0]], spec["lr"])
                    clock.add("step", time.process_time() - t0)
                    losses.setdefault(mode, []).append(float(loss))
                    for k, v in clock.t.items():
                        per.setdefault((mode, k), []).append(v)
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        for mode in MODES:
            cells = [f"{med(per.get((mode, k), [0.0])) * 1000:.0f} ({min(per.get((mode, k), [0.0])) * 1000:.0f})"
                     for k in KEYS]
            print(f"| {S} | {mode} | " + " | ".join(cells)
                  + f" | {losses[mode][0]:.4f} / {losses[mode][-1]:.4f} |", flush=True)
        off = med(per[("off", "step")])
        for mode in MODES[1:]:
            d = med(per[(mode, "step")]) - off
            again = med(per[(mode, "again layers")])
            print(f"S={S} {mode}: recompute cost {d * 1000:.0f} ms/step = {100 * d / off:.1f}% of the off step;"
                  f" forward-again {again * 1000:.0f} ms, machinery + rest {(d - again) * 1000:.0f} ms", flush=True)
        del trainer, model, batches
        ops.pt_flash_attn, ops.pt_flash_attn_bwd, linear_ce._blocks = base, base_bwd, base_head


if __name__ == "__main__":
    main()
