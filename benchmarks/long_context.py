"""Long-context LoRA training on CPU: step time and peak RSS per sequence length, paddletune vs
transformers+peft (sdpa), and the blocked attention kernel's rate against the matmul ceiling.

    python benchmarks/long_context.py [--seqs 512,1024,2048,4096] [--recompute off,on] [--runs 3]
                                      [--steps 2] [--warmup 1] [--full-seq 1024] [--kernel-seqs 1024,4096]
                                      [--peers paddletune,hf] [--smoke]

Acceptance rows only (issue 37), on an idle machine:
    python benchmarks/long_context.py --runs 3 --kernel-seqs 4096      # every row (~20 min idle)
    python benchmarks/long_context.py --seqs 1024,2048 --recompute off --full-seq 0 --kernel-seqs ''
    python benchmarks/long_context.py --seqs '' --full-seq 0 --kernel-seqs 1024,2048,4096  # kernel only

Model: the compare_peers.py / docs/design.md section 5 Llama (4 layers, hidden 256, 8 heads of 32,
intermediate 688, vocab 32000), batch 1, every token labelled, LoRA r=8 alpha=16 on q,k,v,o,
gate,up,down, AdamW, clip 1.0, fp32; recompute "on" = whole decoder layers for both peers
(paddletune recompute_granularity full; transformers gradient_checkpointing, non-reentrant).
Every run is its own process (benchmarks/peers/*_train.py), so peak RSS is that process's
ru_maxrss; the peers alternate within a row and the first one rotates from run to run. Medians.
One full fine-tuning row (--full-seq) and, per peer, the exponent a of peak RSS ~ S^a fitted
over the recompute-off rows (least squares in log-log), for the whole RSS and for RSS above the
process's RSS after imports (what the run itself allocates).

Kernel rate: paddletune's blocked attention forward + backward on [1, 8, S, 32] causal (the
model's attention shape), in a child process, against the best paddle fp32 matmul rate
(cpu_ceiling.py's 1024^3 and 2048^3 squares). FLOPs counted as cpu_ceiling.py counts attention:
4 * S(S+1)/2 * heads * head_dim forward, twice that backward (what the backward needs, not the
kernel's recomputation of the scores). `--smoke`: tiny model and lengths, 1 step (script check).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(0, HERE)
import harness  # noqa: E402
from cpu_ceiling import measure_matmul  # noqa: E402


def kernel_child(seqs, heads, dim, min_time):
    """One JSON line: {S: forward + backward seconds} of the blocked kernel (best of 3 rounds)."""
    import time

    sys.path.insert(0, os.path.dirname(HERE))
    import paddletune  # noqa: F401  (threads before paddle)
    import numpy as np
    import paddle

    from paddletune import kernels

    out = {}
    for S in seqs:
        rng = np.random.default_rng(0)
        q, k, v = (paddle.to_tensor(rng.standard_normal((1, heads, S, dim)).astype(np.float32)) for _ in range(3))
        for t in (q, k, v):
            t.stop_gradient = False
        dout = paddle.to_tensor(rng.standard_normal((1, S, heads * dim)).astype(np.float32))

        def once():
            o = kernels.blocked_attention(q, k, v, 1.0 / math.sqrt(dim), causal=True)
            grads = paddle.grad([o], [q, k, v], [dout])
            float(grads[0][0, 0, 0, 0])

        if kernels.blocked_attention(q, k, v, 1.0, causal=True) is None:
            raise SystemExit("the CPU kernels are off: nothing to time")
        once()
        best = float("inf")
        for _ in range(3):
            reps, t0 = 0, time.perf_counter()
            while reps == 0 or time.perf_counter() - t0 < min_time:
                once()
                reps += 1
            best = min(best, (time.perf_counter() - t0) / reps)
        out[S] = best
    print(json.dumps(out))


def kernel_rates(seqs, heads, dim, min_time, env):
    cmd = [sys.executable, os.path.abspath(__file__), "--kernel-child", ",".join(map(str, seqs)),
           "--heads", str(heads), "--dim", str(dim), "--min-time", str(min_time)]
    r = subprocess.run(cmd, env=dict(env, PYTHONPATH=harness.ROOT), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"kernel child failed:\n{r.stderr[-3000:]}")
    secs = json.loads(r.stdout.strip().splitlines()[-1])
    return {int(S): (t, 3 * 4 * (int(S) * (int(S) + 1) // 2) * heads * dim / t / 1e9) for S, t in secs.items()}


def fit_exponent(xs, ys):
    """Least-squares slope of log y on log x (None for fewer than two points)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if y > 0]
    if len(pts) < 2:
        return None
    mx, my = statistics.mean(p[0] for p in pts), statistics.mean(p[1] for p in pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


def run_rows(o, cfg, work, env):
    """{(method, S, recompute): {peer: [result per run]}}, peers alternating within each row."""
    results = {}
    rows = [("lora", S, rc) for rc in o.recompute for S in o.seqs]
    if o.full_seq:
        rows.append(("full", o.full_seq, "off"))
    for method, S, rc in rows:
        c = dict(cfg, seq=S, batch=1)
        data = harness.write_data(os.path.join(work, f"data-{S}.safetensors"),
                                  harness.uniform_batches(c, o.warmup + o.steps))
        spec = dict(harness.LORA, mode=f"{method}-{S}-{rc}", method=method, layout="padded", data=data,
                    checkpoint=os.path.join(work, "checkpoint"), steps=o.steps, warmup=o.warmup, lr=1e-3,
                    max_grad_norm=1.0, seed=0, batch=1, seq=S, workdir=work, recompute=rc == "on")
        got = results.setdefault((method, S, rc), {})
        for run in range(o.runs):
            for peer in o.peers[run % len(o.peers):] + o.peers[:run % len(o.peers)]:
                res = harness.run_peer(peer, spec, env, work)
                got.setdefault(peer, []).append(res)
                print(f"[{method} S={S} recompute {rc} run {run + 1}/{o.runs}] {peer}: {res['status']}"
                      + (f" {res['step_s']:.3f} s/step, {res['peak_rss_mb']:.0f} MB" if res["status"] == "ok"
                         else f" - {res.get('reason', '')}"), file=sys.stderr, flush=True)
    return results


def med(runs, key):
    ok = [r[key] for r in runs if r["status"] == "ok"]
    return statistics.median(ok) if ok else None


def step_rows(o, results):
    """The markdown lines of the step-time / RSS table and the RSS exponents (none without rows)."""
    if not results:
        return []
    out = []
    peers = o.peers
    label = {p: harness.PEERS[p]["label"] for p in peers}
    out.append("| method | S | recompute | " + " | ".join(f"{label[p]} s/step | {label[p]} peak RSS MB" for p in peers)
               + (" | step speed-up | RSS ratio |" if len(peers) == 2 else " |"))
    out.append("|---|---|---|" + "---|---|" * len(peers) + ("---|---|" if len(peers) == 2 else ""))
    for (method, S, rc), got in results.items():
        cells, vals = [], {}
        for p in peers:
            runs = got.get(p, [{"status": "skipped", "reason": "not run"}])
            t, m = med(runs, "step_s"), med(runs, "peak_rss_mb")
            vals[p] = (t, m)
            cells.append(f"{t:.3f} | {m:.0f}" if t is not None else f"{runs[0]['status']}: {runs[0].get('reason', '')[:60]} | -")
        line = f"| {method} | {S} | {rc} | " + " | ".join(cells)
        if len(peers) == 2:
            (ta, ma), (tb, mb) = vals[peers[0]], vals[peers[1]]
            line += (f" | {tb / ta:.2f}x | {ma / mb:.2f}x" if ta and tb else " | - | -")
        out.append(line + " |")
    out.append(f"\nStep speed-up = {label[peers[-1]]} s/step / {label[peers[0]]} s/step; RSS ratio = "
               f"{label[peers[0]]} / {label[peers[-1]]}." if len(peers) == 2 else "")
    for p in peers:
        xs, whole, own = [], [], []
        for (method, S, rc), got in results.items():
            runs = got.get(p, [])
            if method == "lora" and rc == "off" and med(runs, "peak_rss_mb"):
                xs.append(S)
                whole.append(med(runs, "peak_rss_mb"))
                own.append(whole[-1] - med(runs, "rss_after_import_mb"))
        a, b = fit_exponent(xs, whole), fit_exponent(xs, own)
        if a is not None:
            out.append(f"- {label[p]}: peak RSS ~ S^{a:.2f} (whole process), ~ S^{b:.2f} (above the RSS after "
                       f"imports), fitted over S = {', '.join(map(str, xs))}, recompute off.")
    return out


def report(o, cfg, results, rates, ceiling, env):
    cmd = "python benchmarks/long_context.py " + " ".join(sys.argv[1:])
    print(f"\n`{cmd.strip()}`\n")
    print(f"{harness.describe(dict(cfg, seq='S', batch=1))}; LoRA r={harness.LORA['lora_rank']} on "
          f"{', '.join(harness.LORA['lora_targets'])}; {o.warmup} warmup + {o.steps} timed steps per run, "
          f"median of {o.runs} alternating runs; each run its own process.")
    print(f"Machine: {harness.cpu_text()}; load average at start {o.load[0]:.2f} / {o.load[1]:.2f} / "
          f"{o.load[2]:.2f} (1 / 5 / 15 min).")
    print(f"Peers: paddletune (CPU op table, blocked attention kernel); transformers+peft with "
          f"attn_implementation=sdpa; both with {harness.env_text(env)}, the same batches and labels (every "
          f"token labelled, attention_mask all ones).\n")
    for line in step_rows(o, results):
        print(line)
    if rates:
        print(f"\nBlocked attention kernel, forward + backward, [1, {o.heads}, S, {o.dim}] causal; matmul ceiling "
              f"(best paddle fp32 rate, cpu_ceiling.py squares) {ceiling:.1f} GFLOP/s:\n")
        print("| S | fwd + bwd ms | GFLOP/s (needed FLOPs) | % of ceiling |")
        print("|---|---|---|---|")
        for S, (t, rate) in sorted(rates.items()):
            print(f"| {S} | {t * 1e3:.1f} | {rate:.1f} | {100 * rate / ceiling:.0f}% |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="512,1024,2048,4096")
    p.add_argument("--recompute", default="off,on", help="off, on or off,on")
    p.add_argument("--peers", default="paddletune,hf")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--full-seq", type=int, default=1024, help="S of the one full fine-tuning row (0: none)")
    p.add_argument("--kernel-seqs", default="1024,4096", help="S of the kernel rate rows ('' : none)")
    p.add_argument("--min-time", type=float, default=0.5, help="seconds per kernel / matmul timing round")
    p.add_argument("--smoke", action="store_true", help="tiny model, S 64,128, 1 step, 1 run (script check)")
    p.add_argument("--kernel-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--heads", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--dim", type=int, default=32, help=argparse.SUPPRESS)
    o = p.parse_args()
    if o.kernel_child:
        return kernel_child([int(s) for s in o.kernel_child.split(",")], o.heads, o.dim, o.min_time)
    if o.smoke:
        o.seqs, o.steps, o.warmup, o.runs, o.full_seq, o.kernel_seqs, o.min_time = "64,128", 1, 0, 1, 64, "128", 0.05
    o.seqs = [int(s) for s in o.seqs.split(",") if s]
    o.recompute = o.recompute.split(",")
    o.peers = o.peers.split(",")
    o.load = os.getloadavg()
    cfg = harness.SMOKE if o.smoke else harness.DESIGN
    o.heads, o.dim = cfg["num_attention_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    env = harness.peer_env("same")
    rates, ceiling = {}, None
    if o.kernel_seqs:
        squares = [(256, 256, 256)] if o.smoke else [(1024, 1024, 1024), (2048, 2048, 2048)]
        ceiling = max(measure_matmul("paddle", squares, o.min_time, env)["gflops"].values())
        rates = kernel_rates([int(s) for s in o.kernel_seqs.split(",")], o.heads, o.dim, o.min_time, env)
    results = {}
    if o.seqs or o.full_seq:   # --seqs '' --full-seq 0: the kernel rate rows only
        with tempfile.TemporaryDirectory(prefix="paddletune-long-") as work:
            harness.write_checkpoint(os.path.join(work, "checkpoint"), dict(cfg, seq=max(o.seqs + [o.full_seq])))
            results = run_rows(o, cfg, work, env)
    report(o, cfg, results, rates, ceiling, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
