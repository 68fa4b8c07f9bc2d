"""Training cases for the tensor-parallel tests, run by tests/launch_cases.py on launched ranks
and in the test process for the single-process reference (same function, world size 1).

Every case trains a checkpoint for a few steps on variable-length copy data (target counts differ
per micro-batch and per rank), with gradient clipping active, evaluates, and returns per rank:
the logged losses and grad norms, eval loss / accuracy, the local and global shape of every
parameter, the eval logits width, and what was communicated (our collectives, and the engine's
reshards counted from paddle's own log). Rank 0 writes the trained tensors (whole, gathered)
to out_dir/trained.safetensors (and the starting tensors to initial.safetensors).

adam_epsilon defaults to 1e-4 here: with AdamW's usual 1e-8 every element moves by about
lr * sign(g) per step, so elements whose gradient is at float32 rounding level (summation order
differs between layouts: partial sums over TP ranks) flip sign and differ by a whole step; a
larger epsilon keeps the update proportional to the gradient there, so the comparison measures
the gradients' agreement, not AdamW's amplification of rounding noise.
"""
import contextlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import paddletune  # noqa: E402,F401
import engine_reshards  # noqa: E402  (registers paddle's reshard log sites before any DTensor op)


def copy_data(n, seed, vocab=600):
    from dp_worker import variable_length_data

    return variable_length_data(n=n, seed=seed)


def _gather_trainable(model, trainer, tpg):
    """{name: whole array} of the trainable tensors (gathered from the TP ranks)."""
    if tpg is None:   # (paddle's stage 3: each tensor's slices gathered)
        return trainer.par.whole_arrays(trainer.trainable)
    from paddletune.parallel.tensor import full_array

    log, tpg.log = tpg.log, None
    out = {n: full_array(model, n, p, tpg) for n, p in trainer.trainable.items()}
    tpg.log = log
    return out


