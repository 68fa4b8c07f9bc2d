"""ChatGLM-6B (v1). No independent oracle runs here: transformers has no ChatGLM-6B and THUDM's
remote code is not available offline. What is checked: the prefix-LM mask and the 2-D positions
on a hand-worked example (with and without left padding), that the model really attends
bidirectionally over the prompt and causally over the answer, output shapes, the KV cache
against the full forward, the HF export round trip (config.json says "chatglm" with
position_encoding_2d, which picks this family, not ChatGLM2), and learning with LoRA."""
import numpy as np
import paddle
import pytest

from conftest import rel_err
from paddletune.models import build_model, get_spec, save_pretrained
from paddletune.loading import load_model
from paddletune.models.cache import KVCache
from paddletune.models.chatglm import glm_layout, glm_mask, glm_positions

G, SOP, EOP = 4, 5, 6   # the tiny config's [gMASK], sop, eop


def tiny(**kw):
    paddle.seed(0)
    return build_model(dict(get_spec("chatglm6b").tiny_config, vocab_size=600, initializer_range=0.1,
                            **kw), seed=0)


def test_hand_worked_mask_and_positions():
    cfg = get_spec("chatglm6b").config_cls.from_dict(get_spec("chatglm6b").tiny_config)
    ids = np.array([[10, 11, G, SOP, 12, 13]])              # a, b, [gMASK], sop, x, y
    ctx, mask, pads = glm_layout(ids, cfg)
    assert (ctx.tolist(), mask.tolist(), pads.tolist()) == ([3], [2], [0])
    p1, p2 = glm_positions(0, 6, ctx, mask, pads)
    assert p1.tolist() == [[0, 1, 2, 2, 2, 2]] and p2.tolist() == [[0, 0, 0, 1, 2, 3]]
    blocked = glm_mask(6, 0, ctx, pads).numpy()[0, 0]
    want = np.array([[0, 0, 0, 1, 1, 1],    # queries 0..2 (prompt) see keys 0..2: both directions
                     [0, 0, 0, 1, 1, 1],
                     [0, 0, 0, 1, 1, 1],
                     [0, 0, 0, 0, 1, 1],    # sop sees the prompt and itself
                     [0, 0, 0, 0, 0, 1],
                     [0, 0, 0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(blocked, want)
    # left padding: one pad in front; positions count real tokens, the pad's key is blocked
    ids = np.array([[0, 10, G, SOP, 12]])
    am = np.array([[0, 1, 1, 1, 1]])
    ctx, mask, pads = glm_layout(ids, cfg, am)
    assert (ctx.tolist(), mask.tolist(), pads.tolist()) == ([2], [1], [1])
    p1, p2 = glm_positions(0, 5, ctx, mask, pads)
    assert p1[0, 1:].tolist() == [0, 1, 1, 1] and p2[0, 1:].tolist() == [0, 0, 1, 2]
    blocked = glm_mask(5, 0, ctx, pads, am).numpy()[0, 0]
    assert blocked[:, 0].all() and not blocked[1, 2] and blocked[1, 3] and not blocked[3, 3]
    # a later token with a cache: row index 5 -> p1 = m, p2 = 5 - 1 - c + 1
    p1, p2 = glm_positions(5, 1, ctx, mask, pads)
    assert (p1.tolist(), p2.tolist()) == ([[1]], [[3]])


def test_attention_is_prefix_lm_and_shapes():
    model = tiny()
    model.eval()
    ids = np.array([[10, 11, 12, G, SOP, 13, 14, 15]] * 2)
    ids[1, 6] = 99
    out = model(paddle.to_tensor(ids)).logits.numpy()
    assert out.shape == (2, 8, 600)
    assert np.allclose(out[0, :6], out[1, :6], atol=1e-6)      # a later answer token: causal
    assert not np.allclose(out[0, 6:], out[1, 6:])
    ids2 = ids.copy()
    ids2[1] = ids[0]
    ids2[1, 2] = 98                                              # a later prompt token
    out2 = model(paddle.to_tensor(ids2)).logits.numpy()
    assert not np.allclose(out2[0, 0], out2[1, 0], atol=1e-4)    # ... reaches prompt position 0


def test_kv_cache_equals_full_forward():
    model = tiny()
    model.eval()
    ids = np.random.default_rng(0).integers(7, 600, (2, 12))
    ids[:, 4], ids[:, 5] = G, SOP
    full = model(paddle.to_tensor(ids)).logits.numpy()
    cache = KVCache.for_model(model, 2, 16)
    steps = [model(paddle.to_tensor(ids[:, :7]), cache=cache).logits.numpy()]
    for t in range(7, 12):
        steps.append(model(paddle.to_tensor(ids[:, t:t + 1]), cache=cache).logits.numpy())
    assert rel_err(np.concatenate(steps, 1), full) <= 1e-5


def test_export_round_trip_picks_this_family(tmp_path):
    import json

    model = tiny()
    model.eval()
    save_pretrained(model, str(tmp_path / "out"))
    conf = json.load(open(tmp_path / "out" / "config.json"))
    assert conf["model_type"] == "chatglm" and conf["position_encoding_2d"] is True
    back = load_model(str(tmp_path / "out"))
    assert type(back).__name__ == "ChatGLMForConditionalGeneration"
    ids = paddle.to_tensor(np.array([[10, 11, G, SOP, 12, 13]]))
    np.testing.assert_allclose(back(ids).logits.numpy(), model(ids).logits.numpy(), atol=1e-6)
    with pytest.raises(ValueError, match="sop"):
        back(paddle.to_tensor(np.array([[10, 11, 12]])))


def glm_copy_pairs(n=16, length=8, seed=0):
    """copy pairs in ChatGLM-6B's layout: r, [gMASK], sop, r, eop; labels on r and eop."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        r = rng.integers(7, 600, size=length).tolist()
        ids = r + [G, SOP] + r + [EOP]
        labels = [-100] * (length + 2) + r + [EOP]
        out.append({"input_ids": np.array(ids, np.int64), "labels": np.array(labels, np.int64), "id": i})
    return out


def test_lora_learns_copy_pairs(tmp_path):
    from conftest import token_accuracy, training_args
    from paddletune import peft
    from paddletune.args import ModelArgument
    from paddletune.trainer import Trainer

    model = tiny()
    data = glm_copy_pairs()
    assert token_accuracy(model, data) < 0.2
    setup = peft.apply(model, ModelArgument(model_name_or_path="unused", lora=True, lora_rank=8))
    Trainer(model, training_args(tmp_path, max_steps=60), train_dataset=data,
            trainable=setup.trainable, export_fn=lambda d: None).train()
    assert token_accuracy(model, data) == 1.0
