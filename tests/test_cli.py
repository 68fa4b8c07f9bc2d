"""llm/finetune_generation.py end to end: the shipped argument file, the PaddleNLP `cd llm` habit,
the output loading in transformers, and bad input that exits non-zero and writes nothing."""
import json
import os

import numpy as np
import pytest

from conftest import ROOT, hf_checkpoint, rel_err, run_script

SCRIPT = os.path.join(ROOT, "llm", "finetune_generation.py")
SFT = os.path.join(ROOT, "llm", "llama", "sft_argument.json")
QUICK = ["--max_steps", "4", "--logging_steps", "1", "--save_strategy", "no", "--evaluation_strategy", "no",
         "--load_best_model_at_end", "false", "--per_device_train_batch_size", "4",
         "--per_device_eval_batch_size", "8", "--max_evaluate_steps", "2", "--disable_tqdm", "true"]


def test_shipped_sft_file_trains_and_transformers_loads_result(tmp_path):
    import paddle
    import torch
    import transformers
    from paddletune.models import load_model

    out = tmp_path / "out"
    r = run_script([SCRIPT, SFT, "--output_dir", str(out)] + QUICK)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "model saved to" in r.stdout and "ppl" in r.stdout
    log = [json.loads(l) for l in open(out / "train_log.jsonl")]
    assert [e["step"] for e in log if "loss" in e] == [1, 2, 3, 4]
    ids = np.random.RandomState(0).randint(3, 500, (1, 12))
    ours = load_model(str(out))(paddle.to_tensor(ids)).logits.numpy()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert rel_err(ours, ref) <= 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok("Add 1 and 2.").input_ids[0] == tok.bos_token_id


def test_paddlenlp_habit_cd_llm(tmp_path):
    r = run_script(["finetune_generation.py", "llama/sft_argument.json", "--output_dir", str(tmp_path / "o"),
                    "--do_eval", "false"] + QUICK[:-4], cwd=os.path.join(ROOT, "llm"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert os.path.exists(tmp_path / "o" / "config.json")


def _bad_model(tmp_path):
    path, _ = hf_checkpoint(tmp_path / "badheads", "llama")
    conf = json.load(open(os.path.join(path, "config.json")))
    conf["num_key_value_heads"] = 3
    json.dump(conf, open(os.path.join(path, "config.json"), "w"))
    return path


def _data(tmp_path, lines):
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    (d / "train.json").write_text(lines)
    return str(d)


BAD = {
    "unknown_key": (lambda t: ["--lerning_rate", "1"], "did you mean 'learning_rate'"),
    "hub_name": (lambda t: ["--model_name_or_path", "facebook/llama-7b"], "does not download"),
    "bad_dataset_dir": (lambda t: ["--dataset_name_or_path", str(t / "nope")], "is not a directory"),
    "malformed_line": (lambda t: ["--dataset_name_or_path", _data(t, '{"src": "a", "tgt": "b"}\n{"src": \n')],
                       "train.json:2: not valid JSON"),
    "empty_dataset": (lambda t: ["--dataset_name_or_path", _data(t, "\n")], "empty"),
    "src_not_below_max": (lambda t: ["--src_length", "512", "--max_length", "512"], "must be smaller than max_length"),
    "indivisible_heads": (lambda t: ["--model_name_or_path", _bad_model(t)], "multiple of num_key_value_heads"),
    "refused_key": (lambda t: ["--from_aistudio", "true"], "no downloads"),
    "bad_resume": (lambda t: ["--resume_from_checkpoint", str(t / "nope")], "is not a directory"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_and_writes_nothing(tmp_path, case):
    extra, msg = BAD[case]
    out = tmp_path / "out"
    r = run_script([SCRIPT, SFT, "--output_dir", str(out), "--do_eval", "false"] + QUICK[:-4] + extra(tmp_path))
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert msg in r.stderr, r.stderr[-2000:]
    assert not out.exists()


def test_data_parallel_launch_rank0_writes(tmp_path):
    from conftest import launch

    out = tmp_path / "out"
    r = launch([SCRIPT, SFT, "--output_dir", str(out)] + ["--max_steps", "3"] + QUICK[2:], nproc=2, log_dir=tmp_path / "log")
    logs = {k: open(tmp_path / "log" / f"workerlog.{k}").read() for k in (0, 1)}
    assert r.returncode == 0, logs[0][-3000:] + logs[1][-3000:]
    assert "data-parallel ranks = 2, global batch = 8" in logs[0]
    assert "model saved to" in logs[0] and "model saved to" not in logs[1]
    log = [l for l in open(out / "train_log.jsonl")]
    assert len([l for l in log if '"loss"' in l]) == 3     # one writer: no duplicated lines
    assert os.path.exists(out / "config.json")


def test_lora_under_data_parallel_launch(tmp_path):
    """LoRA (adapter-only training and output) with 2 launched ranks: the adapter is written once,
    by rank 0, and torch peft loads it onto the transformers base."""
    from conftest import launch

    out = tmp_path / "out"
    lora = os.path.join(ROOT, "llm", "llama", "lora_argument.json")
    r = launch([SCRIPT, lora, "--output_dir", str(out), "--max_steps", "2"] + QUICK[2:], nproc=2,
               log_dir=tmp_path / "log")
    logs = {k: open(tmp_path / "log" / f"workerlog.{k}").read() for k in (0, 1)}
    assert r.returncode == 0, logs[0][-3000:] + logs[1][-3000:]
    assert "data-parallel ranks = 2" in logs[0] and "trainable params:" in logs[0]
    assert os.path.exists(out / "adapter_config.json") and not os.path.exists(out / "model.safetensors")
    import peft
    import transformers
    from paddletune.models import resolve_model_path

    base = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_path("paddletune/tiny-llama"))
    model = peft.PeftModel.from_pretrained(base, str(out))
    assert any("lora_B" in n and float(p.abs().sum()) > 0 for n, p in model.named_parameters())
