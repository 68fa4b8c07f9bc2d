"""Launched cases of tests/test_fleet.py (fleet.init, the topology over fleet's groups, the
collective recorder). Each returns JSON for the test to compare against hand-worked layouts."""
import os
import types


def _args(tp=1, pp=1):
    return types.SimpleNamespace(tensor_parallel_degree=tp, pipeline_parallel_degree=pp,
                                 sharding="", sharding_parallel_degree=-1)


def init_case(tp=2):
    """parallel.init on fleet: coordinates, group ranks, and which groups are fleet's."""
    from paddletune import parallel

    topo = parallel.init(_args(tp))
    hcg = topo.hcg
    fleet_groups = {"dp": hcg.get_data_parallel_group(), "tp": hcg.get_model_parallel_group(),
                    "pp": hcg.get_pipe_parallel_group(),
                    "sharding": hcg.get_sharding_parallel_group()}
    return {"rank": topo.rank, "coords": topo.coords, "hcg": type(hcg).__name__,
            "groups": {k: list(g.ranks) for k, g in topo.groups.items()},
            "is_fleets": {k: topo.groups[k] is fleet_groups[k] for k in topo.groups if k in fleet_groups},
            "fleet_log": os.path.exists(os.path.join(os.environ["PADDLE_LOG_DIR"],
                                                     f"fleet.rank{topo.rank}.log"))}


def recorder_case(tp=2):
    """Three known collectives inside recorder.record(), one outside, one tagged."""
    import paddle
    import paddle.distributed as dist

    from paddletune import parallel
    from paddletune.parallel import recorder

    topo = parallel.init(_args(tp))
    outside = paddle.ones([5])
    topo.all_reduce_sum(outside, "tp")                     # not recorded (no block)
    with recorder.record() as log:
        topo.all_reduce_sum(paddle.ones([2, 3], dtype="float64"), "tp")
        with recorder.tag("bcast"):
            dist.broadcast(paddle.arange(4, dtype="int64"), src=topo.ranks("dp")[0],
                           group=topo.groups["dp"])
        parts = []
        dist.all_gather(parts, paddle.ones([3], dtype="float32"))
    return {"rank": topo.rank, "log": log}


def _tp_step(model, tp_mod, fleet_ops):
    """One forward + backward of a fixed batch; (loss, {param: grad array}, pg-level collectives)."""
    import numpy as np
    import paddle

    from paddletune.parallel import recorder

    tp_mod.FLEET_MP_OPS = fleet_ops
    rng = np.random.RandomState(3)
    ids = paddle.to_tensor(rng.randint(3, 600, size=[2, 12]).astype("int64"))
    labels = paddle.to_tensor(np.where(rng.rand(2, 12) < 0.3, -100, ids.numpy()).astype("int64"))
    model.clear_gradients()
    with recorder.record() as log:
        out = model.tensor_parallel.causal_lm_loss(model, {"input_ids": ids, "labels": labels})
        loss = out.loss_sum / out.num_tokens
        loss.backward()
    grads = {n: tp_mod.local(p.grad).numpy().tolist() for n, p in model.named_parameters()
             if p.grad is not None}
    wire = [(e["op"], e["ranks"], e["shapes"], e["dtypes"]) for e in log if e["level"] == "pg"]
    tp_mod.FLEET_MP_OPS = True
    return float(loss), grads, wire


