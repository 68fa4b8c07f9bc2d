"""Generation eval inside fine-tuning: a memorisation task whose answers are checkable
(after training, greedy answers equal the targets -> BLEU-4 = ROUGE = 1), generated_output.json,
metric_for_best_model=bleu4, and argument checks."""
import json
import os
import random

import numpy as np
import pytest
from conftest import load_script, write_jsonl

from paddletune.args import ArgumentError, parse_args
from paddletune.trainer.metrics import generation_metrics, split_source_target

WORDS = "apple river stone cloud green house music paper light dream garden silver".split()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from paddletune.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("geneval")
    ckpt = make_tiny_checkpoint(str(root / "model"), "llama", seed=0, hidden_size=64,
                                intermediate_size=128, num_hidden_layers=2)
    rng = random.Random(0)
    rows = [{"src": f"item {i}:", "tgt": " ".join(rng.choice(WORDS) for _ in range(6))} for i in range(8)]
    write_jsonl(str(root / "data" / "train.json"), rows)
    write_jsonl(str(root / "data" / "dev.json"), rows)
    return ckpt, str(root / "data"), rows


def test_split_source_target():
    ex = {"input_ids": np.array([1, 7, 8, 9, 10, 2]), "labels": np.array([-100, -100, -100, 9, 10, 2])}
    assert split_source_target(ex, {2}) == ([1, 7, 8], [9, 10])
    two = {"input_ids": np.array([1, 5, 6, 2, 7, 8, 2]), "labels": np.array([-100, -100, 6, 2, -100, 8, 2])}
    assert split_source_target(two, {2}) == ([1, 5, 6, 2, 7], [8])   # the last round's answer


def test_finetune_with_generation_eval_reaches_exact_answers(setup, tmp_path):
    ckpt, data, rows = setup
    ft = load_script("llm/finetune_generation.py")
    out = str(tmp_path / "out")
    rc = ft.main(["--model_name_or_path", ckpt, "--dataset_name_or_path", data, "--output_dir", out,
                  "--do_train", "true", "--do_eval", "true", "--max_steps", "60",
                  "--learning_rate", "0.01", "--warmup_steps", "0", "--lr_scheduler_type", "constant",
                  "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "4",
                  "--evaluation_strategy", "steps", "--eval_steps", "10", "--save_strategy", "steps",
                  "--save_steps", "10", "--logging_steps", "10", "--disable_tqdm", "true",
                  "--eval_with_do_generation", "true", "--save_generation_output", "true",
                  "--max_new_tokens", "12", "--metric_for_best_model", "bleu4",
                  "--load_best_model_at_end", "true", "--src_length", "16", "--max_length", "48"])
    assert rc == 0
    logs = [json.loads(l) for l in open(os.path.join(out, "train_log.jsonl"))]
    evals = [r for r in logs if "eval_bleu4" in r]
    assert evals[0]["eval_bleu4"] < 0.5 and evals[0]["step"] == 10    # untrained answers are wrong
    assert len(evals) >= 2 and {"eval_rouge1", "eval_rouge2", "eval_rougel", "eval_loss"} <= set(evals[-1])
    assert evals[-1]["eval_bleu4"] == 1.0 and evals[-1]["eval_rougel"] == 1.0
    saved = [json.loads(l) for l in open(os.path.join(out, "generated_output.json"))]
    assert [r["tgt"] for r in saved] == [r["tgt"] for r in rows]
    assert [r["output"] for r in saved] == [r["tgt"] for r in rows]      # exact answers
    assert [r["src"] for r in saved] == [r["src"] for r in rows]
    # the logged scores are the scores of the saved outputs
    m = generation_metrics([r["output"] for r in saved], [r["tgt"] for r in saved])
    assert m["bleu4"] == pytest.approx(evals[-1]["eval_bleu4"], abs=1e-6)


BASE = ["--model_name_or_path", "m", "--dataset_name_or_path", "d", "--output_dir", "o", "--do_eval", "true"]


@pytest.mark.parametrize("extra,msg", [
    (["--save_generation_output", "true"], "needs eval_with_do_generation"),
    (["--temperature", "0"], "temperature' must be > 0"),
    (["--top_p", "1.5"], "top_p' must be in"),
    (["--max_new_tokens", "0"], "max_new_tokens"),
    (["--metric_for_best_model", "rouge2"], "needs eval_with_do_generation"),
])
def test_generation_argument_errors(extra, msg):
    with pytest.raises(ArgumentError, match=msg):
        parse_args(BASE + extra)
    parse_args(BASE + ["--eval_with_do_generation", "true", "--save_generation_output", "true",
                       "--metric_for_best_model", "rougel"])


def test_generation_eval_without_evaluation_is_unused():
    """PaddleNLP's long-context files set eval_with_do_generation with no evaluation at all: it
    has no effect there (warned), as in PaddleNLP."""
    seen = []
    parse_args(BASE + ["--eval_with_do_generation", "true", "--do_eval", "false"], warn=seen.append)
    assert any("eval_with_do_generation: true' has no effect" in w for w in seen)


@pytest.mark.parametrize("method", [["--lora", "true", "--lora_rank", "8"],
                                    ["--prefix_tuning", "true", "--num_prefix_tokens", "4"]])
def test_generation_eval_with_peft_methods(setup, tmp_path, method):
    """Generation eval runs on the PEFT-wrapped model (LoRA layers / prefix encoder) and the
    logged scores are those of the saved outputs."""
    ckpt, data, rows = setup
    ft = load_script("llm/finetune_generation.py")
    out = str(tmp_path / "out")
    rc = ft.main(["--model_name_or_path", ckpt, "--dataset_name_or_path", data, "--output_dir", out,
                  "--do_train", "true", "--do_eval", "true", "--max_steps", "5", "--learning_rate", "0.01",
                  "--per_device_train_batch_size", "8", "--save_strategy", "no", "--logging_steps", "5",
                  "--disable_tqdm", "true", "--eval_with_do_generation", "true",
                  "--save_generation_output", "true", "--max_new_tokens", "6", "--src_length", "16",
                  "--max_length", "48"] + method)
    assert rc == 0
    logs = [json.loads(l) for l in open(os.path.join(out, "train_log.jsonl"))]
    final = [r for r in logs if "eval_bleu4" in r][-1]
    saved = [json.loads(l) for l in open(os.path.join(out, "generated_output.json"))]
    assert len(saved) == len(rows)
    m = generation_metrics([r["output"] for r in saved], [r["tgt"] for r in saved])
    assert all(m[k] == pytest.approx(final["eval_" + k], abs=1e-6) for k in m)
