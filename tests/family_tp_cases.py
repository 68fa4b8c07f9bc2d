"""Launched cases for the model families under tensor parallelism (tests/test_families_tp.py):
what each rank holds of the fused / head-structured layers, and the ALiBi slopes it uses."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import paddletune  # noqa: E402,F401


def held_slices(ckpt, names):
    """Load `ckpt` under TP=2; per name in `names` (parameters) this rank's local array, and per
    module with a head_offset (set by parallel/) that offset and the ALiBi slopes its attention
    reads, if any."""
    from conftest import training_args
    from paddletune import parallel
    from paddletune.loading import load_model

    topo = parallel.init(training_args("/tmp/unused", tensor_parallel_degree=2))
    model = load_model(ckpt, topology=topo)
    params = dict(model.named_parameters())
    local = {n: (params[n]._local_value() if params[n].is_dist() else params[n]).numpy().tolist()
             for n in names}
    offsets, slopes = {}, {}
    for name, m in model.named_sublayers():
        if getattr(m, "head_offset", None) is not None:
            offsets[name] = m.head_offset
        table = getattr(m, "slopes", None)
        if table is not None and hasattr(table, "get"):
            attn = [c for c in m.children() if getattr(c, "head_offset", None) is not None]
            if attn:
                n = attn[0].weight._local_value().shape[1] // (3 * model.config.head_dim)
                slopes[name] = table.get(attn[0].head_offset, n).numpy().tolist()
    return {"local": local, "offsets": offsets, "slopes": slopes, "rank": topo.tp_rank}


def glm6b_rows(n, seed, vocab=600):
    """Variable-length copy rows in ChatGLM-6B's layout (tiny config: [gMASK]=4, sop=5, eop=6):
    src, [gMASK], sop, tgt, eop; labels on tgt and eop."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s, t = int(rng.integers(1, 12)), int(rng.integers(1, 25))
        src, tgt = rng.integers(7, vocab, size=s).tolist(), rng.integers(7, vocab, size=t).tolist()
        out.append({"input_ids": np.array(src + [4, 5] + tgt + [6], np.int64),
                    "labels": np.array([-100] * (s + 2) + tgt + [6], np.int64), "id": i})
    return out


def train_glm6b(**kwargs):
    """tp_cases.train_case on ChatGLM-6B-layout rows (its data function swapped for the call)."""
    import tp_cases

    saved = tp_cases.copy_data
    tp_cases.copy_data = glm6b_rows
    try:
        return tp_cases.train_case(**kwargs)
    finally:
        tp_cases.copy_data = saved
