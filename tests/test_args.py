"""Argument parsing: PaddleNLP files, overrides, unknown keys, bad values, help."""
import dataclasses
import glob
import json
import os

import pytest

from paddletune import args as A
from paddletune.args import ArgumentError, parse_args

HERE = os.path.dirname(os.path.abspath(__file__))
# a copy of ../shared/paddlenlp_argument_files (PaddleNLP's key sets), so CI needs nothing outside the repo
FIXTURES = os.path.join(HERE, "data", "paddlenlp_argument_files")
SHARED = os.path.join(HERE, "..", "..", "shared", "paddlenlp_argument_files")
PADDLENLP_FILES = sorted(glob.glob(os.path.join(FIXTURES, "*", "*.json")))


def write(tmp_path, d, name="a.json"):
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return str(p)


BASE = {"model_name_or_path": "m", "dataset_name_or_path": "d", "output_dir": "o"}


def test_fixture_copy_matches_shared():
    assert len(PADDLENLP_FILES) == 9
    if os.path.isdir(SHARED):  # the copy must not drift from the shared originals
        for p in PADDLENLP_FILES:
            rel = os.path.relpath(p, FIXTURES)
            assert json.load(open(p)) == json.load(open(os.path.join(SHARED, rel))), rel


def not_yet(data):
    """Keys of `data` that the declared table says must be refused for now: a parallel degree
    above 1 (args.PARALLEL_NOT_YET)."""
    return {k for k, v in data.items() if k in A.PARALLEL_NOT_YET and int(v) > 1}


@pytest.mark.parametrize("path", PADDLENLP_FILES, ids=lambda p: "/".join(p.split(os.sep)[-2:]))
def test_paddlenlp_files_have_only_known_keys(path, tmp_path):
    """Every key of PaddleNLP's argument files is known here, whatever happens to the file as a
    whole. Each key alone (on top of the required three) is accepted or refused by a message that
    names it. The whole file is accepted, or refused by a message that names one of its keys
    the tables mark as not available yet; with those keys removed one by one, the rest parses."""
    data = json.load(open(path))
    unknown = [k for k in data if A.ALIASES.get(k, k) not in A.TABLE]
    assert not unknown, unknown
    for key, value in data.items():
        if key in BASE:
            continue
        try:
            A.build(dict(BASE, **{key: value}), warn=lambda m: None)
        except ArgumentError as e:
            assert key in str(e), (key, str(e))
    expected = not_yet(data)
    refused, rest = [], dict(data)
    for _ in range(len(data) + 1):
        try:
            parse_args([write(tmp_path, rest)], warn=lambda m: None)
            break
        except ArgumentError as e:
            named = [k for k in rest if f"'{k}'" in str(e)]
            assert len(named) == 1 and named[0] in expected, (str(e), expected)
            assert "not available yet" in str(e), str(e)
            refused.append(named[0])
            del rest[named[0]]
    assert set(refused) == expected, (refused, expected)
    if expected:   # the original file itself is refused, naming one of those keys
        with pytest.raises(ArgumentError, match="not available yet") as e:
            parse_args([path], warn=lambda m: None)
        assert any(f"'{k}'" in str(e.value) for k in expected), str(e.value)
    else:
        parse_args([path], warn=lambda m: None)


def test_json_then_overrides(tmp_path):
    p = write(tmp_path, dict(BASE, learning_rate=0.1, lora_target_modules=[".*q_proj"]))
    m, d, q, g, t = parse_args([p, "--learning_rate", "0.5", "--max_steps=7", "--disable_tqdm", "true",
                                "--src_length", "16", "--max_length", "32"])
    assert t.learning_rate == 0.5 and t.max_steps == 7 and t.disable_tqdm is True
    assert d.src_length == 16 and m.lora_target_modules == [".*q_proj"] and t.output_dir == "o"


def test_unknown_key_names_file_and_nearest(tmp_path):
    p = write(tmp_path, dict(BASE, lerning_rate=0.1))
    with pytest.raises(ArgumentError) as e:
        parse_args([p])
    assert p in str(e.value) and "lerning_rate" in str(e.value) and "learning_rate" in str(e.value)


def test_unknown_cli_key(tmp_path):
    with pytest.raises(ArgumentError, match="did you mean 'per_device_train_batch_size'"):
        parse_args([write(tmp_path, BASE), "--per_device_train_batchsize", "2"])


@pytest.mark.parametrize("key,value,msg", [
    ("learning_rate", "fast", "must be float"),
    ("max_steps", 1.5, "must be int"),
    ("do_train", "maybe", "must be bool"),
    ("lr_scheduler_type", "exp", "must be one of"),
    ("src_length", 4096, "must be smaller than max_length"),
    ("per_device_train_batch_size", 0, "must be positive"),
    ("from_aistudio", True, "no downloads"),
    ("metric_for_best_model", "bleu4", "needs eval_with_do_generation"),
])
def test_bad_values(tmp_path, key, value, msg):
    with pytest.raises(ArgumentError, match=msg) as e:
        parse_args([write(tmp_path, dict(BASE, **{key: value}))])
    assert key in str(e.value)


