"""Attention alone, forward and backward: the CPU column's blocked kernel (models/ops.cpu_attention)
vs the dense path it replaces (models/layers._dense_attention), one process, alternating.

    PYTHONPATH=. python benchmarks/attention_kernel.py [--cases 4:256:causal,4:256:pad,1:1024:causal] [--reps 8]
                                                       [--cpu-time]

Case B:S:mask on [B, 8, S, 32] (the compare_peers model's heads): causal = the plain causal mask;
pad = causal plus three padded keys in row 0 (the kernel reads a key window per row,
layers.PaddedRows; the dense path gets the [B, 1, S, S] bool mask). Prints min ms over --reps
alternating repetitions (forward, backward separately). --cpu-time: process CPU time instead of
wall time (on a shared machine, with OMP_NUM_THREADS=1 MKL_NUM_THREADS=1: the time on one core,
which other processes do not inflate).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import paddletune  # noqa: E402,F401  (threads before paddle)
import numpy as np  # noqa: E402
import paddle  # noqa: E402

from paddletune.models import layers, ops  # noqa: E402


def case(B, S, kind, reps, clock, N=8, D=32):
    rng = np.random.default_rng(0)
    q, k, v = (paddle.to_tensor(rng.standard_normal((B, N, S, D)).astype("float32")) for _ in range(3))
    for t in (q, k, v):
        t.stop_gradient = False
    dout = paddle.to_tensor(rng.standard_normal((B, S, N * D)).astype("float32"))
    am = np.ones((B, S), "int64")
    am[0, -3:] = 0
    bias = layers.causal_mask(S) if kind == "causal" else layers.attention_bias(B, S, 0, paddle.to_tensor(am))
    scale = 1 / np.sqrt(D)
    dense_bias = bias.dense() if isinstance(bias, layers.PaddedRows) else bias
    fns = {"kernel": lambda: ops.cpu_attention(q, k, v, bias, 0.0, True, scale),
           "dense": lambda: layers._dense_attention(q, k, v, dense_bias, scale=scale)}
    if fns["kernel"]() is None:
        raise SystemExit("the CPU kernels are off: nothing to compare")
    best = {n: [float("inf")] * 2 for n in fns}
    for _ in range(reps):
        for name, f in fns.items():
            t0 = clock()
            o = f()
            t1 = clock()
            g = paddle.grad([o], [q, k, v], [dout])
            float(g[0][0, 0, 0, 0])
            t2 = clock()
            best[name] = [min(best[name][0], t1 - t0), min(best[name][1], t2 - t1)]
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="4:256:causal,4:256:pad,1:1024:causal,1:2048:causal")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--cpu-time", action="store_true", help="process CPU time (use with 1 thread)")
    o = p.parse_args()
    clock = time.process_time if o.cpu_time else time.perf_counter
    print(f"`python benchmarks/attention_kernel.py {' '.join(sys.argv[1:])}`".replace(" `", "`"))
    print(f"\nload average {os.getloadavg()[0]:.2f}; {'process CPU' if o.cpu_time else 'wall'} time, "
          f"{os.environ.get('OMP_NUM_THREADS', 'default')} OpenMP threads; min of {o.reps} alternating repetitions\n")
    print("| [B, 8, S, 32] | mask | kernel fwd / bwd ms | dense fwd / bwd ms | dense / kernel (fwd + bwd) |")
    print("|---|---|---|---|---|")
    for c in o.cases.split(","):
        B, S, kind = c.split(":")
        r = case(int(B), int(S), kind, o.reps, clock)
        (kf, kb), (df, db) = r["kernel"], r["dense"]
        print(f"| B={B}, S={S} | {kind} | {kf * 1e3:.1f} / {kb * 1e3:.1f} | {df * 1e3:.1f} / {db * 1e3:.1f} | "
              f"{(df + db) / (kf + kb):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
