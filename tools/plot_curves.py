"""Plot a run's training curves from its train_log.jsonl (any run: finished, running or resumed).

    python tools/plot_curves.py ./checkpoints/llama_pretrain_ckpts            # -> DIR/training_curves.png
    python tools/plot_curves.py DIR/train_log.jsonl --output curves.png        # + curves.json beside it

Writes the PNG (loss with eval_loss, learning rate, gradient norm, tokens/s, then each eval_
metric and each other logged metric, against the optimizer step) and, beside it with the same
name and .json, the series it plotted: {name: {"step": [...], "value": [...]}} - the values of
train_log.jsonl exactly. Needs matplotlib (pip install -e '.[plot]'). Errors: one `error:` line,
exit code 2.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddletune import cli  # noqa: E402
from paddletune.curves import read_log, write_curves  # noqa: E402
from paddletune.observe import PNG_LIBRARY, missing_library  # noqa: E402


@cli.entry
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a run's output_dir, or a train_log.jsonl")
    ap.add_argument("--output", help="PNG to write (default: training_curves.png beside the log)")
    ap.add_argument("--title", help="figure title (default: the run's directory name)")
    args = ap.parse_args(argv)
    why = missing_library(PNG_LIBRARY[0])
    if why is not None:
        raise ValueError(f"plotting needs matplotlib, which does not import here ({why}): {PNG_LIBRARY[1]}")
    records = read_log(args.path)
    run_dir = args.path if os.path.isdir(args.path) else os.path.dirname(os.path.abspath(args.path))
    out = args.output or os.path.join(run_dir, "training_curves.png")
    if not out.lower().endswith(".png"):
        raise ValueError(f"--output {out} must end in .png (the series go beside it as .json)")
    png, js = write_curves(records, out, title=args.title or os.path.basename(os.path.abspath(run_dir)))
    print(f"wrote {png} and {js} ({len(records)} records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
