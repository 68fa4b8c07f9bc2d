"""Profiling a training run: paddle.profiler traces over a window of steps, and the time of each
optimizer step split into phases (keys: paddletune/observe.py; off by default, and then nothing
here runs: the step has no extra call, sync or timer).

    source = profiling.attach(trainer, source, total)   # Trainer._train: the source, timed or not
    ... loop ...                                        # each step: its phases, as below
    profiling.detach(trainer)                           # traces written, trainer restored

Phases of one step (wall clock, milliseconds; on a GPU each boundary synchronises the device so a
phase holds its kernels):
  data           building the step's micro-batches (the source's iterator)
  forward        the model and the loss (Trainer._forward, per micro-batch)
  backward       Trainer._backward less the forward passes and collectives inside it (under
                 pipeline parallel the 1F1B schedule's forward, backward and sends are all here)
  communication  the data-parallel collectives: token counts, the gradient all-reduce (buckets
                 flattened, summed, split), loss sums; sharding's reduce/broadcast of owned
                 tensors; pipeline stages' sums of shared tensors. 0 on one process. Tensor-
                 parallel collectives inside the model's layers stay in forward / backward
  optimizer      the rest of Trainer.training_step: gradient norm, clipping, AdamW, clearing
step_ms is the step's wall time from the first read of its data to the end of training_step, so
the phases add up to it but for the loop's bookkeeping between them (microseconds). Timing is by
wrapping those methods on this Trainer instance (and its Topology and its parallel object's
sharding / pipeline parts) for the run; detach removes the wrappers. Rank 0 writes every step's record to
output_dir/profile_breakdown.jsonl and logs the mean of each logging interval; traces (every rank,
rank<R>_time_<stamp>.paddle_trace.json: chrome://tracing, Perfetto) go to the plan's path.
"""
import json
import logging
import os
import time

import paddle

from .. import observe

logger = logging.getLogger("paddletune")
PHASES = ("data", "forward", "backward", "communication", "optimizer")
BREAKDOWN = "profile_breakdown.jsonl"
COMMUNICATION = {"topo": ("all_reduce_grads", "all_reduce_scalars", "all_reduce_sum"),
                 "shard": ("reduce_grads", "begin_step", "after_step", "square_norm"),
                 "pp": ("sum_replicated_grads", "sum_over_stages")}


def _device_sync():
    """paddle.device.synchronize on a GPU place (kernels are asynchronous there), else None."""
    if paddle.is_compiled_with_cuda() and "gpu" in str(paddle.get_device()):
        return paddle.device.synchronize
    return None


class PhaseTimer:
    """Exclusive wall-clock time per phase inside an open step: a phase entered inside another
    (forward inside backward) is subtracted from the outer one."""

    def __init__(self, sync=None):
        self.sync = sync
        self.stack, self.open, self.t0 = [], False, 0.0
        self.acc = dict.fromkeys(PHASES, 0.0)

    def begin_step(self):
        if not self.open:
            self._sync()
            self.open, self.t0, self.stack = True, time.perf_counter(), []
            self.acc = dict.fromkeys(PHASES, 0.0)

    def end_step(self):
        """{phase: ms, "step_ms": ms} of the open step, which is closed."""
        self._sync()
        step = time.perf_counter() - self.t0
        self.open = False
        out = {f"{k}_ms": round(v * 1e3, 4) for k, v in self.acc.items()}
        out["step_ms"] = round(step * 1e3, 4)
        return out

    def _sync(self):
        if self.sync is not None:
            self.sync()

    def timed(self, phase, fn):
        def run(*args, **kwargs):
            if not self.open:
                return fn(*args, **kwargs)
            self._sync()
            frame = [time.perf_counter(), 0.0]   # start, time of the phases inside
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                dt = time.perf_counter() - frame[0]
                self.stack.pop()
                self.acc[phase] += dt - frame[1]
                if self.stack:
                    self.stack[-1][1] += dt
        return run


class TimedSource:
    """A training source whose iterator opens a step and times its data phase; every other
    attribute is the source's."""

    def __init__(self, source, timer):
        self._source, self._timer = source, timer

    def __getattr__(self, name):
        return getattr(self._source, name)

    def iterate(self, epoch, start_step=0):
        it = iter(self._source.iterate(epoch, start_step))
        fetch = self._timer.timed("data", lambda: next(it))
        while True:
            self._timer.begin_step()
            try:
                item = fetch()
            except StopIteration:
                return
            yield item


