"""paddletune vs PaddleFormers vs transformers+peft: the same Llama, the same weights, the same
data, each peer in its own process, runs alternating, medians reported in one table.

    python benchmarks/compare_peers.py --setup          # once: PaddleFormers' venv (its pins)
    python benchmarks/compare_peers.py [--steps 5] [--warmup 2] [--runs 3] [--modes lora,lora-sft,full]
                                       [--peers paddletune,paddleformers,hf] [--env same|defaults] [--smoke]

Configuration (docs/design.md section 5): Llama, 4 layers, hidden 256, 8 heads, intermediate 688,
vocab 32000, sequence 256, batch 4; AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), lr
--lr, global-norm clipping 1.0, fp32. Every peer loads one HF safetensors checkpoint written here
(seeded N(0, 0.02)), so step-1 losses agree; LoRA A matrices are random per library.
Modes:
  lora      LoRA r=8, alpha=16 on q,k,v,o,gate,up,down; uniform length, every token labelled
  lora-sft  LoRA on variable-length SFT examples (30-70% prompt, unlabelled): every peer pads each
            batch to its longest row (their default); paddletune also packs (zero padding,
            sequential and greedy; ratios use greedy)
  full      full fine-tuning, uniform length, every token labelled
Each run does --warmup untimed then --steps timed optimizer steps; tokens/s counts real (non-pad)
tokens, target tokens/s the labelled ones. Peers run as benchmarks/peers/*_train.py; a peer that
is not installed is reported as skipped with the reason. `--smoke`: tiny model, 1 step, 1 run.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import harness  # noqa: E402

MODES = {  # mode -> (method, data kind, [(peer, layout)], the paddletune layout the ratios use)
    "lora": ("lora", "uniform", [("paddletune", "padded"), ("paddleformers", "padded"), ("hf", "padded")], "padded"),
    "lora-sft": ("lora", "sft", [("paddletune", "greedy_zero_padding"), ("paddletune", "zero_padding"),
                                 ("paddletune", "padded"), ("paddleformers", "padded"), ("hf", "padded")],
                 "greedy_zero_padding"),
    "full": ("full", "uniform", [("paddletune", "padded"), ("paddleformers", "padded"), ("hf", "padded")], "padded"),
}
LAYOUT = {"padded": "padding", "zero_padding": "zero padding", "greedy_zero_padding": "greedy zero padding"}


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", action="store_true", help="create the peers' venvs, then exit")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    p.add_argument("--runs", type=int, default=3, help="runs per row, alternating between peers")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--peers", default=",".join(harness.PEERS))
    p.add_argument("--env", choices=["same", "defaults"], default="same",
                   help="same: every peer gets threads=cores and MKL_DEBUG_CPU_TYPE=5 on AMD; defaults: none set")
    p.add_argument("--threads", type=int, default=None, help="thread count for --env same (default: physical cores)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 step, no warmup, 1 run (test suite)")
    p.add_argument("--json", default=None, help="also write every run's raw result here")
    o = p.parse_args()
    o.modes, o.peers = o.modes.split(","), o.peers.split(",")
    for m in o.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    for peer in o.peers:
        if peer not in harness.PEERS:
            p.error(f"unknown peer {peer!r}; choose from {', '.join(harness.PEERS)}")
    if o.smoke:
        o.steps, o.warmup, o.runs = 1, 0, 1
    return o


def prepare(o, cfg, work):
    """Checkpoint + one data file per data kind; returns {data kind: path}."""
    harness.write_checkpoint(os.path.join(work, "checkpoint"), cfg)
    n = o.warmup + o.steps
    data = {}
    kinds = {MODES[m][1] for m in o.modes}
    if "uniform" in kinds:
        data["uniform"] = harness.write_data(os.path.join(work, "data-uniform.safetensors"),
                                             harness.uniform_batches(cfg, n))
    if "sft" in kinds:
        ex = harness.sft_examples(cfg, n)
        data["sft"] = harness.write_data(os.path.join(work, "data-sft.safetensors"),
                                         harness.pad_examples(ex, cfg["batch"])[:n], ex)
    return data


def run_all(o, cfg, work, data, env):
    """{(mode, peer, layout): [result per run]}; within a mode the rows alternate, and the
    starting row rotates from run to run so no peer always goes first."""
    results = {}
    for mode in o.modes:
        method, kind, rows, _ = MODES[mode]
        rows = [r for r in rows if r[0] in o.peers]
        static = set()
        for run in range(o.runs):
            for peer, layout in rows[run % len(rows):] + rows[:run % len(rows)]:
                if (peer, layout) in static:
                    continue
                spec = dict(harness.LORA, mode=mode, method=method, layout=layout, checkpoint=os.path.join(work, "checkpoint"),
                            data=data[kind], steps=o.steps, warmup=o.warmup, lr=o.lr, max_grad_norm=1.0, seed=0,
                            batch=cfg["batch"], seq=cfg["seq"], workdir=work)
                res = harness.run_peer(peer, spec, env, work)
                results.setdefault((mode, peer, layout), []).append(res)
                print(f"[{mode} run {run + 1}/{o.runs}] {peer} ({LAYOUT[layout]}): {res['status']}"
                      + (f" {res['target_tokens_per_sec']:.0f} target tok/s" if res["status"] == "ok" else
                         f" - {res.get('reason', '')}"), file=sys.stderr, flush=True)
                if res["status"] in ("pending", "skipped"):
                    static.add((peer, layout))   # the same answer on every run: ask once
    return results


def summarise(runs):
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        return {"status": runs[0]["status"], "reason": runs[0].get("reason", "")}
    med = {k: statistics.median(r[k] for r in ok) for k in
           ("tokens_per_sec", "target_tokens_per_sec", "step_s", "peak_rss_mb")}
    tgt = [r["target_tokens_per_sec"] for r in ok]
    return dict(med, status="ok", runs=len(ok), failed=len(runs) - len(ok), lo=min(tgt), hi=max(tgt),
                loss_first=ok[0]["loss_first"], loss_last=ok[0]["loss_last"],
                loss_last_spread=max(r["loss_last"] for r in ok) - min(r["loss_last"] for r in ok),
                trainable=ok[0]["trainable_params"], threads=ok[0].get("threads", ""),
                versions=ok[0].get("versions", {}), python=ok[0].get("python", ""))


def table(o, results):
    lines = ["| mode | peer | data layout | tokens/s | target tokens/s (min-max) | s/step | peak RSS (MB) | "
             f"trainable params | loss step 1 / step {o.warmup + o.steps} | paddletune / peer (target tok/s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode in o.modes:
        ref_layout = MODES[mode][3]
        ref = summarise(results.get((mode, "paddletune", ref_layout), [{"status": "skipped"}]))
        for peer, layout in MODES[mode][2]:
            if (mode, peer, layout) not in results:
                continue
            s = summarise(results[(mode, peer, layout)])
            name = harness.PEERS[peer]["label"]
            if s["status"] != "ok":
                lines.append(f"| {mode} | {name} | {LAYOUT[layout]} | {s['status']}: {s['reason']} |  |  |  |  |  |  |")
                continue
            ratio = (f"{ref['target_tokens_per_sec'] / s['target_tokens_per_sec']:.2f}x"
                     if ref["status"] == "ok" else f"- ({ref['status']})")
            fail = f" ({s['failed']} runs failed)" if s["failed"] else ""
            lines.append(f"| {mode} | {name} | {LAYOUT[layout]} | {s['tokens_per_sec']:.0f} | "
                         f"{s['target_tokens_per_sec']:.0f} ({s['lo']:.0f}-{s['hi']:.0f}){fail} | {s['step_s']:.3f} | "
                         f"{s['peak_rss_mb']:.0f} | {s['trainable']:,} | {s['loss_first']:.4f} / "
                         f"{s['loss_last']:.4f} | {ratio} |")
    return "\n".join(lines)


def environment_notes(o, results, env):
    seen, out = set(), []
    for (mode, peer, layout), runs in results.items():
        s = summarise(runs)
        if peer in seen or s["status"] != "ok":
            continue
        seen.add(peer)
        vers = ", ".join(f"{k} {v}" for k, v in s["versions"].items())
        out.append(f"- {harness.PEERS[peer]['label']}: {vers}; {harness.env_text(env)}; {s['threads']}; "
                   f"python {s['python']}")
    return "\n".join(out)


def main():
    o = parse()
    if o.setup:
        harness.setup(o.peers)
        return 0
    cfg = harness.SMOKE if o.smoke else harness.DESIGN
    env = harness.peer_env(o.env, o.threads)
    with tempfile.TemporaryDirectory(prefix="paddletune-peers-") as work:
        data = prepare(o, cfg, work)
        results = run_all(o, cfg, work, data, env)
    cmd = "python benchmarks/compare_peers.py " + " ".join(sys.argv[1:])
    print(f"\n`{cmd.strip()}`\n")
    print(f"{harness.describe(cfg)}; LoRA r={harness.LORA['lora_rank']}, alpha={harness.LORA['lora_alpha']} on "
          f"{', '.join(harness.LORA['lora_targets'])}; AdamW lr {o.lr:g}, clip 1.0, fp32; {o.warmup} warmup + "
          f"{o.steps} timed steps per run, median of {o.runs} alternating runs.")
    print(f"Machine: {harness.cpu_text()}. Timings from a shared, loaded machine unless stated otherwise.\n")
    print(table(o, results))
    print("\nEnvironment per peer (the same thread variables for every peer with --env same):")
    print(environment_notes(o, results, env))
    print("\nLosses: every peer starts from the same safetensors weights, so step-1 losses agree (full and "
          "LoRA: B = 0); later LoRA losses differ slightly because each library draws its own A matrices.")
    for key, runs in results.items():
        for r in runs:
            if r["status"] == "failed" and r.get("stderr"):
                print(f"\n{key} failed:\n{r['stderr'][-2000:]}", file=sys.stderr)
    if o.json:
        with open(o.json, "w") as f:
            json.dump({" / ".join(k): v for k, v in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
