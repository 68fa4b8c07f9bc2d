"""Optimizer step time: paddletune's AdamW on paddle.optimizer.AdamW (paddletune/trainer/optim.py)
vs the own AdamW it replaced (tests/reference_adamw.py), on the trainable tensors of the
compare_peers configuration (Llama 4 layers, hidden 256, intermediate 688, vocab 32000): full
fine-tuning (39 tensors, 19.5M elements) and LoRA r=8 on 7 targets (56 tensors, LoRA+ scale 4 on B).
Steps alternate old / new in one process; min and median of --reps steps each.

    python benchmarks/optimizer_step.py [--reps 30]
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import paddle  # noqa: E402

import reference_adamw  # noqa: E402
from paddletune.trainer import optim  # noqa: E402

H, I, V, L, R = 256, 688, 32000, 4, 8


def shapes():
    full, lora = [("embed", [V, H]), ("lm_head", [H, V]), ("norm", [H])], []
    for layer in range(L):
        for n, s in (("q", [H, H]), ("k", [H, H]), ("v", [H, H]), ("o", [H, H]), ("gate", [H, I]),
                     ("up", [H, I]), ("down", [I, H])):
            full.append((f"{layer}.{n}.weight", s))
            lora += [(f"{layer}.{n}.lora_A", [s[0], R]), (f"{layer}.{n}.lora_B", [R, s[1]])]
        full += [(f"{layer}.input_norm", [H]), (f"{layer}.post_norm", [H])]
    return {"full": full, "lora": lora}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=30)
    reps = p.parse_args().reps
    for mode, spec in shapes().items():
        opts, times = {}, {"old": [], "new": []}
        for name, cls in (("old", reference_adamw.AdamW), ("new", optim.AdamW)):
            params = [(n, paddle.create_parameter(s, "float32")) for n, s in spec]
            scales = {n: 4.0 for n, _ in params if n.endswith("lora_B")}
            opts[name] = (cls(params, scales, weight_decay=0.1),
                          {n: paddle.randn(t.shape) * 1e-3 for n, t in params})
        for _ in range(reps):
            for name, (opt, grads) in opts.items():
                t = time.perf_counter()
                opt.step(grads, 1e-3)
                times[name].append(time.perf_counter() - t)
        for name, ts in times.items():
            print(f"{mode:4s} {name}: {len(spec)} tensors, min {min(ts) * 1e3:.2f} ms, "
                  f"median {statistics.median(ts) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
