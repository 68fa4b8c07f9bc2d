"""Process topology and the collectives the trainer needs.

    topo = paddletune.parallel.init(training_args)   # after paddle.distributed.launch, or alone
    load_model(path, topology=topo); Trainer(..., topology=topo)

`init` returns an explicit Topology (parallel/topology.py: degrees, this rank's coordinates, its
process groups, collectives along an axis); nothing about the layout is kept in module state.
With more than one process, fleet.init runs first (parallel/engine.py) and the dp / pp /
sharding / tp groups are fleet's HybridCommunicateGroup's; one process alone never imports fleet.
Data parallel is built: every rank holds the whole model, reads a disjoint share of each global
batch, and gradients are summed over the data-parallel group (gloo on CPU, NCCL on GPU).
Tensor / pipeline / sharding degrees are computed here under PaddleNLP's rules (their layouts:
tensor.py, pipeline.py, sharding.py). expert_parallel_degree carves expert groups out of the data
ranks (topology.py "ep" / "ep_data" groups; the MoE layout itself: expert.py).

A launched run ends with `finish(code)` (engine.py: a world barrier, a handshake on the job's
store, os._exit; cli.finish calls it at the end of the llm/ scripts): an ordinary exit can crash
a rank after a successful run while its peers exit.
"""
import os

from .engine import finish
from .topology import (AXES, Topology, TopologyError, coordinates, create_groups, degrees_from_args,
                       expert_degree_from_args, group_ranks)

__all__ = ["init", "finish", "single", "Topology", "TopologyError", "degrees_from_args", "world_from_env"]


def world_from_env():
    """(world size, rank) as paddle.distributed.launch exports them; (1, 0) when run alone."""
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1")), int(os.environ.get("PADDLE_TRAINER_ID", "0"))


def single():
    """The topology of one process alone (tests, tools, inference)."""
    return Topology()


def init(training_args=None):
    """Start the process group when launched with several processes and return the Topology.
    Without arguments every launched rank is data parallel."""
    world, rank = world_from_env()
    degrees = (degrees_from_args(training_args, world) if training_args is not None
               else {"dp": world, "pp": 1, "sharding": 1, "tp": 1})
    ep = expert_degree_from_args(training_args, degrees) if training_args is not None else 1
    groups, hcg = {}, None
    if training_args is not None:
        from .sharding import check_offload

        check_offload(training_args, degrees, ep)   # before fleet starts (a GPU-only refusal)
    if world > 1:
        from . import engine, recorder

        recorder.install_from_env(rank)
        hcg = engine.start_fleet(degrees, world, rank)
        groups = engine.check_groups(hcg, rank, degrees)
        groups.update(_make_groups(rank, degrees, world, ep))
    return Topology(world_size=world, rank=rank, degrees=degrees,
                    coords=coordinates(rank, degrees), groups=groups, ep_degree=ep, hcg=hcg,
                    pipeline=_pipeline_settings(training_args))


def _pipeline_settings(args):
    """What fleet's pipeline engine needs from the training arguments (pipeline.py)."""
    if args is None:
        return {}
    return {"virtual": max(int(getattr(args, "virtual_pp_degree", 1) or 1), 1),   # (any argument
            "accumulate_steps": max(int(getattr(args, "gradient_accumulation_steps", 1) or 1), 1),  # class)
            "micro_batch_size": max(int(getattr(args, "per_device_train_batch_size", 1) or 1), 1)}


def _make_groups(rank, degrees, world, ep=1):
    """This rank's process group per axis (not given by fleet: engine.py) whose groups are
    proper subsets of the world."""
    groups = {}
    for axis in ("data", "ep", "ep_data"):
        size = len(group_ranks(0, degrees, axis, ep))
        if size <= 1 or size == world:
            continue
        groups[axis] = create_groups(rank, world, lambda r: [group_ranks(r, degrees, axis, ep)])
    return groups