def test_no_effect_keys_warn_once(tmp_path):
    seen = []
    parse_args([write(tmp_path, dict(BASE, eval_accumulation_steps=16, use_sparse_mask=True))], warn=seen.append)
    assert sum("eval_accumulation_steps" in w for w in seen) == 1
    assert sum("use_sparse_mask" in w for w in seen) == 1


def test_fp16_on_cpu_warns(tmp_path):
    if paddle_sees_gpu():
        pytest.skip("paddle sees a GPU here: fp16 runs on it, there is no CPU warning to check")
    seen = []
    parse_args([write(tmp_path, dict(BASE, fp16=True, fp16_opt_level="O2"))], warn=seen.append)
    assert any("fp16" in w and "float32" in w for w in seen)


def test_missing_required_key(tmp_path):
    with pytest.raises(ArgumentError, match="'output_dir' is required"):
        parse_args([write(tmp_path, {"model_name_or_path": "m", "dataset_name_or_path": "d"})])


def test_file_errors(tmp_path):
    with pytest.raises(ArgumentError, match="not found"):
        parse_args([str(tmp_path / "nope.json")])
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(ArgumentError, match="not valid JSON"):
        parse_args([str(bad)])


def test_every_key_in_exactly_one_class_with_help():
    names = [f for cls in A.CLASSES for f in cls.__dataclass_fields__]
    assert len(names) == len(set(names))
    for name, (cls, f) in A.TABLE.items():
        assert f.metadata["help"], name
        assert f.metadata["status"] in ("implemented", "no_effect", "refused"), name
        if f.metadata["status"] != "implemented":
            assert f.metadata["why"], name


def test_help_lists_every_key(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for name in A.TABLE:
        assert f"--{name} " in out


def test_paddlenlp_defaults():
    m, d, q, g, t = A.build(dict(BASE))
    assert (d.src_length, d.max_length, m.lora_rank, m.num_prefix_tokens, q.weight_blocksize) == (1024, 2048, 8, 128, 64)


def test_nullable_keys_reset_from_the_command_line(tmp_path):
    p = write(tmp_path, dict(BASE, weight_quantize_algo="nf4", lora=True))
    m, d, q, g, t = parse_args([p, "--weight_quantize_algo", "none"])
    assert q.weight_quantize_algo is None


def paddle_sees_gpu():
    """Asked of paddle directly (not of paddletune.runtime, the code under test)."""
    import paddle

    return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def test_gpu_device_without_a_gpu_is_refused(tmp_path):
    if paddle_sees_gpu():
        pytest.skip("paddle sees a GPU here: device: gpu is valid, the refusal cannot be checked")
    with pytest.raises(ArgumentError, match="sees no GPU"):
        parse_args([write(tmp_path, dict(BASE, device="gpu"))])


def test_derived_values_are_resolved_before_the_checks():
    """_resolve is the one step that changes parsed values (PaddleNLP's implications)."""
    m, d, q, g, t = A.build(dict(BASE, lora_path="x", greedy_zero_padding=True,
                                 metric_for_best_model="eval_loss"))
    assert m.lora and d.zero_padding
    assert t.metric_for_best_model == "loss" and t.greater_is_better is False
    with pytest.raises(ArgumentError, match="zero_padding.*cannot be used with prefix_tuning"):
        A.build(dict(BASE, prefix_path="p", intokens=True))   # prefix_path implies prefix_tuning
    m, d, q, g, t = A.build(dict(BASE, prefix_path="p", metric_for_best_model="accuracy"))
    assert m.prefix_tuning and t.greater_is_better is True
    with pytest.raises(ArgumentError, match="got 'eval_nope'"):   # an unknown name is kept as given
        A.build(dict(BASE, metric_for_best_model="eval_nope"))


def test_checks_change_nothing():
    objs = A.build(dict(BASE, lora=True, zero_padding=True, metric_for_best_model="ppl",
                        weight_quantize_algo="nf4", do_train=True, max_steps=3))
    before = [dataclasses.asdict(o) for o in objs]
    A._check_values(*objs, sources={}, warn=lambda m: None)
    assert [dataclasses.asdict(o) for o in objs] == before


def test_no_key_is_declared_twice_in_a_class():
    """A dataclass keeps the last of two same-named fields silently (virtual_pp_degree once was
    'refused' and then 'no_effect' further down): every key is written once in the source."""
    import ast

    from paddletune.alignment import args as alignment_args

    for mod in (A, alignment_args):
        for node in ast.parse(open(mod.__file__).read()).body:
            if isinstance(node, ast.ClassDef):
                names = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)]
                assert len(names) == len(set(names)), (mod.__name__, node.name)


def test_interleaved_pipeline_is_refused(tmp_path):
    with pytest.raises(ArgumentError, match="virtual_pp_degree") as e:
        parse_args([write(tmp_path, dict(BASE, virtual_pp_degree=2))])
    assert "interleaved" in str(e.value)
