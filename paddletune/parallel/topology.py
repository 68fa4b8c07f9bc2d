"""Process topology: parallel degrees, this rank's coordinates, and the process groups.

    topo = paddletune.parallel.init(training_args)     # once per process, after the launcher
    topo.data_degree, topo.data_rank                   # who reads which share of a global batch
    topo.all_reduce_sum(t)                             # over the data-parallel ranks (default)

Ranks are laid out as PaddleNLP / fleet order them, outermost first: dp, pp, sharding, mp (tensor
parallel innermost, so the ranks of one tensor-parallel group are adjacent):
    rank = ((dp_rank * pp + pp_rank) * sharding + sharding_rank) * tp + tp_rank
Example, 8 ranks as dp 2 x pp 2 x tp 2: rank 5 = dp 1, pp 0, tp 1; its tensor-parallel group is
[4, 5], its data-parallel group [1, 5].

Data is split over dp x sharding ranks (sharding ranks are data-parallel ranks that also split
optimizer state); tensor- and pipeline-parallel ranks of one replica read the same batch.

Expert parallel (Mixture-of-Experts, parallel/expert.py) is carved out of the data ranks, as in
Megatron / PaddleNLP: with ep = expert_parallel_degree, consecutive data ranks form an expert group
("ep": data ranks d with the same d // ep; ep rank = d % ep) and the data ranks that hold the same
experts form an expert-data group ("ep_data": the same d % ep). Example, 4 data ranks at ep 2:
ep groups [0, 1], [2, 3]; ep_data groups [0, 2], [1, 3].
"""
from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np

AXES = ("dp", "pp", "sharding", "tp")


class TopologyError(ValueError):
    """A parallel layout that cannot be built (message names both numbers)."""


