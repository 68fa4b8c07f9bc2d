"""Prefix tuning: trainable set, identity with 0 tokens, one pass equals token-by-token decoding
through the KV cache (prefix included), masks extended, torch peft loads our PREFIX_TUNING files,
the projection is folded at save, learning, bad input. Oracles: the base model, the cached
decode, the unpadded run, torch peft on the transformers model, hand counts, the copy task."""
import json

import numpy as np
import paddle
import pytest

from peft_util import tiny, randomize, ids, run
from conftest import copy_pairs, hf_checkpoint, lm_loss, rel_err, token_accuracy, training_args
from paddletune import peft
from paddletune.args import ArgumentError, ModelArgument, build
from paddletune.loading import load_model
from paddletune.models.cache import KVCache
from paddletune.peft import prefix
from paddletune.trainer import Trainer


def margs(**kw):
    return ModelArgument(model_name_or_path=kw.pop("model_name_or_path", "paddletune/tiny-llama"),
                         prefix_tuning=True, **kw)


def test_trainable_names_and_count():
    model = tiny()
    setup = peft.apply(model, margs(num_prefix_tokens=5))
    L, K, P, D = 2, 2, 5, 16
    assert {n: list(p.shape) for n, p in setup.trainable.items()} == {
        "prefix_encoder.key_prefix": [L, K, P, D], "prefix_encoder.value_prefix": [L, K, P, D]}
    assert all(p.stop_gradient == (n not in setup.trainable) for n, p in model.named_parameters())
    model = tiny()
    setup = peft.apply(model, margs(num_prefix_tokens=5, prefix_projection=True,
                                    prefix_projection_hidden_size=24))
    H, out = 64, L * 2 * K * D
    assert {n: list(p.shape) for n, p in setup.trainable.items()} == {
        "prefix_encoder.embedding": [P, H], "prefix_encoder.proj_in.weight": [H, 24],
        "prefix_encoder.proj_in.bias": [24], "prefix_encoder.proj_out.weight": [24, out],
        "prefix_encoder.proj_out.bias": [out]}


def test_zero_prefix_tokens_equals_base():
    model = tiny()
    base = run(model, ids())
    prefix.attach(model, prefix.new_encoder(model, 0))
    assert rel_err(run(model, ids()), base) < 1e-6


@pytest.mark.parametrize("kv_heads", [4, 2, 1])        # MHA, GQA, MQA
def test_one_pass_equals_token_by_token_through_cache(kv_heads):
    model = tiny(num_key_value_heads=kv_heads)
    setup = peft.apply(model, margs(num_prefix_tokens=3))
    randomize(setup.trainable, scale=0.5)
    x = ids(S=7)
    full = run(model, x)
    assert rel_err(full, run(tiny(num_key_value_heads=kv_heads), x)) > 1e-2  # the prefix matters
    cache = prefix.fill_cache(model, KVCache.for_model(model, 2, 3 + 7))
    assert cache.length == 3
    parts = [run(model, x[:, :4], cache=cache)]          # a chunk, then one token at a time
    parts += [run(model, x[:, t:t + 1], cache=cache) for t in range(4, 7)]
    assert rel_err(np.concatenate(parts, axis=1), full) < 1e-5


