"""Bloom, GPT-2, OPT and Qwen3 against transformers (torch CPU, fp32) on tiny random checkpoints
that transformers saved: logits, greedy decoding through our KV cache against transformers'
generate, and our export loading back in transformers."""
import numpy as np
import paddle
import pytest
import torch

from conftest import rel_err
from family_util import hf_family
from paddletune.models import save_pretrained
from paddletune.loading import load_model
from paddletune.models.cache import KVCache

CASES = {   # name -> (kind, config overrides)
    "qwen3": ("qwen3", {}),
    "qwen3_untied_mha": ("qwen3", dict(tie_word_embeddings=False, num_key_value_heads=4)),
    "gpt2": ("gpt2", {}),
    "gpt2_inverse_layer_scale_relu": ("gpt2", dict(scale_attn_by_inverse_layer_idx=True,
                                                   activation_function="relu")),
    "opt": ("opt", {}),
    "opt_project_post_ln": ("opt", dict(word_embed_proj_dim=32, do_layer_norm_before=False)),
    "bloom": ("bloom", {}),
    "bloom_6_heads_residual_post_ln": ("bloom", dict(hidden_size=48, n_head=6,
                                                     apply_residual_connection_post_layernorm=True)),
}


def ids_for(seq, batch=2, seed=0):
    return np.random.RandomState(seed).randint(3, 600, (batch, seq))


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tmp_path, name):
    kind, cfg = CASES[name]
    path, ref_model = hf_family(tmp_path / "ck", kind, **cfg)
    ids = ids_for(24)
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids)).logits.numpy()
    model = load_model(path)
    out = model(paddle.to_tensor(ids)).logits.numpy()
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= 1e-4, (name, rel_err(out, ref))


@pytest.mark.parametrize("kind", ["qwen3", "gpt2", "opt", "bloom"])
def test_greedy_decoding_through_cache_equals_transformers(tmp_path, kind):
    """Prompt in one forward, then one token at a time through the pre-allocated KV cache: the
    greedy tokens equal transformers' generate(do_sample=False), and every step's logits its
    raw logits."""
    path, ref_model = hf_family(tmp_path / "ck", kind, seed=1)
    prompt = ids_for(7, batch=2, seed=3)
    new = 10
    with torch.no_grad():
        ref = ref_model.generate(torch.tensor(prompt), max_new_tokens=new, do_sample=False,
                                 min_new_tokens=new, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
    want = ref.sequences.numpy()[:, prompt.shape[1]:]
    model = load_model(path)
    cache = KVCache.for_model(model, batch_size=2, max_length=prompt.shape[1] + new)
    logits = model(paddle.to_tensor(prompt), cache=cache).logits[:, -1]
    got, scores = [], []
    for _ in range(new):
        scores.append(logits.numpy())
        z = logits.numpy().copy()
        z[:, 2] = -np.inf   # eos (id 2) is barred until min_new_tokens, as transformers does
        nxt = z.argmax(-1)
        got.append(nxt)
        logits = model(paddle.to_tensor(nxt[:, None]), cache=cache).logits[:, -1]
    assert np.array_equal(np.stack(got, 1), want)
    assert rel_err(np.stack(scores, 1), torch.stack(ref.logits, 1).numpy()) <= 1e-4


@pytest.mark.parametrize("kind", ["qwen3", "gpt2", "opt", "bloom"])
def test_export_loads_in_transformers(tmp_path, kind):
    import transformers

    path, _ = hf_family(tmp_path / "ck", kind, seed=2)
    model = load_model(path)
    save_pretrained(model, str(tmp_path / "out"))
    ids = ids_for(12)
    ours = model(paddle.to_tensor(ids)).logits.numpy()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert rel_err(ours, ref) <= 1e-5


LEARN = {"qwen3": {}, "gpt2": {}, "opt": {}, "bloom": {}, "baichuan": {},
         "baichuan_alibi": {"position_embedding": "alibi"}, "qwen": {}}


@pytest.mark.parametrize("name", list(LEARN))
def test_lora_learns_copy_pairs(tmp_path, name):
    """16 random-token copy pairs, LoRA (the family's default targets, r=8) on a random tiny model:
    greedy (teacher-forced argmax) accuracy on every target token reaches 100%."""
    from conftest import copy_pairs, token_accuracy, training_args
    from paddletune import peft
    from paddletune.args import ModelArgument
    from paddletune.models import build_model, get_spec
    from paddletune.trainer import Trainer

    model_type = name.split("_")[0]
    paddle.seed(0)
    model = build_model(dict(get_spec(model_type).tiny_config, vocab_size=600, initializer_range=0.1,
                             **LEARN[name]), seed=0)
    data = copy_pairs()
    assert token_accuracy(model, data) < 0.2
    setup = peft.apply(model, ModelArgument(model_name_or_path="unused", lora=True, lora_rank=8))
    assert setup.trainable and all("lora_" in n for n in setup.trainable)
    Trainer(model, training_args(tmp_path, max_steps=60), train_dataset=data,
            trainable=setup.trainable, export_fn=lambda d: None).train()
    assert token_accuracy(model, data) == 1.0


@pytest.mark.parametrize("kind,base", [("gpt2", "transformer"), ("opt", "model"), ("bloom", "transformer")])
def test_base_model_checkpoint_loads(tmp_path, kind, base):
    """The hub's gpt2 / facebook/opt-* / bigscience/bloom* files were saved from the base model:
    tensor names lack the head model's prefix ("h.0.attn.c_attn.weight"). They load (the reader
    adds ModelSpec.base_prefix) and give the head model's logits (the head is tied)."""
    import json
    import os

    path, ref_model = hf_family(tmp_path / "ck", kind)
    getattr(ref_model, base).save_pretrained(str(tmp_path / "base"))
    conf = json.load(open(tmp_path / "base" / "config.json"))
    from paddletune.models.hf import SafetensorsFile

    stored = SafetensorsFile(os.path.join(tmp_path, "base", "model.safetensors")).keys()
    assert stored and not any(k.startswith(base + ".") for k in stored)
    assert conf["model_type"] == kind
    ids = ids_for(10)
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids)).logits.numpy()
    assert rel_err(load_model(str(tmp_path / "base"))(paddle.to_tensor(ids)).logits.numpy(), ref) <= 1e-4


