"""Mixture-of-Experts (Mixtral, Qwen2-MoE) against transformers (torch CPU, fp32) on tiny random
checkpoints that transformers saved (its per-expert layout) or that hold its fused in-memory
layout (experts.gate_up_proj / down_proj): logits, the load-balancing auxiliary loss and the
training loss that includes it (with the router's gradient), the export loading back in
transformers, LoRA on experts + router learning copy pairs, the argument files, and the
refusals (tensor / pipeline parallel, capacity-limited routing)."""
import json
import os

import numpy as np
import paddle
import pytest
import torch

from conftest import ROOT, lm_loss, rel_err
from family_util import hf_family
from paddletune.models import save_pretrained
from paddletune.loading import load_model

CASES = {   # name -> (kind, config overrides)
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    # renormalised top-k weights; layer 1 dense (mlp_only_layers)
    "qwen2_moe_norm_topk_mlp_only": ("qwen2_moe", dict(norm_topk_prob=True, mlp_only_layers=[1])),
    # decoder_sparse_step 2: layers 1 sparse, 0 and 2 dense; no shared expert
    "qwen2_moe_step2_no_shared": ("qwen2_moe", dict(decoder_sparse_step=2,
                                                    shared_expert_intermediate_size=0)),
}


def ids_for(seq, batch=2, seed=0):
    return np.random.RandomState(seed).randint(3, 600, (batch, seq))


def write_fused(ref_model, src, dst):
    """The torch model's own state dict (transformers 5's fused expert tensors) as a checkpoint."""
    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    state = {k: v.contiguous() for k, v in ref_model.state_dict().items()}
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            os.system(f"cp {os.path.join(src, name)} {dst}/")
    return sorted(state)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tmp_path, name):
    kind, cfg = CASES[name]
    path, ref_model = hf_family(tmp_path / "ck", kind, **cfg)
    ids = ids_for(24)
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids)).logits.numpy()
    model = load_model(path)
    out = model(paddle.to_tensor(ids)).logits.numpy()
    assert rel_err(out, ref) <= 1e-4, (name, rel_err(out, ref))
    sparse = [i for i, b in enumerate(model.model.layers) if b.sparse]
    want = {"qwen2_moe_norm_topk_mlp_only": [0, 2], "qwen2_moe_step2_no_shared": [1]}
    assert sparse == want.get(name, list(range(len(model.model.layers))))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_fused_expert_layout_loads(tmp_path, kind):
    """A checkpoint in transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I], mlp.gate) loads as the per-expert tensors: same logits, no tensor
    unused; transformers itself loads the same file to the same logits."""
    import transformers

    path, ref_model = hf_family(tmp_path / "ck", kind, seed=1)
    names = write_fused(ref_model, path, str(tmp_path / "fused"))
    assert any(n.endswith("experts.gate_up_proj") for n in names)
    assert not any(".experts.0." in n or "block_sparse_moe" in n for n in names)
    ids = ids_for(16)
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids)).logits.numpy()
    ours = load_model(str(tmp_path / "fused"))(paddle.to_tensor(ids)).logits.numpy()
    assert rel_err(ours, ref) <= 1e-4
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fused")).eval()
    with torch.no_grad():
        assert rel_err(hf(torch.tensor(ids)).logits.numpy(), ref) <= 1e-6


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_aux_loss_and_training_loss_equal_transformers(tmp_path, kind):
    """A right-padded batch with labels: transformers' aux_loss (load_balancing_loss_func over the
    real tokens) and loss (CE + router_aux_loss_coef x aux) equal ours (the Trainer's loss
    function, which logs aux_loss), and so does the gradient of a router weight (the aux term's
    gradient reaches the router)."""
    from paddletune.models.loss import lm_loss_for

    path, ref_model = hf_family(tmp_path / "ck", kind, seed=2)
    ids = ids_for(20, batch=3, seed=4)
    am = np.ones_like(ids)
    am[1, 13:] = 0
    am[2, 7:] = 0
    labels = np.where(am == 1, ids, -100)
    labels[:, :3] = -100
    ref_model.train()
    ref = ref_model(torch.tensor(ids), attention_mask=torch.tensor(am), labels=torch.tensor(labels))
    ref.loss.backward()
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    ref_grad = ref_model.model.layers[0].mlp.gate.weight.grad.numpy()   # [E, H]

    model = load_model(path)
    model.train()
    loss_fn = lm_loss_for(model)
    assert "attention_mask" in loss_fn.batch_keys and "aux_loss" in loss_fn.metric_names
    batch = {k: paddle.to_tensor(v) for k, v in
             dict(input_ids=ids, labels=labels, attention_mask=am).items()}
    out = loss_fn(model, batch)
    aux, want = float(out.metrics["aux_loss"][0]), float(ref.aux_loss.detach())
    assert abs(aux - want) <= 1e-5 * max(1.0, abs(want)), (aux, want)   # (measured <= 3e-7)
    assert abs(float(out.loss) - float(ref.loss)) <= 1e-5 * float(ref.loss)
    coef = model.config.moe["aux_coef"]
    assert coef * aux > 1e-3 * float(out.loss)   # the aux term is not negligible here
    out.loss.backward()
    grad = getattr(model.model.layers[0], block).gate.weight.grad.numpy().T   # paddle [H, E]
    assert rel_err(grad, ref_grad) <= 1e-4
    # without the padding mask the statistics differ: the mask is really used
    no_mask = lm_loss(model, ids, labels)
    assert abs(float(no_mask.metrics["aux_loss"][0]) - aux) > 1e-6


