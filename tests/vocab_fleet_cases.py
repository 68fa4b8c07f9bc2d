"""Launched case of tests/test_vocab_fleet.py: the vocabulary cross-entropy's CUDA route (fleet's
c_softmax_with_cross_entropy over row blocks, parallel/vocab.py) run on gloo with a CPU stand-in
for fleet's op, against the CPU path on the same ranks.

The stand-in (test code only): paddle 3.3.1's CPU kernel of c_softmax_with_cross_entropy is a
stub, so `mp_ops._c_softmax_with_cross_entropy` is replaced, inside this case only, by a function
that binds its arguments to the real function's signature, checks them as the real one does
(label dims, label range), and computes what the GPU kernel returns - loss [rows, 1] =
log sum_v exp(z_v) - z_y over every rank's columns and the softmax [rows, Vl] of the local ones -
written here over dist.all_reduce, independently of vocab.py. Then the real function is called
with the same bound arguments and must get past its own checks to the stub kernel.
"""
import contextlib
import inspect
import os
import sys
import weakref

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import paddletune  # noqa: E402,F401


@contextlib.contextmanager
def _fleet_standin(tpg, calls):
    import paddle
    import paddle.distributed as dist
    from paddle.distributed.fleet.layers.mpu import mp_ops

    real = mp_ops._c_softmax_with_cross_entropy
    sig = inspect.signature(real)
    seen = []   # weak references to every block's logits and softmax handed over so far

    def standin(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        z, label, group = a["logits"], a["label"], a["group"]
        calls.append({"rows": int(z.shape[0]), "width": int(z.shape[1]),
                      "group_is_mp": group is tpg.mp_group, "return_softmax": a["return_softmax"],
                      "ignore_index": a["ignore_index"], "label_shape": list(label.shape),
                      "alive_before": sum(r() is not None for r in seen)})
        assert z.ndim - 1 == label.ndim and int(label.max()) < z.shape[-1] * group.nranks
        with paddle.no_grad():
            m = z.max(axis=-1, keepdim=True)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            e = paddle.exp(z - m)
            s = e.sum(-1, keepdim=True)
            dist.all_reduce(s, group=group)
            col = label - group.rank * z.shape[-1]
            own = (col >= 0) & (col < z.shape[-1])
            zy = paddle.take_along_axis(z, paddle.where(own, col, paddle.zeros_like(col)).unsqueeze(-1),
                                        axis=-1) * own.astype(z.dtype).unsqueeze(-1)
            dist.all_reduce(zy, group=group)
            loss, soft = paddle.log(s) + m - zy, e / s
        seen.extend([weakref.ref(z), weakref.ref(soft)])
        try:
            real(*bound.args, **bound.kwargs)
            calls[-1]["real"] = "ran"
        except Exception as err:   # past paddle's checks, at the stub kernel
            calls[-1]["real"] = f"{type(err).__name__}: {err}"
        return (loss, soft) if a["return_softmax"] else loss

    mp_ops._c_softmax_with_cross_entropy = standin
    try:
        yield
    finally:
        mp_ops._c_softmax_with_cross_entropy = real


def fleet_ce_case(vocab=601, hidden=16, n=37, rows=8):
    """CPU path and CUDA route (is_compiled_with_cuda faked True, the stand-in above) of
    VocabParallelCE (training) and _ShardedCE (kept logits), for a head [H, Vl] and a tied
    embedding [Vl, H]; blocks of `rows` rows. Returns losses, gradients and the op's calls."""
    import types

    import numpy as np
    import paddle

    from paddletune import parallel
    from paddletune.models.linear_ce import LinearCrossEntropy
    from paddletune.parallel import vocab as pv
    from paddletune.parallel.tensor import TensorParallel

    topo = parallel.init(types.SimpleNamespace(tensor_parallel_degree=2, pipeline_parallel_degree=1,
                                               sharding="", sharding_parallel_degree=-1))
    tpg = TensorParallel(topo)
    vl = -(-vocab // tpg.degree)
    rng = np.random.RandomState(0)                         # the same on every rank
    w_full = np.zeros([vl * tpg.degree, hidden], np.float32)
    w_full[:vocab] = rng.randn(vocab, hidden) * 0.1          # padding rows are zeros (as loaded)
    h = rng.randn(n, hidden).astype(np.float32)
    t = rng.randint(0, vocab, size=n).astype(np.int64)
    t[:3] = [vocab - 1, 0, vl]                               # last real column, rank edges
    mine = w_full[tpg.rank * vl:(tpg.rank + 1) * vl]

    def run(transposed, keep):
        hp = paddle.to_tensor(h, stop_gradient=False)
        wp = paddle.to_tensor(mine if transposed else mine.T.copy(), stop_gradient=False)
        tt = paddle.to_tensor(t)
        if keep:
            z = pv._local_logits(hp, wp, transposed, tpg, vocab)
            loss = pv._ShardedCE.apply(z, tt, tpg)
        else:
            loss = pv.VocabParallelCE.apply(hp, wp, tt, transposed, tpg, vocab)
        loss.backward()
        return {"loss": float(loss), "dh": hp.grad.numpy().tolist(), "dw": wp.grad.numpy().tolist()}

    saved_block, saved_cuda = LinearCrossEntropy.BLOCK_ELEMENTS, paddle.is_compiled_with_cuda
    LinearCrossEntropy.BLOCK_ELEMENTS = rows * 4 * vl
    out = {"rank": tpg.rank, "vl": vl, "cpu": {}, "fleet": {}, "calls": {}}
    try:
        for transposed in (False, True):
            for keep in (False, True):
                key = f"{'tied' if transposed else 'head'}_{'kept' if keep else 'blocks'}"
                out["cpu"][key] = run(transposed, keep)
                calls = out["calls"][key] = []
                paddle.is_compiled_with_cuda = lambda: True
                try:
                    with _fleet_standin(tpg, calls):
                        out["route"] = pv.fleet_ce_route()
                        out["fleet"][key] = run(transposed, keep)
                finally:
                    paddle.is_compiled_with_cuda = saved_cuda
    finally:
        LinearCrossEntropy.BLOCK_ELEMENTS = saved_block
    out["route_after"] = pv.fleet_ce_route()
    return out
