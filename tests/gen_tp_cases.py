"""Generation cases for tests/test_generation_tp.py, run on launched ranks (tests/launch_cases.py)
and, for the one-process reference, in the test process (the same functions with tp=1).

generate_case: load a checkpoint (this rank's slices under TP), optionally attach prefix tuning,
then generate a left-padded batch of prompts with the KV cache under each named configuration.
Per configuration it returns the ids and finish reasons, and under TP what the split looked like:
the logits width, the KV cache's key/value heads, and every collective recorded by
model.tensor_parallel.log during generation (op, shape).
ops_case: the sharded token choice on the same random logits (ties and padding included) that
the test gives generation.choose_tokens in one process.
predictor_case: llm/predictor.py's main() on this rank (the script launched under TP).
"""
import io
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import paddletune  # noqa: E402,F401


def _topology(tp):
    from conftest import training_args
    from paddletune import parallel

    if tp <= 1:
        return None
    return parallel.init(training_args("/tmp/unused", tensor_parallel_degree=tp))


class _CacheShapes:
    """Records the key buffer shape of every KVCache generation allocates."""

    def __init__(self):
        from paddletune.models.cache import KVCache

        self.shapes, self.cls, self.orig = [], KVCache, KVCache.for_model.__func__

    def __enter__(self):
        orig, shapes = self.orig, self.shapes

        def for_model(cls, *a, **kw):
            cache = orig(cls, *a, **kw)
            shapes.append(list(cache.keys[0].shape))
            return cache
        self.cls.for_model = classmethod(for_model)
        return self

    def __exit__(self, *exc):
        self.cls.for_model = classmethod(self.orig)


def _load(ckpt, tp, prefix_tokens):
    from paddletune import peft, runtime
    from paddletune.args import ModelArgument
    from paddletune.loading import load_model
    from paddletune.parallel import tensor as tensor_parallel

    model = load_model(ckpt, topology=_topology(tp))
    if prefix_tokens:
        runtime.set_seed(0)      # the same prefix values on every rank and in one process
        peft.apply(model, ModelArgument(model_name_or_path=ckpt, prefix_tuning=True,
                                        num_prefix_tokens=prefix_tokens))
        if getattr(model, "tensor_parallel", None) is not None:
            tensor_parallel.finalize(model, model.tensor_parallel)
    model.eval()
    return model


def generate_case(ckpt, configs, prompts, tp=1, prefix_tokens=0):
    """configs: {name: GenerationConfig keyword dict}. Returns {name: result} (see module doc)."""
    import numpy as np

    from paddletune.generation import generate
    from paddletune.tokenizer import Tokenizer

    model = _load(ckpt, tp, prefix_tokens)
    tok = Tokenizer(ckpt)
    tpg = getattr(model, "tensor_parallel", None)
    out = {}
    for name, kw in configs.items():
        kw = dict(kw)
        want_logits = kw.pop("return_logits", False)
        if tpg is not None:
            tpg.log = []
        with _CacheShapes() as caches:
            res = generate(model, prompts, tokenizer=tok, return_logits=want_logits, **kw)
        out[name] = {"ids": res.sequences, "reasons": res.finish_reasons, "cache": caches.shapes,
                     "comm": list(tpg.log) if tpg is not None else [],
                     "width": int(res.logits[0].shape[-1]) if want_logits else None,
                     "logits": [np.asarray(x).tolist() for x in res.logits] if want_logits else None}
        if tpg is not None:
            tpg.log = None
    out["_"] = {"hidden": model.config.hidden_size, "vocab": model.config.vocab_size,
                "kv_heads": model.spec.prefix_layout(model.config)[1]}
    return out


def ops_case(tp, configs, batch=4, vocab=601, seeds=3):
    """Sharded choose_tokens on seeded random logits (ties: values rounded to 0.5; this rank's
    columns of a vocabulary padded to a multiple of tp). Returns {config: [ids per seed]}."""
    import math

    import paddle

    from paddletune.generation import GenerationConfig, choose_tokens
    from paddletune.parallel.tensor import TensorParallel

    group = TensorParallel(_topology(tp))
    vl = math.ceil(vocab / tp)
    cols = slice(group.rank * vl, (group.rank + 1) * vl)
    out = {}
    for name, kw in configs.items():
        cfg = GenerationConfig(**kw).validate()
        out[name] = []
        for seed in range(seeds):
            z, seen, u = op_inputs(seed, batch, vocab, vl * tp)
            ids = choose_tokens(paddle.to_tensor(z[:, cols]), cfg, paddle.to_tensor(seen[:, cols]),
                                paddle.to_tensor(u), group, vocab)
            out[name].append(ids.numpy().tolist())
    return out


def op_inputs(seed, batch, vocab, padded):
    """(logits [batch, padded] float32 with zeros past `vocab`, seen mask, uniforms [batch, 1])."""
    import numpy as np

    rng = np.random.default_rng(seed)
    z = np.zeros((batch, padded), np.float32)
    z[:, :vocab] = np.round(rng.standard_normal((batch, vocab)) * 6) / 2   # many equal logits
    seen = np.zeros((batch, padded), np.float32)
    seen[:, :vocab] = rng.random((batch, vocab)) < 0.1
    return z, seen, (1.0 - rng.random((batch, 1))).astype(np.float32)


def predictor_case(argv):
    """llm/predictor.py main(argv) on this rank: (return code, what it printed)."""
    from conftest import load_script

    out = io.StringIO()
    rc = load_script("llm/predictor.py").main(list(argv), stdout=out)
    return {"rc": rc, "printed": out.getvalue()}