def mp_ops_case(ckpt, tp=2, quant=None):
    """Under TP, every planned float module is fleet's layer class and runs that class's forward
    (calls counted per module); all planned modules' communication goes through fleet's mp_ops
    (calls counted per module in forward); and loss, gradients and wire (recorder) equal those
    of our former executors (patched forwards over our PyLayers) on the same checkpoint.
    `quant`: the model's linears quantized (they keep the patched forward over mp_ops)."""
    import paddle
    from paddle.distributed.fleet import meta_parallel
    from paddle.distributed.fleet.layers.mpu import mp_ops

    from paddletune import parallel
    from paddletune.loading import load_model
    from paddletune.parallel import fleet_layers
    from paddletune.parallel import tensor as tp_mod

    topo = parallel.init(_args(tp))
    q = None
    if quant:
        from paddletune.args import QuantArgument

        q = QuantArgument(weight_quantize_algo=quant)
    model = load_model(ckpt, topology=topo, quant=q)
    planned = {n: m for n, m in model.named_sublayers() if getattr(m, "_pt_tp", False)}
    counts = {n: {"_c_identity": 0, "_mp_allreduce": 0, "fleet_forward": 0} for n in planned}
    column_inputs, current = {}, []
    originals = {k: getattr(mp_ops, k) for k in ("_c_identity", "_mp_allreduce")}
    classes = {k: getattr(meta_parallel, k) for k in
               ("ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding")}
    class_forwards = {k: c.forward for k, c in classes.items()}
    names = {id(m): n for n, m in planned.items()}

    logits_pass = {n: 0 for n in planned}   # fleet forwards in a plain forward to the logits
    phase = [counts]

    def counting(kind):
        def fn(*a, **k):
            if current and phase[0] is counts:
                counts[current[-1]][kind] += 1
            return originals[kind](*a, **k)
        return fn

    def class_counting(fwd):
        def fn(self, *a, **k):
            if phase[0] is counts:
                counts[names[id(self)]]["fleet_forward"] += 1
            else:
                logits_pass[names[id(self)]] += 1
            return fwd(self, *a, **k)
        return fn

    def entering(name, fwd):
        def fn(x, *a, **k):
            if planned[name]._pt_tp == "column" and phase[0] is counts:
                column_inputs.setdefault(id(x), x)      # kept alive: ids stay distinct
            current.append(name)
            try:
                return fwd(x, *a, **k)
            finally:
                current.pop()
        return fn

    for name, m in planned.items():
        m.forward = entering(name, m.forward)
    for k in originals:
        setattr(mp_ops, k, counting(k))
    for k, c in classes.items():
        c.forward = class_counting(class_forwards[k])
    try:
        fleet_run = _tp_step(model, tp_mod, True)
        phase[0] = logits_pass   # the LM head's forward runs here (the loss uses its weight)
        with paddle.no_grad():
            model(paddle.to_tensor([[5, 9, 17, 3]], dtype="int64"))
    finally:
        for k, v in originals.items():
            setattr(mp_ops, k, v)
        for k, c in classes.items():
            c.forward = class_forwards[k]
    n_inputs = len(column_inputs)
    fleet_layers.ENABLED = False   # the same checkpoint on our former executors
    try:
        ours = load_model(ckpt, topology=topo, quant=q)
    finally:
        fleet_layers.ENABLED = True
    ours_run = _tp_step(ours, tp_mod, False)
    return {"kinds": {n: m._pt_tp for n, m in planned.items()}, "counts": counts,
            "distinct_column_inputs": n_inputs, "logits_pass": logits_pass,
            "types": {n: type(m).__name__ for n, m in planned.items()},
            "is_fleet": {n: isinstance(m, tuple(classes.values())) for n, m in planned.items()},
            "ours_types": {n: type(m).__name__ for n, m in ours.named_sublayers()
                           if getattr(m, "_pt_tp", False)},
            "shims": {k: getattr(v, "__module__", "") for k, v in originals.items()},
            # state-dict names, global / local shapes and dtypes: fleet's layers vs the former
            "params": [_param_row(n, p) for n, p in model.state_dict().items()],
            "ours_params": [_param_row(n, p) for n, p in ours.state_dict().items()],
            "uninitialized": [n for n, p in model.named_parameters() if not p._is_initialized()],
            "fleet": fleet_run, "ours": ours_run}


def _param_row(name, p):
    loc = p._local_value() if p.is_dist() else p
    return [name, list(p.shape), list(loc.shape), str(p.dtype)]


def _fingerprint(grads):
    """Two float64 sums per gradient (plain and position-weighted): equal arrays give equal
    fingerprints; arrays from different data almost surely do not."""
    import numpy as np

    out = []
    for g in grads:
        a = np.asarray(g, np.float64).reshape(-1)
        out += [float(a.sum()), float((a * np.arange(1, a.size + 1)).sum())]
    return out


