"""Tensor parallel on this machine: per-rank loading memory and bytes communicated per step.

    python benchmarks/tensor_parallel.py [--hidden 768 --layers 12 --intermediate 2048 --vocab 32000]
                                         [--batch 2 --seq 128] [--smoke]

Writes a random Llama checkpoint (default 134M parameters, 537 MB float32), then:
1. loads it in one process and in each rank of a TP=2 launch, each in a fresh process, and
   reports the peak RSS growth during the load (the kernel's VmHWM, reset before the load);
2. runs training steps under TP=2 (LoRA off, full fine-tuning) and reports what our collectives
   moved per step (every collective is recorded by parallel.tensor.TensorParallel.log), against
   Megatron's analytic count for tensor parallelism without sequence parallelism: per
   micro-batch two all-reduces of [tokens, H] per layer forward (after attention, after the MLP)
   and two backward (the inputs of q/k/v and of gate/up), plus the vocabulary-parallel
   embedding's forward all-reduce and the LM head input's backward one:
       (4 L + 2) x tokens x H x 4 bytes
   The vocabulary-parallel loss adds a few numbers per token (row max, sum of exponentials,
   target logit) and the step one scalar (the gradient norm); the ratio shows their share.
Timing is on a shared 2-core CPU: indicative only (gloo all-reduce, 1 thread per rank).
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
import json, os, sys, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import paddletune
from paddletune import parallel, runtime
from paddletune.args import TrainingArguments
from paddletune.loading import load_model
mode, ckpt, out, batch, seq, steps = sys.argv[2], sys.argv[3], sys.argv[4], *map(int, sys.argv[5:8])

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024

args = TrainingArguments(output_dir=out, tensor_parallel_degree=2 if mode != "one" else 1,
                         per_device_train_batch_size=batch, max_steps=steps, logging_steps=1,
                         save_strategy="no", disable_tqdm=True, learning_rate=1e-4)
topo = parallel.init(args) if mode != "one" else parallel.single()
open("/proc/self/clear_refs", "w").write("5")
before = rss("VmRSS")
model = load_model(ckpt, topology=topo)
res = {"load_growth_mb": rss("VmHWM") - before, "rank": topo.rank}
if mode == "train":
    import numpy as np
    from paddletune.trainer import Trainer
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(3, 1000, seq), "labels": rng.integers(3, 1000, seq)} for _ in range(batch * steps)]
    marks = []
    tr = Trainer(model, args, train_dataset=data, export_fn=lambda d: None, topology=topo,
                 callbacks=[lambda t, info: marks.append((len(t.par.tp.log), time.time()))])
    tr.par.tp.log = []
    t0 = time.time()
    tr.train()
    res["step_s"] = (marks[-1][1] - t0) / steps
    res["comm"] = tr.par.tp.log[:marks[-1][0]]   # the training steps only (not the final export)
json.dump(res, open(os.path.join(out, f"{mode}-{topo.rank}.json"), "w"))
'''


def launch(nproc, args, cwd):
    if nproc == 1:
        cmd = [sys.executable] + args
    else:
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
               "--log_dir", os.path.join(cwd, f"log-{args[1]}")] + args
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"benchmark run failed ({' '.join(cmd[:6])} ...):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 step (test suite)")
    a = p.parse_args()
    if a.smoke:
        a.hidden, a.layers, a.intermediate, a.heads, a.vocab, a.seq, a.steps = 64, 2, 128, 4, 1000, 16, 1
    import paddletune  # noqa: F401
    from paddletune.models import build_model, save_pretrained

    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"model_type": "llama", "vocab_size": a.vocab, "hidden_size": a.hidden,
               "intermediate_size": a.intermediate, "num_hidden_layers": a.layers,
               "num_attention_heads": a.heads, "num_key_value_heads": a.heads,
               "max_position_embeddings": max(256, a.seq)}
        model = build_model(cfg, seed=0)
        n_params = sum(int(x.size) for x in model.parameters())
        ck = os.path.join(tmp, "ck")
        save_pretrained(model, ck, dtype="float32")
        del model
        worker = os.path.join(tmp, "worker.py")
        open(worker, "w").write(WORKER)
        common = [ROOT, None, ck, tmp, str(a.batch), str(a.seq), str(a.steps)]
        for mode, nproc in (("one", 1), ("load", 2), ("train", 2)):
            launch(nproc, [worker] + [common[0], mode] + common[2:], tmp)
        res = {f: json.load(open(os.path.join(tmp, f))) for f in os.listdir(tmp) if f.endswith(".json")}
    report(a, n_params, res)


def report(a, n_params, res):
    one = res["one-0.json"]["load_growth_mb"]
    loads = [res[f"load-{r}.json"]["load_growth_mb"] for r in (0, 1)]
    tokens = a.batch * a.seq
    analytic = (4 * a.layers + 2) * tokens * a.hidden * 4
    comm = res["train-0.json"]["comm"]
    measured = sum(4 * max(1, _numel(shape)) for _, shape in comm) / a.steps
    wide = sum(4 * _numel(shape) for _, shape in comm if shape and shape[-1] == a.hidden) / a.steps
    print(f"command: python benchmarks/tensor_parallel.py --hidden {a.hidden} --layers {a.layers} "
          f"--intermediate {a.intermediate} --vocab {a.vocab} --batch {a.batch} --seq {a.seq}")
    print(f"model: Llama {n_params / 1e6:.0f}M parameters ({4 * n_params / 2**20:.0f} MiB float32)\n")
    print("| measure | one process | TP=2 rank 0 | TP=2 rank 1 | ratio (TP / one) |")
    print("|---|---|---|---|---|")
    print(f"| peak RSS growth while loading (MiB) | {one:.0f} | {loads[0]:.0f} | {loads[1]:.0f} | "
          f"{max(loads) / one:.2f} (target <= 0.6) |")
    print("\n| communication per optimizer step | bytes | vs Megatron analytic |")
    print("|---|---|---|")
    print(f"| Megatron analytic (4L+2) x tokens x H x 4 | {analytic:,} | 1.00 |")
    print(f"| measured: activation all-reduces [.., H] | {wide:,.0f} | {wide / analytic:.3f} |")
    print(f"| measured: everything (+ loss row stats, grad norm) | {measured:,.0f} | {measured / analytic:.3f} |")
    print(f"\nstep time under TP=2 (rank 0, {a.steps} steps, shared 2-core CPU): "
          f"{res['train-0.json']['step_s']:.2f} s")


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
