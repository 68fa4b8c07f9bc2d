"""Profiling (issue 18, deliverable 5): paddle.profiler's chrome trace over the chosen window of
steps, the per-step phase breakdown (data, forward, backward, communication, optimizer) adding
up to the step's wall time, communication > 0 only with collectives (2 data-parallel ranks), and
nothing changed on the default path."""
import glob
import importlib.util
import json
import os

import pytest

from conftest import ROOT, launch
from test_curves import ARGFILE, finetune

PHASES = ("data_ms", "forward_ms", "backward_ms", "communication_ms", "optimizer_ms")


def breakdown(out):
    with open(os.path.join(out, "profile_breakdown.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def check_phases(recs, steps):
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    for r in recs:
        parts = [r[p] for p in PHASES]
        assert all(v >= 0 for v in parts), r
        assert r["forward_ms"] > 0 and r["backward_ms"] > 0 and r["optimizer_ms"] > 0, r
        # the phases cover the step (all but the loop's bookkeeping between them)
        assert sum(parts) <= r["step_ms"] * 1.001 + 0.05, r
        assert sum(parts) >= 0.9 * r["step_ms"], r


def test_profiler_traces_the_window_and_times_the_phases(tmp_path):
    out = str(tmp_path / "out")
    assert finetune(out, profiler=True, profiler_steps="1,3", evaluation_strategy="no") == 0
    traces = glob.glob(os.path.join(out, "profiler", "*.json"))
    assert len(traces) == 1, traces
    with open(traces[0]) as f:
        trace = json.load(f)   # chrome trace format
    events = trace["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]   # complete events: name, start, duration
    assert len(spans) > 100 and all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in spans)
    steps = sorted(e["name"].split("[")[0] for e in events if e.get("cat") == "ProfileStep")
    assert steps == ["ProfileStep#1", "ProfileStep#2"]   # window 1,3: steps 1 and 2 from 0
    assert any("matmul" in e["name"] for e in spans)   # operator level
    recs = breakdown(out)
    check_phases(recs, 4)
    assert all(r["communication_ms"] == 0 for r in recs)   # one process: no collectives


def test_paddlenlp_keys_and_default_path(tmp_path):
    """profiler_options (PaddleNLP's string) picks the path; skip_profile_timer: false times the
    phases without traces; neither key: no file, no wrapper left on the Trainer."""
    from paddletune.trainer.trainer import Trainer

    out, path = str(tmp_path / "a"), str(tmp_path / "traces")
    assert finetune(out, profiler_options=f"batch_range=[1,2]; profile_path={path}", max_steps=2,
                    evaluation_strategy="no") == 0
    assert len(glob.glob(os.path.join(path, "rank0_*.paddle_trace.json"))) == 1
    assert not os.path.exists(os.path.join(out, "profiler"))
    check_phases(breakdown(out), 2)
    out = str(tmp_path / "b")
    assert finetune(out, skip_profile_timer=False, max_steps=2, evaluation_strategy="no") == 0
    check_phases(breakdown(out), 2)
    assert not os.path.exists(os.path.join(out, "profiler"))

    seen = {}
    orig = Trainer._train

    def spy(self):
        seen["source"] = type(self._source()).__name__
        r = orig(self)
        seen["patched"] = [n for n in ("training_step", "_backward", "_forward") if n in vars(self)]
        seen["callbacks"] = list(self.callbacks)
        return r

    Trainer._train = spy
    try:
        out = str(tmp_path / "c")
        assert finetune(out, max_steps=2, evaluation_strategy="no") == 0
    finally:
        Trainer._train = orig
    assert seen["patched"] == [] and seen["callbacks"] == []
    assert not os.path.exists(os.path.join(out, "profile_breakdown.jsonl"))


def test_two_ranks_spend_time_in_communication(tmp_path):
    out = str(tmp_path / "dp")
    keys = dict(output_dir=out, max_steps=3, src_length=64, max_length=128, per_device_train_batch_size=1,
                logging_steps=1, disable_tqdm=True, evaluation_strategy="no", do_eval=False,
                load_best_model_at_end=False, save_strategy="no", skip_profile_timer=False)
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    if tensorboard:   # the curves under a launch: written by rank 0 only
        keys["report_to"] = "tensorboard"
    r = launch([os.path.join(ROOT, "llm", "finetune_generation.py"), ARGFILE] +
               [f"--{k}={v}" for k, v in keys.items()], nproc=2, log_dir=tmp_path / "logs")
    assert r.returncode == 0, [open(p).read()[-2000:] for p in (tmp_path / "logs").glob("workerlog*")]
    recs = breakdown(out)   # rank 0's
    check_phases(recs, 3)
    assert all(r["communication_ms"] > 0 for r in recs), recs
    if tensorboard:
        assert len(glob.glob(os.path.join(out, "runs", "*", "events.out.tfevents.*"))) == 1


@pytest.mark.parametrize("over,key", [(dict(profiler_steps="5"), "profiler_steps"),
                                      (dict(profiler_steps="3,3"), "profiler_steps"),
                                      (dict(profiler_options="batch_range=[2];x=1"), "profiler_options"),
                                      (dict(profiler_options="unknown=1"), "profiler_options")])
def test_bad_profiler_values_are_one_error_line(tmp_path, capsys, over, key):
    out = str(tmp_path / "out")
    assert finetune(out, **over) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and f"'{key}'" in err[0], err
    assert not os.path.exists(out)
