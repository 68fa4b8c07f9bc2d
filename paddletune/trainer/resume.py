"""Resuming a run from a checkpoint (trainer/checkpoint.py's format, any layout that wrote it):
the Trainer's `resume_from_checkpoint`, and the best checkpoint's weights at the end.

Functions of the Trainer `t`; the checkpoint's slices are read through its parallel object
(parallel/layout.py), so any tensor / pipeline / sharding layout resumes any other with the same
global batch."""
import json
import logging
import os

import numpy as np
import paddle

from ..models import check_finite
from . import checkpoint as ckpt

logger = logging.getLogger("paddletune")


def log_resume(t, path, total, steps_per_epoch):
    """One prominent line: what a (re)run continues from and what is left."""
    if not t.main:
        return
    st, a = t.state, t.args
    step = st["global_step"]
    where = f"step {step} of {total}"
    if steps_per_epoch:
        where += (f", epoch {st['epoch'] + st['step_in_epoch'] / steps_per_epoch:.2f} of "
                  f"{total / steps_per_epoch:.2f}")
    left = (f"{total - step} steps left to train" if step < total else
            "nothing left to train: the model is exported (and evaluated) again")
    logger.warning("RESUMING from %s (%s): %s; set overwrite_output_dir: true to train from the "
                   "start", path, where, left)


def resume(t, which):
    """Load the checkpoint `which` (resume_from_checkpoint) into the Trainer `t`: trainable tensors,
    optimizer state, data position, RNG streams, trainer state. Returns its path."""
    path = ckpt.resume_path(t.args.output_dir, which)
    reader = ckpt.CheckpointReader(path)
    state = reader.trainer_state()
    check_layout(t, state, path)
    load_trainable(t, reader, path)
    names = [f"{n}.{s}" for n in t.trainable for s in ("exp_avg", "exp_avg_sq")]
    missing = [k for k in names if k not in reader.index["optimizer"]]
    if missing:
        raise ValueError(f"{path}: optimizer state lacks {missing[0]}: checkpoint from a different setup?")
    tensors = {f"{n}.{s}": t.par.read_local(reader, n, t.trainable[n], "optimizer", f"{n}.{s}")
               for n in t.optimizer.held for s in ("exp_avg", "exp_avg_sq")}   # owned ones
    for n in t.optimizer.masters():   # AMP O2: the float32 masters, where the checkpoint has them
        if f"{n}.master" in reader.index["optimizer"]:
            tensors[f"{n}.master"] = t.par.read_local(reader, n, t.trainable[n], "optimizer", f"{n}.master")
    t.optimizer.load_state_dict(tensors, state.pop("optimizer"))
    reader.release()
    rngs = state.pop("rng")
    data = state.pop("data_state", None)
    if data is not None and hasattr(t._source(), "load_state_dict"):
        t._source().load_state_dict(data[t.topo.data_rank])
    degrees = state.pop("degrees", {"dp": state.get("world_size", 1), "pp": 1, "sharding": 1, "tp": 1})
    state.pop("world_size", None)
    state.pop("global_batch", None)
    if t.main:
        ckpt.report_changed_args(state.pop("args", None), t.args, path)
    state.pop("args", None)
    if degrees == t.topo.degrees:
        ckpt.restore_rng(rngs, t.topo.rank, path)
    else:
        logger.warning("resuming under another layout (%s, checkpoint: %s): dropout RNG streams "
                       "are not carried over, they continue from the seed",
                       t.topo.describe(), ", ".join(f"{k}={v}" for k, v in degrees.items()))
    t.state.update(state)
    t._weights_at = t.state["global_step"]
    if t.main:   # the log holds what the checkpoint saw: later steps' records are dropped
        rewrite_log(t.args.output_dir, t.state["log_history"])
    return path


def rewrite_log(output_dir, records):
    """train_log.jsonl := `records` (atomic: written beside, then renamed). After a resume the
    steps after the checkpoint are trained again, so their old records would be duplicates."""
    path = os.path.join(output_dir, "train_log.jsonl")
    if not os.path.exists(path):
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in records)
    os.replace(tmp, path)


def check_layout(t, state, path):
    """Another layout may resume a checkpoint as long as every step sees the same data: the
    global batch must be equal; streamed data needs the same number of data ranks."""
    saved = state.get("global_batch")
    if saved is not None and saved != t.global_batch():
        raise ValueError(
            f"{path} was written with a global batch of {saved} examples per step, this run has "
            f"{t.global_batch()} (per_device_train_batch_size x gradient_accumulation_steps x "
            f"{t.topo.data_degree} data-parallel ranks); resume needs the same global batch")
    data = state.get("data_state")
    if data is not None and len(data) != t.topo.data_degree:
        raise ValueError(f"{path} holds the stream positions of {len(data)} data-parallel ranks "
                         f"(lazy data); this run has {t.topo.data_degree}: resume streamed "
                         "data with the same number of data-parallel ranks")


def assign(tensor, array):
    """tensor <- array (float32 from a checkpoint), narrowed by paddle for a 16-bit tensor (AMP
    O2 weights: set_value refuses a float32 array for a bfloat16 parameter)."""
    if tensor.dtype in (paddle.bfloat16, paddle.float16):
        tensor.set_value(paddle.to_tensor(np.asarray(array, np.float32)).astype(tensor.dtype))
    else:
        tensor.set_value(array)


def load_trainable(t, reader, path):
    """Read each trainable tensor's slice from the checkpoint (any layout wrote it)."""
    missing = [n for n in t.trainable if n not in reader.index["model"]]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks trainable tensors {missing[:3]} "
                         "(was it written by a different model or PEFT method?)")
    for n, p in t.trainable.items():
        want = t.par.global_shape(n, p)
        if reader.global_shape(n) != want:
            raise ValueError(f"{path}: {n} has shape {reader.global_shape(n)}, model has {want}")
        target = t.par.load_target(n, p)   # None: released under our stage 3 (its owner loads it)
        if target is not None:   # (paddle's stage 3: this rank's slice)
            assign(target, check_finite(t.par.read_local(reader, n, p), n, where=path))
