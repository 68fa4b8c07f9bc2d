"""QLoRA: LoRA adapters trained on a quantized (frozen) backbone, merged into the ORIGINAL
full-precision weights, and the two argument files run end to end.

Oracles: the copy task (100% greedy accuracy on 16 random-token pairs); the merged checkpoint
read back by the `safetensors` library and compared with W + s * B @ A computed in numpy from the
base checkpoint and the adapter file (not from dequantized weights: those differ by ~10%).
"""
import json
import os

import numpy as np
import pytest

from conftest import copy_pairs, hf_checkpoint, run_script, token_accuracy, training_args


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    path, _ = hf_checkpoint(tmp_path_factory.mktemp("qlora_base"))
    return path


@pytest.mark.parametrize("algo", ["nf4", "weight_only_int8"])
def test_qlora_copy_task_and_merge_into_original_weights(base_ckpt, algo, tmp_path):
    from safetensors.numpy import load_file

    from paddletune import peft
    from paddletune.args import ModelArgument
    from paddletune.loading import load_model
    from paddletune.quant import QuantConfig, QuantizedLinear
    from paddletune.trainer import Trainer

    model = load_model(base_ckpt, quant=QuantConfig(algo, 64, True))
    margs = ModelArgument(model_name_or_path=base_ckpt, lora=True, lora_rank=8)
    setup = peft.apply(model, margs)
    bases = [m.base_layer for n, m in model.named_sublayers() if hasattr(m, "base_layer")]
    assert len(bases) == 14 and all(isinstance(b, QuantizedLinear) for b in bases)
    assert all(".lora_" in n for n in setup.trainable)
    data = copy_pairs()
    assert token_accuracy(model, data) < 0.1
    out = tmp_path / "run"
    trainer = Trainer(model, training_args(out, max_steps=100), train_dataset=data,
                      trainable=setup.trainable, export_fn=setup.export_fn)
    trainer.train()
    acc = token_accuracy(model, data)
    assert acc == 1.0, acc

    merged = str(tmp_path / "merged")
    peft.merge_lora(str(out), merged)
    conf = json.load(open(out / "adapter_config.json"))
    assert conf["base_model_name_or_path"] == base_ckpt
    scale = conf["lora_alpha"] / conf["r"]
    adapter = load_file(str(out / "adapter_model.safetensors"))
    base = load_file(os.path.join(base_ckpt, "model.safetensors"))
    got = load_file(os.path.join(merged, "model.safetensors"))
    assert set(got) == set(base)
    n_merged = 0
    for name, w in base.items():
        key = "base_model.model." + name[:-len(".weight")]
        if key + ".lora_A.weight" in adapter:
            A, B = adapter[key + ".lora_A.weight"], adapter[key + ".lora_B.weight"]
            expect = w.astype(np.float64) + scale * (B.astype(np.float64) @ A.astype(np.float64))
            n_merged += 1
        else:
            expect = w
        assert got[name].dtype == np.float32
        np.testing.assert_allclose(got[name], expect, rtol=1e-5, atol=1e-6, err_msg=name)
    assert n_merged == 14
    # the merged full-precision model: print its copy accuracy (the adapter was trained to
    # compensate the quantization error, so it may differ from the quantized model's)
    full = load_model(merged)
    print(f"{algo}: QLoRA accuracy {acc:.3f}; merged full-precision model {token_accuracy(full, data):.3f}")


@pytest.mark.parametrize("argfile", ["qlora_argument.json", "wint8_lora_argument.json"])
def test_argument_files_end_to_end(argfile, tmp_path):
    out = tmp_path / "out"
    proc = run_script([os.path.join("llm", "finetune_generation.py"),
                       os.path.join("llm", "llama", argfile), "--output_dir", str(out),
                       "--max_steps", "12", "--logging_steps", "4", "--max_evaluate_steps", "2",
                       "--disable_tqdm", "true"])
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "whole model" in log and "quantized backbone" in log
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    assert not (out / "model.safetensors").exists()
    conf = json.load(open(out / "adapter_config.json"))
    assert conf["peft_type"] == "LORA" and conf["base_model_name_or_path"] == "paddletune/tiny-llama"
    merged = tmp_path / "merged"
    proc = run_script([os.path.join("llm", "merge_lora_params.py"), "--lora_path", str(out),
                       "--merge_lora_model_path", str(merged)])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (merged / "config.json").exists() and (merged / "model.safetensors").exists()
