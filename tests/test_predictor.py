"""llm/predictor.py against transformers (its chat-template rendering + greedy generate) on the
same checkpoint: batch mode with the checkpoint's template, a built-in template, no template,
multi-round src, src_length; --chat driven through stdin; errors before the model is loaded."""
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, hf_checkpoint, load_script, write_jsonl

from paddletune.data.chat_template import BUILTIN_TEMPLATES

SCRIPT = os.path.join(ROOT, "llm", "predictor.py")
ROWS = [{"src": "Reverse the words: apple river", "tgt": "river apple"},
        {"src": "Sort the numbers: 3 1 2", "tgt": "1 2 3"},
        {"src": "hello there, how are you today?", "tgt": ""}]
N = 10


def _load_script():
    return load_script("llm/predictor.py")


predictor = _load_script()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A transformers-saved tiny Llama whose tokenizer_config.json carries a chatml template."""
    path, hf = hf_checkpoint(tmp_path_factory.mktemp("pred"), seed=21)
    conf_path = os.path.join(path, "tokenizer_config.json")
    conf = json.load(open(conf_path))
    conf["chat_template"] = BUILTIN_TEMPLATES["chatml"]
    json.dump(conf, open(conf_path, "w"))
    return path, hf


def hf_answer(path, hf, conversation=None, text=None, template=None, cut=None):
    """transformers: render + tokenize (or plain tokenize), greedy generate, decode."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    if conversation is not None:
        ids = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                      chat_template=template, return_dict=False)
        # paddletune's rule (data/chat_template.py): a tokenizer that adds BOS gets it in front of
        # a rendered conversation that does not start with it (transformers leaves it out)
        if ids[0] != tok.bos_token_id:
            ids = [tok.bos_token_id] + ids
    else:
        ids = tok(text).input_ids
    if cut:
        ids = ids[:1] + ids[len(ids) - (cut - 1):]
    with torch.no_grad():
        g = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        max_new_tokens=N, do_sample=False, pad_token_id=0)
    return tok.decode(g[0, len(ids):], skip_special_tokens=True)


def run(args, stdin=None):
    out = io.StringIO()
    rc = predictor.main(args, stdin=stdin, stdout=out)
    return rc, out.getvalue()


def greedy(path, *extra):
    return ["--model_name_or_path", path, "--decode_strategy", "greedy_search",
            "--max_length", str(N), *extra]


def test_batch_mode_with_checkpoint_template_equals_transformers(ckpt, tmp_path):
    path, hf = ckpt
    data = write_jsonl(str(tmp_path / "dev.json"), ROWS)
    out_file = str(tmp_path / "out.json")
    rc, printed = run(greedy(path, "--data_file", data, "--output_file", out_file, "--batch_size", "2"))
    assert rc == 0
    got = [json.loads(l) for l in open(out_file)]
    assert [(r["src"], r["tgt"]) for r in got] == [(r["src"], r["tgt"]) for r in ROWS]
    expected = [hf_answer(path, hf, [{"role": "user", "content": r["src"]}]) for r in ROWS]
    assert [r["output"] for r in got] == expected
    lines = printed.splitlines()
    assert lines[0] == f"3 answers written to {out_file}"
    n_tokens = int(lines[-1].split()[1])
    assert re.fullmatch(r"generated \d+ tokens in [\d.]+ s: [\d.]+ tokens/s \(wall [\d.]+ s\)", lines[-1])
    assert 0 < n_tokens <= 3 * N


def test_builtin_template_none_and_src_length(ckpt, tmp_path):
    path, hf = ckpt
    data = write_jsonl(str(tmp_path / "dev.json"), ROWS[:2])
    rc, printed = run(greedy(path, "--data_file", data, "--chat_template", "llama2"))
    got = [json.loads(l) for l in printed.splitlines() if l.startswith("{")]
    assert rc == 0 and [r["output"] for r in got] == [
        hf_answer(path, hf, [{"role": "user", "content": r["src"]}], template=BUILTIN_TEMPLATES["llama2"])
        for r in ROWS[:2]]
    rc, printed = run(greedy(path, "--data_file", data, "--chat_template", "none"))
    got = [json.loads(l) for l in printed.splitlines() if l.startswith("{")]
    assert [r["output"] for r in got] == [hf_answer(path, hf, text=r["src"]) for r in ROWS[:2]]
    # src_length without a template: BOS kept, text tokens cut from the left
    rc, printed = run(greedy(path, "--data_file", data, "--chat_template", "none", "--src_length", "5"))
    got = [json.loads(l) for l in printed.splitlines() if l.startswith("{")]
    assert [r["output"] for r in got] == [hf_answer(path, hf, text=r["src"], cut=5) for r in ROWS[:2]]


