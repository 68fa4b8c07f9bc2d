"""How close paddletune's training step comes to the machine's fp32 matmul rate.

    python benchmarks/cpu_ceiling.py [--steps 5] [--warmup 2] [--runs 3] [--modes full,lora,lora-sft]
                                     [--peers paddletune,hf,paddleformers] [--smoke]

1. The ceiling: fp32 matmul GFLOP/s of paddle and numpy (torch beside them, as a reference),
   each in its own process with the same thread settings as the training runs, on a 1024^3
   (2048^3) square and on the step's own shapes (MLP up and down, LM head forward and its input
   gradient: [tokens, vocab] x [vocab, hidden]). The ceiling is the best paddle rate.
2. The step: benchmarks/peers/paddletune_train.py (with --peers, the other peers' scripts too) on
   the docs/design.md section 5 model, as compare_peers.py runs it; achieved = needed FLOPs / step time.

Needed FLOPs (`step_flops`) count matmuls only, and only those the step cannot avoid: per token
and Linear (in, out) 2*in*out forward, 2*in*out for the input gradient unless nothing upstream
trains (LoRA: layer 0's q/k/v read the frozen embedding), 2*in*out for the weight gradient when
it trains (full: 6N per token, frozen backbone: ~4N); LoRA adds its own A/B products; causal
attention 4*pairs*heads*head_dim forward with pairs = n(n+1)/2 per sequence of n real tokens,
twice that backward; the LM head only at labelled positions. Embedding lookups, norms, softmax
and the optimizer are not counted, so 100% is out of reach by construction.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "peers"))
import harness  # noqa: E402

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_shapes(cfg):
    """[(name, in, out)] of one decoder layer."""
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    D = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    return [("q_proj", H, q), ("k_proj", H, kv), ("v_proj", H, kv), ("o_proj", q, H),
            ("gate_proj", H, I), ("up_proj", H, I), ("down_proj", I, H)]


def step_flops(cfg, seq_lens, n_logits, method, lora_rank=8, lora_targets=LINEARS, causal=True):
    """Matmul FLOPs one optimizer step needs (forward + backward), see the module docstring.

    seq_lens: real tokens of each sequence (packed examples count separately); n_logits: positions
    whose logits the loss needs (labelled targets; B*S where a library computes every position);
    method "full" | "lora"; causal=False counts the full n^2 score matrix (what dense kernels do).
    Worked example, 1 layer, hidden 2, heads 1, intermediate 4, vocab 8, one sequence of 3 tokens,
    2 labelled, full: per token the Linears hold 2*2*4 + 3*2*4 = 40 weights -> 6*40*3 = 720;
    attention pairs 6 -> 4*6*2 = 48 forward, x3 = 144; head 6*2*8*2 = 192; total 1056."""
    T = sum(seq_lens)
    D = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    qdim = cfg["num_attention_heads"] * D
    full = method == "full"
    total = 0
    for layer in range(cfg["num_hidden_layers"]):
        for name, fin, fout in linear_shapes(cfg):
            mm = 2 * fin * fout * T
            lora = method == "lora" and name in lora_targets
            upstream_trains = full or layer > 0 or name not in ("q_proj", "k_proj", "v_proj")
            total += mm * (1 + upstream_trains + full)
            if lora:
                a, b = 2 * lora_rank * fin * T, 2 * lora_rank * fout * T
                # forward x@A and (xA)@B; backward dB, d(xA), dA; dx through A if upstream trains
                total += a + b + b + b + a + (a if upstream_trains else 0)
        pairs = sum(n * (n + 1) // 2 if causal else n * n for n in seq_lens)
        total += 3 * 4 * pairs * qdim
    head = 2 * cfg["hidden_size"] * cfg["vocab_size"] * n_logits
    total += head * (2 + full)
    return total


# ----------------------------------------------------------------------------- matmul children

def matmul_child(lib, shapes, min_time):
    """Best GFLOP/s over 3 rounds of repeated [m,k]@[k,n] per shape; prints one JSON line."""
    import time

    import numpy as np

    if lib == "paddle":
        sys.path.insert(0, os.path.dirname(HERE))
        import paddletune  # noqa: F401  (thread settings before paddle loads)
        import paddle

        mk = lambda s: paddle.to_tensor(np.random.default_rng(0).standard_normal(s, dtype=np.float32))  # noqa: E731
        mm, version = paddle.matmul, paddle.__version__
    elif lib == "torch":
        import torch

        mk = lambda s: torch.from_numpy(np.random.default_rng(0).standard_normal(s, dtype=np.float32))  # noqa: E731
        mm, version = torch.matmul, torch.__version__
    else:
        mk = lambda s: np.random.default_rng(0).standard_normal(s, dtype=np.float32)  # noqa: E731
        mm, version = np.matmul, np.__version__
    out = {}
    for m, k, n in shapes:
        a, b = mk((m, k)), mk((k, n))
        mm(a, b)
        best = 0.0
        for _ in range(3):
            reps, t0 = 0, time.perf_counter()
            while True:
                c = mm(a, b)
                reps += 1
                dt = time.perf_counter() - t0
                if dt >= min_time:
                    break
            float(c[0, 0])
            best = max(best, 2 * m * k * n * reps / dt / 1e9)
        out[f"{m}x{k}x{n}"] = best
    print(json.dumps({"lib": lib, "version": version, "gflops": out}))


def measure_matmul(lib, shapes, min_time, env):
    cmd = [sys.executable, os.path.abspath(__file__), "--matmul-child", lib, "--min-time", str(min_time),
           "--shapes", ",".join("x".join(map(str, s)) for s in shapes)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        if lib == "torch":   # optional reference: report, don't fail
            return {"lib": lib, "version": "not available", "gflops": {}}
        raise SystemExit(f"matmul child ({lib}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- main

MODES = {"full": ("full", "uniform", "padded"), "lora": ("lora", "uniform", "padded"),
         "lora-sft": ("lora", "sft", "zero_padding")}


def step_needs(cfg, result, method):
    """(needed FLOPs per real token, labelled fraction) over the batches the child timed."""
    flops = sum(step_flops(cfg, b["seq_lens"], b["targets"], method) for b in result["timed_batches"])
    real = sum(sum(b["seq_lens"]) for b in result["timed_batches"])
    return flops / real, sum(b["targets"] for b in result["timed_batches"]) / real


def median_run(runs):
    """(layout, result) of the run with the median tokens/s (the first result if none is ok)."""
    ok = sorted((r for r in runs if r[1]["status"] == "ok"), key=lambda r: r[1]["tokens_per_sec"])
    return ok[len(ok) // 2] if ok else runs[0]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--peers", default="paddletune", help="also time these peers' steps against the same "
                   "ceiling, e.g. paddletune,hf,paddleformers (needed FLOPs do not depend on the library)")
    p.add_argument("--runs", type=int, default=3, help="runs per row (alternating); the median run is shown")
    p.add_argument("--min-time", type=float, default=0.5, help="seconds per matmul timing round")
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 step, short matmul timing (test suite)")
    p.add_argument("--matmul-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shapes", default="", help=argparse.SUPPRESS)
    o = p.parse_args()
    if o.matmul_child:
        return matmul_child(o.matmul_child, [tuple(map(int, s.split("x"))) for s in o.shapes.split(",")], o.min_time)
    if o.smoke:
        o.steps, o.warmup, o.min_time, o.runs = 1, 0, 0.05, 1
    cfg = harness.SMOKE if o.smoke else harness.DESIGN
    env = harness.peer_env("same")
    tokens = cfg["batch"] * cfg["seq"]
    square = 256 if o.smoke else 1024
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    # square, then the step's own: MLP up, MLP down, LM head forward, LM head input gradient
    shapes = [(square, square, square), (tokens, H, I), (tokens, I, H), (tokens, H, V), (tokens, V, H)]
    if not o.smoke:
        shapes.insert(1, (2048, 2048, 2048))
    mats = [measure_matmul(lib, shapes, o.min_time, env) for lib in ("paddle", "numpy", "torch")]
    ceiling = max(mats[0]["gflops"].values())
    rows = []
    with tempfile.TemporaryDirectory(prefix="paddletune-ceiling-") as work:
        harness.write_checkpoint(os.path.join(work, "checkpoint"), cfg)
        n = o.warmup + o.steps
        uni = harness.write_data(os.path.join(work, "uniform.safetensors"), harness.uniform_batches(cfg, n))
        ex = harness.sft_examples(cfg, n)
        sft = harness.write_data(os.path.join(work, "sft.safetensors"), harness.pad_examples(ex, cfg["batch"])[:n], ex)
        for mode in o.modes.split(","):
            method, kind, layout = MODES[mode]
            data = uni if kind == "uniform" else sft
            spec = dict(harness.LORA, mode=mode, method=method, layout=layout, checkpoint=os.path.join(work, "checkpoint"),
                        data=data, steps=o.steps, warmup=o.warmup, lr=1e-3, max_grad_norm=1.0, seed=0,
                        batch=cfg["batch"], seq=cfg["seq"], workdir=work)
            peers, runs = o.peers.split(","), {}
            for run in range(o.runs):   # alternating, the first peer rotating, as in compare_peers.py
                for peer in peers[run % len(peers):] + peers[:run % len(peers)]:
                    lay = layout if peer == "paddletune" else "padded"   # peers: their default padding
                    runs.setdefault(peer, []).append((lay, harness.run_peer(peer, dict(spec, layout=lay), env, work)))
            for peer in peers:
                rows.append((mode, *median_run(runs[peer]), peer))
    print(f"\n`python benchmarks/cpu_ceiling.py {' '.join(sys.argv[1:])}`".replace(" `", "`"))
    print(f"\nMachine: {harness.cpu_text()}; {harness.env_text(env)}. Loaded, shared machine unless stated.\n")
    print("| fp32 matmul [m,k]x[k,n] | " + " | ".join(f"{m['lib']} {m['version']} GFLOP/s" for m in mats) + " |")
    print("|---|" + "---|" * len(mats))
    for key in mats[0]["gflops"]:
        print(f"| {key} | " + " | ".join(f"{m['gflops'][key]:.1f}" if key in m["gflops"] else "-" for m in mats) + " |")
    print(f"\nCeiling (best paddle rate): {ceiling:.1f} GFLOP/s.\n")
    print(f"{harness.describe(cfg)}; training step as in compare_peers.py, {o.warmup} warmup + {o.steps} timed "
          f"steps, median of {o.runs} alternating runs per row.\n")
    print("| mode | peer | data layout | labelled fraction | needed MFLOP/token | tokens/s | achieved GFLOP/s | "
          "% of ceiling | tokens/s at ceiling |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, layout, res, peer in rows:
        if res["status"] != "ok":
            print(f"| {mode} | {peer} | {layout} | {res['status']}: {res.get('reason', '')} | | | | | |")
            continue
        per_tok, frac = step_needs(cfg, res, MODES[mode][0])
        achieved = per_tok * res["tokens_per_sec"] / 1e9
        print(f"| {mode} | {peer} | {layout.replace('_', ' ')} | {frac:.2f} | {per_tok / 1e6:.1f} | {res['tokens_per_sec']:.0f} | "
              f"{achieved:.1f} | {100 * achieved / ceiling:.0f}% | {ceiling * 1e9 / per_tok:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