def test_aux_loss_off_when_config_says_so(tmp_path):
    """output_router_logits false (transformers' default): the loss is the plain CE."""
    path, ref_model = hf_family(tmp_path / "ck", "mixtral", output_router_logits=False)
    ids = ids_for(12)
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids), labels=torch.tensor(ids)).loss.item()
    model = load_model(path)
    out = lm_loss(model, ids, ids)
    assert out.metrics is None and abs(float(out.loss) - ref) <= 1e-5 * ref


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_export_is_transformers_layout_and_loads_there(tmp_path, kind):
    """save_pretrained writes the tensor names transformers 5 itself writes (per-expert layout,
    which transformers 4 reads too), and transformers loads them to our logits."""
    import transformers
    from paddletune.models.hf import SafetensorsFile

    path, _ = hf_family(tmp_path / "ck", kind, seed=3)
    model = load_model(path)
    out = str(tmp_path / "out")
    save_pretrained(model, out)
    theirs = SafetensorsFile(os.path.join(path, "model.safetensors"))
    mine = SafetensorsFile(os.path.join(out, "model.safetensors"))
    assert sorted(mine.keys()) == sorted(theirs.keys())
    assert all(mine.shape(k) == theirs.shape(k) for k in mine.keys())
    ids = ids_for(12)
    ours = model(paddle.to_tensor(ids)).logits.numpy()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert rel_err(hf(torch.tensor(ids)).logits.numpy(), ours) <= 1e-5


@pytest.mark.parametrize("model_type,router", [("mixtral", r".*\.block_sparse_moe\.gate$"),
                                               ("qwen2_moe", r".*\.mlp\.gate$")])
def test_lora_learns_copy_pairs(tmp_path, model_type, router):
    """16 random-token copy pairs, LoRA r=8 on the default targets (attention, every expert, the
    shared expert) plus the router, aux loss on: greedy accuracy reaches 100%."""
    from conftest import copy_pairs, token_accuracy, training_args
    from paddletune import peft
    from paddletune.args import ModelArgument
    from paddletune.models import build_model, get_spec
    from paddletune.trainer import Trainer

    spec = get_spec(model_type)
    paddle.seed(0)
    model = build_model(dict(spec.tiny_config, vocab_size=600, initializer_range=0.1), seed=0)
    data = copy_pairs()
    assert token_accuracy(model, data) < 0.2
    targets = list(spec.lora_targets) + [router]
    setup = peft.apply(model, ModelArgument(model_name_or_path="unused", lora=True, lora_rank=8,
                                            lora_target_modules=targets))
    assert setup.trainable and all("lora_" in n for n in setup.trainable)
    wrapped = {n.rsplit(".lora_", 1)[0] for n in setup.trainable}
    assert any(".experts.3." in n for n in wrapped) and any(n.endswith(".gate") for n in wrapped)
    tr = Trainer(model, training_args(tmp_path, max_steps=60), train_dataset=data,
                 trainable=setup.trainable, export_fn=lambda d: None)
    tr.train()
    assert token_accuracy(model, data) == 1.0
    logged = [e for e in tr.state["log_history"] if "aux_loss" in e]
    assert logged and all(0.9 < e["aux_loss"] < 4.0 for e in logged)   # E x sum f P: 1 = balanced


