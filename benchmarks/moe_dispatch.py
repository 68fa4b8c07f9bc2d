"""Expert-parallel dispatch on this machine: tokens per expert, bytes moved, step time.

    python benchmarks/moe_dispatch.py [--hidden 256 --layers 4 --experts 8 --top-k 2]
                                      [--batch 4 --seq 128 --steps 4] [--smoke]

Writes a random Mixtral checkpoint, then trains it (full fine-tuning, aux loss on) with the same
global batch in one process, under DP=2 and under EP=2 (2 launched processes each) and reports:
1. tokens per expert (routed assignments, summed over the timed steps and the data ranks) per
   sparse layer, from the EP=2 run;
2. the bytes the expert group's collectives moved per step and rank (parallel/expert.py records
   every one: all_gather counted as (ep-1) x its input, all_reduce as a ring's 2 (ep-1)/ep), against
   the all-to-all volume expert parallel needs: each token's hidden vector goes to its k experts
   and comes back (forward), and the same two exchanges again in backward:
       4 x assignments x H x 4 bytes x (share of assignments whose expert is on another rank)
   with that share (ep-1)/ep under uniform routing, and as measured from this run's routing.
   gloo has no all-to-all: the fallback all-gathers [x | w | idx] of the whole group and sums a
   [group tokens, H] buffer, so it moves more (the ratio column). The all-to-all path written for
   NCCL runs too, through cpu_compat's all-gather emulation (its step time is the emulation's):
   its recorded bytes are what the all-to-all itself sends (plus a [ep, E] count table);
3. the median step time of each layout (a shared 2-core CPU, 1 thread per rank: indicative only).
"""
import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORKER = r'''
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import paddletune
from paddletune import parallel, runtime
from paddletune.args import TrainingArguments
from paddletune.loading import load_model
from paddletune.models.moe import SparseMoeBlock
from paddletune.trainer import Trainer
mode, ckpt, out = sys.argv[2:5]
batch, seq, steps = map(int, sys.argv[5:8])
ep = 2 if mode in ("ep2", "a2a") else 1
args = TrainingArguments(output_dir=out, expert_parallel_degree=ep, per_device_train_batch_size=batch,
                         max_steps=steps, logging_steps=1, save_strategy="no", disable_tqdm=True,
                         learning_rate=1e-4)
topo = parallel.init(args)
runtime.set_seed(0)
model = load_model(ckpt, topology=topo)
counts, leaving = {}, [0]
epg = getattr(model, "expert_parallel", None)

def recording(block, name):
    route = block.route
    def route_and_count(x):
        logits, w, idx = route(x)
        if model.training:
            ids = idx.numpy().reshape(-1)
            counts[name] = counts.get(name, 0) + np.bincount(ids, minlength=block.num_experts)
            el = block.num_experts // ep   # assignments whose expert lives on another ep rank
            leaving[0] += int((ids // el != (epg.rank if epg is not None else 0)).sum())
        return logits, w, idx
    block.route = route_and_count

for name, m in model.named_sublayers():
    if isinstance(m, SparseMoeBlock):
        recording(m, name)
rng = np.random.default_rng(0)
world = topo.data_degree
data = [{"input_ids": rng.integers(3, 500, seq), "labels": rng.integers(3, 500, seq)}
        for _ in range(batch * world * (steps + 1))]
marks = []
if epg is not None:
    epg.log = []
    epg.use_alltoall = mode == "a2a"   # the NCCL path; on gloo through cpu_compat's emulation
tr = Trainer(model, args, train_dataset=data, export_fn=lambda d: None, topology=topo,
             callbacks=[lambda t, info: marks.append((len(epg.log) if epg is not None else 0, time.time()))])
t0 = time.time()
tr.train()
times = np.diff([t0] + [t for _, t in marks])
log = epg.log[:marks[-1][0]] if epg is not None else []
res = {"rank": topo.rank, "step_s": float(np.median(times[1:] if len(times) > 1 else times)),
       "bytes": sum(b for _, _, b in log) / steps, "counts": {k: v.tolist() for k, v in counts.items()},
       "leaving": leaving[0], "ep_rank": epg.rank if epg is not None else 0}
json.dump(res, open(os.path.join(out, f"{mode}-{topo.rank}.json"), "w"))
'''


from tensor_parallel import launch  # noqa: E402  (same launcher: one process or paddle.distributed.launch)