@pytest.mark.parametrize("kind", ["qwen3", "gpt2", "opt", "bloom"])
def test_batched_left_padded_generation_equals_transformers(tmp_path, kind):
    """paddletune.generation.generate on prompts of different lengths (left padded: learned
    positions and ALiBi must count real tokens only, as transformers does) = transformers'
    generate(do_sample=False) with the attention mask, row by row."""
    from paddletune.generation import generate

    path, hf = hf_family(tmp_path / "ck", kind, seed=5)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 600, n).tolist() for n in (3, 9, 6)]
    L, new = max(map(len, prompts)), 12
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    am = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        rows = hf.generate(ids, attention_mask=am, max_new_tokens=new, do_sample=False,
                           pad_token_id=0).numpy()[:, L:].tolist()
    want = [r[:next((i + 1 for i, t in enumerate(r) if t == 2), len(r))] for r in rows]   # eos 2
    got = generate(load_model(path), prompts, max_new_tokens=new, pad_token_id=0)
    assert got.sequences == want and len(set(map(len, prompts))) > 1


def test_gpt2_conv1d_weights_quantize_in_their_layout(tmp_path):
    """Weight-only int8 on GPT-2: the Conv1D weights ([in, out] in the file) reach the quantizer
    in torch layout (hf.read_torch_linear), so the quantized model's logits stay near the float
    model's (a transposed matrix would not even have the right shape for the non-square ones)."""
    from paddletune.args import QuantArgument

    path, _ = hf_family(tmp_path / "ck", "gpt2", seed=3)
    ids = paddle.to_tensor(ids_for(10))
    ref = load_model(path)(ids).logits.numpy()
    q = load_model(path, quant=QuantArgument(weight_quantize_algo="weight_only_int8"))
    assert type(q.transformer.h[0].attn.c_attn).__name__ != "Linear"
    assert rel_err(q(ids).logits.numpy(), ref) < 2e-2
