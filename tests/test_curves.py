"""Training curves (issue 18, deliverable 6): report_to's event files read back with VisualDL's and
TensorBoard's own readers equal train_log.jsonl; the PNG + series JSON at the end of training and
from tools/plot_curves.py equal train_log.jsonl; a missing library is one `error:` line."""
import glob
import json
import logging
import os
import sys

import numpy as np
import pytest

from conftest import ROOT, load_script

ARGFILE = os.path.join(ROOT, "llm", "llama", "sft_argument.json")


def finetune(out, **over):
    """llm/finetune_generation.py in-process, 4 steps of the built-in tiny Llama, logged every
    step, evaluated at steps 2 and 4."""
    keys = dict(output_dir=out, max_steps=4, src_length=64, max_length=128, per_device_train_batch_size=2,
                per_device_eval_batch_size=8, max_evaluate_steps=1, logging_steps=1, disable_tqdm=True,
                evaluation_strategy="steps", eval_steps=2, load_best_model_at_end=False, save_strategy="no")
    keys.update(over)
    return load_script("llm/finetune_generation.py").main([ARGFILE] + [f"--{k}={v}" for k, v in keys.items()])


def log_records(out):
    with open(os.path.join(out, "train_log.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def expected_scalars(records):
    """{tag: [(step, value)]} the event files must hold: train/<key>, eval/<metric> (reference:
    PaddleNLP's tag rewrite), built here from train_log.jsonl alone."""
    out = {}
    for r in records:
        for k, v in r.items():
            if k == "step" or not isinstance(v, (int, float)):
                continue
            tag = "eval/" + k[len("eval_"):] if k.startswith("eval_") else "train/" + k
            out.setdefault(tag, []).append((r["step"], float(v)))
    return out


@pytest.fixture(scope="module", autouse=True)
def draw_png():
    """conftest.py turns the end-of-training PNG off for the rest of the suite; on here."""
    old = os.environ.get("PADDLETUNE_PLOT")
    os.environ["PADDLETUNE_PLOT"] = "1"
    yield
    if old is None:
        os.environ.pop("PADDLETUNE_PLOT")
    else:
        os.environ["PADDLETUNE_PLOT"] = old


@pytest.fixture(scope="module")
def run(tmp_path_factory, draw_png):
    pytest.importorskip("visualdl")
    pytest.importorskip("tensorboard")
    out = str(tmp_path_factory.mktemp("curves") / "out")
    assert finetune(out, report_to="visualdl,tensorboard") == 0
    return out


def _logdir(out):
    dirs = glob.glob(os.path.join(out, "runs", "*"))   # PaddleNLP's default logging_dir
    assert len(dirs) == 1, dirs
    return dirs[0]


def test_tensorboard_events_read_back_equal_train_log(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    want = expected_scalars(log_records(run))
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "eval/loss",
            "eval/accuracy"} <= set(want)
    acc = EventAccumulator(_logdir(run), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted(want)
    for tag, pairs in want.items():
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in pairs], tag
        # event files hold float32
        np.testing.assert_allclose([v for _, v in got], [v for _, v in pairs], rtol=1e-6, err_msg=tag)
    assert [s for s, _ in want["train/loss"]] == [1, 2, 3, 4] and [s for s, _ in want["eval/loss"]] == [2, 4]


def test_visualdl_records_read_back_equal_train_log(run):
    from visualdl import LogReader

    want = expected_scalars(log_records(run))
    files = glob.glob(os.path.join(_logdir(run), "vdlrecords.*.log"))
    assert len(files) == 1, files
    reader = LogReader(file_path=files[0])
    assert sorted(reader.get_tags()["scalar"]) == sorted(want)
    for tag, pairs in want.items():
        got = [(r.id, r.value) for r in reader.get_data("scalar", tag)]
        assert [s for s, _ in got] == [s for s, _ in pairs], tag
        np.testing.assert_allclose([v for _, v in got], [v for _, v in pairs], rtol=1e-6, err_msg=tag)


def _series_from_log(records):
    """The reference of the plotted series: every numeric key but step / epoch, in file order."""
    out = {}
    for r in records:
        for k, v in r.items():
            if k not in ("step", "epoch") and isinstance(v, (int, float)):
                out.setdefault(k, {"step": [], "value": []})
                out[k]["step"].append(r["step"])
                out[k]["value"].append(v)
    return out


def _is_png(path):
    with open(path, "rb") as f:
        head = f.read(24)
    return head[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 1000 and \
        int.from_bytes(head[16:20], "big") > 100   # IHDR width


def test_end_of_training_png_and_series(run):
    pytest.importorskip("matplotlib")
    assert _is_png(os.path.join(run, "training_curves.png"))
    with open(os.path.join(run, "training_curves.json")) as f:
        assert json.load(f) == _series_from_log(log_records(run))


def test_plot_tool_writes_png_and_the_series_of_train_log(run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    tool = load_script("tools/plot_curves.py")
    png = str(tmp_path / "plots" / "c.png")
    assert tool.main([os.path.join(run, "train_log.jsonl"), "--output", png]) == 0
    assert _is_png(png)
    with open(str(tmp_path / "plots" / "c.json")) as f:
        got = json.load(f)
    want = _series_from_log(log_records(run))
    assert got == want and {"loss", "lr", "grad_norm", "tokens_per_sec", "eval_loss"} <= set(got)
    assert not [p for p in os.listdir(tmp_path / "plots") if p.startswith(".tmp")]   # atomic
    # a malformed log: one error line, exit 2
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train_log.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": \n')
    capsys.readouterr()
    assert tool.main([str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "train_log.jsonl:2" in err[0]


def test_no_matplotlib_one_info_line_and_no_png(tmp_path, monkeypatch, caplog):
    from paddletune.args import TrainingArguments
    from paddletune.trainer.reporting import Reporter

    out = tmp_path / "run"
    out.mkdir()
    (out / "train_log.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib raises ImportError
    caplog.set_level(logging.INFO, logger="paddletune")
    rep = Reporter(TrainingArguments(output_dir=str(out)))
    rep.end_of_training()
    rep.write({"step": 1, "eval_loss": 1.0})   # a later record: still no PNG, no second line
    said = [r.getMessage() for r in caplog.records if "matplotlib" in r.getMessage()]
    assert len(said) == 1 and "pip install" in said[0]
    assert sorted(os.listdir(out)) == ["train_log.jsonl"]


@pytest.mark.parametrize("name,module", [("visualdl", "visualdl"), ("tensorboard", "tensorboard")])
def test_missing_library_is_one_error_line(tmp_path, monkeypatch, capsys, name, module):
    monkeypatch.setitem(sys.modules, module, None)
    out = str(tmp_path / "out")
    assert finetune(out, report_to=f"{name}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert "'report_to'" in err[0] and f"pip install {module}" in err[0]
    assert not os.path.exists(out)   # before any work or write


def test_report_to_values(tmp_path):
    from paddletune import observe
    from paddletune.args import ArgumentError, build

    assert observe.report_targets(["visualdl, tensorboard", "visualdl"]) == ["visualdl", "tensorboard"]
    assert observe.report_targets(None) == [] and observe.report_targets(["none"]) == []
    base = dict(model_name_or_path="m", dataset_name_or_path="d", output_dir=str(tmp_path))
    assert build(dict(base, report_to="none"))[-1].report_to is None
    with pytest.raises(ArgumentError, match="'report_to' names 'wandb'.*visualdl, tensorboard"):
        build(dict(base, report_to="wandb"))
