"""Write a tiny random model in Hugging Face format (deterministic: same arguments, same bytes).

    python tools/make_tiny_checkpoint.py --model_type chatglm --output ./tiny-chatglm2
    python tools/make_tiny_checkpoint.py --model_type llama --output ./tiny-llama --config '{"num_hidden_layers": 4}'
    python tools/make_tiny_checkpoint.py --builtin paddletune/tiny-chatglm2 --output ./tiny

The architecture comes from the model's ModelSpec.tiny_config (updated by --config), weights are
N(0, 0.02) from a numpy RNG seeded by --seed, and the tokenizer is the shipped tiny one of that
model type (a ChatGLM sentencepiece tokenizer for chatglm, byte-level BPE otherwise).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddletune import cli  # noqa: E402
from paddletune.models import registered_types  # noqa: E402
from paddletune.models.tiny import ASSETS, BUILTIN, make_tiny_checkpoint  # noqa: E402


def default_tokenizer(model_type):
    """The tokenizer a built-in model of this type ships with."""
    for mt, overrides in BUILTIN.values():
        if mt == model_type and "tokenizer" in overrides:
            return os.path.join(ASSETS, overrides["tokenizer"])
    return os.path.join(ASSETS, "tiny-tokenizer")


@cli.entry   # errors: one `error:` line, exit 2
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_type", help=f"one of {registered_types()}")
    ap.add_argument("--builtin", choices=sorted(BUILTIN), help="the exact configuration of a built-in name")
    ap.add_argument("--output", required=True, help="directory to write (must not exist or be empty)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", help="tokenizer directory (default: the shipped tiny one)")
    ap.add_argument("--config", default="{}", help="JSON object of config.json overrides")
    args = ap.parse_args(argv)
    overrides = {}
    if args.builtin:
        args.model_type, overrides = BUILTIN[args.builtin]
        overrides = dict(overrides)
        overrides.pop("tokenizer", None)
    if args.model_type not in registered_types():
        ap.error(f"--model_type must be one of {registered_types()} (or give --builtin)")
    try:
        extra = json.loads(args.config)
        assert isinstance(extra, dict)
    except (ValueError, AssertionError):
        ap.error(f"--config must be a JSON object, got {args.config!r}")
    if os.path.exists(args.output) and os.listdir(args.output):
        ap.error(f"--output {args.output} exists and is not empty")
    overrides.update(extra)
    tok = args.tokenizer or default_tokenizer(args.model_type)
    make_tiny_checkpoint(args.output, args.model_type, seed=args.seed, tokenizer_dir=tok, **overrides)
    print(f"wrote tiny {args.model_type} to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