def run_file(folder, name, out):
    from conftest import load_script

    argv = [os.path.join(ROOT, "llm", folder, f"{name}_argument.json"), f"--output_dir={out}",
            "--max_steps=2", "--src_length=64", "--max_length=128", "--per_device_train_batch_size=2",
            "--per_device_eval_batch_size=4", "--max_evaluate_steps=1", "--logging_steps=1",
            "--disable_tqdm=true"]
    assert load_script("llm/finetune_generation.py").main(argv) == 0
    return [json.loads(line) for line in open(os.path.join(out, "train_log.jsonl"))]


# torch peft 0.21 converts a per-expert LoRA (experts.N.w1/w3/w2) onto transformers 5's fused
# Mixtral experts; for Qwen2-MoE it has no such conversion and drops the routed experts' LoRA
# (attention and shared-expert LoRA load), so only Mixtral's adapter is compared there
@pytest.mark.parametrize("folder,builtin,peft_loads", [("mixtral", "paddletune/tiny-mixtral", True),
                                                       ("qwen2moe", "paddletune/tiny-qwen2moe", False)])
def test_argument_files_run(tmp_path, folder, builtin, peft_loads):
    """llm/<moe>/lora_argument.json and sft_argument.json run 2 steps on the built-in tiny MoE;
    the log carries aux_loss; the LoRA adapter wraps experts (Mixtral's: torch peft loads it onto
    transformers' model to our adapted logits); the SFT export loads in transformers with the
    trained model's logits."""
    import transformers
    from paddletune import peft
    from paddletune.models import resolve_model_path

    x = np.random.default_rng(0).integers(3, 500, (2, 9))
    out = str(tmp_path / "lora")
    log = run_file(folder, "lora", out)
    steps = [e for e in log if "loss" in e and "eval_loss" not in e]
    assert [e["step"] for e in steps] == [1, 2] and all("aux_loss" in e for e in steps)
    assert any("eval_aux_loss" in e and "eval_accuracy" in e for e in log)
    adapter = json.load(open(os.path.join(out, "adapter_config.json")))
    assert adapter["peft_type"] == "LORA"
    ours = peft.load_adapter(load_model(builtin), lora_path=out)
    assert any(".experts.0." in n and "lora_A" in n for n, _ in ours.named_parameters())
    with paddle.no_grad():
        want = ours(paddle.to_tensor(x)).logits.numpy()
        plain = load_model(builtin)(paddle.to_tensor(x)).logits.numpy()
    assert rel_err(want, plain) > 1e-3    # the adapter is not the identity
    if peft_loads:   # torch peft puts the per-expert LoRA onto transformers 5's fused experts
        from peft import PeftModel

        base = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_path(builtin))
        hf = PeftModel.from_pretrained(base, out).eval()
        with torch.no_grad():
            assert rel_err(hf(torch.tensor(x)).logits.numpy(), want) <= 1e-5
    out = str(tmp_path / "sft")
    run_file(folder, "sft", out)
    with paddle.no_grad():
        want = load_model(out)(paddle.to_tensor(x)).logits.numpy()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert rel_err(hf(torch.tensor(x)).logits.numpy(), want) <= 1e-5


