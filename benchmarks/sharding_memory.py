"""Per-rank memory of sharding stage 1/2/3 against the analytic ZeRO shares, 2 launched ranks.

    python benchmarks/sharding_memory.py [--hidden 768 --layers 12 --vocab 32000 --seq 128] [--smoke]

Full fine-tuning of a random Llama (the default is ~134M parameters, 536 MB in float32), each
mode in a fresh 2-rank launch: plain data parallel ("dp") and sharding stage1 / stage2 / stage3
over both ranks. Per rank, after the last step:
  params     trainable elements holding storage between steps (stage3: the owned ones)
  grads      gradient elements held after the reduction (stage2+: the owned ones)
  optimizer  AdamW moment elements (stage1+: the owned tensors' only)
each in MiB (float32) and as a share of the unsharded amount, against ZeRO's analytic share
(stage1: 1 / 1 / 1/S, stage2: 1 / 1/S / 1/S, stage3: 1/S / 1/S / 1/S; S = 2); whole tensors
are partitioned, so the measured share is 1/S up to the granularity of one tensor. Also per rank
the peak RSS growth over the RSS before the model was loaded (model load included; the
activations and the gradients of backward add to it; stage3 peaks at the owned tensors + the
non-block ones + one block during a step, the blocks being gathered one at a time).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORKER = r'''
import json, os, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import paddletune
from paddletune import parallel
from paddletune.args import TrainingArguments

def field(name):
    for line in open("/proc/self/status"):
        if line.startswith(name + ":"):
            return int(line.split()[1]) / 1024

ckpt, out, mode, seq, steps, vocab = sys.argv[2], sys.argv[3], sys.argv[4], *map(int, sys.argv[5:8])
args = TrainingArguments(output_dir=out, sharding="" if mode == "dp" else mode, per_device_train_batch_size=1,
                         max_steps=steps, logging_steps=1, save_strategy="no", disable_tqdm=True,
                         learning_rate=1e-5, max_grad_norm=1.0)
topo = parallel.init(args)
from paddletune.loading import load_model
from paddletune.trainer import Trainer
before = field("VmRSS")
model = load_model(ckpt, topology=topo)
rng = np.random.default_rng(0)
data = [{"input_ids": rng.integers(3, vocab, seq), "labels": rng.integers(3, vocab, seq)} for _ in range(2 * steps)]
tr = Trainer(model, args, train_dataset=data, export_fn=lambda d: None, topology=topo)
seen = {}
def record(t, info):
    total = sum(int(np.prod(p.shape)) for p in t.trainable.values())
    sh = t.par.shard
    seen.update(total=total, optimizer=sum(int(v.size) for d in (t.optimizer.exp_avg, t.optimizer.exp_avg_sq) for v in d.values()),
                params=sh.resident(t.trainable) if sh is not None else total,
                grads=sh.stats.get("grad_numel", total) if sh is not None else total,
                peak_params=sh.stats.get("peak_resident") if sh is not None else None)
tr.callbacks.append(record)
tr.train()
seen["peak_rss_growth"] = field("VmHWM") - before
json.dump(seen, open(os.path.join(out, f"rank{topo.rank}.json"), "w"))
'''

SHARE = {"dp": (1, 1, 1), "stage1": (1, 1, 0.5), "stage2": (1, 0.5, 0.5), "stage3": (0.5, 0.5, 0.5)}


def run(a):
    from paddletune.models import build_model, save_pretrained

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"model_type": "llama", "vocab_size": a.vocab, "hidden_size": a.hidden,
               "intermediate_size": a.intermediate or a.hidden * 8 // 3, "num_hidden_layers": a.layers,
               "num_attention_heads": a.heads, "num_key_value_heads": a.heads, "max_position_embeddings": a.seq}
        ck = os.path.join(tmp, "ck")
        save_pretrained(build_model(cfg, seed=0), ck, dtype="float32")
        worker = os.path.join(tmp, "w.py")
        open(worker, "w").write(WORKER)
        for mode in a.modes:
            out = os.path.join(tmp, mode)
            os.makedirs(out)
            cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
                   os.path.join(out, "log"), worker, ROOT, ck, out, mode, str(a.seq), str(a.steps), str(a.vocab)]
            r = subprocess.run(cmd, cwd=tmp, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True)
            if r.returncode:
                logs = os.path.join(out, "log")
                tail = "".join(open(os.path.join(logs, f)).read()[-2000:] for f in sorted(os.listdir(logs))
                               if f.startswith("workerlog"))
                sys.exit(f"{mode} run failed:\n{tail}")
            rows.append((mode, [json.load(open(os.path.join(out, f"rank{i}.json"))) for i in (0, 1)]))
    return rows


def mib(numel):
    return numel * 4 / 2 ** 20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=list(SHARE), choices=list(SHARE))
    p.add_argument("--smoke", action="store_true", help="a tiny model, 1 step, stage3 only (the test suite's run)")
    a = p.parse_args(argv)
    if a.smoke:
        a.hidden, a.intermediate, a.layers, a.heads, a.vocab, a.seq, a.steps = 64, 96, 2, 4, 600, 16, 1
        a.modes = ["stage3"]
    rows = run(a)
    total = rows[0][1][0]["total"]
    print(f"sharding over 2 ranks, Llama with {total / 1e6:.1f}M trainable parameters "
          f"({mib(total):.0f} MiB float32), per rank (rank 0 / rank 1)\n")
    print("| mode | params MiB (share) | grads MiB (share) | optimizer MiB (share) | analytic share "
          "params / grads / optimizer | stage3 peak params in a step MiB | peak RSS growth MiB |")
    print("|---|---|---|---|---|---|---|")
    for mode, ranks in rows:
        def cell(key, full):
            return " / ".join(f"{mib(r[key]):.0f} ({r[key] / full:.3f})" for r in ranks)
        peak = " / ".join(f"{mib(r['peak_params']):.0f}" for r in ranks) if ranks[0]["peak_params"] else "-"
        share = " / ".join(str(s) for s in SHARE[mode])
        rss = " / ".join(f"{r['peak_rss_growth']:.0f}" for r in ranks)
        print(f"| {mode} | {cell('params', total)} | {cell('grads', total)} | {cell('optimizer', 2 * total)} "
              f"| {share} | {peak} | {rss} |")


if __name__ == "__main__":
    main()
