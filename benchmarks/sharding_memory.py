"""Per-rank memory of sharding stage 1/2/3 against the analytic ZeRO shares, 2 launched ranks.

    python benchmarks/sharding_memory.py [--hidden 768 --layers 12 --vocab 32000 --seq 128] [--smoke]
    python benchmarks/sharding_memory.py --peft lora|qlora [--modes stage3]   (frozen backbone rows)
    python benchmarks/sharding_memory.py --model llama2-70b                   (the memory model only)

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

--peft lora / qlora: LoRA r 8 on every linear of the same model, its backbone float32 (lora) or nf4
(qlora), and per rank the bytes held between steps by the trainable parameters, the frozen float
parameters and the buffers (the quantized codes and scales), each as a share of the whole beside
1/S: what the frozen backbone costs a rank when it dominates (sharding exists for that case).

--model llama2-70b: no run; prints `memory_model`'s per-rank bytes for Llama-2-70B LoRA and QLoRA on
8 x 80 GB at seq 4096 with recompute, for no sharding and stages 1-3, and its formula.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORKER = r'''
import json, os, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
from sharding_memory import held_by_kind
import numpy as np
import paddletune
from paddletune import parallel
from paddletune.args import TrainingArguments

def field(name):
    for line in open("/proc/self/status"):
        if line.startswith(name + ":"):
            return int(line.split()[1]) / 1024

ckpt, out, mode, seq, steps, vocab = sys.argv[2], sys.argv[3], sys.argv[4], *map(int, sys.argv[5:8])
method = sys.argv[8] if len(sys.argv) > 8 else "full"
args = TrainingArguments(output_dir=out, sharding="" if mode == "dp" else mode, per_device_train_batch_size=1,
                         max_steps=steps, logging_steps=1, save_strategy="no", disable_tqdm=True,
                         learning_rate=1e-5, max_grad_norm=1.0)
topo = parallel.init(args)
from paddletune.loading import load_model
from paddletune.trainer import Trainer
before = field("VmRSS")
from paddletune.args import ModelArgument, QuantArgument
quant = QuantArgument(weight_quantize_algo="nf4") if method == "qlora" else None
model = load_model(ckpt, topology=topo, quant=quant)
setup = None
if method != "full":
    from paddletune import peft
    setup = peft.apply(model, ModelArgument(lora=True, lora_rank=8))
rng = np.random.default_rng(0)
data = [{"input_ids": rng.integers(3, vocab, seq), "labels": rng.integers(3, vocab, seq)} for _ in range(2 * steps)]
tr = Trainer(model, args, train_dataset=data, export_fn=lambda d: None, topology=topo,
             trainable=setup.trainable if setup else None)
seen = {}

def record_held(t, info):
    seen["held"] = held_by_kind(model)

def record(t, info):
    if method != "full":
        return record_held(t, info)
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

def nbytes(t):
    return int(math.prod(t.shape)) * t.element_size()


def held(t):
    """Bytes this tensor's storage holds on this rank now: its own if initialized, plus a separate
    shard storage (paddle's group_sharded stage 3 clears a parameter it does not need and keeps
    the rank's slice in `fw_storage`)."""
    own = nbytes(t) if t._is_initialized() else 0
    fw = getattr(t, "fw_storage", None)
    if fw is not None and fw._is_initialized() and not (t._is_initialized() and fw._is_shared_buffer_with(t)):
        own += nbytes(fw)
    return own


def held_by_kind(model):
    """{"trainable" | "frozen" | "buffers": [bytes held now, bytes of the whole tensors]} over a
    model's parameters (frozen = stop_gradient) and buffers (quantized codes and scales)."""
    kinds = {"trainable": [0, 0], "frozen": [0, 0], "buffers": [0, 0]}
    for p in model.parameters():
        k = kinds["frozen" if p.stop_gradient else "trainable"]
        k[0] += held(p)
        k[1] += nbytes(p)
    for b in model.buffers():
        kinds["buffers"][0] += held(b)
        kinds["buffers"][1] += nbytes(b)
    return kinds


SHARE = {"dp": (1, 1, 1), "stage1": (1, 1, 0.5), "stage2": (1, 0.5, 0.5), "stage3": (0.5, 0.5, 0.5)}

LLAMA2_70B = {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
              "intermediate_size": 28672, "vocab_size": 32000, "tie_word_embeddings": False}
MODELS = {"llama2-70b": LLAMA2_70B}
NF4 = 0.5 + 4 / 64   # bytes per quantized value: two codes per byte + a float32 absmax per 64 values


def memory_model(cfg, method="lora", stage=0, S=8, seq=4096, batch=1, r=8, shard_buffers=False,
                 frozen_kept=False):
    """{term: bytes} on one rank of LoRA / QLoRA training over S data-parallel = sharding ranks
    (stage 0: plain data parallel), with recompute. Why: the frozen backbone, not the trainable
    state, decides whether a 70B LoRA fits, and only stage 3 (which shards frozen parameters) or
    sharded quantized buffers move it.

    Counts (H hidden, L layers, n heads, k KV heads, d = H/n, I intermediate, V vocabulary, untied):
        M = L * (2*H*n*d + 2*H*k*d + 3*H*I)    block linears (q, o; k, v; gate, up, down)
        F = 2*V*H + (2*L + 1)*H                 other float weights (embedding, head; norms)
        T = L * r * (2*(H + n*d) + 2*(H + k*d) + 3*(H + I))   LoRA A [r, in] + B [out, r], 7 linears
    Bytes (GPU: bf16 compute, AdamW, master weights and gradients in float32 as amp O2 keeps them):
        frozen       LoRA  2*(M + F)                   bf16 backbone; stage 3: / S (group_sharded
                                                       shards stop_gradient parameters too)
                     QLoRA q*M + 2*F, q = 0.5 + 4/64   nf4 codes + a float32 absmax per 64 values;
                                                       stage 3: 2*F / S, and q*M / S only with
                                                       shard_buffers (codes and scales are buffers,
                                                       which group_sharded never shards)
        adapters     2*T                               bf16; stage 3: / S
        gradients    4*T                               float32 main_grad; stage >= 2: / S
        optimizer    8*T + 4*T                         AdamW moments + float32 master weights;
                                                       stage >= 1: / S (each rank keeps them for
                                                       the parameters it updates)
        activations  2*b*s*H*L                         each block's bf16 input (recompute)
                   + 2*b*s*(10*H + 3*I)                the block being recomputed in backward
                                                       (flash attention: no n*s score term)
                   + 8*b*s*V                           float32 logits and their gradient
                                                       (not sharded by any stage: per micro-batch)
        gather       stage 3: two blocks' frozen weights whole beyond their slices, the block
                     being computed and the one stage 3 prefetches (measured in backward:
                     tools/probes/gs_held_probe.py): 2 * 2*M/L (LoRA), 2 * q*M/L (QLoRA with
                     shard_buffers), 0 otherwise (the codes stay whole)
    frozen_kept: stage 3 as paddle 3.3.1 ships it, where backward gathers frozen parameters again
    and never releases them (docs/notes/group_sharded_frozen.md): the frozen float weights count
    whole (2*(M + F) for LoRA, 2*F of QLoRA), nothing gathered on top.
    b = batch per rank, s = seq. Not counted: the CUDA context and allocator slack (~1-3 GB), the
    dequantized weight of one linear inside the QLoRA matmul.
    """
    H, L, V, I = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["intermediate_size"]
    n = cfg["num_attention_heads"]
    k = cfg.get("num_key_value_heads", n)
    d = cfg.get("head_dim", H // n)
    M = L * (2 * H * n * d + 2 * H * k * d + 3 * H * I)
    F = 2 * V * H + (2 * L + 1) * H
    T = L * r * (2 * (H + n * d) + 2 * (H + k * d) + 3 * (H + I))
    s3, s2, s1 = (S if stage >= x else 1 for x in (3, 2, 1))
    f3 = 1 if frozen_kept else s3
    if method == "lora" and frozen_kept:
        frozen, gather = 2 * (M + F), 0
    elif method == "lora":
        frozen, gather = 2 * (M + F) / s3, (2 * 2 * M / L if stage >= 3 else 0)
    else:
        codes = NF4 * M / (S if stage >= 3 and shard_buffers else 1)
        frozen, gather = codes + 2 * F / f3, (2 * NF4 * M / L if stage >= 3 and shard_buffers and not frozen_kept else 0)
    tokens = batch * seq
    return {"frozen": frozen, "adapters": 2 * T / s3, "gradients": 4 * T / s2, "optimizer": 12 * T / s1,
            "activations": 2 * tokens * H * L + 2 * tokens * (10 * H + 3 * I) + 8 * tokens * V,
            "gather": gather}


def print_model(name, S=8, gpu_gib=80, seq=4096, batch=1, r=8):
    cfg = MODELS[name]
    print(f"{name} LoRA r {r} on every linear, {S} ranks x {gpu_gib} GiB, seq {seq}, batch {batch} per rank, "
          "recompute, bf16 + float32 master / gradients, per rank GiB (memory_model):\n")
    print("| method | sharding | frozen weights | adapters | gradients | optimizer | activations "
          "| stage-3 gather | total | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = ([("lora", st, False, False) for st in (0, 1, 2, 3)] + [("lora", 3, False, True)]
            + [("qlora", st, False, False) for st in (0, 1, 2, 3)] + [("qlora", 3, True, False), ("qlora", 3, False, True)])
    for method, stage, shard_buffers, kept in rows:
        t = memory_model(cfg, method, stage, S, seq, batch, r, shard_buffers, kept)
        total = sum(t.values())
        label = "none (dp)" if stage == 0 else f"stage{stage}"
        if method == "qlora" and stage == 3:
            label += " codes sharded (ours)" if shard_buffers else " codes whole (paddle: buffers)"
        if kept:
            label += ", paddle as shipped (frozen kept whole after backward)"
        cells = " | ".join(f"{t[key] / 2 ** 30:.2f}" for key in
                           ("frozen", "adapters", "gradients", "optimizer", "activations", "gather"))
        print(f"| {'QLoRA nf4' if method == 'qlora' else 'LoRA bf16'} | {label} | {cells} | "
              f"{total / 2 ** 30:.2f} | {'yes' if total <= gpu_gib * 2 ** 30 else 'no'} |")
    print("\nformula (memory_model):\n" + memory_model.__doc__)



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
                   os.path.join(out, "log"), worker, ROOT, ck, out, mode, str(a.seq), str(a.steps), str(a.vocab),
                   a.peft or "full"]
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


def print_held(a, rows):
    """The --peft table: per rank, bytes held between steps by each kind of tensor, as a share of
    the whole (one process holds 1.0) beside 1/S."""
    print(f"{a.peft} (r 8, every linear) on a Llama of hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}: "
          "bytes held between steps per rank (rank 0 / rank 1), share of the whole, S = 2\n")
    print("| mode | trainable MiB (share) | frozen float MiB (share) | buffers (quantized codes, scales) "
          "MiB (share) | all MiB (share) | 1/S | group_sharded stage 3 share (trainable / frozen / buffers) |")
    print("|---|---|---|---|---|---|---|")
    for mode, ranks in rows:
        def cell(kinds):
            held = [sum(r["held"][k][0] for k in kinds) for r in ranks]
            whole = sum(ranks[0]["held"][k][1] for k in kinds)
            return " / ".join(f"{h / 2 ** 20:.2f} ({h / whole:.3f})" if whole else "-" for h in held)
        print(f"| {mode} | {cell(['trainable'])} | {cell(['frozen'])} | {cell(['buffers'])} "
              f"| {cell(['trainable', 'frozen', 'buffers'])} | 0.5 | 0.5 / 0.5 / 1 (buffers are never sharded) |")


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
    p.add_argument("--peft", choices=["lora", "qlora"],
                   help="LoRA r 8 on every linear of a float32 (lora) / nf4 (qlora) backbone: per-rank bytes "
                        "held by trainable, frozen and buffer tensors (default modes: stage3)")
    p.add_argument("--model", choices=list(MODELS), help="print the memory model of this model and exit (no run)")
    a = p.parse_args(argv)
    if a.model:
        return print_model(a.model)
    if a.peft and a.modes == list(SHARE):
        a.modes = ["stage3"]
    if a.smoke:
        # (hidden 512: LoRA's A / B (512 x 8) exceed the stage-3 segment_size rule at S = 2 on CPU
        # (2048 elements), so paddle slices them, as it does at real sizes)
        a.hidden, a.intermediate, a.layers, a.heads, a.vocab, a.seq, a.steps = 512, 1024, 2, 4, 600, 16, 1
        a.modes = ["stage3"]
    rows = run(a)
    if a.peft:
        return print_held(a, rows)
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
