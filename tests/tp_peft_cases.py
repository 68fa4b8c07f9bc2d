"""Launched cases of tests/test_tp_peft_recorder.py: one training run of a PEFT / quantized
method under tensor parallelism, with every collective recorded (parallel/recorder.py) and
tagged by the planned module whose forward issued it.

`peft_step_case` also runs in the test process with tp=1 (the one-process reference of the
losses). It returns per rank: the logged losses, the recorded wire-level ("pg") collectives as
[tag, op, ranks, shapes, dtypes], the bytes of this rank's parameters and buffers by dtype, and
the planned modules' kinds.
"""
import contextlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import paddletune  # noqa: E402,F401


def _tag_planned(model, recorder):
    """Wrap the forward of every planned module (the outermost module at the plan's path: the
    PEFT wrapper when there is one) so what it issues is tagged "fwd:<path>"."""
    kinds = {}
    for name, m in model.named_sublayers():
        kind = getattr(m, "_pt_tp", None)
        if isinstance(kind, str):
            kinds[name[:-len(".base_layer")] if name.endswith(".base_layer") else name] = kind
    modules = dict(model.named_sublayers())
    for name in kinds:
        outer = modules[name]
        fwd = outer.forward

        def wrapped(*a, _fwd=fwd, _tag="fwd:" + name, **k):
            with recorder.tag(_tag):
                return _fwd(*a, **k)
        outer.forward = wrapped
    return kinds


def _local_bytes(model):
    """{dtype: bytes} of this rank's parameters (local shards) and buffers."""
    out = {}
    tensors = [p._local_value() if p.is_dist() else p for p in model.parameters()]
    tensors += [b for b in model.buffers() if b is not None]
    for t in tensors:
        key = str(t.dtype).replace("paddle.", "")
        out[key] = out.get(key, 0) + int(t.numel()) * t.element_size()
    return out


def peft_step_case(ckpt, out_dir, method="sft", quant=None, rdrop=False, neftune=False, tp=2,
                   steps=2, micro=2):
    """`steps` optimizer steps of `method` (sft | lora | prefix | adapter | lowrank_adapter |
    bitfit, optionally R-Drop / NEFTune, quant an algorithm name for QLoRA) at TP=`tp`."""
    from conftest import training_args
    from dp_worker import variable_length_data
    from paddletune import parallel, peft, runtime
    from paddletune.args import ModelArgument, QuantArgument
    from paddletune.loading import load_model
    from paddletune.parallel import recorder
    from paddletune.trainer import Trainer

    args = training_args(out_dir, per_device_train_batch_size=micro, max_steps=steps, logging_steps=1,
                         learning_rate=2e-2, max_grad_norm=1.0, tensor_parallel_degree=tp,
                         adam_epsilon=1e-4)
    topo = parallel.init(args)
    runtime.set_seed(0)
    model = load_model(ckpt, topology=topo,
                       quant=QuantArgument(weight_quantize_algo=quant) if quant else None)
    margs = ModelArgument(model_name_or_path=ckpt, lora=method == "lora", lora_rank=4,
                          prefix_tuning=method == "prefix", num_prefix_tokens=3,
                          adapter=method == "adapter", adapter_size=8,
                          lowrank_adapter=method == "lowrank_adapter", bitfit=method == "bitfit",
                          neftune=neftune, neftune_noise_alpha=5.0, rdrop=rdrop, rdrop_alpha=2.0)
    setup = peft.apply(model, margs)
    marks, log = [], []   # log length after each optimizer step (what follows is the export)
    trainer = Trainer(model, args, train_dataset=variable_length_data(16, 0), trainable=setup.trainable,
                      export_fn=lambda d: None, topology=topo, loss_fn=setup.loss_fn,
                      callbacks=[lambda tr, info: marks.append(len(log))])
    kinds = _tag_planned(model, recorder) if tp > 1 else {}
    with recorder.record() as rec, recorder.tag("step"), _counting_mp_ops(recorder, rec) as mp_calls:
        log = rec
        trainer.train()
    hist = trainer.state["log_history"]
    wire = [[e["tag"], e["op"], e["ranks"], e["shapes"], e["dtypes"]]
            for e in log[:marks[-1]] if e["level"] == "pg"]
    return {"losses": [r["loss"] for r in hist if "loss" in r], "wire": wire, "kinds": kinds,
            "mp_calls": [c[:3] for c in mp_calls if c[3] < marks[-1]],
            "bytes": _local_bytes(model), "rank": topo.rank,
            "trainable": sorted(setup.trainable) if setup.trainable else None}


@contextlib.contextmanager
def _counting_mp_ops(recorder, log):
    """Within the block, every call of fleet's mp_ops._c_identity / _mp_allreduce (looked up by
    parallel/tensor.py at call time) is listed as [tag, function, input shape, len(log)]; the
    recorder's innermost tag (read from its state: test code) names the planned module."""
    from paddle.distributed.fleet.layers.mpu import mp_ops

    calls, originals = [], {k: getattr(mp_ops, k) for k in ("_c_identity", "_mp_allreduce")}

    def counting(name):
        def fn(x, *a, **k):
            tags = recorder._state["tags"]
            calls.append([tags[-1] if tags else None, name, [int(s) for s in x.shape],
                          len(log)])
            return originals[name](x, *a, **k)
        return fn

    for k in originals:
        setattr(mp_ops, k, counting(k))
    try:
        yield calls
    finally:
        for k, v in originals.items():
            setattr(mp_ops, k, v)
