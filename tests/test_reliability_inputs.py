"""Issue 17, bad inputs of llm/finetune_generation.py and llm/predictor.py: each ends in one
`error:` line naming the file / key / value, exit code 2, before the model is loaded where the
input allows it, and nothing new in output_dir. The scripts' main() runs in this process (a
subprocess costs ~4 s of imports each); `load_model` is watched to tell "before loading".

Items: 2 (index paths), 7 (output_dir), 10 (non-finite values, tokenizer vs vocabulary, output
file), 11 (silently accepted values), 12 (raw tracebacks)."""
import json
import os
import shutil
import struct

import numpy as np
import pytest

from conftest import ROOT, load_script, write_jsonl

SFT = os.path.join(ROOT, "llm", "llama", "sft_argument.json")
QUICK = ["--max_steps", "2", "--do_eval", "false", "--evaluation_strategy", "no", "--save_strategy", "no",
         "--load_best_model_at_end", "false", "--disable_tqdm", "true", "--per_device_train_batch_size", "4",
         "--logging_steps", "1", "--src_length", "64", "--max_length", "128"]


@pytest.fixture(scope="module")
def ft():
    return load_script("llm/finetune_generation.py")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The built-in tiny Llama (vocab 600, 1024 positions) and a 16-row dataset."""
    from paddletune.models import resolve_model_path

    root = tmp_path_factory.mktemp("rel_inputs")
    rows = [json.loads(l) for l in open(os.path.join(ROOT, "paddletune", "assets", "sample-sft", "train.json"))][:16]
    write_jsonl(root / "data" / "train.json", rows)
    write_jsonl(root / "data" / "dev.json", rows[:4])
    return {"model": resolve_model_path("paddletune/tiny-llama"), "data": str(root / "data"), "rows": rows}


def model_copy(base, tmp, config=None, edit=None):
    """A copy of the tiny model with config.json keys changed (None deletes) / files edited."""
    d = tmp / "model"
    shutil.copytree(base["model"], d)
    if config:
        conf = json.load(open(d / "config.json"))
        for k, v in config.items():
            conf.pop(k) if v is None else conf.__setitem__(k, v)
        (d / "config.json").write_text(json.dumps(conf))
    if edit:
        edit(d)
    return str(d)


def data_dir(tmp, text):
    d = tmp / "bad_data"
    d.mkdir()
    (d / "train.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(d)


def rewrite_header(path, change):
    """Rewrite a safetensors header in place through change(header dict)."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    change(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    open(path, "wb").write(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def _set(name, **info):
    return lambda h: h[next(k for k in h if k != "__metadata__" and name in k)].update(info)


def _first_tensor(d, fn):
    return rewrite_header(os.path.join(d, "model.safetensors"), fn)


def _nan_weight(d):
    from paddletune.models import hf

    st = hf.SafetensorsFile(os.path.join(d, "model.safetensors"))
    tensors = {k: st.get(k) for k in st.keys()}
    tensors["model.norm.weight"][3] = np.nan
    hf.write_safetensors(os.path.join(d, "model.safetensors"), tensors)


def _int32_weight(d):
    from paddletune.models import hf

    st = hf.SafetensorsFile(os.path.join(d, "model.safetensors"))
    tensors = {k: st.get(k) for k in st.keys()}
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    hf.write_safetensors(os.path.join(d, "model.safetensors"), tensors)


def _escaping_index(d):
    """Shards + an index whose entries climb out of the directory."""
    os.rename(os.path.join(d, "model.safetensors"), os.path.join(os.path.dirname(d), "outside.safetensors"))
    from paddletune.models import hf

    st = hf.SafetensorsFile(os.path.join(os.path.dirname(d), "outside.safetensors"))
    json.dump({"weight_map": {k: "../outside.safetensors" for k in st.keys()}},
              open(os.path.join(d, "model.safetensors.index.json"), "w"))


def _truncate(name, keep=0.5):
    def edit(d):
        p = os.path.join(d, name)
        data = open(p, "rb").read()
        open(p, "wb").write(data[:int(len(data) * keep)])
    return edit


def _args_file(tmp, text):
    p = tmp / "args.json"
    p.write_text(text)
    return str(p)


def _readonly(tmp):
    if os.geteuid() == 0:   # root writes anywhere a mode allows: /sys refuses even root
        return "/sys/paddletune-reliability-out"
    d = tmp / "ro"
    d.mkdir()
    os.chmod(d, 0o555)
    return str(d / "out")


