"""Training curves out of the Trainer: report_to's event files and the PNG at the end.

The records that go to train_log.jsonl (Trainer._record) also go, with their step, to one writer
per integration of report_to (paddletune/observe.py), in logging_dir:
  visualdl      visualdl.LogWriter: vdlrecords.*.log (read by `visualdl --logdir DIR`, LogReader)
  tensorboard   tensorboard's own EventFileWriter + Event / Summary protos: events.out.tfevents.*
                (read by `tensorboard --logdir DIR`, EventAccumulator); no TensorFlow, no torch
Tags follow PaddleNLP's (and Hugging Face's) rewrite of the record keys: eval_<m> -> eval/<m>,
every other number -> train/<key> (train/loss, train/lr, train/grad_norm, train/tokens_per_sec,
train/epoch, ...); "step" is the global step of the event. With a profiling key on, each logging
interval's mean phase times go there too as profile/<phase>_ms (trainer/profiling.py).
logging_dir defaults to output_dir/runs/<Mon DD_HH-MM-SS>_<host>, as PaddleNLP's does (one
directory per run: a resumed run gets a new one starting at its first new step). Each record is
flushed when written.
At the end of training the curves of output_dir/train_log.jsonl go to output_dir/
training_curves.png (+ .json, the plotted series; paddletune/curves.py) when matplotlib imports,
else one info line says how to get them. A record logged after that (the scripts' final eval)
redraws them. Only the main process (rank 0) writes; other ranks have no Reporter.
"""
import logging
import math
import os
import socket
import time
import weakref
from datetime import datetime

from .. import curves, observe

logger = logging.getLogger("paddletune")
PNG = "training_curves.png"


def default_logging_dir(output_dir):
    stamp = datetime.now().strftime("%b%d_%H-%M-%S")
    return os.path.join(output_dir, "runs", f"{stamp}_{socket.gethostname()}")


def tags(rec):
    """{tag: float} of a log record (see the module docstring)."""
    out = {}
    for k, v in rec.items():
        if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        out["eval/" + k[5:] if k.startswith("eval_") else "train/" + k] = float(v)
    return out


class VisualDLWriter:
    def __init__(self, logdir):
        from visualdl import LogWriter

        self.w = LogWriter(logdir=logdir)

    def add(self, step, scalars):
        for tag, v in scalars.items():
            self.w.add_scalar(tag, v, step)
        self.w.flush()

    def close(self):
        self.w.close()


class TensorBoardWriter:
    def __init__(self, logdir):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.event, self.summary = event_pb2.Event, summary_pb2.Summary
        self.w = EventFileWriter(logdir)

    def add(self, step, scalars):
        values = [self.summary.Value(tag=t, simple_value=v) for t, v in scalars.items()]
        self.w.add_event(self.event(wall_time=time.time(), step=step, summary=self.summary(value=values)))
        self.w.flush()

    def close(self):
        self.w.close()


WRITERS = {"visualdl": VisualDLWriter, "tensorboard": TensorBoardWriter}


def _close_all(writers):
    for w in writers:
        try:
            w.close()
        except Exception:   # noqa: BLE001 - at exit: nothing left to report to
            pass


class Reporter:
    """Event writers of report_to and the end-of-training PNG, for the main process."""

    def __init__(self, args):
        self.output_dir = args.output_dir
        targets = observe.report_targets(args.report_to)
        observe.check_libraries(targets)   # a Trainer used from Python: the arguments' own check
        self.logging_dir = args.logging_dir or default_logging_dir(args.output_dir)
        self.writers = [WRITERS[t](self.logging_dir) for t in targets]
        self.targets, self.trained = targets, False
        if targets:
            logger.info("curves to %s: %s", self.logging_dir, ", ".join(targets))
        weakref.finalize(self, _close_all, list(self.writers))

    @classmethod
    def for_trainer(cls, trainer):
        return cls(trainer.args) if trainer.main else None

    def write(self, rec):
        scalars = tags(rec)
        if scalars:
            for w in self.writers:
                w.add(int(rec["step"]), scalars)
        if self.trained:
            self.plot()

    def add(self, step, scalars):
        """Scalars {tag: value} of `step` as they are (profiling's profile/<phase>_ms)."""
        for w in self.writers:
            w.add(int(step), {k: float(v) for k, v in scalars.items()})

    def end_of_training(self):
        self.trained = True
        self.plot()

    def plot(self):
        """output_dir/training_curves.png + .json from train_log.jsonl (no matplotlib: one info line)."""
        log = os.path.join(self.output_dir, "train_log.jsonl")
        if not os.path.isfile(log) or os.environ.get("PADDLETUNE_PLOT", "1") == "0":
            return   # (PADDLETUNE_PLOT=0: no PNG; the test suite sets it outside the curve tests)
        why = observe.missing_library(observe.PNG_LIBRARY[0])
        if why is not None:
            if not getattr(self, "_said", False):
                logger.info("no %s: matplotlib is not installed (%s)", PNG, observe.PNG_LIBRARY[1])
                self._said = True
            return
        png, _ = curves.write_curves(curves.read_log(log), os.path.join(self.output_dir, PNG),
                                     title=os.path.basename(os.path.abspath(self.output_dir)))
        logger.info("training curves: %s", png)
