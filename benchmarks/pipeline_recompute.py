"""Recompute and pipeline parallel on this machine: activation memory, time, and the 1F1B bubble.

    python benchmarks/pipeline_recompute.py [--hidden 512 --layers 8 --seq 256 --batch 4] [--smoke]

1. Recompute (one process, full fine-tuning of a random Llama, each mode in a fresh process):
   for recompute off / full / full_attn / core_attn, the peak RSS growth of the first training
   step over the RSS before it (the activations kept for backward dominate it; later steps reuse
   freed memory, so only the first shows it) and the step time (median of the later --steps).
2. Pipeline on fleet's engine (PP=2 on 2 launched ranks, accumulation m = 2, 4, 8; then p = 4,
   m = 8 on 4 ranks with v = 1 (PipelineParallel) and v = 2 virtual stages (PipelineParallel-
   WithInterleave); micro-batch 1): per stage, the idle share of a step = 1 - compute / wall, with
   compute the time inside fleet's forward / backward micro-steps (its micro-step callbacks, the
   pipeline trace) and wall the whole forward_backward_pipeline call, against the analytic
   bubble (p-1)/(v m+p-1). No threshold. On a CPU with fewer cores than ranks the stages also
   compete for the cores (a "waiting" stage's peer runs slower), and the p2p meta messages and
   blocking gloo sends are outside compute: the measured share is an upper bound of the
   schedule's bubble.
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
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import paddletune
from paddletune import parallel
from paddletune.args import TrainingArguments
from paddletune.loading import load_model
from paddletune.trainer import Trainer
ckpt, out, seq, accum, steps, pp, vpp = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:9])
args = TrainingArguments(output_dir=out, pipeline_parallel_degree=pp, virtual_pp_degree=vpp, per_device_train_batch_size=1,
                         gradient_accumulation_steps=accum, max_steps=steps, logging_steps=1,
                         save_strategy="no", disable_tqdm=True, learning_rate=1e-4)
topo = parallel.init(args)
model = load_model(ckpt, topology=topo)
rng = np.random.default_rng(0)
data = [{"input_ids": rng.integers(3, 1000, seq), "labels": rng.integers(3, 1000, seq)} for _ in range(accum * steps)]
tr = Trainer(model, args, train_dataset=data, export_fn=lambda d: None, topology=topo)
marks = []
tr.callbacks.append(lambda t, info: marks.append(time.perf_counter()))
model.pipeline.trace = []
t0 = time.perf_counter()
tr.train()
ev = model.pipeline.trace
# steps after the first (warm-up): compute time inside the schedule vs the schedule's wall time
steps_seen, busy, total, open_at, t_step = 0, 0.0, 0.0, {}, None
for e in ev:
    if e[0] == "step":
        steps_seen += 1
        t_step = e[2]
    elif e[0] == "step_end" and steps_seen > 1:
        total += e[2] - t_step
    elif e[0] in ("F", "B"):
        open_at[(e[0], e[1])] = e[2]
    elif e[0] in ("F_end", "B_end"):
        t = e[2] - open_at.pop((e[0][0], e[1]))
        busy += t if steps_seen > 1 else 0.0
json.dump({"stage": topo.pp_rank, "busy": busy, "total": total}, open(os.path.join(out, f"pp-{topo.pp_rank}.json"), "w"))
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


def pipeline_rows(a):
    from paddletune.models import build_model, save_pretrained

    out = []
    runs = [(2, 1, m) for m in a.accum] + ([(4, v, 8) for v in (1, 2)] if a.pp4 else [])
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"model_type": "llama", "vocab_size": 1000, "hidden_size": a.hidden, "intermediate_size": a.hidden * 3,
               "num_hidden_layers": a.layers, "num_attention_heads": 8, "num_key_value_heads": 8,
               "max_position_embeddings": a.seq}
        ck = os.path.join(tmp, "ck")
        save_pretrained(build_model(cfg, seed=0), ck, dtype="float32")
        worker = os.path.join(tmp, "w.py")
        open(worker, "w").write(PP_WORKER)
        for pp, v, m in runs:
            run = os.path.join(tmp, f"p{pp}v{v}m{m}")
            os.makedirs(run)
            cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(pp), "--log_dir",
                   os.path.join(run, "log"), worker, ROOT, ck, run, str(a.seq), str(m), str(a.steps), str(pp), str(v)]
            r = subprocess.run(cmd, cwd=tmp, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"pipeline run failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
            stages = [json.load(open(os.path.join(run, f"pp-{s}.json"))) for s in range(pp)]
            idle = [1 - s["busy"] / max(s["total"], 1e-9) for s in stages]
            out.append((pp, v, m, (pp - 1) / (v * m + pp - 1), idle))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--accum", default="2,4,8")
    p.add_argument("--no-pp4", dest="pp4", action="store_false", help="skip the p = 4 runs (4 ranks)")
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 step (test suite)")
    a = p.parse_args()
    a.accum = [int(x) for x in a.accum.split(",")]
    if a.smoke:
        a.hidden, a.layers, a.seq, a.batch, a.steps, a.accum, a.pp4 = 64, 2, 16, 2, 2, [2], False
    import paddletune  # noqa: F401

    print(f"command: python benchmarks/pipeline_recompute.py --hidden {a.hidden} --layers {a.layers} "
          f"--seq {a.seq} --batch {a.batch}\n")
    print("| recompute | peak RSS growth in a step (MiB) | vs off | step time (s) | vs off |")
    print("|---|---|---|---|---|")
    rows = recompute_rows(a)
    base_mem, base_t = rows[0][1], rows[0][2]
    for mode, mem, t in rows:
        print(f"| {mode} | {mem:.0f} | {mem / max(base_mem, 1e-9):.2f} | {t:.3f} | {t / base_t:.2f} |")
    print("\n| stages p | virtual v | micro-batches m | bubble (p-1)/(v m+p-1) | idle share per stage |")
    print("|---|---|---|---|---|")
    for pp, v, m, bubble, idle in pipeline_rows(a):
        print(f"| {pp} | {v} | {m} | {bubble:.3f} | {' / '.join(f'{x:.3f}' for x in idle)} |")

if __name__ == "__main__":
    main()
