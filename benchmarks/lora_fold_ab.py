"""The folded LoRA path (peft/lora.py _FoldedLoRA) against the unfolded branch, in ONE process,
alternating, timed in CPU time (time.process_time, single-threaded by default): usable on a loaded
machine, unlike wall time.

    PYTHONPATH=. python benchmarks/lora_fold_ab.py [--cases 256x4,1024x1,2048x1]
                                                 [--recompute off,on] [--rounds 4] [--steps 2]
                                                 [--threads 1] [--smoke]

Model and step as benchmarks/long_context.py (the 4-layer, hidden-256 Llama, LoRA r=8 alpha 16 on
every linear, Trainer.training_step: forward, backward, clip, AdamW). Per case (sequence x batch),
recompute setting and mode (fold on / off, LoRALinear.fold), CPU ms per step of the whole step and
of the LoRA linears' forward calls (both passes under recompute), median (min) over the steps.
"""
import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(0, os.path.dirname(HERE))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="256x4,1024x1,2048x1", help="sequence x batch, comma separated")
    ap.add_argument("--recompute", default="off,on")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", default="1")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 32x2, 1 round of 1 step (script check)")
    o = ap.parse_args()
    if o.smoke:
        o.cases, o.rounds, o.steps = "32x2", 1, 1
    os.environ.setdefault("PADDLETUNE_NUM_THREADS", o.threads)

    import harness
    import paddletune  # noqa: F401  (threads before paddle)
    import paddletune_train
    from paddletune.peft import lora

    work = tempfile.mkdtemp(prefix="lora-fold-ab-")
    cases = [tuple(map(int, c.split("x"))) for c in o.cases.split(",")]
    cfg = dict(harness.SMOKE if o.smoke else harness.DESIGN)
    harness.write_checkpoint(os.path.join(work, "checkpoint"), dict(cfg, seq=max(s for s, _ in cases)))
    print(f"threads {os.environ.get('OMP_NUM_THREADS')}, {o.rounds} rounds x {o.steps} steps per mode, "
          "CPU ms per step, median (min)")
    print("| S x batch | recompute | step, fold on | step, fold off | LoRA linears fwd, on | off | loss on / off |")
    print("|---|---|---|---|---|---|---|")
    for S, B in cases:
        c = dict(cfg, seq=S, batch=B)
        data = harness.write_data(os.path.join(work, f"data-{S}x{B}.safetensors"), harness.uniform_batches(c, 1))
        spec = dict(harness.LORA, method="lora", layout="padded", data=data, checkpoint=os.path.join(work, "checkpoint"),
                    steps=o.steps, warmup=0, lr=0.0, max_grad_norm=1.0, seed=0, batch=B, seq=S, workdir=work)
        trainer, batches = paddletune_train.build(spec)
        model = trainer.model
        lin = {"t": 0.0}
        for sub in model.sublayers():
            if isinstance(sub, lora.LoRALinear):
                fwd = sub.forward

                def timed(*a, _f=fwd, **k):
                    t0 = time.process_time()
                    try:
                        return _f(*a, **k)
                    finally:
                        lin["t"] += time.process_time() - t0
                sub.forward = timed
        trainer.training_step([batches[0]], spec["lr"])   # warm-up
        for rc in o.recompute.split(","):
            model.recompute = rc == "on"
            per, losses = {}, {}
            for r in range(o.rounds):
                for fold in ((True, False) if r % 2 == 0 else (False, True)):
                    lora.LoRALinear.fold = fold
                    for _ in range(o.steps):
                        lin["t"] = 0.0
                        t0 = time.process_time()
                        loss, *_ = trainer.training_step([batches[0]], spec["lr"])
                        per.setdefault((fold, "step"), []).append(time.process_time() - t0)
                        per.setdefault((fold, "lin"), []).append(lin["t"])
                        losses.setdefault(fold, []).append(float(loss))
            lora.LoRALinear.fold = True
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            cell = lambda k: f"{med(per[k]) * 1000:.0f} ({min(per[k]) * 1000:.0f})"  # noqa: E731
            print(f"| {S}x{B} | {rc} | {cell((True, 'step'))} | {cell((False, 'step'))} | {cell((True, 'lin'))} | "
                  f"{cell((False, 'lin'))} | {losses[True][0]:.6f} / {losses[False][0]:.6f} |", flush=True)
        del trainer, model, batches


if __name__ == "__main__":
    main()