def degrees_from_args(args, world_size):
    """{axis: degree} from TrainingArguments under PaddleNLP's rules: a degree of -1 or 1 is off;
    sharding_parallel_degree -1 with `sharding` set takes every remaining rank; dp is inferred as
    world / (tp * pp * sharding) and must come out whole."""
    def deg(v):
        return 1 if v in (None, -1, 0, 1) else int(v)

    tp = deg(getattr(args, "tensor_parallel_degree", 1))
    pp = deg(getattr(args, "pipeline_parallel_degree", 1))
    sharding_on = bool(getattr(args, "sharding", ""))
    sd = getattr(args, "sharding_parallel_degree", -1)
    if sharding_on and sd in (None, -1):
        if world_size % (tp * pp):
            raise TopologyError(f"world size {world_size} is not divisible by tensor_parallel_degree "
                                f"x pipeline_parallel_degree = {tp * pp}")
        sd = world_size // (tp * pp)
    sharding = deg(sd) if sharding_on else 1
    inner = tp * pp * sharding
    if world_size % inner:
        raise TopologyError(
            f"world size {world_size} (launched processes) is not divisible by tensor_parallel_degree "
            f"{tp} x pipeline_parallel_degree {pp} x sharding_parallel_degree {sharding} = {inner}; "
            "launch a multiple of that many processes or change the degrees")
    return {"dp": world_size // inner, "pp": pp, "sharding": sharding, "tp": tp}


def expert_degree_from_args(args, degrees):
    """expert_parallel_degree (-1 / 0 / 1 = off): it must divide the data-parallel degree
    (dp x sharding), whose ranks it splits the experts over."""
    v = getattr(args, "expert_parallel_degree", 1)
    ep = 1 if v in (None, -1, 0, 1) else int(v)
    data = degrees["dp"] * degrees["sharding"]
    if data % ep:
        raise TopologyError(f"expert_parallel_degree {ep} does not divide the data-parallel degree "
                            f"{data} (world / (tensor x pipeline degrees)): expert-parallel ranks are "
                            "data-parallel ranks; choose a divisor of it")
    if ep > 1 and degrees["sharding"] > 1:
        raise TopologyError(f"expert_parallel_degree {ep} with sharding_parallel_degree "
                            f"{degrees['sharding']}: sharding of expert-parallel models is not built; "
                            "use one of them")
    return ep


def coordinates(rank, degrees):
    """{axis: index} of `rank` in the dp x pp x sharding x tp grid (see the module docstring)."""
    shape = [degrees[a] for a in AXES]
    return dict(zip(AXES, (int(i) for i in np.unravel_index(rank, shape))))


def create_groups(rank, world, groups_of):
    """This rank's process group of a family of groups, created collectively: every rank creates
    every group, in the same order (group creation is collective; a rank that skipped one would
    pair its next creation with another rank's different group). groups_of(r) lists the groups
    (lists of global ranks) rank r belongs to; each distinct group is created once, in order of
    first appearance over r = 0 .. world-1. Returns None when this rank is in none of them.
    The one group-creation path of the package: Topology's axes (parallel.init), tensor
    parallel's replicated-head groups, the pipeline's stage pairs (point-to-point, tied embedding)."""
    from .cpu_compat import new_group

    seen, mine = [], None
    for r in range(world):
        for ranks in groups_of(r):
            if ranks in seen:
                continue
            seen.append(ranks)
            g = new_group(ranks, world)
            if rank in ranks:
                mine = g
    return mine


def group_ranks(rank, degrees, axis, ep=1):
    """Global ranks of `rank`'s group along `axis` ("data" = the dp and sharding axes together;
    "ep" / "ep_data" = the expert groups of the module docstring, at expert degree `ep`), in order."""
    if axis in ("ep", "ep_data"):
        data = group_ranks(rank, degrees, "data")
        d = data.index(rank)
        return data[(d // ep) * ep:(d // ep + 1) * ep] if axis == "ep" else data[d % ep::ep]
    grid = np.arange(int(np.prod([degrees[a] for a in AXES]))).reshape([degrees[a] for a in AXES])
    c = coordinates(rank, degrees)
    axes = ("dp", "sharding") if axis == "data" else (axis,)
    index = tuple(slice(None) if a in axes else c[a] for a in AXES)
    return [int(r) for r in grid[index].reshape(-1)]


@dataclass
class Topology:
    """This process's place in the job. Groups are paddle process groups (None = the world group
    or a single rank): dp / pp / sharding / tp are fleet's HybridCommunicateGroup's (`hcg`),
    data / ep / ep_data ours (engine.py says why); collectives below are no-ops along an axis
    of degree 1."""
    world_size: int = 1
    rank: int = 0
    degrees: Dict[str, int] = field(default_factory=lambda: {a: 1 for a in AXES})
    coords: Dict[str, int] = field(default_factory=lambda: {a: 0 for a in AXES})
    groups: Dict[str, object] = field(default_factory=dict)
    ep_degree: int = 1   # expert_parallel_degree (parallel/expert.py); 1 = off
    hcg: object = None   # fleet's HybridCommunicateGroup (parallel/engine.py); None alone
    # pipeline settings from the training arguments (pipeline.py): virtual_pp_degree,
    # accumulate_steps, micro_batch_size
    pipeline: Dict[str, object] = field(default_factory=dict)

    # ---------------------------------------------------------------- degrees and coordinates
    dp_degree = property(lambda self: self.degrees["dp"])
    tp_degree = property(lambda self: self.degrees["tp"])
    pp_degree = property(lambda self: self.degrees["pp"])
    sharding_degree = property(lambda self: self.degrees["sharding"])
    dp_rank = property(lambda self: self.coords["dp"])
    tp_rank = property(lambda self: self.coords["tp"])
    pp_rank = property(lambda self: self.coords["pp"])
    sharding_rank = property(lambda self: self.coords["sharding"])

    @property
    def data_degree(self):
        """Ranks that read disjoint shares of a global batch: dp x sharding."""
        return self.degrees["dp"] * self.degrees["sharding"]

    @property
    def data_rank(self):
        return self.coords["dp"] * self.degrees["sharding"] + self.coords["sharding"]

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def distributed(self):
        return self.world_size > 1

    def ranks(self, axis):
        """Global ranks of this rank's group along `axis` (dp, pp, sharding, tp or data)."""
        return group_ranks(self.rank, self.degrees, axis, self.ep_degree)

    @property
    def ep_rank(self):
        """This rank's index in its expert-parallel group (0 when expert parallel is off)."""
        return self.ranks("ep").index(self.rank)

    def size(self, axis):
        return len(self.ranks(axis))

    def describe(self):
        return ", ".join(f"{a}={self.degrees[a]}" for a in AXES)

    # ---------------------------------------------------------------- collectives
    def _group(self, axis):
        """(group, size) for a collective along `axis`; size 1 means nothing to do."""
        n = self.size(axis)
        if n <= 1:
            return None, 1
        return (None if n == self.world_size else self.groups[axis]), n

    def all_reduce_sum(self, t, axis="data"):
        """Sum tensor `t` over the ranks of `axis` in place; returns it."""
        import paddle.distributed as dist

        group, n = self._group(axis)
        if n > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    def all_reduce_scalars(self, values, axis="data") -> List[float]:
        """Sum a list of python floats over the ranks of `axis` with one collective."""
        if self.size(axis) <= 1:
            return [float(v) for v in values]
        import paddle

        t = paddle.to_tensor([float(v) for v in values], dtype="float64")
        self.all_reduce_sum(t, axis)
        return [float(v) for v in t.numpy()]

    def all_reduce_grads(self, grads, axis="data", bucket_numel=1 << 24):
        """Sum gradient tensors over the ranks of `axis`; returns the summed list. Gradients are
        flattened into few large buckets: one collective per bucket, not per tensor."""
        if self.size(axis) <= 1:
            return grads
        out, bucket, size = [], [], 0
        for g in grads:
            bucket.append(g)
            size += g.size
            if size >= bucket_numel:
                out += self._reduce_bucket(bucket, axis)
                bucket, size = [], 0
        if bucket:
            out += self._reduce_bucket(bucket, axis)
        return out

    def _reduce_bucket(self, grads, axis):
        import paddle

        flat = paddle.concat([g.reshape([-1]) for g in grads])
        self.all_reduce_sum(flat, axis)
        sizes = [g.size for g in grads]
        return [piece.reshape(g.shape) for piece, g in zip(paddle.split(flat, sizes), grads)]

    def barrier(self):
        if self.world_size > 1:
            import paddle.distributed as dist

            dist.barrier()

    def all_gather_json(self, obj):
        """[obj of rank 0, obj of rank 1, ...] over the whole job, for a JSON-able obj."""
        if self.world_size <= 1:
            return [obj]
        import json

        import paddle
        import paddle.distributed as dist

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
