"""Training throughput and peak RSS for the docs/design.md section 5 configuration, with and without the
CPU runtime tuning (threads = physical cores, MKL_DEBUG_CPU_TYPE=5 on AMD, heap reuse in malloc).

    python benchmarks/train_throughput.py [--steps 6] [--warmup 2] [--method full|lora] [--smoke]

Configuration: Llama, 4 layers, hidden 256, 8 heads, intermediate 688, vocab 32000, sequence 256,
batch 4, every token labelled; AdamW. `--method lora` trains LoRA r=8 on every decoder Linear
(needs paddletune.peft). Each mode runs in its own process (the runtime settings are read when
paddle loads); the table prints tokens/s over the timed steps and peak RSS of the process.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 256, "intermediate_size": 688,
          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
          "max_position_embeddings": 1024, "rms_norm_eps": 1e-6}
SEQ, BATCH = 256, 4


def child(opts):
    sys.path.insert(0, ROOT)
    import numpy as np

    import paddletune  # noqa: F401  (runtime set-up happens here)
    from paddletune.args import TrainingArguments
    from paddletune.models import build_model
    from paddletune.trainer import Trainer

    model = build_model(CONFIG, seed=0)
    if opts.method == "lora":
        from paddletune import peft
        from paddletune.args import ModelArgument

        trainable = peft.apply(model, ModelArgument(model_name_or_path="x", lora=True, lora_rank=8)).trainable
    else:
        trainable = None
    model.train()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CONFIG["vocab_size"], (BATCH, SEQ))
    batch = {"input_ids": ids, "labels": ids.copy(), "attention_mask": np.ones_like(ids)}
    args = TrainingArguments(output_dir="/tmp/unused", per_device_train_batch_size=BATCH, max_steps=opts.steps,
                             learning_rate=1e-4, disable_tqdm=True)
    trainer = Trainer(model, args, train_dataset=[], export_fn=lambda d: None, trainable=trainable)
    for _ in range(opts.warmup):
        trainer.training_step([batch], 1e-4)
    t = time.perf_counter()
    for _ in range(opts.steps):
        loss, *_ = trainer.training_step([batch], 1e-4)
    float(loss)
    dt = time.perf_counter() - t
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tokens_per_sec": BATCH * SEQ * opts.steps / dt, "step_s": dt / opts.steps,
                      "peak_rss_mb": rss, "loss": float(loss)}))


MODES = {
    "paddle defaults (1 thread, glibc malloc)": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                                                 "MKL_DEBUG_CPU_TYPE": None, "PADDLETUNE_MALLOC": "default"},
    "paddletune runtime tuning": {"OMP_NUM_THREADS": None, "MKL_NUM_THREADS": None, "MKL_DEBUG_CPU_TYPE": None,
                                  "PADDLETUNE_MALLOC": None},
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--method", choices=["full", "lora"], default="full")
    p.add_argument("--smoke", action="store_true", help="1 timed step, no warmup (test suite)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.smoke:
        opts.steps, opts.warmup = 1, 0
    if opts.child:
        return child(opts)
    rows = []
    for name, env_changes in MODES.items():
        env = dict(os.environ)
        for k, v in env_changes.items():
            env.pop(k, None)
            if v is not None:
                env[k] = v
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--steps", str(opts.steps),
               "--warmup", str(opts.warmup), "--method", opts.method]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"benchmark child failed: {name}")
        rows.append((name, json.loads(r.stdout.strip().splitlines()[-1])))
    print(f"\n`python benchmarks/{os.path.basename(__file__)} --steps {opts.steps} --warmup {opts.warmup} --method {opts.method}`\n")
    print(f"Llama 4 layers, hidden 256, vocab 32000, seq {SEQ}, batch {BATCH}, method {opts.method}\n")
    print("| runtime | tokens/s | s/step | peak RSS (MB) |")
    print("|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['tokens_per_sec']:.0f} | {r['step_s']:.3f} | {r['peak_rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
