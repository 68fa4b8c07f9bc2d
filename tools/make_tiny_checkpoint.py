"""Write a tiny random checkpoint in Hugging Face format (deterministic; no downloads).

    python tools/make_tiny_checkpoint.py --model_type llama --output ./tiny-llama [--seed 0]
        [--tokenizer DIR] [--set hidden_size=128 --set num_hidden_layers=4 ...]

Weights are N(0, 0.02) from numpy's RNG seeded with --seed; the tokenizer defaults to the built-in
byte-level BPE (paddletune/assets/tiny-tokenizer). The output loads in paddletune and transformers.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    from paddletune.models import registered_types
    from paddletune.models.tiny import TINY_TOKENIZER, make_tiny_checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_type", default="llama", choices=registered_types(), help="architecture")
    p.add_argument("--output", required=True, help="directory to write (created)")
    p.add_argument("--seed", type=int, default=0, help="numpy seed of the random weights")
    p.add_argument("--tokenizer", default=TINY_TOKENIZER, help="tokenizer directory to copy")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config.json override (value parsed as JSON when possible); repeatable")
    a = p.parse_args(argv)
    overrides = {}
    for kv in a.set:
        if "=" not in kv:
            p.error(f"--set expects KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        try:
            overrides[k] = json.loads(v)
        except json.JSONDecodeError:
            overrides[k] = v
    make_tiny_checkpoint(a.output, a.model_type, seed=a.seed, tokenizer_dir=a.tokenizer, **overrides)
    print(f"wrote {a.model_type} checkpoint to {os.path.abspath(a.output)}")


if __name__ == "__main__":
    main()