def test_refusals(tmp_path):
    """Pipeline parallel names its key (tensor parallel is accepted: tests/test_moe_tp.py); a
    capacity factor (token dropping) and a Mixtral sliding window are refused at config load
    naming the key."""
    from paddletune.models import load_config, resolve_model_path
    from paddletune.parallel.plan import check_layout

    path = resolve_model_path("paddletune/tiny-mixtral")
    spec, cfg = load_config(path)
    check_layout(spec, cfg, 2)   # the MoE tensor-parallel plan: no refusal

    class PP:
        tp_degree, pp_degree = 1, 2
    with pytest.raises(ValueError, match="pipeline_parallel_degree"):
        load_model(path, topology=PP())
    conf = json.load(open(os.path.join(path, "config.json")))
    bad = tmp_path / "bad"
    bad.mkdir()
    json.dump(dict(conf, capacity_factor=1.25), open(bad / "config.json", "w"))
    with pytest.raises(ValueError, match="capacity_factor.*dropless"):
        load_config(str(bad))
    json.dump(dict(conf, sliding_window=4096), open(bad / "config.json", "w"))
    with pytest.raises(ValueError, match="sliding_window=4096"):
        load_config(str(bad))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_recompute_full_keeps_every_gradient(kind):
    """recompute (whole blocks) with the aux loss on: every gradient, the routers' included
    (their aux-loss part flows through the router logits collected inside recomputed blocks),
    equals the run without recompute."""
    from paddletune.models import build_model, get_spec

    x = paddle.to_tensor(np.random.default_rng(0).integers(3, 500, (2, 12)))
    grads = []
    for on in (False, True):
        model = build_model(dict(get_spec(kind).tiny_config, initializer_range=0.1), seed=0)
        model.train()
        model.recompute = on
        lm_loss(model, x, x).loss.backward()
        grads.append({n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1]) and any(n.endswith(".gate.weight") for n in grads[0])
    assert max(rel_err(grads[1][n], grads[0][n]) for n in grads[0]) <= 1e-6


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_greedy_decoding_through_cache_equals_transformers(tmp_path, kind):
    """Prompt in one forward, then one token at a time through the KV cache (each new token
    routed alone): the greedy tokens equal transformers' generate(do_sample=False)."""
    from paddletune.models.cache import KVCache

    path, ref_model = hf_family(tmp_path / "ck", kind, seed=1)
    prompt, new = ids_for(7, batch=2, seed=3), 8
    with torch.no_grad():
        ref = ref_model.generate(torch.tensor(prompt), max_new_tokens=new, do_sample=False,
                                 min_new_tokens=new, pad_token_id=0)
    want = ref.numpy()[:, prompt.shape[1]:]
    model = load_model(path)
    cache = KVCache.for_model(model, batch_size=2, max_length=prompt.shape[1] + new)
    logits = model(paddle.to_tensor(prompt), cache=cache).logits[:, -1]
    got = []
    for _ in range(new):
        z = logits.numpy().copy()
        z[:, 2] = -np.inf   # eos barred until min_new_tokens, as transformers does
        got.append(z.argmax(-1))
        logits = model(paddle.to_tensor(got[-1][:, None]), cache=cache).logits[:, -1]
    assert np.array_equal(np.stack(got, 1), want)


def test_weight_only_int8_quantizes_experts_keeps_routers():
    """weight_only_int8 on the built-in Qwen2-MoE: every expert (and the shared expert) is
    quantized, the routers and the shared-expert gate stay float (ModelSpec.quant_keep); logits
    stay near the float model's."""
    from paddletune.args import QuantArgument

    ids = paddle.to_tensor(ids_for(10))
    ref = load_model("paddletune/tiny-qwen2moe")(ids).logits.numpy()
    q = load_model("paddletune/tiny-qwen2moe", quant=QuantArgument(weight_quantize_algo="weight_only_int8"))
    block = q.model.layers[1].mlp
    assert type(block.experts[3].down_proj).__name__ == "QuantizedLinear"
    assert type(block.shared_expert.up_proj).__name__ == "QuantizedLinear"
    assert type(block.gate).__name__ == "Linear" and type(block.shared_expert_gate).__name__ == "Linear"
    assert rel_err(q(ids).logits.numpy(), ref) < 5e-2   # (measured 0.023: a near-tie may flip)
