"""Where paddletune's training step spends its time: paddle's profiler over a few steps of the
compare_peers configuration, summarised by phase and by operator.

    PYTHONPATH=. python benchmarks/peers/profile_paddletune.py [--method full|lora]
        [--layout padded|zero_padding] [--steps 3] [--smoke] [--raw] [--kernels]

Phases (paddle's Model Summary): Forward, Backward, Others (= clipping, optimizer, host work).
Operators: the top ones by CPU total, grouped (matmul, loss, norms/pow, elementwise, ...).
"Operator time / step time" below 100% is host (Python) time between kernels.
"""
import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402

GROUPS = [("matmul (fwd + grad)", r"matmul"), ("cross-entropy + softmax", r"cross_entropy|softmax"),
          ("pow (RMSNorm x^2, grad-norm g**2)", r"pow"),
          ("scale / multiply / divide / sqrt / add / subtract (optimizer, clip, residuals)",
           r"^(scale|multiply|divide|sqrt|add|subtract|Global_(Multiply|Add|Scale)GradNode)"),
          ("embedding (fwd + grad)", r"embedding|Embedding"),
          ("reshape / split / concat / slice / transpose", r"reshape|split|concat|slice|transpose|Reshape|Split|Concat|Slice")]


def parse_ops(text):
    """[(name, calls, cpu_total_ms)] from the 'Operator Summary' of paddle's profiler text."""
    out, on = [], False
    for line in text.splitlines():
        if "Thread: All threads merged" in line:
            on = True
            continue
        if on and line.startswith("-----"):
            if out:
                break
            continue
        m = re.match(r"^(\S+(?: dygraph)?)\s+(\d+)\s+([\d.]+) /", line) if on else None
        if m:
            out.append((m.group(1).replace(" dygraph", ""), int(m.group(2)), float(m.group(3))))
    return out


def parse_phases(text):
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^\s+(Forward|Backward|Others)\s+\S+\s+([\d.]+) /", text, re.M)}


def best_ms(f, n=3):
    f()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return 1000 * best


