"""llm/<family>/*_argument.json run end to end (2 steps, in process) on the family's built-in tiny
model and sample data. The LoRA run's adapter has the family's default targets; for families that
transformers has, torch peft loads the adapter onto transformers' model of the same built-in
checkpoint (GPT-2: onto its Conv1D layers) and gives our adapted model's logits."""
import json
import os

import numpy as np
import paddle
import pytest
import torch

from conftest import ROOT, load_script, rel_err

FAMILIES = {   # folder -> (built-in model, LoRA target module names, transformers has it)
    "qwen3": ("paddletune/tiny-qwen3", ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                        "up_proj", "v_proj"], True),
    "gpt-3": ("paddletune/tiny-gpt2", ["c_attn", "c_fc", "c_proj"], True),
    "opt": ("paddletune/tiny-opt", ["fc1", "fc2", "k_proj", "out_proj", "q_proj", "v_proj"], True),
    "bloom": ("paddletune/tiny-bloom", ["dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"], True),
    "baichuan2": ("paddletune/tiny-baichuan2", ["W_pack", "down_proj", "gate_proj", "o_proj", "up_proj"], False),
    "qwen": ("paddletune/tiny-qwen", ["c_attn", "c_proj", "w1", "w2"], False),
}


def run(folder, name, out):
    argv = [os.path.join(ROOT, "llm", folder, f"{name}_argument.json"), f"--output_dir={out}",
            "--max_steps=2", "--src_length=64", "--max_length=128", "--per_device_train_batch_size=2",
            "--per_device_eval_batch_size=4", "--max_evaluate_steps=1", "--logging_steps=1",
            "--disable_tqdm=true"]
    assert load_script("llm/finetune_generation.py").main(argv) == 0
    log = [json.loads(line) for line in open(os.path.join(out, "train_log.jsonl"))]
    assert [e["step"] for e in log if "loss" in e] == [1, 2]


@pytest.mark.parametrize("folder", list(FAMILIES))
def test_lora_file_runs_and_torch_peft_loads_the_adapter(tmp_path, folder):
    from paddletune import peft
    from paddletune.models import resolve_model_path
    from paddletune.loading import load_model

    builtin, targets, in_transformers = FAMILIES[folder]
    conf = json.load(open(os.path.join(ROOT, "llm", folder, "lora_argument.json")))
    assert conf["model_name_or_path"] == builtin and conf["lora"] is True
    out = str(tmp_path / "out")
    run(folder, "lora", out)
    adapter = json.load(open(os.path.join(out, "adapter_config.json")))
    assert adapter["peft_type"] == "LORA" and sorted(adapter["target_modules"]) == targets
    x = np.random.default_rng(0).integers(3, 500, (2, 9))
    ours = peft.load_adapter(load_model(builtin), lora_path=out)
    with paddle.no_grad():
        want = ours(paddle.to_tensor(x)).logits.numpy()
        plain = load_model(builtin)(paddle.to_tensor(x)).logits.numpy()
    assert rel_err(want, plain) > 1e-3    # the adapter is not the identity
    if in_transformers:
        import transformers
        from peft import PeftModel

        base = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_path(builtin))
        hf = PeftModel.from_pretrained(base, out).eval()
        with torch.no_grad():
            got = hf(torch.tensor(x)).logits.numpy()
        assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("folder", list(FAMILIES))
def test_sft_file_runs(tmp_path, folder):
    """Full fine-tuning: the export has the family's architecture and loads back (in our loader;
    in transformers too where it has the family) with the trained model's logits."""
    from paddletune.models import get_spec
    from paddletune.loading import load_model

    out = str(tmp_path / "out")
    run(folder, "sft", out)
    saved = json.load(open(os.path.join(out, "config.json")))
    assert tuple(saved["architectures"]) == get_spec(saved["model_type"]).architectures
    x = np.random.default_rng(1).integers(3, 500, (2, 9))
    with paddle.no_grad():
        ours = load_model(out)(paddle.to_tensor(x)).logits.numpy()
    if FAMILIES[folder][2]:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            assert rel_err(hf(torch.tensor(x)).logits.numpy(), ours) <= 1e-5