def write_checkpoint(path, a):
    from paddletune.models import build_model, get_spec, save_pretrained

    cfg = dict(get_spec("mixtral").tiny_config, hidden_size=a.hidden, num_hidden_layers=a.layers,
               intermediate_size=2 * a.hidden, num_local_experts=a.experts, num_experts_per_tok=a.top_k,
               vocab_size=512, output_router_logits=True)
    save_pretrained(build_model(cfg, seed=0), path)


def analytic(ranks, ep, H, steps):
    """(all-to-all bytes per step and rank under uniform routing, under this run's routing)."""
    assignments = sum(sum(sum(c) for c in r["counts"].values()) for r in ranks)
    leaving = sum(r["leaving"] for r in ranks)
    per = 4 * H * 4 / steps / len(ranks)   # 4 exchanges of float32 rows, per step and rank
    return per * assignments * (ep - 1) / ep, per * leaving


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="per-rank micro-batch at 2 ranks")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 step")
    a = p.parse_args(argv)
    if a.smoke:
        a.hidden, a.layers, a.experts, a.batch, a.seq, a.steps = 64, 1, 4, 1, 16, 1
    command = " ".join(["python benchmarks/moe_dispatch.py"] + list(argv if argv is not None else sys.argv[1:]))
    tmp = tempfile.mkdtemp(prefix="moe_dispatch_")
    ckpt = os.path.join(tmp, "ckpt")
    write_checkpoint(ckpt, a)
    worker = os.path.join(tmp, "worker.py")
    open(worker, "w").write(WORKER)
    res = {}
    for mode, nproc, batch in (("one", 1, 2 * a.batch), ("dp2", 2, a.batch), ("ep2", 2, a.batch),
                               ("a2a", 2, a.batch)):
        launch(nproc, [worker, ROOT, mode, ckpt, tmp, str(batch), str(a.seq), str(a.steps)], tmp)
        res[mode] = [json.load(open(os.path.join(tmp, f"{mode}-{r}.json"))) for r in range(nproc)]
    print(table(res, a, command))


def table(res, a, command):
    ep = res["ep2"]
    counts = {}
    for r in ep:
        for k, v in r["counts"].items():
            counts[k] = [x + y for x, y in zip(counts.get(k, [0] * a.experts), v)]
    uniform, routed = analytic(ep, 2, a.hidden, a.steps)
    out = [f"`{command}`", "",
           f"Mixtral, hidden {a.hidden}, {a.layers} layers, {a.experts} experts, top-{a.top_k}; global "
           f"batch {2 * a.batch} x {a.seq} tokens; {a.steps} steps (median step time of steps 2..)", "",
           "| layer | " + " | ".join(f"e{e}" for e in range(a.experts)) + " |",
           "|---|" + "---|" * a.experts]
    for k in sorted(counts, key=lambda n: int(n.split(".")[2]) if n.count(".") >= 2 else 0):
        out.append(f"| {k} | " + " | ".join(str(c) for c in counts[k]) + " |")
    out += ["", "| layout | step time (s) | dispatch bytes / step / rank | all-to-all analytic, uniform | "
            "all-to-all analytic, this routing | measured / analytic |", "|---|---|---|---|---|---|"]
    for mode, name in (("one", "1 process"), ("dp2", "DP=2"), ("ep2", "EP=2, gloo all-gather fallback"),
                       ("a2a", "EP=2, all-to-all path (gloo: emulated; bytes = the all-to-all's)")):
        step = sum(r["step_s"] for r in res[mode]) / len(res[mode])
        if mode in ("ep2", "a2a"):
            got = sum(r["bytes"] for r in res[mode]) / len(res[mode])
            out.append(f"| {name} | {step:.3f} | {got / 1e6:.2f} MB | {uniform / 1e6:.2f} MB | "
                       f"{routed / 1e6:.2f} MB | {got / max(routed, 1):.2f}x |")
        else:
            out.append(f"| {name} | {step:.3f} | - | - | - | - |")
    out.append("")
    out.append("The gloo fallback all-gathers every token of the group ([x | w | idx]) and all-reduces a "
               "[group tokens, H] buffer (and the adjoints in backward), so it moves more than an "
               "all-to-all would; on NCCL the all-to-all path (parallel/expert.py, untested here) "
               "sends only the assignments whose expert is on another rank (its row: the bytes it records, "
               "run here through the all-gather emulation).")
    return "\n".join(out)


if __name__ == "__main__":
    main()