# name: (setup(tmp, base) -> (args, output_dir or None), expected text, before loading?)
CASES = {
    # 7: output_dir checked by a test write before anything is loaded
    "outdir_is_file": (lambda t, b: ([], str(_touch(t / "afile"))), "is a file, not a directory", True),
    "outdir_under_file": (lambda t, b: ([], str(_touch(t / "afile") / "sub")), "is a file", True),
    "outdir_not_permitted": (lambda t, b: ([], _readonly(t)), "is not writable", True),
    # 10: non-finite values, a tokenizer bigger than the model's vocabulary
    "lr_nan_in_file": (lambda t, b: ([_args_file(t, json.dumps(dict(json.load(open(SFT)), learning_rate=float("nan"))))], None),
                       "'learning_rate' must be a finite number, got nan", True),
    "lr_infinity": (lambda t, b: (["--learning_rate", "Infinity"], None), "'learning_rate' must be a finite number, got inf", True),
    "tokenizer_bigger_than_vocab": (lambda t, b: (["--model_name_or_path", model_copy(b, t, {"vocab_size": 500})], None),
                                    "has 600 tokens, more than the vocab_size 500", True),
    "nonfinite_weights": (lambda t, b: (["--model_name_or_path", model_copy(b, t, edit=_nan_weight)], None),
                          "tensor model.norm.weight holds 1 non-finite values", False),
    # 11: values that were accepted silently
    "epochs_zero": (lambda t, b: (["--max_steps", "-1", "--num_train_epochs", "0"], None), "'num_train_epochs' must be > 0", True),
    "max_steps_negative": (lambda t, b: (["--max_steps", "-5"], None), "'max_steps' must be > 0 (that many steps) or -1", True),
    "beta1": (lambda t, b: (["--adam_beta1", "2.0"], None), "'adam_beta1' must be in [0, 1), got 2.0", True),
    "warmup_negative": (lambda t, b: (["--warmup_steps", "-3"], None), "'warmup_steps' must be >= 0, got -3", True),
    "grad_norm_negative": (lambda t, b: (["--max_grad_norm", "-1"], None), "'max_grad_norm' must be >= 0", True),
    "eval_steps_zero": (lambda t, b: (["--eval_steps", "0"], None), "'eval_steps' must be positive", True),
    "duplicate_key": (lambda t, b: ([_args_file(t, open(SFT).read().replace('"seed": 42', '"seed": 42, "learning_rate": 0.1'))], None),
                      "key 'learning_rate' is given twice (0.003 and 0.1)", True),
    "only_empty_targets": (lambda t, b: (["--dataset_name_or_path", data_dir(t, '{"src": "a", "tgt": ""}\n{"src": "b", "tgt": " "}\n')], None),
                           "all 2 rows have an empty target", True),
    "int32_weight": (lambda t, b: (["--model_name_or_path", model_copy(b, t, edit=_int32_weight)], None),
                     "model.norm.weight is stored as I32", True),
    # 12: raw tracebacks before
    "lr_null": (lambda t, b: ([_args_file(t, open(SFT).read().replace('"learning_rate": 0.003', '"learning_rate": null'))], None),
                "'learning_rate' must be float, got null", True),
    "lone_surrogate": (lambda t, b: (["--dataset_name_or_path", data_dir(t, '{"src": "a", "tgt": "b"}\n{"src": "x\\ud800y", "tgt": "b"}\n')], None),
                       "train.json:2: the text holds a lone surrogate", True),
    "not_utf8": (lambda t, b: (["--dataset_name_or_path", data_dir(t, b'{"src": "a", "tgt": "b"}\n{"src": "a", "tgt": "b"}\n{"src": "\xff", "tgt": "b"}\n')], None),
                 "train.json:3: not UTF-8 text (byte 0xff at column 10)", True),
    "safetensors_truncated": (lambda t, b: (["--model_name_or_path", model_copy(b, t, edit=_truncate("model.safetensors"))], None),
                              "the file is truncated", True),
    "safetensors_header_oversized": (lambda t, b: (["--model_name_or_path", model_copy(b, t, edit=lambda d: _patch(d, b"\xff" * 6 + b"\x00\x00"))], None),
                                     "its header length says", True),
    "safetensors_unknown_dtype": (lambda t, b: (["--model_name_or_path", model_copy(b, t, edit=lambda d: _first_tensor(d, _set("norm", dtype="F8_E4M3")))], None),
                                  "has dtype 'F8_E4M3', which is not supported", True),
    "config_missing_hidden_size": (lambda t, b: (["--model_name_or_path", model_copy(b, t, {"hidden_size": None})], None),
                                   "config.json lacks 'hidden_size'", True),
    "config_missing_layers": (lambda t, b: (["--model_name_or_path", model_copy(b, t, {"num_hidden_layers": None})], None),
                              "config.json lacks 'num_hidden_layers'", True),
    "config_missing_vocab": (lambda t, b: (["--model_name_or_path", model_copy(b, t, {"vocab_size": None})], None),
                             "config.json lacks 'vocab_size'", True),
    "config_string_number": (lambda t, b: (["--model_name_or_path", model_copy(b, t, {"hidden_size": "128"})], None),
                             "'hidden_size' must be a positive integer, got '128'", True),
    "tokenizer_json_corrupt": (lambda t, b: (["--model_name_or_path", model_copy(b, t, edit=_truncate("tokenizer.json"))], None),
                               "tokenizer.json cannot be read as a tokenizer", True),
    # 2: an index entry outside the model directory
    "index_escapes_directory": (lambda t, b: (["--model_name_or_path", model_copy(b, t, edit=_escaping_index)], None),
                                "names the file '../outside.safetensors', which is outside", True),
}


