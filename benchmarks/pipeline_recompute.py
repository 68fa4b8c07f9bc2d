"""Recompute and pipeline parallel on this machine: activation memory, time, and the pipeline bubble.

    python benchmarks/pipeline_recompute.py [--hidden 512 --layers 8 --seq 256 --batch 4]
        [--pp 4 --virtual 1,2 --micro 8 --pp-steps 5 --pp-hidden 512 --pp-layers 8 --pp-seq 256]
        [--skip recompute|pipeline] [--smoke]

1. Recompute (one process, full fine-tuning of a random Llama, each mode in a fresh process):
   for recompute off / full / full_attn / core_attn, the peak RSS growth of the first training
   step over the RSS before it (the activations kept for backward dominate it; later steps reuse
   freed memory, so only the first shows it) and the step time (median of the later --steps).
2. Pipeline on fleet's engine (p = --pp launched ranks, m = --micro micro-batches of 1 row, for
   each virtual_pp_degree v; the run goes through the Trainer as any job does). Inside each rank
   fleet's own methods are wrapped with timers: PipelineParallel._forward_step / _backward_step
   (one micro-batch of one chunk: wall time and the main thread's CPU time) and each engine
   class's forward_backward_pipeline (the step's schedule). Per stage, over the steps after the
   first: measured idle = 1 - (time inside forward / backward) / (step wall time), printed beside
   the analytic bubble (p-1)/(v m+p-1). No threshold.

Why measured idle is above the bubble here, and how the table separates the causes: p
processes share 2 cores (and the machine's other jobs), so a stage also waits while the stage
it needs is descheduled, and its own compute stretches when it loses the cores. Measured idle
therefore mixes the schedule's bubble with contention. More columns pull them apart:
- compute wall / CPU: forward / backward wall time over their CPU time (OMP_NUM_THREADS=1, so
  CPU time is the op's work): 1.0 means the stage had a core while computing, above 1 it lost it.
- replay: the schedule each stage actually ran (its recorded order of forward / backward per
  chunk) replayed as if every stage had its own core and p2p cost nothing, each op taking its
  stage's median measured CPU time for that kind and chunk: the bubble of fleet's schedule with
  this model's real stage imbalance (the first stage embeds, the last computes the loss head)
  and per-op overheads. With equal costs (forward 1, backward 2) the replay reproduces
  (p-1)/(v*m+p-1) exactly, which checks that the replay's dependency model matches the
  schedule fleet ran.
- step CPU / wall (process, main thread): how much of the step the rank got the CPU at all; the
  process figure includes the rank's other threads (gloo's transport among them), the main
  thread's is the schedule and compute only (paddle's CPU kernels run in the calling thread).
- CPU ms per F, B: the mean CPU time of one forward / backward (one chunk, one micro-batch).
Reading: replay (measured costs) - bubble is stage imbalance and per-op overhead; measured idle
- replay is what the shared cores and p2p add (gloo over TCP, plus a meta message per hop where
fleet's shape cache is off). Contention acts both ways (a stage waits for a descheduled peer,
but its own stretched compute also fills more of the step), so measured idle is an upper bound
of the schedule's idle only in the loose sense, and only the replay and CPU columns are
comparable between runs on a loaded machine.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PP_WORKER = r'''
import inspect, json, os, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from paddle.distributed.fleet.meta_parallel import pipeline_parallel as fpp
from paddletune import parallel
from paddletune.args import TrainingArguments
from paddletune.loading import load_model
from paddletune.trainer import Trainer
ckpt, out, seq, p, v, m, steps = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:9])
ops, step_rows, depth, engines = [], [], [0], set()

def timed_op(kind, fn):
    """fleet's per-micro-batch forward / backward (chunk = virtual stage of this rank), timed."""
    sig = inspect.signature(fn)
    def wrapper(self, *a, **k):
        chunk = sig.bind(self, *a, **k).arguments.get("chunk_id")
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(self, *a, **k)
        finally:
            if step_rows and step_rows[-1]["end"] is None:
                ops.append((kind, chunk or 0, t0, time.perf_counter(), time.thread_time() - c0))
    return wrapper

def timed_step(fn):
    """fleet's forward_backward_pipeline (one step's schedule), outermost call only."""
    def wrapper(self, *a, **k):
        depth[0] += 1
        if depth[0] == 1:
            engines.add(type(self).__name__)
            step_rows.append({"start": time.perf_counter(), "cpu0": time.process_time(), "t0": time.thread_time(),
                              "end": None, "ops": len(ops)})
        try:
            return fn(self, *a, **k)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                step_rows[-1].update(end=time.perf_counter(), cpu=time.process_time() - step_rows[-1]["cpu0"],
                                     tcpu=time.thread_time() - step_rows[-1]["t0"])
    return wrapper

