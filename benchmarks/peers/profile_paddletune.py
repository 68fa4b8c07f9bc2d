"""Where paddletune's training step spends its time: paddle's profiler over a few steps of the
compare_peers configuration, summarised by phase and by operator.

    PYTHONPATH=. python benchmarks/peers/profile_paddletune.py [--method full|lora]
        [--layout padded|zero_padding] [--steps 3] [--smoke] [--raw]

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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=["full", "lora"], default="lora")
    p.add_argument("--layout", choices=["padded", "zero_padding"], default="padded")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 step")
    p.add_argument("--raw", action="store_true", help="print paddle's full summary too")
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
        prof = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], timer_only=False)
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
        print(f"\n| top operators | calls/step | ms/step | share |\n|---|---|---|---|")
        for n, calls, ms in ops[:o.top]:
            print(f"| {n} | {calls / steps:.0f} | {ms / steps:.1f} | {100 * ms / total:.1f}% |")
    if o.raw or not ops:
        print(text)


if __name__ == "__main__":
    main()
