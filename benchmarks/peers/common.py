"""Child side of the peer benchmarks: read the run spec and the shared batches, time the training
steps, print one result line. Imports only the standard library, numpy and safetensors, so every
peer's interpreter (its own venv, e.g. PaddleFormers' with its numpy pin) can load it.

A peer script is `python peers/<peer>_train.py SPEC.json`; SPEC holds
    checkpoint   HF Llama directory (config.json + model.safetensors) every peer starts from
    data         safetensors file of batches "{i}.input_ids|labels|attention_mask" [B, L_i] int64
                 (labels unshifted, HF convention: position t is predicted from tokens < t,
                 -100 = no loss; attention_mask 1 = real token, 0 = right padding)
    method       "lora" | "full";  lora_rank, lora_alpha, lora_targets (module names)
    layout       "padded" | "zero_padding" | "greedy_zero_padding" (packed rows; paddletune only)
    steps, warmup, lr, max_grad_norm, seed
    recompute    optional, default false: recompute whole decoder layers in backward (long_context.py)
The result line is `BENCH_RESULT {json}`; tokens are counted here from the batches (not by the
peer), so every peer is measured with the same token and target counts.
"""
import json
import os
import resource
import sys
import time

import numpy as np

MARK = "BENCH_RESULT "
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def read_spec():
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} SPEC.json")
    with open(sys.argv[1], encoding="utf-8") as f:
        return json.load(f)


def load_batches(path, prefix="padded"):
    """[{input_ids, labels, attention_mask}] (numpy int64) in step order."""
    from safetensors.numpy import load_file

    flat = load_file(path)
    n = len({k.split(".")[1] for k in flat if k.startswith(prefix + ".")})
    return [{key: flat[f"{prefix}.{i}.{key}"] for key in ("input_ids", "labels", "attention_mask")}
            for i in range(n)]


def load_examples(path):
    """Unpadded examples [{input_ids, labels}] in the order the padded batches use them."""
    from safetensors.numpy import load_file

    flat = load_file(path)
    off = flat["examples.offsets"]
    return [{"input_ids": flat["examples.input_ids"][a:b], "labels": flat["examples.labels"][a:b]}
            for a, b in zip(off[:-1], off[1:])]


def counts(batch):
    """(real tokens, target tokens) of one batch: non-pad positions, and labels that a shifted
    loss uses (labels[:, 1:] != -100)."""
    real = int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].size
    return real, int((batch["labels"][:, 1:] != -100).sum())


def seq_lens(batch):
    """Real tokens of every sequence in the batch: one per row, or one per packed example
    (runs of equal segment_ids among real tokens)."""
    mask = batch["attention_mask"] if "attention_mask" in batch else np.ones_like(batch["input_ids"])
    if "segment_ids" not in batch:
        return [int(n) for n in mask.sum(1)]
    out = []
    for seg, m in zip(batch["segment_ids"], mask):
        _, n = np.unique(seg[m.astype(bool)], return_counts=True)
        out += [int(x) for x in n]
    return out


def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_steps(step_fn, batches, spec, prepared=None):
    """Run warmup + steps optimizer steps over batches[0], batches[1], ... (cycling); time the
    last `steps`. step_fn(batch) -> float loss (a host value, so the step has finished).
    `prepared[i]` (e.g. torch tensors made beforehand) is passed instead of the numpy batches[i],
    which are still what the tokens are counted from."""
    total = spec["warmup"] + spec["steps"]
    losses, times, real, target, timed = [], [], 0, 0, []
    for i in range(total):
        b = batches[i % len(batches)]
        arg = b if prepared is None else prepared[i % len(batches)]
        t0 = time.perf_counter()
        losses.append(float(step_fn(arg)))
        dt = time.perf_counter() - t0
        if i >= spec["warmup"]:
            times.append(dt)
            r, t = counts(b)
            real, target = real + r, target + t
            timed.append({"seq_lens": seq_lens(b), "targets": t})
    elapsed = sum(times)
    return {"status": "ok", "steps": spec["steps"], "warmup": spec["warmup"],
            "tokens_per_sec": real / elapsed, "target_tokens_per_sec": target / elapsed,
            "step_s": elapsed / len(times), "step_times": times, "losses": losses,
            "loss_first": losses[0], "loss_last": losses[-1], "peak_rss_mb": rss_mb(), "timed_batches": timed}


def thread_env():
    return {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DEBUG_CPU_TYPE")}


def emit(result):
    """Print the one machine-readable line the parent reads (last line of stdout)."""
    result.setdefault("env", thread_env())
    sys.stdout.flush()
    print(MARK + json.dumps(result), flush=True)


def not_available(reason):
    """A configuration this peer cannot run yet (e.g. a paddletune feature still on its branch)."""
    emit({"status": "pending", "reason": reason})
    raise SystemExit(0)


def count_params(params):
    return int(sum(int(np.prod(list(p.shape))) for p in params))
