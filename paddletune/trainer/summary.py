"""The lines a run shows a person: the layout at the start, progress, and which weights were exported.

Kept out of trainer.py so the loop only calls them:
  - layout_line: the parallel layout by name ("tensor 2 x pipeline 1 x data 1 x sharding 1"), not
    only the data-parallel rank count;
  - progress: tqdm only on rank 0 and only when stderr is a terminal; under a launcher (stderr a
    log file) a bar would write carriage returns and partial lines into workerlog.N, so a plain
    progress line per logging interval is logged instead;
  - export_lines: after load_best_model_at_end, which step was exported, its metric and the last
    step's, and how to export the last one instead (an equal metric keeps the earlier checkpoint,
    transformers' rule, so a run that reaches accuracy 1.0 early exports that early step).
"""
import logging
import sys
import time

logger = logging.getLogger("paddletune")


def layout_line(degrees, ep_degree=1):
    """'tensor 2 x pipeline 1 x data 1 x sharding 1' (+ ' (expert 2 of the data ranks)') from the
    Topology's degrees {dp, pp, sharding, tp}; world size = their product."""
    text = (f"tensor {degrees['tp']} x pipeline {degrees['pp']} x data {degrees['dp']} x "
            f"sharding {degrees['sharding']}")
    return text + (f" (expert {ep_degree} of the data ranks)" if ep_degree and ep_degree > 1 else "")


def progress(total, initial, every, show, stream=None):
    """A tqdm bar where a person watches a terminal, else a TextProgress (a log line every `every`
    steps), else None (`show` False: disable_tqdm, or not rank 0)."""
    if not show:
        return None
    stream = sys.stderr if stream is None else stream
    if getattr(stream, "isatty", lambda: False)():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True, file=stream)
    return TextProgress(total, initial, every)


class TextProgress:
    """tqdm's update/close for a log file: 'progress: 100/1125 steps (8.9%), 0:00:12 elapsed,
    ~0:02:03 left' every `every` steps and at the last (rate over the steps run here)."""

    def __init__(self, total, initial, every):
        self.total, self.n, self.start_n = total, initial, initial
        self.every, self.t0 = max(int(every or 1), 1), time.time()

    def update(self, k=1):
        self.n += k
        if self.n % self.every == 0 or self.n >= self.total:
            logger.info(self.line(time.time() - self.t0))

    def line(self, elapsed):
        done = self.n - self.start_n
        left = (self.total - self.n) * elapsed / done if done else 0.0
        return (f"progress: {self.n}/{self.total} steps ({100.0 * self.n / max(self.total, 1):.1f}%), "
                f"{_clock(elapsed)} elapsed, ~{_clock(left)} left")

    def close(self):
        pass


def _clock(seconds):
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def export_lines(metric, best_step, best_value, last_step, last_value, output_dir):
    """What load_best_model_at_end exported, for the closing lines (logged by rank 0)."""
    if best_step is None:
        return []
    if best_step == last_step:
        return [f"exported: the last step, {best_step} ({metric} = {best_value:.6g}, the best)"]
    last = f"{last_value:.6g}" if last_value is not None else "not evaluated"
    tie = " (equal: the earlier checkpoint is kept, as transformers does)" if last_value == best_value else ""
    return [f"exported: the best checkpoint, step {best_step} ({metric} = {best_value:.6g}); the last "
            f"step, {last_step}, has {metric} = {last}{tie}",
            f"to export the last step instead: rerun with --load_best_model_at_end false, or python "
            f"llm/merge_tp_and_pp_params.py --model_name_or_path {output_dir}/checkpoint-{last_step} "
            f"(kept beside the best)"]
