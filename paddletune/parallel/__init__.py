"""Process topology and the collectives the trainer needs.

    topo = paddletune.parallel.init(training_args)   # after paddle.distributed.launch, or alone

Data parallel: every rank holds the whole model, reads a disjoint share of each global batch,
and gradients are summed with all_reduce. (Tensor/pipeline/sharding plug in here later: the
per-model TP plan lives in ModelSpec.tp_plan, checkpoints are layout-independent.)
Built on plain paddle.distributed collectives, which work over gloo on CPU.
"""
import os
from dataclasses import dataclass

import paddle
import paddle.distributed as dist


@dataclass
class Topology:
    world_size: int = 1
    rank: int = 0
    dp_degree: int = 1
    dp_rank: int = 0
    tp_degree: int = 1
    pp_degree: int = 1
    sharding_degree: int = 1

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def distributed(self):
        return self.world_size > 1


_TOPOLOGY = Topology()


def world_from_env():
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1")), int(os.environ.get("PADDLE_TRAINER_ID", "0"))


def init(training_args=None):
    """Start the process group when launched with several processes; return the Topology."""
    global _TOPOLOGY
    world, rank = world_from_env()
    if world > 1 and not dist.is_initialized():
        dist.init_parallel_env()
    _TOPOLOGY = Topology(world_size=world, rank=rank, dp_degree=world, dp_rank=rank)
    return _TOPOLOGY


def topology():
    return _TOPOLOGY


def all_reduce_sum(t):
    """Sum a tensor over all data-parallel ranks (in place); identity when alone."""
    if _TOPOLOGY.dp_degree > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_scalars(values):
    """Sum a list of python floats over ranks with one collective."""
    if _TOPOLOGY.dp_degree <= 1:
        return [float(v) for v in values]
    t = paddle.to_tensor([float(v) for v in values], dtype="float64")
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(v) for v in t.numpy()]


def all_reduce_grads(grads, bucket_numel=1 << 24):
    """Sum a list of gradient tensors over data-parallel ranks; returns the summed list.
    Gradients are flattened into few large buckets: one collective per bucket, not per tensor."""
    if _TOPOLOGY.dp_degree <= 1:
        return grads
    out, bucket, size = [], [], 0
    for g in grads:
        bucket.append(g)
        size += g.size
        if size >= bucket_numel:
            out += _reduce_bucket(bucket)
            bucket, size = [], 0
    if bucket:
        out += _reduce_bucket(bucket)
    return out


def _reduce_bucket(grads):
    flat = paddle.concat([g.reshape([-1]) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    sizes = [g.size for g in grads]
    return [piece.reshape(g.shape) for piece, g in zip(paddle.split(flat, sizes), grads)]


def barrier():
    if _TOPOLOGY.world_size > 1:
        dist.barrier()


def all_gather_json(obj):
    """[obj of rank 0, obj of rank 1, ...] for a JSON-able obj (e.g. RNG states)."""
    if _TOPOLOGY.world_size <= 1:
        return [obj]
    import json

    import numpy as np

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8).astype(np.int32)
    sizes = []
    dist.all_gather(sizes, paddle.to_tensor([len(data)], dtype="int64"))
    longest = max(int(s.numpy()[0]) for s in sizes)
    padded = np.zeros(longest, np.int32)
    padded[:len(data)] = data
    parts = []
    dist.all_gather(parts, paddle.to_tensor(padded))
    return [json.loads(p.numpy()[:int(s.numpy()[0])].astype(np.uint8).tobytes().decode())
            for p, s in zip(parts, sizes)]
