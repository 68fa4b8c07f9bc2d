"""LoRA: trainable set, HF-PEFT files read by torch peft (and the reverse), in-model merge, learning,
exact resume, bad input. Oracles: torch peft on the transformers model, the unmerged model,
hand-computed parameter counts, the uninterrupted run, the copy task."""
import json
import logging
import os

import numpy as np
import pytest

from peft_util import tiny, randomize, ids, run as logits
from conftest import copy_pairs, hf_checkpoint, rel_err, token_accuracy, training_args
from paddletune import peft
from paddletune.args import ArgumentError, ModelArgument, build
from paddletune.loading import load_model
from paddletune.peft import lora
from paddletune.trainer import Trainer
from paddletune.trainer.checkpoint import load_checkpoint, read_tensors


def margs(**kw):
    return ModelArgument(model_name_or_path=kw.pop("model_name_or_path", "paddletune/tiny-llama"),
                         lora=True, **kw)


def test_trainable_names_and_count():
    model = tiny()
    setup = peft.apply(model, margs(lora_rank=4))
    H, I, KV = 64, 512, 2 * 16
    dims = {"q_proj": (H, H), "k_proj": (H, KV), "v_proj": (H, KV), "o_proj": (H, H),
            "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}
    expect = {}
    for layer in range(2):
        for mod, (i, o) in dims.items():
            part = "self_attn" if mod.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            name = f"model.layers.{layer}.{part}.{mod}"
            expect[f"{name}.lora_A.weight"] = [i, 4]
            expect[f"{name}.lora_B.weight"] = [4, o]
    assert {n: list(p.shape) for n, p in setup.trainable.items()} == expect
    assert sum(int(np.prod(s)) for s in expect.values()) == 2 * 4 * sum(i + o for i, o in dims.values())
    # only adapters get gradients: every base parameter is frozen
    assert all(p.stop_gradient == (n not in expect) for n, p in model.named_parameters())
    assert setup.lr_scales is None


def test_fresh_adapter_is_identity_and_lora_plus_scales():
    model = tiny()
    base = logits(model, ids())
    setup = peft.apply(model, margs(lora_rank=4, lora_plus_scale=16.0))
    assert rel_err(logits(model, ids()), base) == 0.0
    assert setup.lr_scales == {n: 16.0 for n in setup.trainable if ".lora_B." in n}


@pytest.mark.parametrize("kw", [dict(lora_rank=4, lora_alpha=12),
                                dict(lora_rank=4, lora_alpha=8, rslora=True,
                                     lora_target_modules=[r".*\.q_proj$", r".*layers\.1\.mlp\.down_proj$"])])
def test_torch_peft_loads_our_adapter(tmp_path, kw):
    import torch
    from peft import PeftModel

    path, hf_model = hf_checkpoint(tmp_path / "base")
    model = load_model(path)
    setup = peft.apply(model, margs(model_name_or_path=path, **kw))
    randomize(setup.trainable)
    setup.export_fn(str(tmp_path / "adapter"))
    conf = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert conf["peft_type"] == "LORA" and conf["base_model_name_or_path"] == os.path.abspath(path)
    x = ids()
    ours = logits(model, x)
    pm = PeftModel.from_pretrained(hf_model, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        theirs = pm(torch.tensor(x)).logits.numpy()
    assert rel_err(ours, theirs) < 1e-4
    # and the adapter actually matters (the comparison is not base vs base)
    assert rel_err(logits(load_model(path), x), theirs) > 1e-2


def test_we_load_torch_peft_adapter_and_merge_like_peft(tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model

    path, hf_model = hf_checkpoint(tmp_path / "base", seed=2)
    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"],
                     init_lora_weights=False, task_type="CAUSAL_LM")
    pm = get_peft_model(hf_model, cfg).eval()
    pm.save_pretrained(str(tmp_path / "torch_adapter"))
    x = ids()
    with torch.no_grad():
        theirs = pm(torch.tensor(x)).logits.numpy()
    model = peft.load_adapter(load_model(path), lora_path=str(tmp_path / "torch_adapter"))
    assert len(lora.lora_layers(model)) == 2 * 3
    assert rel_err(logits(model, x), theirs) < 1e-4
    # file merge vs torch peft's merge_and_unload, tensor by tensor
    out = peft.merge_lora(str(tmp_path / "torch_adapter"), str(tmp_path / "merged"), base_path=path)
    merged = read_tensors(os.path.join(out, "model.safetensors"))
    ref = {k: v.numpy() for k, v in pm.merge_and_unload().state_dict().items()}
    for k, v in merged.items():
        assert rel_err(v, ref[k]) < 1e-6, k


def test_save_load_and_in_model_merge(tmp_path):
    model = tiny()
    setup = peft.apply(model, margs(lora_rank=4, lora_dropout=0.2))
    randomize(setup.trainable)
    x = ids()
    unmerged = logits(model, x)
    setup.export_fn(str(tmp_path / "a"))
    again = peft.load_adapter(tiny(), lora_path=str(tmp_path / "a"))
    assert rel_err(logits(again, x), unmerged) < 1e-6
    # eval() never merges; merge() does, and changes nothing numerically
    w_before = model.model.layers[0].self_attn.q_proj.base_layer.weight.numpy().copy()
    model.eval()
    assert not any(m.merged for m in lora.lora_layers(model).values())
    assert np.array_equal(model.model.layers[0].self_attn.q_proj.base_layer.weight.numpy(), w_before)
    lora.merge(model)
    assert rel_err(logits(model, x), unmerged) < 1e-5
    lora.unmerge(model)
    assert rel_err(model.model.layers[0].self_attn.q_proj.base_layer.weight.numpy(), w_before) < 1e-6


def test_copy_task_reaches_full_accuracy(tmp_path):
    model = tiny()
    data = copy_pairs()
    assert token_accuracy(model, data) < 0.2
    setup = peft.apply(model, margs(lora_rank=8))
    Trainer(model, training_args(tmp_path, max_steps=60), train_dataset=data,
            trainable=setup.trainable, export_fn=lambda d: None).train()
    assert token_accuracy(model, data) == 1.0


def test_start_line_counts(tmp_path):
    model = tiny()
    setup = peft.apply(model, margs(lora_rank=4))
    n_base = sum(int(np.prod(p.shape)) for n, p in model.named_parameters() if n not in setup.trainable)
    n_lora = 2 * 4 * (128 + 96 + 96 + 128 + 576 + 576 + 576)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())
    log = logging.getLogger("paddletune")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        Trainer(model, training_args(tmp_path, max_steps=1), train_dataset=copy_pairs(),
                trainable=setup.trainable, export_fn=lambda d: None).train()
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    want = "trainable params: {:,} / {:,} ({:.2%})".format(n_lora, n_base + n_lora,
                                                           n_lora / (n_base + n_lora))
    assert want in lines


def _train(out, ga, resume=None):
    model = tiny()
    setup = peft.apply(model, margs(lora_rank=4, lora_dropout=0.1))
    args = training_args(out, max_steps=6, save_strategy="steps", save_steps=2, logging_steps=1,
                         per_device_train_batch_size=8 // ga, gradient_accumulation_steps=ga,
                         resume_from_checkpoint=resume, learning_rate=3e-3)
    tr = Trainer(model, args, train_dataset=copy_pairs(), trainable=setup.trainable,
                 export_fn=setup.export_fn)
    tr.train()
    losses = {r["step"]: r["loss"] for r in tr.state["log_history"] if "loss" in r}
    return losses, {n: p.numpy().copy() for n, p in setup.trainable.items()}


@pytest.mark.parametrize("ga", [1, 2])
def test_resume_is_exact(tmp_path, ga):
    full_losses, full_w = _train(tmp_path / "full", ga)
    ck = tmp_path / "full" / "checkpoint-2"
    saved = load_checkpoint(str(ck))[0]
    assert set(saved) == set(full_w)                      # adapter-only checkpoint
    res_losses, res_w = _train(tmp_path / "resumed", ga, resume=str(ck))
    assert sorted(res_losses) == [1, 2, 3, 4, 5, 6]     # history 1-2 comes from the checkpoint
    for s in res_losses:
        assert abs(res_losses[s] - full_losses[s]) <= 1e-6, s
    for n in full_w:
        assert np.abs(res_w[n] - full_w[n]).max() <= 1e-6, n
    assert os.path.exists(tmp_path / "resumed" / "adapter_model.safetensors")


# ------------------------------------------------------------------------------ bad input

def test_bad_arguments():
    base = {"model_name_or_path": "m", "dataset_name_or_path": "d", "output_dir": "o"}
    with pytest.raises(ArgumentError, match="prefix_tuning.*cannot be combined with lora"):
        build(dict(base, lora=True, prefix_tuning=True))
    with pytest.raises(ArgumentError, match="lora_rank.*must be positive, got 0"):
        build(dict(base, lora=True, lora_rank=0))
    with pytest.raises(ArgumentError, match="lora_rank.*must be positive, got -2"):
        build(dict(base, lora_path="x", lora_rank=-2))    # lora_path implies lora
    with pytest.raises(AssertionError, match="lora_rank must be positive"):
        peft.apply(tiny(), margs(lora_rank=0))


def test_target_regex_matching_nothing():
    model = tiny()
    with pytest.raises(ValueError, match=r"lora_target_modules: 'q_proj' matches no module.*\.q_proj\$"):
        peft.apply(model, margs(lora_target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="not a Linear layer"):
        peft.apply(tiny(), margs(lora_target_modules=[r".*\.self_attn$"]))


def test_adapter_of_other_shapes_is_refused(tmp_path):
    setup = peft.apply(tiny(), margs(lora_rank=4))
    setup.export_fn(str(tmp_path / "a"))
    other = tiny(intermediate_size=256)
    with pytest.raises(ValueError, match="base model of other shapes"):
        peft.load_adapter(other, lora_path=str(tmp_path / "a"))
    assert not lora.lora_layers(other)                  # nothing was changed
    with pytest.raises(ValueError, match="base model of other shapes"):
        peft.apply(tiny(intermediate_size=256), margs(lora_path=str(tmp_path / "a")))


def test_script_refuses_bad_target_before_training(tmp_path):
    from conftest import run_script

    out = tmp_path / "out"
    r = run_script(["llm/finetune_generation.py", "llm/llama/lora_argument.json", "--output_dir",
                    str(out), "--lora_target_modules", "q_proj"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert "lora_target_modules: 'q_proj' matches no module" in r.stderr
    assert not out.exists()