def dp_reducer_case(ckpt, out_dir, fuse_mb=1, accum=2):
    """Pure DP on paddle.DataParallel: one optimizer step of `accum` micro-batches (different data
    per rank); a hook on block 0's input gradient snapshots the last block's parameter gradients
    each micro-batch; the recorder lists what paddletune sent."""
    from conftest import training_args
    from dp_worker import variable_length_data
    from paddletune import parallel, runtime
    from paddletune.loading import load_model
    from paddletune.parallel import data as dp_data
    from paddletune.parallel import recorder
    from paddletune.trainer import Trainer

    args = training_args(out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=accum,
                         max_steps=1, logging_steps=1, max_grad_norm=0.0)
    topo = parallel.init(args)
    runtime.set_seed(0)
    model = load_model(ckpt, topology=topo)
    blocks = list(model.decoder_layers())
    last = [p for p in blocks[-1].parameters() if not p.stop_gradient]
    snaps = []

    def snapshot(grad):
        snaps.append(_fingerprint([p.grad.numpy() if p.grad is not None else [0.0] for p in last]))

    def pre_hook(layer, inputs):
        if not inputs[0].stop_gradient:
            inputs[0].register_hook(snapshot)

    blocks[0].register_forward_pre_hook(pre_hook)
    with dp_data.fuse_grad_size(fuse_mb):
        trainer = Trainer(model, args, train_dataset=variable_length_data(16, 0),
                          trainable={n: p for n, p in model.named_parameters() if not p.stop_gradient},
                          export_fn=lambda d: None, topology=topo)
    dp = trainer.par.dp
    with recorder.record() as log, recorder.tag("train"):
        trainer.train()
    big_all_reduces = [e for e in log if e["op"].startswith("all_reduce") and e["level"] == "pg"
                       and sum(_numel(s) for s in e["shapes"]) >= 64]
    return {"wrapped": type(dp.wrapped).__name__ if dp else None,
            "buckets": len(dp.wrapped.group_indices) if dp else 0,
            "find_unused": dp.find_unused_parameters if dp else None,
            "snaps": snaps, "big_all_reduces": big_all_reduces,
            "final": _fingerprint([p.numpy() for p in last])}


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def moe_dead_expert_case(out_dir, micro=2, steps=2, dead=3):
    """A tiny Mixtral whose routers never pick expert `dead` (its router logit is pushed to
    -1e4 from outside the model): no token reaches it in any micro-batch, so it gets no gradient.
    Under pure DP the reducer must be told (find_unused_parameters). Returns the losses, the
    find_unused flag and the routed-token counts of the dead expert (must be 0)."""
    import paddle

    from conftest import training_args
    from moe_ep_cases import copy_data
    from paddletune import parallel, runtime
    from paddletune.loading import load_model
    from paddletune.trainer import Trainer

    args = training_args(out_dir, per_device_train_batch_size=micro, max_steps=steps,
                         logging_steps=1, max_grad_norm=0.0, adam_epsilon=1e-4)
    topo = parallel.init(args)
    runtime.set_seed(0)
    model = load_model("paddletune/tiny-mixtral", topology=topo)
    routed = []

    def kill(layer, inputs, logits):
        mask = paddle.zeros([logits.shape[-1]], logits.dtype)
        mask[dead] = -1e4
        out = logits + mask
        k = model.config.moe["top_k"]
        routed.append(int((paddle.topk(out, k, axis=-1)[1] == dead).sum()))
        return out

    for name, m in model.named_sublayers():
        if name.endswith(".gate") and isinstance(m, paddle.nn.Linear):
            m.register_forward_post_hook(kill)
    trainer = Trainer(model, args, train_dataset=copy_data(16, 0),
                      trainable={n: p for n, p in model.named_parameters() if not p.stop_gradient},
                      export_fn=lambda d: None, topology=topo)
    dp = trainer.par.dp
    trainer.train()
    losses = None
    if topo.is_main:   # rank 0 writes the log
        from paddletune.curves import read_log

        losses = [r["loss"] for r in read_log(out_dir) if "loss" in r]
    return {"losses": losses, "find_unused": dp.find_unused_parameters if dp else None,
            "routed_to_dead": sum(routed)}
