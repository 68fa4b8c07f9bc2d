"""Llama-family logits against transformers (torch CPU, fp32) on checkpoints saved by transformers."""
import numpy as np
import paddle
import pytest
import torch

from conftest import hf_checkpoint, lm_loss, rel_err
from paddletune.models import build_model, save_pretrained
from paddletune.loading import load_model
from paddletune.models.cache import KVCache

CASES = {
    "llama_mha": ("llama", dict(num_key_value_heads=4), 40),
    "llama3_gqa": ("llama", dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}), 40),
    "qwen2_bias_tied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True), 40),
    "linear_scaling_mqa": ("llama", dict(num_key_value_heads=1, rope_scaling={"rope_type": "linear", "factor": 2.0}), 40),
    # dynamic NTK on a sequence longer than max_position_embeddings (16 < 40)
    "dynamic_ntk": ("llama", dict(max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), 40),
    "head_dim_mlp_bias": ("llama", dict(head_dim=24, attention_bias=True, mlp_bias=True), 24),
    "mistral": ("mistral", dict(num_key_value_heads=2, sliding_window=None), 24),
}


def ids_for(seq, vocab=600, batch=2, seed=0):
    return np.random.RandomState(seed).randint(0, vocab, (batch, seq))


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tmp_path, name):
    kind, cfg, seq = CASES[name]
    path, ref_model = hf_checkpoint(tmp_path / "ck", kind, max_shard_size="60KB", **cfg)
    ids = ids_for(seq)
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids)).logits.numpy()
    model = load_model(path)
    out = model(paddle.to_tensor(ids)).logits.numpy()
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= 1e-4, name


def test_sharded_checkpoint_is_read_from_every_shard(tmp_path):
    """A checkpoint transformers wrote as shards + index: our reader maps every tensor of the
    index to the shard the index names (several files), returns the values transformers holds,
    and the loaded model gives transformers' logits."""
    import json
    import os

    from paddletune.models import hf

    path, ref_model = hf_checkpoint(tmp_path / "ck", "llama", max_shard_size="60KB")
    weight_map = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    shards = set(weight_map.values())
    assert len(shards) >= 3 and not os.path.exists(os.path.join(path, "model.safetensors"))
    reader = hf.CheckpointReader(path)
    assert sorted(reader.keys()) == sorted(weight_map)
    assert {k: os.path.basename(f.path) for k, f in reader.files.items()} == weight_map
    state = {k: v.numpy() for k, v in ref_model.state_dict().items()}
    assert set(weight_map) == set(state) - {k for k in state if k.endswith("inv_freq")}
    for k in weight_map:
        np.testing.assert_array_equal(reader.get(k), state[k], err_msg=k)
    ids = ids_for(20)
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids)).logits.numpy()
    assert rel_err(load_model(path)(paddle.to_tensor(ids)).logits.numpy(), ref) <= 1e-5


def test_write_weights_shards_by_size(tmp_path):
    """Hand-worked sharding: five float32 tensors of 1000 bytes under a 2500-byte limit make the
    shards [a, b], [c, d], [e] (a shard is closed when the next tensor would exceed the limit);
    the index names each tensor's shard and the total size; safetensors (the reference
    library) reads back every value."""
    import json
    import os

    from safetensors.numpy import load_file

    from paddletune.models import hf

    rng = np.random.default_rng(0)
    tensors = [(n, rng.standard_normal((10, 25)).astype(np.float32)) for n in "abcde"]
    files = hf.write_weights(str(tmp_path), iter(tensors), max_shard_size=2500)
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert files == names
    assert sorted(os.listdir(tmp_path)) == sorted(names + ["model.safetensors.index.json"])
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert index["metadata"]["total_size"] == 5000
    assert index["weight_map"] == {"a": names[0], "b": names[0], "c": names[1], "d": names[1],
                                   "e": names[2]}
    back = {}
    for fn in names:
        part = load_file(str(tmp_path / fn))
        assert set(part) == {k for k, v in index["weight_map"].items() if v == fn}
        back.update(part)
    for n, a in tensors:
        np.testing.assert_array_equal(back[n], a)
    # one shard when everything fits: a single model.safetensors, no index
    one = tmp_path / "one"
    one.mkdir()
    assert hf.write_weights(str(one), iter(tensors), max_shard_size=5000) == ["model.safetensors"]
    assert os.listdir(one) == ["model.safetensors"]


