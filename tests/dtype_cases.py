"""Loading in the compute dtype on launched ranks, for tests/test_dtype.py (tests/launch_cases.py).

load_case: load a checkpoint under TP or PP with `dtype` and write every parameter this rank
loaded (its local slice under TP, the stage's whole tensors under PP) to out_dir/rank<R>/ as .npy
(bfloat16 as its uint16 words); returns {name: paddle dtype}, and under TP the float64 logits of
a fixed batch (this rank's vocabulary columns) with their dtype.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import paddletune  # noqa: E402,F401

IDS = [[5, 9, 17, 33, 2, 101, 7, 64], [3, 200, 11, 8, 12, 40, 90, 6]]


def load_case(ckpt, dtype, out_dir, tp=1, pp=1):
    import numpy as np
    import paddle

    from conftest import training_args
    from paddletune import parallel
    from paddletune.loading import load_model
    from paddletune.parallel.pipeline import owned

    topo = parallel.init(training_args("/tmp/unused", tensor_parallel_degree=tp,
                                       pipeline_parallel_degree=pp))
    model = load_model(ckpt, topology=topo, dtype=dtype)
    keep = owned(model, topo.pp_rank, topo.pp_degree) if pp > 1 else (lambda n: True)
    out = os.path.join(out_dir, f"rank{topo.rank}")
    os.makedirs(out, exist_ok=True)
    seen = {}
    for name, p in model.named_parameters():
        if not keep(name):
            continue
        local = p._local_value() if p.is_dist() else p
        np.save(os.path.join(out, name + ".npy"), local.numpy(), allow_pickle=False)
        seen[name] = str(local.dtype)
    result = {"dtypes": seen}
    if tp > 1 and dtype == "float64":   # a forward in float64 (CPU has no 16-bit matmul):
        # the TP layers must keep the dtype (no float32 hop)
        with paddle.no_grad():
            logits = model(input_ids=paddle.to_tensor(IDS)).logits
        local = logits._local_value() if logits.is_dist() else logits
        result["logits_dtype"] = str(local.dtype)
        np.save(os.path.join(out, "logits.npy"), local.numpy(), allow_pickle=False)
    return result


def predictor_case(argv):
    """llm/predictor.py main(argv) on this rank: its return code, and the parameter dtypes of
    the model it loaded (load_for_generation watched)."""
    import io

    import paddletune.loading as loading
    from conftest import load_script

    real, seen = loading.load_for_generation, []

    def spy(*a, **k):
        out = real(*a, **k)
        seen.append(sorted({str(p.dtype) for p in out[0].parameters()}))
        return out
    loading.load_for_generation = spy
    try:
        rc = load_script("llm/predictor.py").main(list(argv), stdout=io.StringIO())
    finally:
        loading.load_for_generation = real
    return {"rc": rc, "dtypes": seen}
