"""Zero padding vs padding: packing efficiency and training tokens/s on a length mix like real
instruction data (many short examples, a few long ones).

    python benchmarks/packing.py [--examples 256] [--max_length 1024] [--batch 8] [--steps 0]
    python benchmarks/packing.py --smoke        # 1 micro-batch per mode on a small set (tests)

Each mode runs forward + backward of a tiny Llama over the same examples:
  padded        micro-batches of --batch examples, right-padded to the longest
  packed        rows of <= max_length tokens (greedy packing), blocked attention (PackedRows)
  packed-dense  the same rows with a dense [S, S] segment mask (the path PackedRows replaces)
tokens/s counts real tokens only. --steps N stops each mode after N micro-batches (0 = all).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import paddletune  # noqa: E402,F401  (CPU threads before paddle)
import numpy as np  # noqa: E402
import paddle  # noqa: E402

from paddletune.data.collate import pad_batch  # noqa: E402
from paddletune.data.packing import collate_packed, pack_greedy, packing_stats  # noqa: E402
from paddletune.models import build_model  # noqa: E402
from paddletune.models.loss import causal_lm_loss  # noqa: E402


def length_mix(n, max_length, seed=0):
    """~85% short (lognormal around 120 tokens), ~15% long (uniform up to max_length)."""
    rng = np.random.default_rng(seed)
    short = np.clip(rng.lognormal(np.log(120), 0.6, n), 8, max_length)
    long = rng.integers(max_length // 4, max_length + 1, n)
    return np.where(rng.random(n) < 0.85, short, long).astype(int).tolist()


def make_examples(lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = rng.integers(3, vocab, n)
        labels = ids.copy()
        labels[:n // 2] = -100
        out.append({"input_ids": ids, "labels": labels, "id": i})
    return out


def run(model, batches, dense=False):
    """Seconds for forward+backward over `batches`, and real tokens processed."""
    tokens, t0 = 0, time.perf_counter()
    for b in batches:
        inp = {k: paddle.to_tensor(v) for k, v in b.items()
               if k in ("input_ids", "labels", "position_ids", "segment_ids")}
        if dense:   # an all-ones attention_mask routes to the dense [S, S] mask
            inp["attention_mask"] = paddle.ones(b["input_ids"].shape, "int64")
        out = causal_lm_loss(model, inp)
        out.loss.backward()
        model.clear_gradients()
        tokens += int(b["attention_mask"].sum())
    return time.perf_counter() - t0, tokens


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=256)
    ap.add_argument("--max_length", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="examples per padded micro-batch")
    ap.add_argument("--rows", type=int, default=1, help="packed rows per micro-batch")
    ap.add_argument("--steps", type=int, default=0, help="micro-batches per mode (0 = all)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="--steps 1 --examples 64 --max_length 128")
    a = ap.parse_args(argv)
    if a.smoke:
        a.steps, a.examples, a.max_length = 1, 64, 128
    cfg = dict(model_type="llama", vocab_size=1000, hidden_size=a.hidden, intermediate_size=a.hidden * 3,
               num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=a.max_length)
    model = build_model(cfg, seed=0)
    model.train()
    lengths = length_mix(a.examples, a.max_length)
    exs = make_examples(lengths, cfg["vocab_size"])
    packs = pack_greedy(lengths, a.max_length)
    stats = packing_stats(lengths, packs, a.max_length, a.batch)
    padded = [pad_batch(exs[i:i + a.batch], 0) for i in range(0, len(exs), a.batch)]
    packed = [collate_packed([[exs[i] for i in p] for p in packs[j:j + a.rows]], 0)
              for j in range(0, len(packs), a.rows)]
    if a.steps:
        padded, packed = padded[:a.steps], packed[:a.steps]
    for batches, dense in ((padded, False), (packed, False), (packed, True)):
        run(model, batches[:1], dense)   # warm-up: first-call kernel setup is not timed
    rows = []
    for name, batches, dense in (("padded", padded, False), ("packed", packed, False),
                                 ("packed-dense", packed, True)):
        slots = sum(b["input_ids"].size for b in batches)
        secs, toks = run(model, batches, dense)
        rows.append((name, len(batches), toks, slots, toks / max(slots, 1), toks / secs, secs))
    print(f"examples {len(exs)}: lengths median {int(np.median(lengths))}, max {max(lengths)}, "
          f"{sum(lengths)} real tokens; {len(packs)} packs of <= {a.max_length}; "
          f"efficiency over the whole set: packed {stats['packed_efficiency']:.1%}, "
          f"padded {stats['padded_efficiency']:.1%}")
    print("| mode | micro-batches | real tokens | computed positions | efficiency | real tokens/s | seconds |")
    print("|---|---|---|---|---|---|---|")
    for name, n, toks, slots, eff, tps, secs in rows:
        print(f"| {name} | {n} | {toks} | {slots} | {eff:.1%} | {tps:.0f} | {secs:.2f} |")
    print("command: python benchmarks/packing.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print("(CPU timings; on a shared/loaded machine they are indicative only)")


if __name__ == "__main__":
    main()
