"""Helpers shared by the PEFT tests: a tiny random Llama, random inputs, eval-mode logits."""
import numpy as np
import paddle

from paddletune.models import build_model, get_spec

CFG = dict(get_spec("llama").tiny_config, vocab_size=600, hidden_size=64, intermediate_size=512,
           num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)


def tiny(**kw):
    paddle.seed(0)
    return build_model(dict(CFG, **kw), seed=0)


def randomize(params, seed=1, scale=0.1):
    """Overwrite parameters with N(0, scale) values (e.g. LoRA B, so an adapter is not identity)."""
    rng = np.random.default_rng(seed)
    for p in params.values():
        p.set_value((rng.standard_normal(p.shape) * scale).astype(np.float32))


def ids(B=2, S=9, seed=3, vocab=600):
    return np.random.default_rng(seed).integers(3, vocab, (B, S)).astype(np.int64)


def run(model, x, **kw):
    """Eval-mode logits as numpy."""
    model.eval()
    with paddle.no_grad():
        return model(paddle.to_tensor(x), **kw).logits.numpy()