fpp.PipelineParallel._forward_step = timed_op("F", fpp.PipelineParallel._forward_step)
fpp.PipelineParallel._backward_step = timed_op("B", fpp.PipelineParallel._backward_step)
for name, cls in vars(fpp).items():
    if isinstance(cls, type) and issubclass(cls, fpp.PipelineParallel) and "forward_backward_pipeline" in vars(cls):
        cls.forward_backward_pipeline = timed_step(cls.forward_backward_pipeline)

args = TrainingArguments(output_dir=out, pipeline_parallel_degree=p, virtual_pp_degree=v,
                         per_device_train_batch_size=1, gradient_accumulation_steps=m, max_steps=steps,
                         logging_steps=1, save_strategy="no", disable_tqdm=True, learning_rate=1e-4)
topo = parallel.init(args)
model = load_model(ckpt, topology=topo)
rng = np.random.default_rng(0)
data = [{"input_ids": rng.integers(3, 1000, seq), "labels": rng.integers(3, 1000, seq)} for _ in range(m * steps)]
Trainer(model, args, train_dataset=data, export_fn=lambda d: None, topology=topo).train()
steps_out = []
for i, s in enumerate(step_rows):
    until = step_rows[i + 1]["ops"] if i + 1 < len(step_rows) else len(ops)
    steps_out.append({k: s[k] for k in ("start", "end", "cpu", "tcpu")} | {"ops": ops[s["ops"]:until]})
json.dump({"stage": topo.pp_rank, "engines": sorted(engines), "steps": steps_out},
          open(os.path.join(out, f"pp-{topo.pp_rank}.json"), "w"))
'''


RECOMPUTE_WORKER = r'''
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import paddletune
import paddle
from paddletune.models import build_model
from paddletune.models.loss import causal_lm_loss
mode, hidden, layers, seq, batch, steps = sys.argv[2], *map(int, sys.argv[3:8])

def field(name):
    for line in open("/proc/self/status"):
        if line.startswith(name + ":"):
            return int(line.split()[1]) / 1024

cfg = {"model_type": "llama", "vocab_size": 8000, "hidden_size": hidden, "intermediate_size": hidden * 3,
       "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 8,
       "max_position_embeddings": seq}
model = build_model(cfg, seed=0)
model.train()
model.recompute, model.recompute_granularity = mode != "off", "full" if mode == "off" else mode
rng = np.random.default_rng(0)
b = {"input_ids": paddle.to_tensor(rng.integers(3, 8000, (batch, seq))),
     "labels": paddle.to_tensor(rng.integers(3, 8000, (batch, seq)))}
open("/proc/self/clear_refs", "w").write("5")
before = field("VmRSS")
times = []
for i in range(steps + 1):
    t = time.perf_counter()
    causal_lm_loss(model, b).loss.backward()
    times.append(time.perf_counter() - t)
    if i == 0:   # the first step's peak: what it kept for backward, in a fresh process
        growth = field("VmHWM") - before
    model.clear_gradients()
