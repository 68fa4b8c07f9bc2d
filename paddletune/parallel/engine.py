"""fleet.init: paddle's hybrid-parallel engine starts here, with more than one process only.

    hcg = start_fleet(degrees, world, rank)    # fleet's HybridCommunicateGroup

`hybrid_configs` come from our degrees (topology.degrees_from_args, PaddleNLP's rules) with the
order ours has always had, outermost first: dp, pp, sharding, (sep, off), mp - so fleet's groups
and coordinates are the ones topology.group_ranks computes; `check_groups` asserts that for every
axis on every launch (cheap: lists of ints), so a change in fleet's layout fails at start.

fleet.init creates every group collectively through paddle.distributed.new_group; on CPU builds
that runs inside cpu_compat.fleet_groups (one TCPStore per non-global gloo group, without which
4-process grids of overlapping groups fail to connect). fleet's Python logging (its loggers under
"paddle.distributed", e.g. topology.py's HybridParallelInfo table) and anything fleet.init prints
(stdout and stderr, incl. init_parallel_env's "Modified FLAGS" banner) go to <log dir>/fleet.rank<R>.log (log dir: $PADDLE_LOG_DIR, else ./log, where
paddle.distributed.launch writes its workerlogs), not to the terminal.

Which groups come from fleet: dp, pp, sharding and tp (fleet's data / pipe / sharding / model
parallel groups). Still ours, created by topology.create_groups: "data" (dp and sharding ranks
together: fleet has no such group), and the expert groups "ep" / "ep_data" (topology.py
docstring: carved out of the data ranks). fleet's EPHybridCommunicateGroup lays its own grid over
the whole world (paddle 3.3.1 topology.py:770, order pipe, moe_sharding, expert, data, sharding,
sep, context, model) and replaces HybridCommunicateGroup as the one hcg; read (not run): its
expert groups come from a separate [pipe, moe_sharding, expert] grid (topology.py:803-811), i.e.
experts are carved out of the sharding side, while ours are carved out of the data ranks
(dp x sharding, with sharding refused under expert parallel). Probed at run time (expert.py
docstring, tests/test_expert_groups_fleet.py): it refuses dp > 1 with experts, so those stay
ours, through the same create_groups path.
"""
import contextlib
import logging
import os

FLEET_AXES = {"dp": "get_data_parallel_group", "pp": "get_pipe_parallel_group",
              "sharding": "get_sharding_parallel_group", "tp": "get_model_parallel_group"}


def strategy_for(degrees):
    """fleet.DistributedStrategy with hybrid_configs from {dp, pp, sharding, tp} degrees."""
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": degrees["dp"], "mp_degree": degrees["tp"], "pp_degree": degrees["pp"],
        "sharding_degree": degrees["sharding"], "order": ["dp", "pp", "sharding", "sep", "mp"]}
    return strategy


def log_path(rank):
    out = os.environ.get("PADDLE_LOG_DIR") or "log"
    return os.path.join(out, f"fleet.rank{rank}.log")


@contextlib.contextmanager
def fleet_output_to_file(rank):
    """fleet's loggers (names under "paddle.distributed") and stdout within the block go to
    log_path(rank); the loggers keep writing there afterwards."""
    path = log_path(rank)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    f = open(path, "a", buffering=1)
    handler = logging.StreamHandler(f)
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(name)s: %(message)s"))

    def redirect():
        for name, lg in list(logging.Logger.manager.loggerDict.items()):
            if name.startswith("paddle.distributed") and isinstance(lg, logging.Logger):
                lg.handlers = [handler]
                lg.propagate = False

    redirect()   # loggers created at import time
    with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        yield
    redirect()   # and those created during fleet.init


_started = {}   # degrees -> hcg: a process that calls parallel.init again (tests run several
                # cases per launch) reuses fleet's groups instead of creating them anew


def start_fleet(degrees, world, rank):
    """fleet.init(is_collective=True, strategy) and its HybridCommunicateGroup (the process
    group is started here when it is not yet: init_parallel_env's FLAGS banner goes to the file
    too). Called again with the same degrees, the same hcg (fleet keeps one per process)."""
    key = tuple(sorted(degrees.items()))
    if key in _started:
        from paddle.distributed import fleet

        if fleet.get_hybrid_communicate_group() is _started[key]:
            return _started[key]
    import numpy as np
    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet
    from paddle.distributed.fleet.base import topology as fleet_topology  # its logger too

    from .cpu_compat import fleet_groups, install_mp_ops

    # fleet builds its hcg once per process (fleet.init skips it while topology's
    # _HYBRID_PARALLEL_GROUP is set): another layout in the same process needs it cleared
    fleet_topology._HYBRID_PARALLEL_GROUP = None
    # with mp > 1 fleet.init reseeds paddle from numpy's global generator
    # (model_parallel_random_seed): both are restored, so starting the engine does not move
    # any random stream the single-process run would also draw from
    np_state, pd_state = np.random.get_state(), paddle.get_rng_state()
    with fleet_output_to_file(rank), fleet_groups(world):
        if not dist.is_initialized():
            dist.init_parallel_env()
        fleet.init(is_collective=True, strategy=strategy_for(degrees))
    np.random.set_state(np_state)
    paddle.set_rng_state(pd_state)
    install_mp_ops()   # fleet's tensor-parallel f / g on gloo (a no-op on CUDA builds)
    _started[key] = fleet.get_hybrid_communicate_group()
    return _started[key]


def check_groups(hcg, rank, degrees):
    """{axis: fleet's group of this rank} for the axes whose groups are proper subsets of the
    world, after asserting fleet's ranks and coordinates equal topology.group_ranks /
    coordinates (the layout every other part of paddletune computes)."""
    from .topology import coordinates, group_ranks

    world = 1
    for d in degrees.values():
        world *= d
    coords = coordinates(rank, degrees)
    fleet_coords = {"dp": hcg.get_data_parallel_rank(), "pp": hcg.get_stage_id(),
                    "sharding": hcg.get_sharding_parallel_rank(), "tp": hcg.get_model_parallel_rank()}
    if fleet_coords != coords:
        raise RuntimeError(f"fleet's coordinates of rank {rank} {fleet_coords} differ from "
                           f"paddletune's {coords} (degrees {degrees})")
    groups = {}
    for axis, getter in FLEET_AXES.items():
        group = getattr(hcg, getter)()
        ours = group_ranks(rank, degrees, axis)
        if list(group.ranks) != ours:
            raise RuntimeError(f"fleet's {axis} group of rank {rank} is {list(group.ranks)}, "
                               f"paddletune's {ours} (degrees {degrees})")
        if 1 < len(ours) < world:
            groups[axis] = group
    return groups