def _touch(p):
    p.write_text("keep me")
    return p


def _patch(d, first8):
    p = os.path.join(d, "model.safetensors")
    data = open(p, "rb").read()
    open(p, "wb").write(first8 + data[8:])


def _listing(root):
    return sorted(os.path.relpath(os.path.join(a, f), root) for a, _, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_error_line_before_loading(ft, base, tmp_path, monkeypatch, capsys, case):
    setup, expect, before_load = CASES[case]
    extra, out = setup(tmp_path, base)
    out = out or str(tmp_path / "out")
    argv = ([] if extra and extra[0].endswith(".json") else [SFT]) + list(extra)
    # the defaults first: the case's own keys come after them and win
    argv[1:1] = ["--output_dir", out, "--dataset_name_or_path", base["data"]] + QUICK
    loaded = []
    real = ft.load_model
    monkeypatch.setattr(ft, "load_model", lambda *a, **k: loaded.append(a) or real(*a, **k))
    before = _listing(tmp_path)
    code = ft.main(argv)
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert code == 2, err[-2000:]
    assert len(lines) == 1 and expect in lines[0], err[-2000:]
    assert "Traceback" not in err
    assert bool(loaded) == (not before_load), f"model loaded: {bool(loaded)}"
    assert _listing(tmp_path) == before   # nothing new anywhere (output_dir included)
    if not out.startswith("/sys"):
        assert not os.path.isdir(out) or not os.listdir(out)


def test_debug_variable_shows_the_traceback(ft, base, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PADDLETUNE_DEBUG", "1")
    model = model_copy(base, tmp_path, edit=_nan_weight)
    code = ft.main([SFT, "--output_dir", str(tmp_path / "out"), "--dataset_name_or_path", base["data"],
                    "--model_name_or_path", model] + QUICK)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err and "check_finite" in err
    assert err.strip().splitlines()[-1].startswith("error: ")


def test_warnings_for_what_is_allowed(base, tmp_path, caplog):
    """max_length beyond the positions with rope scaling (or data that fits) warns; some empty
    targets among real ones warn with the count."""
    from paddletune.args import DataArgument
    from paddletune.data.sft import build_datasets, check_positions
    from paddletune.loading import load_tokenizer

    ds, _ = build_datasets(DataArgument(dataset_name_or_path=base["data"], src_length=64, max_length=128),
                           load_tokenizer(base["model"]))
    check_positions(16, True, 128, (ds,), "cfg.json")
    assert "rope scaling stretches them" in caplog.text
    check_positions(256, False, 512, (ds,), "cfg.json")
    assert "the examples read so far fit" in caplog.text
    check_positions(4, False, 128, (ds,), "cfg.json")   # RoPE / ALiBi: longer examples warn (issue 34)
    assert "use positions the model never saw in training" in caplog.text
    with pytest.raises(ValueError, match="beyond the 16 learned positions"):
        check_positions(16, False, 128, (ds,), "cfg.json", learned=True)
    d = data_dir(tmp_path, '{"src": "a", "tgt": ""}\n{"src": "b", "tgt": "c"}\n')
    build_datasets(DataArgument(dataset_name_or_path=d, src_length=64, max_length=128), load_tokenizer(base["model"]))
    assert "1 of 2 rows have an empty target" in caplog.text


PRED = {
    "output_file_under_a_file": (lambda t, b: ["--output_file", str(_touch(t / "afile") / "out.json")], "cannot be created"),
    "output_file_not_permitted": (lambda t, b: ["--output_file", os.path.join(_readonly(t), "o.json")], "is not writable"),
    "tokenizer_bigger_than_vocab": (lambda t, b: ["--model_name_or_path", model_copy(b, t, {"vocab_size": 512})],
                                    "has 600 tokens, more than the vocab_size 512"),
    "safetensors_truncated": (lambda t, b: ["--model_name_or_path", model_copy(b, t, edit=_truncate("model.safetensors", 0.9))],
                              "the file is truncated"),
}


@pytest.mark.parametrize("case", list(PRED))
def test_predictor_checks_before_loading(base, tmp_path, monkeypatch, capsys, case):
    pred = load_script("llm/predictor.py")
    import paddletune.loading as generation

    loaded = []
    monkeypatch.setattr(generation, "load_for_generation", lambda *a, **k: loaded.append(a))
    extra, expect = PRED[case][0](tmp_path, base), PRED[case][1]
    before = _listing(tmp_path)
    code = pred.main(["--model_name_or_path", base["model"], "--max_length", "4"] + extra)
    err = capsys.readouterr().err
    assert code == 2 and expect in err, err[-2000:]
    assert not loaded and _listing(tmp_path) == before
