"""Training curves from train_log.jsonl: the series, a PNG of them (matplotlib, an optional
extra: pip install -e '.[plot]') and the series as JSON beside the PNG.

    recs = read_log("out/train_log.jsonl")
    s = series(recs)       # {"loss": {"step": [1, 2], "value": [6.4, 6.3]}, "eval_loss": {...}, ...}
    write_curves(recs, "out/training_curves.png")   # PNG + out/training_curves.json (= s)

A series is one numeric key of the log records (every key but "step" and "epoch"), with the
steps of the records that carry it, in file order. Panels: loss (train loss with eval_loss),
learning rate, gradient norm, throughput (tokens/s), then one per other eval_ metric and per
other training metric. Both files are written atomically (temp file, then rename).
"""
import json
import math
import os

from .io import temp_file, write_json

SKIP = ("step", "epoch")
PANELS = (("loss", ("loss", "eval_loss")), ("learning rate", ("lr",)), ("gradient norm", ("grad_norm",)),
          ("tokens / s", ("tokens_per_sec", "target_tokens_per_sec")))


def read_log(path):
    """The records of a train_log.jsonl (a run's output_dir or the file itself). ValueError
    naming the line of a malformed record."""
    if os.path.isdir(path):
        path = os.path.join(path, "train_log.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no training log at {path} (a run writes output_dir/train_log.jsonl; "
                                "pass the run's output_dir or the file)")
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON record ({e})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError(f"{path}:{i}: a record must be a JSON object with an integer 'step'")
            out.append(rec)
    return out


def series(records):
    """{key: {"step": [...], "value": [...]}} of every numeric (finite) value, in record order."""
    out = {}
    for rec in records:
        for k, v in rec.items():
            if k in SKIP or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            s = out.setdefault(k, {"step": [], "value": []})
            s["step"].append(rec["step"])
            s["value"].append(v)
    return out


def panels(data):
    """[(title, [series names])] of the figure: the fixed panels that have data, then one panel
    per remaining series."""
    used, out = set(), []
    for title, names in PANELS:
        have = [n for n in names if n in data]
        if have:
            out.append((title, have))
            used.update(have)
    out += [(n, [n]) for n in data if n not in used]
    return out


def write_curves(records, png_path, title=None):
    """PNG of the series of `records` at png_path (Agg, no pyplot state) and the series as JSON
    beside it (same name, .json). Returns (png path, json path). ImportError when matplotlib is
    missing (before anything is written); ValueError when there is nothing to plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    data = series(records)
    if not data:
        raise ValueError("the training log holds no numeric values to plot")
    layout = panels(data)
    cols = 2 if len(layout) > 1 else 1
    rows = math.ceil(len(layout) / cols)
    fig = Figure(figsize=(5 * cols, 2.5 * rows + 0.5), dpi=80)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, (name, keys) in zip(axes.flat, layout):
        for k in keys:
            s = data[k]
            ax.plot(s["step"], s["value"], marker="o" if len(s["step"]) < 30 else None, markersize=3, label=k)
        ax.set_title(name, fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(layout):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    if title:
        fig.suptitle(title, fontsize=11)
    # fixed margins: tight_layout costs as much as drawing the figure
    fig.subplots_adjust(left=0.09, right=0.98, top=1 - 0.6 / (2.5 * rows + 0.5), bottom=0.45 / (2.5 * rows + 0.5),
                        hspace=0.5, wspace=0.22)
    png_path = os.path.abspath(png_path)
    d = os.path.dirname(png_path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = temp_file(d, suffix=".png")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png")
        os.replace(tmp, png_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    json_path = os.path.splitext(png_path)[0] + ".json"
    write_json(json_path, data)
    return png_path, json_path