def train_case(ckpt, out_dir, method="sft", tp=1, micro=4, accum=2, steps=5, max_grad_norm=0.05,
               lr=1e-2, lora_dropout=0.0, quant=None, eval_n=8, record=True, adam_epsilon=1e-4,
               save_steps=0, resume=None, neftune=False, rdrop=False, pp=1, recompute=False,
               zero_padding=False, trace=False, recompute_granularity="full", sharding="",
               sharding_degree=-1, vpp=1, fixed_length=None, dtype="float32", p2p=False,
               sharding_config="", segment_size=0):
    import numpy as np
    import paddle

    from paddletune.parallel import group_sharded

    # paddle's stage 3 slices tensors of more than segment_size elements; the rule's value (S
    # alignment units) would leave most of these tiny models' tensors whole: 0 slices them all
    group_sharded.SEGMENT_SIZE = segment_size

    from conftest import training_args
    from paddletune import parallel, peft, runtime
    from paddletune.args import ModelArgument, QuantArgument
    from paddletune.models import hf
    from paddletune.loading import load_model
    from paddletune.trainer import Trainer

    args = training_args(out_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                         max_steps=steps, logging_steps=1, learning_rate=lr, max_grad_norm=max_grad_norm,
                         tensor_parallel_degree=tp, pipeline_parallel_degree=pp, recompute=recompute,
                         recompute_granularity=recompute_granularity,
                         lr_scheduler_type="constant", seed=0,
                         per_device_eval_batch_size=4, adam_epsilon=adam_epsilon,
                         save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                         resume_from_checkpoint=resume, sharding=sharding,
                         sharding_parallel_degree=sharding_degree, virtual_pp_degree=vpp,
                         sharding_parallel_config=sharding_config)
    topo = parallel.init(args)
    runtime.set_seed(0)
    q = QuantArgument(weight_quantize_algo=quant) if quant else None
    model = load_model(ckpt, topology=topo, quant=q, dtype=dtype)
    margs = ModelArgument(model_name_or_path=ckpt, lora=method in ("lora", "qlora"), lora_rank=4,
                          lora_dropout=lora_dropout, prefix_tuning=method == "prefix",
                          num_prefix_tokens=3, adapter=method == "adapter", adapter_size=8,
                          lowrank_adapter=method == "lowrank_adapter", bitfit=method == "bitfit",
                          neftune=neftune, neftune_noise_alpha=5.0, rdrop=rdrop, rdrop_alpha=2.0)
    setup = peft.apply(model, margs)
    data, dev = copy_data(32, 0), copy_data(eval_n, 1)
    marks = []   # length of the collective log after each optimizer step
    held = []    # per step: [example ids], resident trainable numel, sharding's measured holdings
    source = None
    if zero_padding:   # packed rows of different lengths every step
        from paddletune.data.packing import PackedSource

        source = PackedSource(data, 64, micro, accum, topo.data_degree, topo.data_rank, seed=0)
    pipe = getattr(model, "pipeline", None)
    if pipe is not None and trace:
        pipe.trace = []
    collate = None
    if fixed_length:   # every batch padded to one length (fleet's interleaved schedule's shape cache)
        from paddletune.data.collate import pad_batch

        collate = lambda ex: pad_batch(ex, 0, length=fixed_length)  # noqa: E731
    trainer = Trainer(model, args, train_dataset=data, eval_dataset=dev, trainable=setup.trainable,
                      collate=collate,
                      export_fn=lambda d: None, topology=topo, loss_fn=setup.loss_fn, train_source=source,
                      callbacks=[lambda tr, info: marks.append(len(tr.par.tp.log) if tr.par.tp else 0),
                                 lambda tr, info: held.append(_holdings(tr, info))])
    tpg = getattr(model, "tensor_parallel", None)
    shard = trainer.par.shard   # stage 3 holds only its own tensors until a step
    if shard is not None:
        shard.gather(trainer.trainable)
    initial = _gather_trainable(model, trainer, tpg)
    if shard is not None:
        shard.release(trainer.trainable)
    if tpg is not None:
        tpg.log = []
    from paddletune.parallel import recorder

    with engine_reshards.record(enabled=record and tpg is not None) as rec, \
            (recorder.record() if p2p else contextlib.nullcontext([])) as wire:
        trainer.train()
    p2p_log = [{k: e[k] for k in ("op", "ranks", "shapes", "dtypes", "bytes")} for e in wire
               if e["level"] == "pg" and e["op"] in ("send", "recv")]
    comm = list(tpg.log[:marks[-1]]) if tpg is not None else []   # the training steps only
    widths = []
    orig = trainer.loss_fn

    def loss_fn(m, b):
        out = orig(m, b)
        widths.append(int(out.label_logits.shape[-1]) if out.label_logits is not None else None)
        return out
    loss_fn.token_loss = getattr(orig, "token_loss", False)   # (MoE: token loss + aux terms)
    trainer.loss_fn = loss_fn
    metrics = trainer.evaluate()
    hist = trainer.state["log_history"]
    result = {"losses": [r["loss"] for r in hist if "loss" in r],
              "grad_norms": [r["grad_norm"] for r in hist if "grad_norm" in r],
              "eval": {"loss": metrics["loss"], "accuracy": metrics["accuracy"]},
              "shapes": {n: [list(p.shape), list((p._local_value() if p.is_dist() else p).shape)]
                         for n, p in model.named_parameters()},
              "eval_logits_width": widths[0] if widths else None, "comm": comm,
              "engine_reshards": dict(rec.calls), "rank": topo.rank,
              "trace": pipe.trace if pipe is not None and trace else None,
              "p2p": p2p_log if p2p else None,
              "pp_engine": (f"{type(pipe.engine).__module__}.{type(pipe.engine).__name__}"
                            if pipe is not None else None),
              "stage": topo.pp_rank, "held": held, "degrees": topo.degrees,
              "shared": _shared_facts(pipe, model, wire) if pipe is not None else None,
              "owned": list(shard.owned) if shard is not None else None,   # (sharding: this rank's)
              # which engine updates: fleet's wrappers down to paddle's optimizer (None: ours)
              "optimizer_chain": trainer.par.hybrid.chain if trainer.par.hybrid is not None else None,
              "held_dtypes": {n: str(p.dtype) for n, p in trainer.trainable.items()},
              "trainable_numel": sum(paddle_numel(p) for p in trainer.trainable.values()),
              "trainable_count": len(trainer.trainable)}
    state = _gather_trainable(model, trainer, tpg)
    if topo.tp_rank == 0 and topo.data_rank == 0:   # one writer per pipeline stage
        os.makedirs(out_dir, exist_ok=True)
        suffix = f"-stage{topo.pp_rank}" if topo.pp_degree > 1 else ""
        for fname, tensors in (("trained", state), ("initial", initial)):
            hf.write_safetensors(os.path.join(out_dir, f"{fname}{suffix}.safetensors"),
                                 {n: np.asarray(a, np.float32) for n, a in tensors.items()})
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)
    return result


