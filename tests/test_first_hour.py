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
def test_adapter_on_builtin_base_loads_offline_with_auto_peft(tmp_path):
    import torch
    from peft import AutoPeftModelForCausalLM

    code, out = finetune(tmp_path, name="lora_argument.json")
    assert code == 0
    conf = json.load(open(os.path.join(out, "adapter_config.json")))
    base = resolve_model_path("paddletune/tiny-llama")
    assert conf["base_model_name_or_path"] == os.path.abspath(base) and os.path.isdir(base)
    assert json.load(open(os.path.join(out, "paddletune_base_model.json"))) == {
        "paddletune_base_model": "paddletune/tiny-llama"}
    env = dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        model = AutoPeftModelForCausalLM.from_pretrained(out).eval()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    ids = [[1, 5, 9, 13, 21, 34]]
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    from paddletune.loading import load_for_generation

    ours, _, _ = load_for_generation("paddletune/tiny-llama", lora_path=out)
    assert rel_err(ours(paddle.to_tensor(ids)).logits.numpy(), ref) < 1e-4


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