def kernels(cfg):
    """Single-kernel timings behind the profile's findings (paddle; torch beside where useful)."""
    import paddle
    import paddle.nn.functional as F

    T, H, V = cfg["batch"] * cfg["seq"], cfg["hidden_size"], cfg["vocab_size"]
    big, act = paddle.randn([V, H]), paddle.randn([T, H])
    logits, tgt = paddle.randn([T - cfg["batch"], V]), paddle.randint(0, V, [T - cfg["batch"], 1])
    rows = [(f"x ** 2 / pow(x, 2), [{V}, {H}] (grad-norm of embed/lm_head)", lambda: big ** 2),
            (f"paddle.square(x), [{V}, {H}]", lambda: paddle.square(big)),
            (f"x.pow(2), [{T}, {H}] (RMSNorm)", lambda: act.pow(2)),
            (f"paddle.square(x), [{T}, {H}]", lambda: paddle.square(act)),
            (f"F.cross_entropy(sum), [{T - cfg['batch']}, {V}]", lambda: F.cross_entropy(logits, tgt, reduction="sum")),
            (f"paddle.exp, [{T - cfg['batch']}, {V}]", lambda: paddle.exp(logits)),
            (f"F.softmax, [16, {V}]", lambda: F.softmax(logits[:16], -1)),
            (f"F.log_softmax, [16, {V}]", lambda: F.log_softmax(logits[:16], -1))]
    print("\n| kernel (fp32, CPU) | paddle ms | torch ms |\n|---|---|---|")
    try:
        import torch
    except ImportError:
        torch = None
    for name, f in rows:
        ref = ""
        if torch is not None and "cross_entropy" in name:
            tl, tt = torch.from_numpy(logits.numpy()), torch.from_numpy(tgt.numpy()[:, 0])
            ref = f"{best_ms(lambda: torch.nn.functional.cross_entropy(tl, tt, reduction='sum')):.1f}"
        elif torch is not None and "** 2" in name:
            tb = torch.from_numpy(big.numpy())
            ref = f"{best_ms(lambda: tb ** 2):.1f}"
        print(f"| {name} | {best_ms(f, 1 if 'log_softmax' in name else 3):.1f} | {ref} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=["full", "lora"], default="lora")
    p.add_argument("--layout", choices=["padded", "zero_padding"], default="padded")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 step")
    p.add_argument("--raw", action="store_true", help="print paddle's full summary too")
    p.add_argument("--kernels", action="store_true", help="also time the single kernels behind the findings")
    o = p.parse_args()
    cfg = harness.SMOKE if o.smoke else harness.DESIGN
    steps = 1 if o.smoke else o.steps
    sys.path.insert(0, harness.ROOT)
    import paddletune  # noqa: F401  (thread settings before paddle)
    import paddle.profiler as profiler

    import paddletune_train

    with tempfile.TemporaryDirectory(prefix="paddletune-profile-") as work:
        harness.write_checkpoint(os.path.join(work, "checkpoint"), cfg)
        ex = harness.sft_examples(cfg, steps + 1)
        data = (harness.write_data(os.path.join(work, "d.safetensors"), harness.pad_examples(ex, cfg["batch"]), ex)
                if o.layout == "zero_padding" else
                harness.write_data(os.path.join(work, "d.safetensors"), harness.uniform_batches(cfg, steps + 1)))
        spec = dict(harness.LORA, mode="profile", method=o.method, layout=o.layout, data=data, steps=steps, warmup=1,
                    checkpoint=os.path.join(work, "checkpoint"), lr=1e-3, max_grad_norm=1.0, seed=0,
                    batch=cfg["batch"], seq=cfg["seq"], workdir=work)
        trainer, batches = paddletune_train.build(spec)
        trainer.training_step([batches[0]], 1e-3)            # warm-up: first-call allocations
        prof = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], on_trace_ready=lambda p: None)  # no trace files
        prof.start()
        t0 = time.perf_counter()
        for i in range(steps):
            loss, *_ = trainer.training_step([batches[(i + 1) % len(batches)]], 1e-3)
            float(loss)
            prof.step()
        wall = (time.perf_counter() - t0) / steps
        prof.stop()
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            prof.summary(sorted_by=profiler.SortedKeys.CPUTotal, op_detail=False, thread_sep=False, time_unit="ms")
    text = buf.getvalue()
    ops, phases = parse_ops(text), parse_phases(text)
    total = wall * 1000 * steps
    print(f"\n{harness.describe(cfg)}; method {o.method}, layout {o.layout}; {steps} profiled steps, "
          f"{wall:.3f} s/step wall (profiler on; loaded machine unless stated).\n")
    if phases:
        print("| phase | ms/step | share |\n|---|---|---|")
        for k in ("Forward", "Backward", "Others"):
            if k in phases:
                print(f"| {k} | {phases[k] / steps:.0f} | {100 * phases[k] / total:.0f}% |")
    if ops:
        print(f"\nOperator time / step time: {100 * sum(ms for _, _, ms in ops) / total:.0f}% "
              "(the rest is host time between kernels)\n")
        print("| operator group | ms/step | share |\n|---|---|---|")
        left = list(ops)
        for name, pat in GROUPS:
            ms = sum(t for n, _, t in left if re.search(pat, n, re.I))
            left = [x for x in left if not re.search(pat, x[0], re.I)]
            print(f"| {name} | {ms / steps:.0f} | {100 * ms / total:.0f}% |")
        print(f"| other operators | {sum(t for _, _, t in left) / steps:.0f} | {100 * sum(t for _, _, t in left) / total:.0f}% |")
        print("\n| top operators | calls/step | ms/step | share |\n|---|---|---|---|")
        for n, calls, ms in ops[:o.top]:
            print(f"| {n} | {calls / steps:.0f} | {ms / steps:.1f} | {100 * ms / total:.1f}% |")
    if o.raw or not ops:
        print(text)
    if o.kernels:
        kernels(cfg)


if __name__ == "__main__":
    main()