@pytest.mark.parametrize("kind,cfg", [("llama", {}), ("qwen2", {"tie_word_embeddings": True})])
def test_saved_model_loads_in_transformers(tmp_path, kind, cfg):
    """Our save_pretrained (sharded: several files + an index covering every parameter) ->
    transformers from_pretrained -> equal logits."""
    import json

    import transformers

    path, _ = hf_checkpoint(tmp_path / "src", kind, **cfg)
    model = load_model(path)
    save_pretrained(model, str(tmp_path / "out"), max_shard_size="50KB")
    index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and sorted(index["weight_map"]) == sorted(n for n, _ in model.named_parameters())
    assert all((tmp_path / "out" / fn).exists() for fn in shards)
    assert not (tmp_path / "out" / "model.safetensors").exists()
    ours = model(paddle.to_tensor(ids_for(20))).logits.numpy()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids_for(20))).logits.numpy()
    assert rel_err(ours, ref) <= 1e-5


def test_labels_give_masked_mean_loss(tiny_llama):
    """With labels the loss is the mean token CE over labelled positions only (torch reference)."""
    model = load_model(tiny_llama)
    ids = ids_for(12)
    labels = ids.copy()
    labels[:, :5] = -100
    labels[1, 9:] = -100
    out = lm_loss(model, ids, labels)
    logits = torch.tensor(model(paddle.to_tensor(ids)).logits.numpy())
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                            torch.tensor(labels[:, 1:]).reshape(-1), ignore_index=-100)
    assert int(out.num_tokens) == int((labels[:, 1:] != -100).sum())
    assert abs(float(out.loss) - float(ref)) < 1e-5


def test_kv_cache_incremental_equals_full(tiny_llama):
    """Prompt in one forward, then token by token through the pre-allocated cache."""
    model = load_model(tiny_llama)
    ids = ids_for(16, batch=2)
    full = model(paddle.to_tensor(ids)).logits.numpy()
    cache = KVCache.for_model(model, batch_size=2, max_length=32)
    steps = [model(paddle.to_tensor(ids[:, :10]), cache=cache).logits.numpy()]
    buf_id = id(cache.keys[0])
    for t in range(10, 16):
        steps.append(model(paddle.to_tensor(ids[:, t:t + 1]), cache=cache).logits.numpy())
    assert cache.length == 16 and id(cache.keys[0]) == buf_id  # written in place, never re-created
    assert rel_err(np.concatenate(steps, axis=1), full) <= 1e-5


