"""llm/chatglm2/*_argument.json run end to end on the built-in tiny ChatGLM2 (a few steps), and
tools/make_tiny_checkpoint.py is deterministic."""
import json
import os

import numpy as np

from conftest import ROOT, load_script, run_script


def test_make_tiny_checkpoint_is_deterministic(tmp_path):
    tool = load_script("tools/make_tiny_checkpoint.py")
    outs = [str(tmp_path / f"t{i}") for i in range(3)]
    for out, seed in zip(outs, (0, 0, 1)):
        assert tool.main(["--model_type", "chatglm", "--output", out, "--seed", str(seed)]) == 0
    read = lambda p, f: open(os.path.join(p, f), "rb").read()  # noqa: E731
    for f in ("model.safetensors", "config.json", "tokenizer.model", "tokenizer_config.json"):
        assert read(outs[0], f) == read(outs[1], f), f
    assert read(outs[0], "model.safetensors") != read(outs[2], "model.safetensors")
    conf = json.load(open(os.path.join(outs[0], "config.json")))
    assert conf["model_type"] == "chatglm" and conf["padded_vocab_size"] == 605
    assert tool.main(["--builtin", "paddletune/tiny-chatglm2", "--output", str(tmp_path / "b")]) == 0
    assert json.load(open(tmp_path / "b" / "config.json"))["num_layers"] == 4


def run_args(name, tmp_path, *extra):
    out = str(tmp_path / name)
    res = run_script(["llm/finetune_generation.py", f"llm/chatglm2/{name}_argument.json",
                      "--output_dir", out, "--max_steps", "6", "--logging_steps", "3",
                      "--evaluation_strategy", "steps", "--save_strategy", "steps",
                      "--eval_steps", "6", "--save_steps", "6", "--max_evaluate_steps", "2",
                      "--disable_tqdm", "true", *extra])
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res


def test_sft_argument_file_runs(tmp_path):
    conf = json.load(open(os.path.join(ROOT, "llm", "chatglm2", "sft_argument.json")))
    assert conf["model_name_or_path"] == "paddletune/tiny-chatglm2"
    # PaddleNLP's stage3 over all ranks: one process runs it with sharding warned off
    assert conf["sharding"] == "stage3" and conf["sharding_parallel_degree"] == -1
    out, res = run_args("sft", tmp_path)
    assert "has no effect with one sharding rank" in res.stdout + res.stderr
    saved = json.load(open(os.path.join(out, "config.json")))
    assert saved["model_type"] == "chatglm" and os.path.exists(os.path.join(out, "tokenizer.model"))
    from paddletune.loading import load_tokenizer   # the ChatGLM2 prompt format travels with the model
    tok = load_tokenizer(out)
    assert type(tok).__name__ == "ChatGLMTokenizer"
    assert tok.apply_chat_template("hi", add_generation_prompt=True, tokenize=False) == "[Round 1]\n\n问：hi\n\n答："
    logs = [json.loads(l) for l in open(os.path.join(out, "train_log.jsonl"))]
    losses = [r["loss"] for r in logs if "loss" in r]
    assert len(losses) == 2 and np.isfinite(losses).all()


def test_lora_argument_file_runs(tmp_path):
    out, _ = run_args("lora", tmp_path)
    conf = json.load(open(os.path.join(out, "adapter_config.json")))
    from paddletune.models import resolve_model_path

    assert conf["peft_type"] == "LORA"   # a built-in base by its portable name (issue 34), also beside it
    assert conf["base_model_name_or_path"] == "paddletune/tiny-chatglm2" and resolve_model_path("paddletune/tiny-chatglm2")
    assert json.load(open(os.path.join(out, "paddletune_base_model.json"))) == {
        "paddletune_base_model": "paddletune/tiny-chatglm2"}
    assert sorted(conf["target_modules"]) == ["dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"]
    assert not os.path.exists(os.path.join(out, "model.safetensors"))   # the adapter only


def test_pt_argument_file_runs(tmp_path):
    out, _ = run_args("pt", tmp_path)
    conf = json.load(open(os.path.join(out, "adapter_config.json")))
    # 4 blocks x multi_query_group_num 2 key/value heads x kv_channels 32 (the built-in model)
    assert conf["peft_type"] == "PREFIX_TUNING" and conf["num_virtual_tokens"] == 16
    assert (conf["num_layers"], conf["num_attention_heads"], conf["token_dim"]) == (4, 2, 64)