def _shared_facts(pipe, model, wire):
    """fleet's shared layers of this stage's PipelineLayer (SharedLayerDesc items, shared comm per
    key: ranks, group id, attributes, built class, whether the attribute is the model's tied
    embedding weight) and, from the recorder, the all-reduces issued over those groups."""
    from paddle.distributed.fleet.meta_parallel import SharedLayerDesc

    layer = pipe.engine._layers
    w = getattr(model.get_input_embeddings(), "weight", None)

    def is_tied_weight(t):   # the parameter itself, or (tensor parallel) its local shard's storage
        return t is w or (w is not None and w.is_dist() and t.data_ptr() == w._local_value().data_ptr())

    comm = {k: {"ranks": list(c["ranks"]), "group": c["group"].id, "attrs": list(c["weight_attr"]),
                "layer": type(c["layer"]).__name__,
                "is_tied_weight": [is_tied_weight(getattr(c["layer"], a)) for a in c["weight_attr"]]}
            for k, c in layer.shared_comm.items()}
    groups = {c["group"] for c in comm.values()}
    return {"descs": [d.layer_name for d in layer._layers_desc if isinstance(d, SharedLayerDesc)],
            "built": {k: type(v).__name__ for k, v in layer.shared_layers.items()},
            "comm": comm, "pp_group": pipe.topo.hcg.get_pipe_parallel_group().id,
            "reduces": [{k: e[k] for k in ("op", "ranks", "shapes", "dtypes", "group")} for e in wire
                        if e["level"] == "api" and e.get("group") in groups]}


def _holdings(trainer, info):
    """After an optimizer step: this rank's example ids, its resident trainable elements, and
    what sharding measured (gradient / optimizer-state elements, stage 3's peak in a step)."""
    import numpy as np
    ids = [int(i) for mb in info["micro_batches"] for i in mb["example_ids"].tolist()]
    shard = trainer.par.shard.stats if trainer.par.shard is not None else None
    opt = sum(int(t.size) for d in (trainer.optimizer.exp_avg, trainer.optimizer.exp_avg_sq)
              for t in d.values())
    resident = (trainer.par.shard.resident(trainer.trainable) if shard is not None
                else sum(paddle_numel(p) for p in trainer.trainable.values()))
    lw = getattr(trainer.par.shard, "layerwise", None) if shard is not None else None
    if lw is not None:   # stage 3 by blocks: the most a step should hold at once
        size = lambda names: sum(int(np.prod(trainer.par.shard.shapes[n])) for n in names)  # noqa: E731
        mine = lambda names: [n for n in names if not trainer.par.shard.owns(n)]  # noqa: E731
        shard = dict(shard, peak_bound=resident + size(mine(lw.rest)) + max(size(mine(u.names)) for u in lw.units))
    from paddletune.parallel.group_sharded import held_numel

    frozen = [p for p in trainer.model.parameters() if p.stop_gradient]   # (a PEFT backbone)
    return {"ids": ids, "resident": resident, "shard": dict(shard or {}),
            # frozen parameters: [elements held now (paddle's stage 3: slices), whole, count]
            "frozen": [sum(held_numel(p) for p in frozen), sum(paddle_numel(p) for p in frozen), len(frozen)],
            "optimizer_numel": opt}