def test_dynamic_ntk_with_cache_equals_transformers_cache(tmp_path):
    """Dynamic NTK rope decoded through the KV cache past max_position_embeddings (16): each step
    rescales the frequencies for the new token while cached keys keep the rotation they got, as
    transformers does with its cache. Oracle: transformers token by token with past_key_values;
    a full forward over all 30 tokens (one rescaling for every position) must differ from both."""
    path, ref_model = hf_checkpoint(tmp_path / "ck", "llama", max_position_embeddings=16,
                                    rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    ids = ids_for(30, batch=2, seed=4)
    model = load_model(path)
    cache = KVCache.for_model(model, batch_size=2, max_length=32)
    ours = [model(paddle.to_tensor(ids[:, :10]), cache=cache).logits.numpy()]
    with torch.no_grad():
        out = ref_model(torch.tensor(ids[:, :10]), use_cache=True)
        ref, past = [out.logits.numpy()], out.past_key_values
        for t in range(10, 30):
            ours.append(model(paddle.to_tensor(ids[:, t:t + 1]), cache=cache).logits.numpy())
            out = ref_model(torch.tensor(ids[:, t:t + 1]), past_key_values=past, use_cache=True)
            ref.append(out.logits.numpy())
            past = out.past_key_values
    ours, ref = np.concatenate(ours, axis=1), np.concatenate(ref, axis=1)
    assert rel_err(ours, ref) <= 1e-4
    full = model(paddle.to_tensor(ids)).logits.numpy()
    assert rel_err(full[:, 16:], ref[:, 16:]) > 1e-3   # the cached path really differs here


def test_build_model_random_init_is_deterministic():
    cfg = {"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4}
    a, b, c = build_model(cfg, seed=3), build_model(cfg, seed=3), build_model(cfg, seed=4)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert np.array_equal(p.numpy(), q.numpy()), n
        w = p.numpy()
        if w.ndim == 2:   # matrices: N(0, 0.02) (the default initializer_range), seed-dependent
            assert abs(w.std() - 0.02) < 0.002 and abs(w.mean()) < 0.002, n
            assert not np.array_equal(w, r.numpy()), n
        else:             # norm weights start at one
            assert (w == 1).all(), n


def test_indivisible_heads_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        build_model({"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 3})


def test_python_api(tiny_llama):
    import paddletune
    from paddletune import load_model as lm, load_tokenizer

    model = lm(tiny_llama)
    tok = load_tokenizer(tiny_llama)
    assert isinstance(model, paddle.nn.Layer) and not model.training
    ids = tok.encode("Add 2 and 3.")
    out = model(paddle.to_tensor([ids]))
    assert list(out.logits.shape) == [1, len(ids), model.config.vocab_size]
    assert tok.decode(ids, skip_special_tokens=True) == "Add 2 and 3."
    assert paddletune.__version__


@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("tied,frozen_head", [(False, False), (True, False), (False, True)])
def test_chunked_training_loss_equals_full_logits(tmp_path, tied, frozen_head, kernels_on, monkeypatch):
    """Training mode computes the head + CE chunk by chunk (LinearCrossEntropy, gradients formed
    in the forward pass); loss and every gradient equal the eval-mode path through full logits,
    with paddletune's CPU kernels (cross-entropy, masked softmax) and with paddle's ops only."""
    from paddletune import kernels
    from paddletune.models import linear_ce, loss

    if not kernels_on:
        monkeypatch.setitem(kernels._STATE, "ops", None)
    elif paddle.is_compiled_with_cuda():
        pytest.skip("CUDA build of paddle: the CPU kernels are off by design")
    else:
        assert kernels.cpu_ops() is not None
    monkeypatch.setattr(linear_ce.LinearCrossEntropy, "BLOCK_ELEMENTS", 600 * 5)   # 5-row chunks
    path, _ = hf_checkpoint(tmp_path / "ck", "qwen2" if tied else "llama", tie_word_embeddings=tied)
    ids = ids_for(14, batch=3)
    labels = ids.copy()
    labels[:, :4] = -100
    grads = {}
    for mode in ("chunked", "full"):
        model = load_model(path)
        if frozen_head and not tied:
            model.lm_head.weight.stop_gradient = True
        model.train() if mode == "chunked" else model.eval()   # eval() selects the full-logits path
        assert loss.linear_head(model) is not None
        out = lm_loss(model, ids, labels)
        assert (out.label_logits is None) == (mode == "chunked")
        out.loss_sum.backward()
        grads[mode] = (float(out.loss_sum), {n: p.grad.numpy() for n, p in model.named_parameters()
                                             if p.grad is not None})
    (l1, g1), (l2, g2) = grads["chunked"], grads["full"]
    assert abs(l1 - l2) <= 1e-5 * abs(l2)
    assert set(g1) == set(g2) and ("lm_head.weight" in g1) == (not frozen_head and not tied)
    assert max(rel_err(g1[k], g2[k]) for k in g2) <= 1e-5
