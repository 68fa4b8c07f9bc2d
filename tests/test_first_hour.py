"""A newcomer's first hour (issue 22, items 5-11): the kernel build is announced, the built-in
models chat (their template leaves the sample run's data unchanged), adapters name a local base,
ChatGLM2 exports load in transformers' own GLM, reruns say what they resume, logs hold each
record once, and the Trainer is a public Python API whose README example runs as written."""
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import paddle
import pytest

from conftest import ROOT, load_script, rel_err, run_script

import paddletune
from paddletune.args import DataArgument
from paddletune.models import resolve_model_path
from paddletune.loading import load_model
from paddletune.loading import load_tokenizer

README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
SAMPLE = os.path.join(ROOT, "paddletune", "assets", "sample-sft")


def finetune(tmp_path, family="llama", name="sft_argument.json", **over):
    """llm/finetune_generation.py in-process on a shipped argument file with a tiny step budget;
    returns (exit code, output_dir)."""
    out = str(tmp_path / "out")
    keys = dict(output_dir=out, max_steps=2, src_length=64, max_length=128, per_device_train_batch_size=2,
                per_device_eval_batch_size=8, max_evaluate_steps=1, logging_steps=1, disable_tqdm=True)
    keys.update(over)
    argv = [os.path.join(ROOT, "llm", family, name)] + [f"--{k}={v}" for k, v in keys.items()]
    return load_script("llm/finetune_generation.py").main(argv), out


# ------------------------------------------------------------------ 5: kernel build log
def test_kernel_build_is_announced_before_and_after(tmp_path, monkeypatch, caplog):
    """A first build logs what the pause is and when it ends (the compile is stubbed: the real
    one takes 15-45 s); the default case says the kernels are on."""
    import paddle.utils.cpp_extension as ext

    from paddletune import kernels

    class Built:
        pass

    for op in kernels.OPS:
        setattr(Built, op, staticmethod(lambda *a: None))
    monkeypatch.setenv("PADDLETUNE_HOME", str(tmp_path))
    monkeypatch.setattr(ext, "load", lambda **kw: Built())
    monkeypatch.setattr(kernels, "_STATE", {})
    caplog.set_level(logging.INFO, logger="paddletune")
    if kernels._why_not() is not None:
        pytest.skip(f"kernels are off here: {kernels._why_not()}")
    assert kernels.cpu_ops() is not None
    text = [r.getMessage() for r in caplog.records]
    start = next(i for i, m in enumerate(text) if m.startswith("CPU kernels: building them once"))
    assert "~15-45 s" in text[start] and str(tmp_path) in text[start]
    assert re.match(r"CPU kernels: built in \d+ s", text[start + 1])
    assert text[-1].startswith("CPU kernels: on")


# ------------------------------------------------------------------ 6: built-in models chat
@pytest.mark.parametrize("name", ["paddletune/tiny-llama", "paddletune/tiny-chatglm2"])
def test_builtin_template_leaves_the_sample_data_unchanged(name):
    """The built-in models carry the 'plain' chat template; every sample row tokenises exactly
    as without a template, so command 1 trains on the same tokens as before."""
    from paddletune.data.sft import ExampleBuilder, read_json_lines

    tok = load_tokenizer(resolve_model_path(name))
    assert tok.template is not None
    raw_tok = load_tokenizer(resolve_model_path(name))
    raw_tok.set_chat_template("none")
    d = DataArgument(src_length=256, max_length=512)
    with_template, raw = ExampleBuilder(tok, d), ExampleBuilder(raw_tok, d)
    n = 0
    for split in ("train", "dev"):
        for line, row in read_json_lines(os.path.join(SAMPLE, f"{split}.json")):
            a, b = with_template(row, line), raw(row, line)
            assert np.array_equal(a["input_ids"], b["input_ids"]) and np.array_equal(a["labels"], b["labels"])
            n += 1
    assert n == 3200


def predictor(argv, lines):
    out = io.StringIO()
    code = load_script("llm/predictor.py").main(argv, stdin=io.StringIO("".join(l + "\n" for l in lines)),
                                                 stdout=out)
    return code, out.getvalue().splitlines()