def reshard_control():
    """Positive control for engine_reshards: an explicit all-gather (Shard -> Replicate) and an
    engine op on a sharded DTensor are seen by the recorder."""
    import paddle
    import paddle.distributed as dist

    from paddletune import parallel

    topo = parallel.init()
    mesh = dist.ProcessMesh(list(range(topo.world_size)), dim_names=["tp"])
    x = dist.shard_tensor(paddle.arange(8, dtype="float32").reshape([4, 2]), mesh, [dist.Shard(0)])
    with engine_reshards.record() as rec:
        full = dist.reshard(x, mesh, [dist.Replicate()])
        y = (x * 2).sum()   # a reduction over the sharded axis: the engine reshards
    return {"calls": dict(rec.calls), "full": full._local_value().numpy().tolist(), "y": float(y)}


def script_main(relpath, argv):
    """Run a script's main(argv) in this (launched) process; returns its exit code."""
    from conftest import load_script

    return load_script(relpath).main(list(argv))


def _rss_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def load_memory(ckpt, tp=2):
    """Peak RSS growth (MB) of this process while loading `ckpt` (under TP=tp, or whole with
    tp=1), from the RSS before the load to the peak during it (the kernel's peak counter reset
    first through /proc/self/clear_refs). Run it in a fresh process (first case of a launch):
    memory a previous case freed would be reused and hide part of the growth."""
    from conftest import training_args
    from paddletune import parallel
    from paddletune.loading import load_model

    topo = parallel.init(training_args("/tmp/unused", tensor_parallel_degree=tp)) if tp > 1 else parallel.single()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # reset VmHWM to the current RSS
    before = _rss_mb("VmRSS")
    model = load_model(ckpt, topology=topo)
    return {"growth_mb": _rss_mb("VmHWM") - before,
            "local_numel": sum(paddle_numel(p) for p in model.parameters())}


def paddle_numel(p):
    import numpy as np

    t = p._local_value() if p.is_dist() else p
    return int(np.prod(t.shape))


def sharded_vocab_ops(vocab=601, n=7, seed=0):
    """Per-token log-probabilities, argmax and R-Drop's KL on vocabulary shards (V=601 padded to
    602 at TP=2) against numpy over the whole vocabulary, with the gradient of the log-probs."""
    import numpy as np
    import paddle

    from paddletune import parallel
    from paddletune.parallel import vocab as V
    from paddletune.parallel.tensor import TensorParallel
    from conftest import training_args

    topo = parallel.init(training_args("/tmp/unused", tensor_parallel_degree=2))
    tp = TensorParallel(topo)
    rng = np.random.default_rng(seed)
    full = (rng.standard_normal((n, vocab)) * 3).astype(np.float32)
    full2 = (full + rng.standard_normal((n, vocab)) * 0.5).astype(np.float32)
    t = rng.integers(0, vocab, n)
    t[0], t[1] = 300, 600                          # the last row of rank 0, the last real column
    vl = -(-vocab // 2)

    def shard(x):
        loc = np.full((n, vl), V.NEG, np.float32)
        part = x[:, tp.rank * vl:(tp.rank + 1) * vl]
        loc[:, :part.shape[1]] = part
        return paddle.to_tensor(loc, stop_gradient=False)
    z = shard(full)
    lp = V.sharded_token_logprobs(z, paddle.to_tensor(t), tp)
    lp.sum().backward()
    a, b = shard(full), shard(full2)
    kl = V.sharded_symmetric_kl(a, b, tp)
    (kl * paddle.to_tensor(np.arange(1, n + 1, dtype=np.float32))).sum().backward()
    real = min(vl, vocab - tp.rank * vl)
    return {"logprobs": lp.numpy().tolist(), "argmax": V.sharded_argmax(z.detach(), tp).numpy().tolist(),
            "grad": z.grad.numpy()[:, :real].tolist(), "kl": kl.numpy().tolist(),
            "kl_grad1": a.grad.numpy()[:, :real].tolist(), "kl_grad2": b.grad.numpy()[:, :real].tolist(),
            "rank": tp.rank, "vl": vl, "full": full.tolist(), "full2": full2.tolist(), "t": t.tolist()}