print(json.dumps({"growth": growth, "time": statistics.median(times[1:])}))
'''


def recompute_rows(a):
    """Each mode in a fresh process: the first step's peak RSS growth over the RSS before it
    (activations kept for backward, gradients, temporaries), and the median later step time."""
    rows = []
    for mode in ("off", "full", "full_attn", "core_attn"):
        r = subprocess.run([sys.executable, "-c", RECOMPUTE_WORKER, ROOT, mode, str(a.hidden), str(a.layers),
                            str(a.seq), str(a.batch), str(a.steps)], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=ROOT))
        if r.returncode:
            sys.exit(f"recompute run failed:\n{r.stderr[-2000:]}")
        res = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append((mode, res["growth"], res["time"]))
    return rows


def replay(stage_ops, p, v, cost=None):
    """The schedule each stage ran (its F / B order, as recorded), replayed as if each stage had
    a core of its own and p2p took no time: an op starts when its stage is free and its input
    is ready (F of virtual stage c*p+s for micro-batch j after F of the virtual stage before it;
    B after B of the virtual stage after it). The j-th F (B) of a chunk is micro-batch j.
    Durations: the measured CPU time of each op, or cost(kind) when given. Returns (makespan,
    [busy time per stage])."""
    last_vs = p * v - 1
    done, free, busy, pos = {}, [0.0] * p, [0.0] * p, [0] * p
    seen = [dict() for _ in range(p)]
    todo = sum(len(o) for o in stage_ops)
    while todo:
        moved = False
        for s in range(p):
            while pos[s] < len(stage_ops[s]):
                kind, chunk, dur = stage_ops[s][pos[s]]
                j = seen[s].get((kind, chunk), 0)
                vs = chunk * p + s
                dep = None
                if kind == "F" and vs > 0:
                    dep = ("F", vs - 1, j)
                elif kind == "B" and vs < last_vs:
                    dep = ("B", vs + 1, j)
                if dep is not None and dep not in done:
                    break
                dur = cost(kind) if cost else dur
                start = max(free[s], done[dep] if dep else 0.0)
                free[s] = done[(kind, vs, j)] = start + dur
                busy[s] += dur
                seen[s][(kind, chunk)] = j + 1
                pos[s] += 1
                todo -= 1
                moved = True
        if not moved:
            raise RuntimeError("replay: recorded schedule has a dependency cycle (op order not understood)")
    return max(free), busy


def stage_summary(stages, p, v, skip=1):
    """Per stage, over the steps after the first `skip` (warm-up): measured idle share (1 - time in
    fleet's forward / backward over the step's wall time), compute stretch (forward / backward
    wall over their CPU time: >1 when the stage lost the cores to the others), the step's CPU
    share; the replayed idle share at measured costs (each op its stage's median CPU time for
    that kind and chunk over the measured steps: single ops hit by contention stay outliers
    there) and at equal costs (F = 1, B = 2)."""
    n = len(stages[0]["steps"])
    rows = [dict(wall=0.0, busy=0.0, cpu_busy=0.0, cpu=0.0, tcpu=0.0, nF=0, nB=0, cF=0.0, cB=0.0) for _ in range(p)]
    costs = {}
    for i in range(skip, n):
        for s, st in enumerate(stages):
            step, r = st["steps"][i], rows[s]
            r["wall"] += step["end"] - step["start"]
            r["cpu"] += step["cpu"]
            r["tcpu"] += step["tcpu"]
            for kind, chunk, t0, t1, c in step["ops"]:
                r["busy"] += t1 - t0
                r["cpu_busy"] += c
                r["n" + kind] += 1
                r["c" + kind] += c
                costs.setdefault((s, kind, chunk), []).append(c)
    med = {key: statistics.median(c) for key, c in costs.items()}
    rep, rep_busy, eq, eq_busy = 0.0, [0.0] * p, 0.0, [0.0] * p
    for i in range(skip, n):
        ops = [[(k, ch, med[(s, k, ch)]) for k, ch, _, _, _ in st["steps"][i]["ops"]] for s, st in enumerate(stages)]
        span, b = replay(ops, p, v)
        rep += span
        rep_busy = [x + y for x, y in zip(rep_busy, b)]
        span, b = replay(ops, p, v, cost=lambda k: 1.0 if k == "F" else 2.0)
        eq += span
        eq_busy = [x + y for x, y in zip(eq_busy, b)]
    for s, r in enumerate(rows):
        r["idle"] = 1 - r["busy"] / max(r["wall"], 1e-12)
        r["stretch"] = r["busy"] / max(r["cpu_busy"], 1e-12)
        r["cpu_share"] = r["cpu"] / max(r["wall"], 1e-12)
        r["main_share"] = r["tcpu"] / max(r["wall"], 1e-12)
        r["replay"] = 1 - rep_busy[s] / max(rep, 1e-12)
        r["equal"] = 1 - eq_busy[s] / max(eq, 1e-12)
        r["steps"] = n - skip
        r["msF"], r["msB"] = (1e3 * r["c" + k] / max(r["n" + k], 1) for k in "FB")
    return rows


def pipeline_runs(a):
    """p launched ranks per virtual degree v: each stage's timed ops and steps (PP_WORKER)."""
    from paddletune.models import build_model, save_pretrained

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"model_type": "llama", "vocab_size": 1000, "hidden_size": a.pp_hidden,
               "intermediate_size": a.pp_hidden * 3, "num_hidden_layers": a.pp_layers, "num_attention_heads": 4,
               "num_key_value_heads": 4, "max_position_embeddings": a.pp_seq}
        ck = os.path.join(tmp, "ck")
        save_pretrained(build_model(cfg, seed=0), ck, dtype="float32")
        worker = os.path.join(tmp, "w.py")
        open(worker, "w").write(PP_WORKER)
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")   # CPU time = the op's work
        for v in a.virtual:
            run = os.path.join(tmp, f"v{v}")
            os.makedirs(run)
            cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(a.pp), "--log_dir",
                   os.path.join(run, "log"), worker, ROOT, ck, run, str(a.pp_seq), str(a.pp), str(v), str(a.micro),
                   str(a.pp_steps)]
            r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
            if r.returncode:
                logs = "".join(open(os.path.join(run, "log", f)).read()[-3000:]
                               for f in sorted(os.listdir(os.path.join(run, "log"))) if f.startswith("workerlog"))
                print(f"\npipeline run v={v} failed (exit {r.returncode}):\n{logs}", file=sys.stderr)
                out.append((v, None))
                continue
            out.append((v, [json.load(open(os.path.join(run, f"pp-{s}.json"))) for s in range(a.pp)]))
    return out


def input_error(a):
    """The pipeline settings paddle's interleaved schedule refuses (checked before any run)."""
    if a.pp < 2:
        return f"--pp {a.pp}: a pipeline needs 2+ stages; set --pp 2 or more"
    for v in a.virtual:
        if v > 1 and a.pp < 3:
            return f"--virtual {v} with --pp {a.pp}: paddle's interleaved schedule needs 3+ stages; use --pp 3+"
        if v > 1 and a.micro < a.pp:
            return f"--virtual {v}, --micro {a.micro}: interleaving needs micro-batches >= --pp ({a.pp})"
        if v < 1 or a.pp_layers % (a.pp * v):
            return (f"--pp-layers {a.pp_layers} with --pp {a.pp}, --virtual {v}: the blocks must be divisible "
                    f"by pp x virtual ({a.pp * max(v, 1)}); pick --pp-layers a multiple of it")
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="steps per run; the first is warm-up")
    p.add_argument("--pp", type=int, default=4, help="pipeline stages (launched ranks)")
    p.add_argument("--virtual", default="1,2", help="virtual_pp_degree values")
    p.add_argument("--micro", type=int, default=8, help="micro-batches per step (gradient_accumulation_steps)")
    p.add_argument("--pp-steps", type=int, default=5, help="steps per pipeline run; the first is warm-up")
    p.add_argument("--pp-hidden", type=int, default=512)
    p.add_argument("--pp-layers", type=int, default=8, help="decoder blocks (divisible by pp x v)")
    p.add_argument("--pp-seq", type=int, default=256)
    p.add_argument("--skip", default="", help="'recompute' or 'pipeline': leave that part out")
    p.add_argument("--smoke", action="store_true", help="tiny models, 2 steps (test suite)")
    a = p.parse_args()
    a.virtual = [int(x) for x in a.virtual.split(",")]
    if a.smoke:
        a.hidden, a.layers, a.seq, a.batch, a.steps = 64, 2, 16, 2, 2
        a.pp_hidden, a.pp_seq, a.micro, a.pp_steps = 32, 8, 8, 2
    bad = input_error(a)
    if bad and a.skip != "pipeline":
        print(f"error: {bad}", file=sys.stderr)
        sys.exit(2)
    import paddletune  # noqa: F401

    print(f"command: python benchmarks/pipeline_recompute.py --hidden {a.hidden} --layers {a.layers} "
          f"--seq {a.seq} --batch {a.batch} --steps {a.steps} --pp {a.pp} --virtual "
          f"{','.join(map(str, a.virtual))} --micro {a.micro} --pp-steps {a.pp_steps} --pp-hidden {a.pp_hidden} --pp-layers "
          f"{a.pp_layers} --pp-seq {a.pp_seq}\n")
    if a.skip != "recompute":
        print("| recompute | peak RSS growth in a step (MiB) | vs off | step time (s) | vs off |")
        print("|---|---|---|---|---|")
        rows = recompute_rows(a)
        base_mem, base_t = rows[0][1], rows[0][2]
        for mode, mem, t in rows:
            print(f"| {mode} | {mem:.0f} | {mem / max(base_mem, 1e-9):.2f} | {t:.3f} | {t / base_t:.2f} |")
    if a.skip == "pipeline":
        return
    m, P = a.micro, a.pp
    print(f"\n| p={P}, m={m}: v | fleet engine | stage | bubble (p-1)/(v m+p-1) | replay, equal costs | "
          "replay, measured CPU costs | measured idle (wall) | compute wall / CPU | step CPU / wall: process, main thread "
          "| F, B per step | CPU ms per F, B |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    failed = []
    for v, stages in pipeline_runs(a):
        bubble = (P - 1) / (v * m + P - 1)
        if stages is None:
            failed.append(v)
            print(f"| {v} | run failed (stderr) | | {bubble:.3f} | | | | | | | |")
            continue
        engine = ",".join(stages[0]["engines"])
        for s, r in enumerate(stage_summary(stages, P, v)):
            print(f"| {v} | {engine} | {s} | {bubble:.3f} | {r['equal']:.3f} | {r['replay']:.3f} | {r['idle']:.3f} | "
                  f"{r['stretch']:.2f} | {r['cpu_share']:.2f}, {r['main_share']:.2f} | {r['nF'] // r['steps']}, {r['nB'] // r['steps']} | "
                  f"{r['msF']:.1f}, {r['msB']:.1f} |")
    if failed:
        sys.exit(f"pipeline run(s) failed: virtual_pp_degree {failed}")


if __name__ == "__main__":
    main()