class Profiling:
    """The run's profiler (paddle.profiler, when the plan traces) and phase timer."""

    def __init__(self, trainer, plan, total):
        self.trainer, self.plan, self.total = trainer, plan, total
        self.timer = PhaseTimer(_device_sync())
        self.patched, self.window, self.records = [], [], []
        self.prof, self.out, self.logged = None, None, 0
        start = trainer.state["global_step"]
        if plan.traces and plan.start >= total - start:
            logger.warning("profiler: the window starts at step %d of this run, which has %d steps "
                           "left: nothing is traced (set profiler_steps / batch_range lower)",
                           plan.start, total - start)
        elif plan.traces:
            self.prof = self._profiler(plan, trainer.topo.rank)

    @staticmethod
    def _profiler(plan, rank):
        import paddle.profiler as profiler

        targets = [profiler.ProfilerTarget.CPU]
        if paddle.is_compiled_with_cuda():
            targets.append(profiler.ProfilerTarget.GPU)
        return profiler.Profiler(targets=targets, scheduler=(plan.start, plan.end),
                                 on_trace_ready=profiler.export_chrome_tracing(plan.path, f"rank{rank}"))

    def _patch(self, obj, name, phase):
        if obj is None or not hasattr(obj, name):
            return
        self.patched.append((obj, name, name in vars(obj)))
        if not self.patched[-1][2]:
            setattr(obj, name, self.timer.timed(phase, getattr(obj, name)))

    def start(self, source):
        t = self.trainer
        for name, phase in (("training_step", "optimizer"), ("_backward", "backward"), ("_forward", "forward")):
            self._patch(t, name, phase)
        for attr, names in COMMUNICATION.items():   # one process: no collectives, 0 ms
            for name in names if t.topo.world_size > 1 else ():
                self._patch(t.topo if attr == "topo" else getattr(t.par, attr, None), name, "communication")
        t.callbacks.insert(0, self.after_step)   # first: later callbacks are not in the step
        if t.main:
            os.makedirs(t.args.output_dir, exist_ok=True)
            self.out = open(os.path.join(t.args.output_dir, BREAKDOWN), "w", encoding="utf-8")
        if self.prof is not None:
            self.prof.start()
            logger.info("profiler: tracing steps %d..%d of this run (from 0) into %s",
                        self.plan.start, self.plan.end - 1, self.plan.path)
        return TimedSource(source, self.timer)

    def after_step(self, trainer, info):
        """The Trainer's callback after every optimizer step: the step's record; the profiler's step."""
        rec = {"step": info["step"], **self.timer.end_step()}
        if self.prof is not None:
            self.prof.step()
        if self.out is None:
            return
        self.out.write(json.dumps(rec) + "\n")
        self.out.flush()
        self.window.append(rec)
        self.records.append(rec)
        a = trainer.args
        if info["step"] % a.logging_steps == 0 or info["step"] >= self.total or (
                a.logging_first_step and info["step"] == 1):
            self._log(self.window, f"profile step {info['step']}")
            self.window = []
            self.logged += 1

    def _log(self, recs, what, report=True):
        """One line: the mean step time of `recs` and its phases; the means to report_to's
        writers as profile/<phase>_ms at the last step of `recs`."""
        mean = {k: sum(r[k] for r in recs) / len(recs) for k in recs[0] if k != "step"}
        parts = " + ".join(f"{p} {mean[p + '_ms']:.2f}" for p in PHASES)
        logger.info("%s (mean of %d steps): %.2f ms = %s", what, len(recs), mean["step_ms"], parts)
        if report and getattr(self.trainer, "reporter", None) is not None:
            self.trainer.reporter.add(recs[-1]["step"], {f"profile/{k}": v for k, v in mean.items()})

    def stop(self):
        t = self.trainer
        if self.after_step in t.callbacks:
            t.callbacks.remove(self.after_step)
        for obj, name, had in reversed(self.patched):
            if not had:
                delattr(obj, name)
        self.patched = []
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
            files = sorted(os.listdir(self.plan.path)) if os.path.isdir(self.plan.path) else []
            logger.info("profiler: %d trace file(s) in %s", len(files), self.plan.path)
        if self.out is not None:
            self.out.close()
            self.out = None
            if self.logged > 1:   # the whole run's mean (the curves have the intervals')
                self._log(self.records, "profile of the run", report=False)


def attach(trainer, source, total):
    """`source` as is when no profiling key is on; else timed, with the profiler started."""
    plan = observe.profile_plan(trainer.args)
    if plan is None:
        return source
    trainer._profiling = Profiling(trainer, plan, total)
    return trainer._profiling.start(source)


def detach(trainer):
    prof = getattr(trainer, "_profiling", None)
    if prof is not None:
        prof.stop()
        trainer._profiling = None