def test_recompute_with_prefix_gives_same_gradients(monkeypatch):
    from paddletune.models import llama

    calls = []
    forward = llama.LlamaDecoderLayer.forward
    monkeypatch.setattr(llama.LlamaDecoderLayer, "forward",
                        lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    grads = []
    for rc in (False, True):
        model = tiny()
        setup = peft.apply(model, margs(num_prefix_tokens=3))
        randomize(setup.trainable, scale=0.5)
        model.train()
        model.recompute = rc
        x = paddle.to_tensor(ids())
        calls.clear()
        lm_loss(model, x, x).loss.backward()
        grads.append({n: p.grad.numpy() for n, p in setup.trainable.items()})
        # layer 0's input (frozen embeddings) needs no gradient: only layer 1 is recomputed
        assert len(calls) == (3 if rc else 2)
    for n in grads[0]:
        assert rel_err(grads[1][n], grads[0][n]) < 1e-6


def test_chatglm2_recomputes_under_prefix_tuning_too(monkeypatch):
    """One runner for every family: ChatGLM2 once skipped recomputation whenever a prefix cache was
    present (its own forward tested `cache is None`); now it recomputes as Llama does, with the
    same gradients."""
    from paddletune.models import build_model, chatglm2, get_spec

    calls = []
    forward = chatglm2.GLMBlock.forward
    monkeypatch.setattr(chatglm2.GLMBlock, "forward",
                        lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    grads = []
    for rc in (False, True):
        paddle.seed(0)
        model = build_model(dict(get_spec("chatglm").tiny_config, padded_vocab_size=600), seed=0)
        setup = peft.apply(model, ModelArgument(model_name_or_path="x", prefix_tuning=True,
                                                num_prefix_tokens=3))
        randomize(setup.trainable, scale=0.5)
        model.train()
        model.recompute = rc
        x = paddle.to_tensor(ids())
        calls.clear()
        lm_loss(model, x, x).loss.backward()
        grads.append({n: p.grad.numpy() for n, p in setup.trainable.items()})
        assert len(calls) == (3 if rc else 2)   # block 1 recomputed (block 0's input needs no grad)
    for n in grads[0]:
        assert rel_err(grads[1][n], grads[0][n]) < 1e-6


def test_attention_mask_is_extended_left_padding():
    model = tiny()
    setup = peft.apply(model, margs(num_prefix_tokens=3))
    randomize(setup.trainable, scale=0.5)
    x = ids(B=1, S=5)
    plain = run(model, x)
    padded = np.concatenate([np.zeros((1, 2), np.int64), x], axis=1)
    mask = np.array([[0, 0, 1, 1, 1, 1, 1]])
    pos = np.array([[3, 3, 3, 4, 5, 6, 7]])               # real tokens start at P = 3
    got = run(model, padded, attention_mask=paddle.to_tensor(mask), position_ids=paddle.to_tensor(pos))
    assert rel_err(got[:, 2:], plain) < 1e-5


def test_torch_peft_loads_our_prefix(tmp_path):
    import torch
    from peft import PeftModel

    path, hf_model = hf_checkpoint(tmp_path / "base")
    model = load_model(path)
    setup = peft.apply(model, margs(model_name_or_path=path, num_prefix_tokens=4))
    randomize(setup.trainable, scale=0.5)
    setup.export_fn(str(tmp_path / "pt"))
    conf = json.load(open(tmp_path / "pt" / "adapter_config.json"))
    assert conf["peft_type"] == "PREFIX_TUNING" and conf["num_virtual_tokens"] == 4
    x = ids()
    pm = PeftModel.from_pretrained(hf_model, str(tmp_path / "pt")).eval()
    with torch.no_grad():
        theirs = pm(input_ids=torch.tensor(x)).logits.numpy()
    assert rel_err(run(model, x), theirs) < 1e-4
    # our loader reads the same files back
    again = peft.load_adapter(load_model(path), prefix_path=str(tmp_path / "pt"))
    assert rel_err(run(again, x), theirs) < 1e-4


def test_projection_is_folded_at_save(tmp_path):
    model = tiny()
    setup = peft.apply(model, margs(num_prefix_tokens=4, prefix_projection=True))
    randomize(setup.trainable, scale=0.3)
    x = ids()
    want = run(model, x)
    setup.export_fn(str(tmp_path / "pt"))
    assert json.load(open(tmp_path / "pt" / "adapter_config.json"))["prefix_projection"] is False
    loaded = peft.load_adapter(tiny(), prefix_path=str(tmp_path / "pt"))
    assert not loaded.prefix_encoder.projection
    assert rel_err(run(loaded, x), want) < 1e-5
    # continuing training from the saved prefix works with direct parameters
    cont = tiny()
    setup2 = peft.apply(cont, margs(prefix_path=str(tmp_path / "pt")))
    assert set(setup2.trainable) == {"prefix_encoder.key_prefix", "prefix_encoder.value_prefix"}
    assert rel_err(run(cont, x), want) < 1e-5


def test_copy_task_reaches_full_accuracy(tmp_path):
    model = tiny()
    data = copy_pairs()
    setup = peft.apply(model, margs(num_prefix_tokens=32))
    assert token_accuracy(model, data) < 0.2
    Trainer(model, training_args(tmp_path, max_steps=150, learning_rate=3e-2), train_dataset=data,
            trainable=setup.trainable, export_fn=lambda d: None).train()
    assert token_accuracy(model, data) == 1.0


def test_bad_input(tmp_path):
    base = {"model_name_or_path": "m", "dataset_name_or_path": "d", "output_dir": "o",
            "prefix_tuning": True}
    with pytest.raises(ArgumentError, match="zero_padding.*cannot be used with prefix_tuning"):
        build(dict(base, zero_padding=True))
    with pytest.raises(ArgumentError, match="num_prefix_tokens.*must be positive"):
        build(dict(base, num_prefix_tokens=0))
    with pytest.raises(ArgumentError, match="cannot be combined with prefix_tuning"):
        build(dict(base, bitfit=True))
    setup = peft.apply(tiny(), margs(num_prefix_tokens=2))
    setup.export_fn(str(tmp_path / "pt"))
    other = tiny(num_key_value_heads=4)
    with pytest.raises(ValueError, match="base model of other shapes"):
        peft.load_adapter(other, prefix_path=str(tmp_path / "pt"))
    assert other.cache_hook is None