def test_chat_on_builtin_models_and_raw_text(caplog):
    """--chat works on a built-in model as it is (its own template, no fallback), with history;
    --chat_template none answers each line as raw text, which for the plain template is the same
    prompt as a one-turn chat."""
    base = ["--model_name_or_path", "paddletune/tiny-llama", "--decode_strategy", "greedy_search",
            "--max_length", "5"]
    caplog.set_level(logging.WARNING, logger="paddletune")
    code, chat = predictor(base + ["--chat"], ["Count the words: apple", "/reset", "Count the words: apple"])
    assert code == 0 and "family's default" not in caplog.text
    assert chat[0] == chat[2] and chat[1] == "(history cleared)"
    code, raw = predictor(base + ["--chat", "--chat_template", "none"], ["Count the words: apple"])
    assert code == 0 and raw[0] == chat[0]


# ------------------------------------------------------------------ 7: adapters name a local base
def test_adapter_on_builtin_base_names_it_portably_and_loads_in_peft(tmp_path):
    """Issue 34 item 11: adapter_config.json names a built-in base by its portable name, not this
    machine's cache path; peft loads the adapter on the resolved base, and paddletune's loaders
    take the name as it is: predictor.py --lora_path DIR alone answers as with the base given."""
    import torch
    import transformers
    from peft import PeftModel

    code, out = finetune(tmp_path, name="lora_argument.json")
    assert code == 0
    conf = json.load(open(os.path.join(out, "adapter_config.json")))
    assert conf["base_model_name_or_path"] == "paddletune/tiny-llama"
    assert json.load(open(os.path.join(out, "paddletune_base_model.json"))) == {
        "paddletune_base_model": "paddletune/tiny-llama"}
    base = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_path("paddletune/tiny-llama"))
    model = PeftModel.from_pretrained(base, out).eval()
    ids = [[1, 5, 9, 13, 21, 34]]
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    from paddletune.loading import load_for_generation

    ours, _, _ = load_for_generation("paddletune/tiny-llama", lora_path=out)
    assert rel_err(ours(paddle.to_tensor(ids)).logits.numpy(), ref) < 1e-4
    # issue 34 item 8: predictor.py --lora_path DIR alone takes the base the adapter names
    greedy = ["--decode_strategy", "greedy_search", "--max_length", "6"]
    code, alone = predictor(["--lora_path", out] + greedy, [])
    code2, both = predictor(["--model_name_or_path", "paddletune/tiny-llama", "--lora_path", out] + greedy, [])
    assert code == code2 == 0 and len(alone) >= 2
    assert [json.loads(l)["output"] for l in alone if l.startswith("{")] == [
        json.loads(l)["output"] for l in both if l.startswith("{")]


