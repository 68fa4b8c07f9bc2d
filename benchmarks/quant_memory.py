"""Quantized-backbone LoRA (QLoRA) vs plain LoRA: backbone bytes, peak training RSS, tokens/s.

    python benchmarks/quant_memory.py                       # default: ~117M-param Llama, 6 steps
    python benchmarks/quant_memory.py --hidden 64 --layers 2 --intermediate 128 --vocab 600 \
        --seq 32 --batch 2 --steps 1                        # smoke run (what the tests do)

A random Llama checkpoint of the requested size is written to a temp dir (float32). Each
algorithm then runs in its own subprocess: load (quantizing while streaming), LoRA r=8 on every
decoder Linear, `--steps` optimizer steps on random tokens. Reported per algorithm:
  backbone MiB   bytes held by the decoder Linear weights (codes + scales; float32 for "none")
  model MiB      every parameter + quantized weights (embeddings and LM head stay float32)
  peak RSS MiB   VmHWM growth over the RSS right after `import paddle` (load + training)
  tokens/s       training tokens per second over the steps after the first
Timings on a shared machine are noisy: compare rows of one run, not runs.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGOS = ("none", "weight_only_int8", "weight_only_int4", "nf4", "fp4")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--blocksize", type=int, default=64)
    p.add_argument("--double-quant", action="store_true", help="8-bit block scales (4-bit algorithms)")
    p.add_argument("--algos", default=",".join(ALGOS), help="comma-separated subset of " + ",".join(ALGOS))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _rss():
    with open("/proc/self/status") as f:
        d = dict(line.split(":", 1) for line in f)
    return int(d["VmRSS"].split()[0]) * 1024, int(d["VmHWM"].split()[0]) * 1024


def worker(a):
    """One algorithm in this process; prints one JSON line."""
    sys.path.insert(0, ROOT)
    import numpy as np
    import paddletune  # noqa: F401  (thread settings before paddle)
    import paddle
    from paddletune import peft
    from paddletune.args import ModelArgument, TrainingArguments
    from paddletune.loading import load_model
    from paddletune.quant import QuantConfig, quant_report
    from paddletune.trainer import Trainer
    from paddletune.data.collate import pad_batch

    base = _rss()[0]
    quant = None if a.worker == "none" else QuantConfig(a.worker, a.blocksize, a.double_quant)
    model = load_model(a.ckpt, quant=quant)
    rep = quant_report(model)
    if quant is None:
        lin = [m for n, m in model.named_sublayers()
               if isinstance(m, paddle.nn.Linear) and ".layers." in n]
        backbone = sum(4 * int(np.prod(m.weight.shape)) for m in lin)
    else:
        backbone = rep["quantized_bytes"]
    setup = peft.apply(model, ModelArgument(model_name_or_path=a.ckpt, lora=True, lora_rank=8))
    rng = np.random.default_rng(0)
    examples = [{"input_ids": ids, "labels": ids.copy()}
                for ids in rng.integers(3, a.vocab, size=(a.batch * a.steps, a.seq))]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=a.batch,
                                 learning_rate=1e-4, max_steps=a.steps, save_strategy="no",
                                 disable_tqdm=True, logging_steps=10**9)
        trainer = Trainer(model, args, train_dataset=examples, trainable=setup.trainable)
        model.train()
        times = []
        for s in range(a.steps):
            micro = [pad_batch(examples[s * a.batch:(s + 1) * a.batch], 0)]
            t0 = time.time()
            loss, *_ = trainer.training_step(micro, 1e-4)
            float(loss)   # wait for the step
            times.append(time.time() - t0)
    timed = times[1:] or times
    peak = _rss()[1] - base
    print("RESULT " + json.dumps({
        "algo": a.worker, "backbone": backbone, "model": rep["model_bytes"], "peak": peak,
        "tokens_per_sec": a.batch * a.seq * len(timed) / sum(timed), "loss": float(loss)}))


def make_checkpoint(a, path):
    sys.path.insert(0, ROOT)
    from paddletune.models.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(path, "llama", seed=0, vocab_size=a.vocab, hidden_size=a.hidden,
                         intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                         num_attention_heads=a.heads, num_key_value_heads=a.heads,
                         max_position_embeddings=max(a.seq, 64))


def main(argv=None):
    a = parse(argv)
    if a.worker:
        return worker(a)
    algos = [x.strip() for x in a.algos.split(",") if x.strip()]
    bad = [x for x in algos if x not in ALGOS]
    if bad:
        raise SystemExit(f"--algos: unknown {bad}; choose from {list(ALGOS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        make_checkpoint(a, ckpt)
        for algo in algos:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", algo, "--ckpt", ckpt]
            for k in ("hidden", "layers", "intermediate", "heads", "vocab", "seq", "batch", "steps",
                      "blocksize"):
                cmd += [f"--{k}", str(getattr(a, k))]
            cmd += ["--double-quant"] if a.double_quant else []
            env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0 or "RESULT " not in proc.stdout:
                raise SystemExit(f"{algo} failed:\n{proc.stderr[-3000:]}")
            rows.append(json.loads(proc.stdout.split("RESULT ", 1)[1]))
    plain = next((r for r in rows if r["algo"] == "none"), None)
    mib = 2.0 ** 20
    print("| backbone | backbone MiB | model MiB | peak train RSS MiB | tokens/s | vs plain LoRA |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        rel = f"{r['tokens_per_sec'] / plain['tokens_per_sec']:.2f}x" if plain else "-"
        name = "float32 (plain LoRA)" if r["algo"] == "none" else r["algo"] + (
            " +dq" if a.double_quant and r["algo"] != "weight_only_int8" else "")
        print(f"| {name} | {r['backbone'] / mib:.3f} | {r['model'] / mib:.3f} | {r['peak'] / mib:.1f} "
              f"| {r['tokens_per_sec']:.0f} | {rel} |")
    print("\ncommand: python " + " ".join(shlex.quote(x) for x in
                                          [os.path.relpath(__file__, ROOT)] + list(argv or sys.argv[1:])))
    print(f"model: Llama hidden {a.hidden}, {a.layers} layers, intermediate {a.intermediate}, vocab "
          f"{a.vocab}; LoRA r=8 on all decoder Linears; batch {a.batch} x seq {a.seq}, {a.steps} steps")
    return rows


if __name__ == "__main__":
    main()
