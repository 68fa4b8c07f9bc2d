"""models/hf.py is the one place of the Linear layout rule: [out, in] (HF/torch) <-> [in, out]
(paddle). Oracle: the rule written out by hand on a tiny Llama's names."""
import numpy as np
import paddle

from paddletune.models import get_spec, hf

SPEC = get_spec("llama")


def test_linear_weights_swap_axes_for_arrays_and_tensors():
    w = np.arange(6, dtype=np.float32).reshape(2, 3)          # paddle [in=2, out=3]
    to_hf = hf.linear_to_hf(w)
    assert to_hf.shape == (3, 2) and to_hf.flags["C_CONTIGUOUS"] and to_hf[2, 1] == w[1, 2]
    assert np.array_equal(hf.linear_to_paddle(to_hf), w)
    t = hf.linear_to_paddle(paddle.to_tensor(to_hf))          # paddle tensors stay tensors
    assert isinstance(t, paddle.Tensor) and np.array_equal(t.numpy(), w)


def test_only_linear_weights_change():
    q, emb, norm = "model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight", "model.norm.weight"
    assert hf.hf_shape(SPEC, q, [64, 32]) == [32, 64] and hf.paddle_shape(SPEC, q, [32, 64]) == [64, 32]
    assert hf.hf_shape(SPEC, emb, [600, 64]) == [600, 64]      # embeddings keep [vocab, hidden]
    assert hf.hf_shape(SPEC, norm, [64]) == [64]
    a = np.ones([600, 64], np.float32)
    assert hf.to_hf_layout(SPEC, emb, a) is a and hf.to_paddle_layout(SPEC, q, a).shape == (64, 600)