# ------------------------------------------------------------------ 8: ChatGLM2 -> transformers GLM
def glm_logits(path, ids):
    import torch
    import transformers

    model = transformers.GlmForCausalLM.from_pretrained(path).eval()
    assert model.config.model_type == "glm"
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def test_chatglm2_exports_load_in_transformers_glm(tmp_path):
    """Full fine-tuning with export_format: glm writes transformers' GlmForCausalLM; LoRA adapters
    convert too (llm/merge_lora_params.py --export_format glm merges into a GLM model); logits
    equal paddletune's ChatGLM2 model of the same weights."""
    ids = [[64790, 64792, 5, 9, 13, 21]]
    base = resolve_model_path("paddletune/tiny-chatglm2")
    ids = [[i % 150 for i in ids[0]]]
    code, out = finetune(tmp_path / "sft", family="chatglm2", name="sft_argument.json", export_format="glm",
                         save_strategy="steps", save_steps=2, evaluation_strategy="no",
                         load_best_model_at_end=False)
    assert code == 0
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == "glm"
    final = glm_logits(out, ids)
    assert final.shape[-1] == json.load(open(os.path.join(base, "config.json")))["padded_vocab_size"]
    merged_ckpt = str(tmp_path / "from_checkpoint")   # the merge tool on the run's checkpoint-2
    assert load_script("llm/merge_tp_and_pp_params.py").main(
        ["--model_name_or_path", os.path.join(out, "checkpoint-2"), "--output_path", merged_ckpt,
         "--export_format", "glm"]) == 0
    assert rel_err(glm_logits(merged_ckpt, ids), final) < 1e-6
    # a LoRA adapter: exported as hf, then converted by the merge tool and in place
    code, lora_out = finetune(tmp_path / "lora", family="chatglm2", name="lora_argument.json",
                              learning_rate=0.05, save_strategy="no", evaluation_strategy="no",
                              load_best_model_at_end=False)
    assert code == 0
    from paddletune.loading import load_for_generation

    ours, _, _ = load_for_generation(base, lora_path=lora_out)
    want = ours(paddle.to_tensor(ids)).logits.numpy()
    merged = str(tmp_path / "merged")
    r = run_script([os.path.join(ROOT, "llm", "merge_lora_params.py"), "--lora_path", lora_out,
                    "--merge_lora_model_path", merged, "--export_format", "glm"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert rel_err(glm_logits(merged, ids), want) < 1e-4
    import torch
    import transformers
    from peft import PeftModel

    from paddletune.models import glm_export

    glm_base, adapter = str(tmp_path / "glm_base"), str(tmp_path / "glm_lora")
    shutil.copytree(base, glm_base)
    glm_export.export_as(glm_base, "glm")
    shutil.copytree(lora_out, adapter)
    glm_export.export_as(adapter, "glm", json.load(open(os.path.join(base, "config.json"))))
    model = PeftModel.from_pretrained(transformers.GlmForCausalLM.from_pretrained(glm_base), adapter).eval()
    with torch.no_grad():
        assert rel_err(model(torch.tensor(ids)).logits.numpy(), want) < 1e-4
    # a family without a GLM layout is refused before anything runs
    code, _ = finetune(tmp_path / "llama", export_format="glm")
    assert code == 2


# ------------------------------------------------------------------ 9, 10: reruns and logs
def test_rerun_says_what_it_resumes_and_logs_each_step_once(tmp_path, capsys):
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, evaluation_strategy="steps",
                  eval_steps=2, load_best_model_at_end=False, save_total_limit=3)
    code, out = finetune(tmp_path, **common)
    assert code == 0
    capsys.readouterr()
    # a run killed after step 4 was logged but before checkpoint-4 was complete: rerun resumes at 2
    shutil.rmtree(os.path.join(out, "checkpoint-4"))
    code, _ = finetune(tmp_path, **common)
    text = capsys.readouterr()
    lines = [l for l in (text.out + text.err).splitlines() if "RESUMING" in l]
    assert code == 0 and len(lines) == 1, lines
    assert "checkpoint-2 (step 2 of 4, epoch" in lines[0] and "2 steps left to train" in lines[0]
    log = [json.loads(l) for l in open(os.path.join(out, "train_log.jsonl"))]
    train_steps = [e["step"] for e in log if "loss" in e]
    eval_steps = [e["step"] for e in log if "eval_loss" in e]
    assert train_steps == [1, 2, 3, 4] and eval_steps == [2, 4]   # final eval = step 4's: once
    # nothing left: one line that says so, and the log is unchanged
    code, _ = finetune(tmp_path, **common)
    text = capsys.readouterr()
    lines = [l for l in (text.out + text.err).splitlines() if "RESUMING" in l]
    assert code == 0 and len(lines) == 1 and "step 4 of 4" in lines[0] and "nothing left to train" in lines[0]
    assert [json.loads(l) for l in open(os.path.join(out, "train_log.jsonl"))] == log


def test_small_first_hour_items():
    """help(paddletune.pipeline) documents it; log/ and checkpoints/ are git-ignored anywhere;
    importing paddletune leaves stderr empty (paddle's thread banner and its blank lines)."""
    doc = paddletune.pipeline.__doc__
    assert doc and "text-generation" in doc and "max_new_tokens" in doc
    if shutil.which("git") and os.path.isdir(os.path.join(ROOT, ".git")) or os.path.isfile(os.path.join(ROOT, ".git")):
        for path in ("log/workerlog.0", "checkpoints/x/config.json", "llm/checkpoints/a", "llm/log/x"):
            r = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
            assert r.returncode == 0, path
    r = run_script(["-c", "import paddletune"])
    assert r.returncode == 0 and r.stderr == "", repr(r.stderr)


# ------------------------------------------------------------------ 11: the public Trainer
def readme_block(after, lang):
    start = README.index(after)
    m = re.compile(rf"```{lang}\n(.*?)```", re.S).search(README, start)
    return m.group(1)


def test_readme_python_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """The README's Trainer example, then its chat command on the result, as written (in a fresh
    working directory that has the checkout's llm/)."""
    os.symlink(os.path.join(ROOT, "llm"), tmp_path / "llm")
    monkeypatch.chdir(tmp_path)
    code = readme_block("## Python API", "python")
    assert 10 <= len(code.strip().splitlines()) <= 25
    capsys.readouterr()
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    printed = [l for l in capsys.readouterr().out.splitlines() if not l.startswith("[")]
    assert printed[-1] == "3" and "'accuracy': 1.0" in printed[-2], printed
    chat = readme_block("Chat with the result:", "bash").strip()
    r = subprocess.run(chat, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[0] == "2"


def test_trainer_api_token_ids_json_file_and_resume(tmp_path):
    """Token-id rows train as language modelling; a parse_args tuple from a shipped JSON file
    runs like the script (its LoRA adapter is the export); a second Trainer on the same
    output_dir resumes; the script's order Trainer(model, args, ...) still works."""
    from paddletune.args import TrainingArguments
    from paddletune.trainer import Trainer

    args = TrainingArguments(output_dir=str(tmp_path / "ids"), max_steps=3, save_steps=3, logging_steps=1,
                             learning_rate=1e-3, per_device_train_batch_size=2, disable_tqdm=True)
    ids = [[1, 5, 6, 7, 8, 2], [1, 9, 10, 11, 2], [1, 12, 13, 14, 15, 16, 2]]
    t = paddletune.Trainer(args, "paddletune/tiny-llama", train_dataset=ids, eval_dataset=ids)
    assert int((t.train_dataset[0]["labels"] != -100).sum()) == 6
    t.train()
    first = t.evaluate()
    assert set(first) == {"loss", "ppl", "accuracy"}
    assert os.path.isfile(tmp_path / "ids" / "config.json")
    again = paddletune.Trainer(TrainingArguments(**dict(vars(args), resume_from_checkpoint=None)),
                               "paddletune/tiny-llama", train_dataset=ids)
    assert again.args.resume_from_checkpoint.endswith("checkpoint-3")
    parsed = paddletune.parse_args([os.path.join(ROOT, "llm", "llama", "lora_argument.json"), "--max_steps", "2",
                                    "--output_dir", str(tmp_path / "lora"), "--src_length", "64",
                                    "--max_length", "128", "--evaluation_strategy", "no",
                                    "--save_strategy", "no", "--load_best_model_at_end", "false",
                                    "--disable_tqdm", "true"])
    lora = paddletune.Trainer(parsed)
    lora.train()
    assert os.path.isfile(tmp_path / "lora" / "adapter_config.json")
    assert isinstance(lora.predict(["Count the words: apple"], max_new_tokens=3), list)
    model = load_model(resolve_model_path("paddletune/tiny-llama"))
    legacy = Trainer(model, args, train_dataset=lora.train_dataset)
    assert legacy.model is model


def test_trainer_api_resumes_exactly_and_holds_the_output_dir_lock(tmp_path):
    """A Trainer used from Python continues a checkpoint exactly (steps 4-5 after a resume at 3
    equal an uninterrupted 5-step run) and, while it trains, holds output_dir's lock: a job that
    already holds it makes train() fail naming that job, before any step."""
    import subprocess
    import sys

    from paddletune.args import TrainingArguments
    from paddletune.outdir import OutputDirError

    ids = [[1] + list(range(5 + i, 12 + i)) + [2] for i in range(8)]

    def args(out, steps, **kw):
        return TrainingArguments(output_dir=str(out), max_steps=steps, save_steps=3, logging_steps=1,
                                 learning_rate=1e-3, per_device_train_batch_size=2, disable_tqdm=True,
                                 warmup_steps=0, lr_scheduler_type="constant", **kw)

    def losses(out):
        return [json.loads(l)["loss"] for l in open(out / "train_log.jsonl") if '"loss"' in l]

    paddletune.Trainer(args(tmp_path / "full", 5), "paddletune/tiny-llama", train_dataset=ids).train()
    paddletune.Trainer(args(tmp_path / "cut", 3), "paddletune/tiny-llama", train_dataset=ids).train()
    resumed = paddletune.Trainer(args(tmp_path / "cut", 5), "paddletune/tiny-llama", train_dataset=ids)
    assert resumed.args.resume_from_checkpoint.endswith("checkpoint-3")
    resumed.train()
    full, cut = losses(tmp_path / "full"), losses(tmp_path / "cut")
    assert len(full) == 5 and len(cut) == 5
    np.testing.assert_allclose(cut[3:], full[3:], rtol=1e-6)
    assert cut[3] != full[2]   # steps 4-5 really trained after the resume

    busy = tmp_path / "busy"
    busy.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "from paddletune import outdir; outdir.claim(sys.argv[2]); print('held', flush=True); "
                               "time.sleep(60)", ROOT, str(busy)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t = paddletune.Trainer(args(busy, 2), "paddletune/tiny-llama", train_dataset=ids)
        with pytest.raises(OutputDirError, match=f"PID {holder.pid}"):
            t.train()
        assert t.state["global_step"] == 0 and sorted(os.listdir(busy)) == [".paddletune.lock"]
    finally:
        holder.kill()
        holder.wait()


# ------------------------------------------------------------------ issue 34, 12: YAML files, key=value
def yaml_of(json_path):
    """The shipped JSON file written as YAML by hand (plain scalars, as a user writes them)."""
    data = json.load(open(json_path))
    return "".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in data.items())


def test_yaml_argument_file_parses_as_its_json_twin(tmp_path):
    """A YAML file with the keys of llm/llama/lora_argument.json gives the same typed arguments,
    with PyYAML's `1e-5` (a string to YAML 1.1) accepted for a float key and `no` for a bool key;
    key=value overrides sit beside --key value and split on the first '=' only."""
    src = os.path.join(ROOT, "llm", "llama", "lora_argument.json")
    text = yaml_of(src).replace("learning_rate: 0.003", "learning_rate: 1e-5").replace(
        "disable_tqdm: false", "disable_tqdm: no")
    (tmp_path / "lora.yaml").write_text(text)
    assert "learning_rate: 1e-5\n" in text and "disable_tqdm: no\n" in text
    over = ["--max_steps", "7", "chat_template=my=template.jinja", "lora_rank=4"]
    got = paddletune.parse_args([str(tmp_path / "lora.yaml")] + over)
    want = paddletune.parse_args([src, "--learning_rate", "1e-5"] + over)
    assert [vars(a) for a in got] == [vars(a) for a in want]
    assert got[4].learning_rate == 1e-5 and got[4].max_steps == 7 and got[0].lora_rank == 4
    assert got[1].chat_template == "my=template.jinja" and got[4].disable_tqdm is False


@pytest.mark.parametrize("line, says, quoted", [
    ("chat_template: no", "'chat_template: no' is the boolean False to YAML, but 'chat_template' is not a true/false key",
     (1, "chat_template", "no")),
    ("max_steps: 010", "'max_steps: 010' is read by YAML as the number 8", (4, "max_steps", 10)),
    ("logging_dir: 010", "'logging_dir: 010' is read by YAML as the number 8", (4, "logging_dir", "010")),
    ("seed: 1\nseed: 2", "key 'seed' is given twice", (4, "seed", 2))])
def test_yaml_surprises_are_errors_naming_the_key(tmp_path, capsys, line, says, quoted):
    """A boolean (yes/no) or octal value in a key that is not boolean, and a repeated key: one
    `error:` line naming file and key, exit 2, before any loading."""
    path = tmp_path / "bad.yml"
    path.write_text(f"model_name_or_path: paddletune/tiny-llama\ndataset_name_or_path: paddletune/sample-sft\n"
                    f"output_dir: {tmp_path / 'out'}\n{line}\n")
    code = load_script("llm/finetune_generation.py").main([str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {path}: ") and says in err[0], err
    assert not os.path.exists(tmp_path / "out")
    fixed = tmp_path / "ok.yml"   # quoting keeps the text
    fixed.write_text(path.read_text().replace(": no", ": 'no'").replace(": 010", ": '010'").replace("seed: 1\n", ""))
    index, key, value = quoted
    assert getattr(paddletune.parse_args([str(fixed)])[index], key) == value


# ------------------------------------------------------------------ issue 34, 6: one file, .jsonl splits
def test_dataset_is_one_jsonl_file_or_jsonl_splits(tmp_path):
    """dataset_name_or_path takes one .json / .jsonl file (train and dev both) and a directory of
    train.jsonl / dev.jsonl; both read the same examples as the train.json / dev.json directory."""
    from paddletune.data import build_datasets

    rows = [{"src": f"Count the words: {' '.join(['apple'] * n)}", "tgt": str(n)} for n in range(1, 7)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    for name in ("json", "jsonl"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"train.{name}").write_text(text)
        (tmp_path / name / f"dev.{name}").write_text(text)
    (tmp_path / "one.jsonl").write_text(text)
    tok = load_tokenizer(resolve_model_path("paddletune/tiny-llama"))

    def ids(path):
        train, dev = build_datasets(DataArgument(dataset_name_or_path=str(path), src_length=64, max_length=128),
                                    tok, do_train=True, do_eval=True)
        return [[list(e["input_ids"]) for e in ds.examples] for ds in (train, dev)]

    want = ids(tmp_path / "json")
    assert len(want[0]) == 6 and ids(tmp_path / "jsonl") == want and ids(tmp_path / "one.jsonl") == want
    code, out = finetune(tmp_path, name="lora_argument.json", dataset_name_or_path=str(tmp_path / "one.jsonl"))
    assert code == 0 and os.path.isfile(os.path.join(out, "adapter_config.json"))
    (tmp_path / "notes.txt").write_text(text)
    with pytest.raises(Exception, match="is not a .json / .jsonl file"):
        build_datasets(DataArgument(dataset_name_or_path=str(tmp_path / "notes.txt")), tok)


# ------------------------------------------------------------------ issue 34, 4-5: best and last kept, said
def test_finished_run_keeps_best_and_last_and_says_what_it_exported(tmp_path, capsys):
    """save_total_limit 1 + load_best_model_at_end keeps the best AND the last checkpoint (as
    transformers), so a rerun has nothing left to train; the closing lines name the exported
    step, its metric and the last step's (read back from train_log.jsonl), and how to export the
    last instead. The best is made an early step on purpose: eval loss with greater_is_better."""
    common = dict(max_steps=6, save_strategy="steps", save_steps=2, evaluation_strategy="steps", eval_steps=2,
                  load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True,
                  save_total_limit=1, name="lora_argument.json")
    code, out = finetune(tmp_path, **common)
    text = capsys.readouterr()
    assert code == 0
    log = [json.loads(l) for l in open(os.path.join(out, "train_log.jsonl"))]
    evals = {e["step"]: e["eval_loss"] for e in log if "eval_loss" in e}
    best = max(sorted(evals), key=lambda s: (evals[s], -s))   # ties: the earlier step
    assert sorted(evals) == [2, 4, 6] and best != 6, evals
    kept = sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))
    assert kept == sorted([f"checkpoint-{best}", "checkpoint-6"]), kept
    assert "layout = tensor 1 x pipeline 1 x data 1 x sharding 1 = 1 process" in text.out + text.err
    lines = [l for l in (text.out + text.err).splitlines() if "exported:" in l or "to export the last" in l]
    assert len(lines) == 2, lines
    assert f"the best checkpoint, step {best} (loss = {evals[best]:.6g}); the last step, 6, has loss = {evals[6]:.6g}" in lines[0]
    assert "--load_best_model_at_end false" in lines[1] and "checkpoint-6" in lines[1]
    code, _ = finetune(tmp_path, **common)
    text = capsys.readouterr()
    resumed = [l for l in (text.out + text.err).splitlines() if "RESUMING" in l]
    assert code == 0 and len(resumed) == 1 and "checkpoint-6 (step 6 of 6" in resumed[0], resumed
    assert "nothing left to train" in resumed[0]
    assert [json.loads(l) for l in open(os.path.join(out, "train_log.jsonl"))] == log


# ------------------------------------------------------------------ issue 34, 7: readable launch output
def test_progress_and_layout_lines(caplog):
    """No tqdm bar when stderr is not a terminal (a launcher's workerlog): a progress line per
    logging interval instead; a terminal gets the bar; rank > 0 or disable_tqdm gets nothing.
    The start-up summary names the layout."""
    from paddletune.trainer import summary

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert summary.progress(10, 0, 5, show=False) is None
    assert type(summary.progress(10, 0, 5, show=True, stream=Tty())).__name__ == "tqdm"
    bar = summary.progress(10, 2, 4, show=True, stream=io.StringIO())
    caplog.set_level(logging.INFO, logger="paddletune")
    for _ in range(8):
        bar.update(1)
    got = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]
    assert [g.split(" steps")[0] for g in got] == ["progress: 4/10", "progress: 8/10", "progress: 10/10"], got
    assert "(100.0%)" in got[-1] and "~0:00:00 left" in got[-1]
    assert summary.layout_line({"tp": 2, "pp": 1, "dp": 1, "sharding": 1}) == "tensor 2 x pipeline 1 x data 1 x sharding 1"


# ------------------------------------------------------------------ issue 34, 10: max_length past the positions
@pytest.mark.parametrize("family", ["llama", "bloom", "gpt2"])
def test_max_length_beyond_positions_warns_for_rope_alibi_refuses_learned(tmp_path, capsys, family):
    """Llama (RoPE) and Bloom (ALiBi) copies of the built-in model with 16 positions
    (max_position_embeddings; Bloom: seq_length) train on examples of up to 128 tokens with one
    warning, as transformers and PaddleNLP allow; GPT-2's learned table (n_positions 1024) refuses
    max_length 2048 with one error line, before loading."""
    if family == "gpt2":
        code, out = finetune(tmp_path, model_name_or_path="paddletune/tiny-gpt2", max_length=2048)
        err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
        assert code == 2 and len(err) == 1 and "max_length=2048 is beyond the 1024 learned positions" in err[0], err
        assert not os.path.exists(os.path.join(out, "config.json"))
        return
    model = tmp_path / "model"
    shutil.copytree(resolve_model_path(f"paddletune/tiny-{family}"), model)
    conf = json.load(open(model / "config.json"))
    conf["seq_length" if family == "bloom" else "max_position_embeddings"] = 16
    (model / "config.json").write_text(json.dumps(conf))
    code, out = finetune(tmp_path, model_name_or_path=str(model), evaluation_strategy="no", do_eval=False,
                         load_best_model_at_end=False, save_strategy="no")
    text = capsys.readouterr()
    warned = [l for l in (text.out + text.err).splitlines() if "is beyond the model's 16 positions" in l]
    assert code == 0 and len(warned) == 1 and "never saw in training" in warned[0], warned
    assert os.path.isfile(os.path.join(out, "config.json"))


# ------------------------------------------------------------------ issue 34, 9: merge tool on an output_dir
def test_merge_tool_takes_output_dir_and_merges_lora_in_one_step(tmp_path, capsys):
    """merge_tp_and_pp_params.py on an output_dir takes its newest checkpoint (saying so) and,
    with --merge_lora true, writes base + adapter as one full HF model: its weights equal peft's
    merge_and_unload of the run's final adapter (the same step) on the transformers base."""
    import torch
    import transformers
    from peft import PeftModel
    from safetensors.numpy import load_file

    code, out = finetune(tmp_path, name="lora_argument.json", max_steps=4, save_strategy="steps", save_steps=2,
                         evaluation_strategy="no", do_eval=False, load_best_model_at_end=False, save_total_limit=3)
    assert code == 0 and sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-4"]
    capsys.readouterr()
    merged = tmp_path / "merged"
    code = load_script("llm/merge_tp_and_pp_params.py").main(
        ["--model_name_or_path", out, "--merge_lora", "true", "--output_path", str(merged)])
    text = capsys.readouterr()
    assert code == 0, text.err[-2000:]
    assert "taking its newest checkpoint, checkpoint-4" in text.out + text.err
    assert os.path.isfile(merged / "config.json") and not os.path.exists(merged / "adapter_config.json")
    assert not [d for d in os.listdir(tmp_path) if d.startswith(".adapter-")]   # temp adapter removed
    base = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_path("paddletune/tiny-llama"))
    ref = PeftModel.from_pretrained(base, out).merge_and_unload().state_dict()
    got = load_file(str(merged / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not np.allclose(ref[q].numpy(), load_file(os.path.join(
        resolve_model_path("paddletune/tiny-llama"), "model.safetensors"))[q])   # the adapter acts
    for name, t in ref.items():
        if name in got:
            assert rel_err(got[name], t.detach().to(torch.float32).numpy()) < 1e-5, name
    assert set(got) >= {n for n in ref if not n.endswith("lm_head.weight")}


# ------------------------------------------------------------------ issue 34, 8: chat history said, limited
def test_chat_says_it_carries_history_and_max_history_turns_limits_it(capsys):
    """--chat says once whether answers see earlier turns; --max_history_turns 0 answers every
    line as if asked first (the oracle: the same line after /reset); -2 is refused."""
    base = ["--model_name_or_path", "paddletune/tiny-llama", "--decode_strategy", "greedy_search",
            "--max_length", "6", "--chat"]
    a, b, c = "Count the words: apple", "Sort the words: river apple", "Uppercase: stone"

    def chat(extra, lines):
        code, out = predictor(base + extra, lines)
        return code, [l for l in out if not l.startswith("generated ")]
    code, alone = chat(["--max_history_turns", "0"], [a, b, c])
    said = capsys.readouterr()
    assert code == 0 and "each line is answered alone" in said.out + said.err
    code, fresh = chat([], [a, "/reset", b, "/reset", c])
    said = capsys.readouterr()
    assert code == 0 and alone == [fresh[0], fresh[2], fresh[4]]
    assert "each answer sees all the earlier turns" in said.out + said.err
    code, one = chat(["--max_history_turns", "1"], [a, b, c])
    said = capsys.readouterr()
    assert code == 0 and len(one) == 3 and one[0] == fresh[0] and "up to 1 earlier turns" in said.out + said.err
    code, _ = chat(["--max_history_turns", "-2"], [a])
    assert code == 2


def test_predictor_scores_rows_with_tgt(tmp_path):
    """--data_file rows with a tgt: exact match / BLEU-4 / ROUGE-L printed at the end, equal to the
    hand count (exact) and to trainer/metrics.py on the printed outputs; rows without tgt are
    not scored."""
    from paddletune.trainer.metrics import generation_metrics

    rows = [{"src": "Count the words: apple", "tgt": "1"}, {"src": "Uppercase: stone", "tgt": "STONE"},
            {"src": "Reverse the words: a b"}]
    (tmp_path / "dev.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out = predictor(["--model_name_or_path", "paddletune/tiny-llama", "--decode_strategy", "greedy_search",
                           "--max_length", "4", "--data_file", str(tmp_path / "dev.json")], [])
    assert code == 0
    outputs = [json.loads(l)["output"] for l in out if l.startswith("{")]
    line = [l for l in out if l.startswith("metrics on")]
    exact = sum(o.strip() == r["tgt"] for o, r in zip(outputs, rows[:2])) / 2
    m = generation_metrics(outputs[:2], ["1", "STONE"])
    assert line == [f"metrics on 2 rows with a tgt: exact match {exact:.4f}, BLEU-4 {m['bleu4']:.4f}, "
                    f"ROUGE-L {m['rougel']:.4f}"], out