def test_dtype_float64_answers_and_16_bit_on_cpu(ckpt, tmp_path, monkeypatch):
    """--dtype float64 loads float64 weights and gives transformers' greedy answers; bfloat16
    (and a bf16 checkpoint's own dtype) computes in float32 on CPU, which has no 16-bit matmul."""
    import paddletune.loading as gen

    path, hf = ckpt
    real, seen = gen.load_for_generation, []

    def spy(*a, **k):
        out = real(*a, **k)
        seen.append((k.get("dtype"), {str(p.dtype) for p in out[0].parameters()}))
        return out
    monkeypatch.setattr(gen, "load_for_generation", spy)
    data = write_jsonl(str(tmp_path / "dev.json"), ROWS[:1])
    rc, printed = run(greedy(path, "--data_file", data, "--dtype", "float64"))
    got = [json.loads(l) for l in printed.splitlines() if l.startswith("{")]
    assert rc == 0 and seen[-1] == ("float64", {"paddle.float64"})
    assert [r["output"] for r in got] == [hf_answer(path, hf, [{"role": "user", "content": ROWS[0]["src"]}])]
    rc, _ = run(greedy(path, "--data_file", data, "--dtype", "bfloat16"))
    assert rc == 0 and seen[-1] == ("float32", {"paddle.float32"})


def test_multi_round_src(ckpt, tmp_path):
    path, hf = ckpt
    row = {"src": ["hi", "Sort the numbers: 3 1 2"], "tgt": ["hello!", "1 2 3"]}
    data = write_jsonl(str(tmp_path / "dev.json"), [row])
    rc, printed = run(greedy(path, "--data_file", data))
    got = json.loads(next(l for l in printed.splitlines() if l.startswith("{")))
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"},
            {"role": "user", "content": "Sort the numbers: 3 1 2"}]
    assert rc == 0 and got["output"] == hf_answer(path, hf, conv)


def test_chat_through_stdin_equals_transformers_with_history(ckpt):
    path, hf = ckpt
    turns = ["hello", "Reverse the words: apple river", "/reset", "Sort the numbers: 3 1 2", "/exit", "ignored"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, SCRIPT] + greedy(path, "--chat"), input="\n".join(turns) + "\n",
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[2] == "(history cleared)" and "tokens/s" in lines[-1] and len(lines) == 5
    history, expected = [], []
    for t in turns[:2]:
        history.append({"role": "user", "content": t})
        a = hf_answer(path, hf, history)
        history.append({"role": "assistant", "content": a})
        expected.append(a)
    expected.append(hf_answer(path, hf, [{"role": "user", "content": turns[3]}]))   # after /reset
    assert [lines[0], lines[1], lines[3]] == [e.replace("\n", " ") for e in expected]
    assert expected[1] != hf_answer(path, hf, [{"role": "user", "content": turns[1]}])  # history mattered


def test_chat_without_a_checkpoint_template(tmp_path):
    """A checkpoint without a chat template: --chat uses the family's default template
    (ModelSpec.default_chat_template, llama2 for Llama, said in a warning) and answers as
    transformers does with that template; --chat_template none answers each line as raw text."""
    path, hf = hf_checkpoint(tmp_path / "plain", seed=22)
    lines = ["Sort the numbers: 3 1 2", "/exit"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    for extra, want in ((["--chat"], hf_answer(path, hf, [{"role": "user", "content": lines[0]}],
                                               template=BUILTIN_TEMPLATES["llama2"])),
                        (["--chat", "--chat_template", "none"], hf_answer(path, hf, text=lines[0]))):
        r = subprocess.run([sys.executable, SCRIPT] + greedy(path, *extra), input="\n".join(lines) + "\n",
                           capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        answers = [l for l in r.stdout.splitlines() if not re.match(r"\[\d\d:\d\d:\d\d\] ", l)]
        assert answers[0] == want.replace("\n", " ")
        assert ("family's default" in r.stdout + r.stderr) == (extra == ["--chat"])


@pytest.mark.parametrize("args,msg", [
    (["--max_lenght", "3"], "unknown key 'max_lenght'; did you mean 'max_length'"),
    (["--data_file", "/nonexistent.json"], "data_file='/nonexistent.json' not found"),
    (["--top_p", "0"], "top_p"),
    (["--decode_strategy", "beam_search"], "must be one of"),
    (["--batch_size", "0"], "batch_size"),
    (["--chat_template", "no_such_template"], "no_such_template"),
    (["--lora_path", "/nonexistent"], "lora_path"),
    (["--dtype", "int8"], "must be one of"),
])
def test_bad_input_fails_before_loading_the_model(ckpt, monkeypatch, capsys, args, msg):
    import paddletune.loading as gen

    monkeypatch.setattr(gen, "load_for_generation", lambda *a, **k: pytest.fail("model was loaded"))
    rc, _ = run(["--model_name_or_path", ckpt[0]] + args)
    assert rc == 2 and msg in capsys.readouterr().err


def test_bad_data_lines_name_the_line(ckpt, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"src": "ok"}\n{"src": 3}\n')
    assert run(["--model_name_or_path", ckpt[0], "--data_file", str(bad)])[0] == 2
    assert f"{bad}:2" in capsys.readouterr().err
    bad.write_text('{"src": "ok"}\nnot json\n')
    assert run(["--model_name_or_path", ckpt[0], "--data_file", str(bad)])[0] == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err


def test_help_explains_every_key(capsys):
    with pytest.raises(SystemExit):
        predictor.parse(["--help"])
    text = capsys.readouterr().out
    for key in ("model_name_or_path", "lora_path", "prefix_path", "src_length", "max_length", "top_k",
                "top_p", "temperature", "repetition_penalty", "decode_strategy", "batch_size",
                "data_file", "output_file", "chat_template", "chat"):
        assert f"--{key} (default" in text
