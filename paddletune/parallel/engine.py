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
import sys
import time

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


FINISH_KEY = "paddletune/finish/{}/{}"   # (call number in this process, phase) on the job's store
_finishes = []   # one entry per finish() of this process: each gets its own store keys


def running():
    """Whether this is a launched rank (PADDLE_TRAINERS_NUM > 1) whose process group is up."""
    try:
        world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    except ValueError:
        return False
    if world <= 1 or "paddle" not in sys.modules:   # (never imports paddle itself)
        return False
    import paddle.distributed as dist

    return dist.is_initialized()


def finish(code=0, timeout=120.0, leave=True):
    """The ordered end of a launched run: every rank calls it once, after its last collective;
    it leaves the process with os._exit(code) (leave=False: returns, for tests). Does nothing
    (returns) when the process group was never started (one process, or a rank that failed
    before parallel.init).

    Why. Every launched process hosts servers its peers are connected to: rank 0 the job's
    TCPStore, the first rank of each non-global gloo group that group's store (cpu_compat.py,
    shims 1 and 4), every rank the sockets of gloo's pairs. paddle keeps them in process-wide C++
    objects (each gloo group's GlooCommContext in CommContextManager, created by
    ProcessGroupGloo::CreateProcessGroupGloo with the group's store; the job's store), so an
    ordinary exit destroys them in static destructors, after Python is gone, while their
    background threads (gloo's device loop, the store's libuv daemon) still serve sockets. A peer
    that exits at that moment closes its sockets into a process that is half torn down. Ranks end
    at nearly the same time (their last collective releases them together) and load stretches
    each teardown. Seen (2026-12-03, load 14-27): 2 of 7 full tests/test_sharding.py runs failed
    after every case had written its results, one worker dying of SIGABRT in paddle's TCPStore
    daemon, one of SIGSEGV; the launcher then fails the job. Not reproduced since (2026-12-04: 49
    launches without this end, 15 of them of sharding / TP / PP cases on 2 and 4 ranks at load
    5-48, 34 small probes with ranks leaving up to 3 s apart or paused at random in their exit):
    the mechanism above is read from paddle's sources, not observed.

    What it does, in order:
      1. a barrier over the world group: no rank is still inside a collective a peer could break;
      2. a two-phase handshake on the job's TCPStore (hosted by rank 0): each rank adds itself to
         "passed", waits until all have, then adds itself to "left" and never touches a store
         again; rank 0 waits until all have left. So the store servers live until every rank
         has passed the barrier and read the count (a rank still polling never meets a closed
         server);
      3. stdout, stderr and logging handlers are flushed, and the process leaves with
         os._exit(code): no destructor of paddle's communication objects runs, so there is
         nothing for a peer's exit to race with (the kernel closes every socket at once; a peer's
         threads see an ordinary end of connection while its own state is intact).
    Every file the run writes is closed before this (checkpoints are renamed into place); the
    output_dir lock is released by the caller (cli.finish, after cli.entry's own release).
    A barrier or store that fails (a peer gone) or a wait past `timeout` seconds (a rank that
    hung) skips to step 3: the launcher reports such a job by the failed rank's code."""
    if not running():
        return
    import paddle.distributed as dist
    from paddle.distributed import collective

    world = int(os.environ["PADDLE_TRAINERS_NUM"])
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    _finishes.append(rank)
    try:
        dist.barrier()
        passed = True
    except RuntimeError:   # a peer is gone (it failed, or left without finish): nothing to order
        passed = False
    store = getattr(collective, "_default_store", None)   # the job's store (init_parallel_env)
    if passed and store is not None:
        _handshake(store, len(_finishes), world, rank, timeout)
    if not leave:
        return
    _flush()
    os._exit(code)


def _handshake(store, call, world, rank, timeout):
    """Step 2 of finish: "passed" by all, then "left" by all, the host (rank 0) waiting last."""
    passed, left = FINISH_KEY.format(call, "passed"), FINISH_KEY.format(call, "left")
    deadline = time.monotonic() + timeout
    try:
        store.add(passed, 1)
        while store.add(passed, 0) < world and time.monotonic() < deadline:
            time.sleep(0.02)
        store.add(left, 1)
        while rank == 0 and store.add(left, 0) < world and time.monotonic() < deadline:
            time.sleep(0.02)
    except RuntimeError:   # the host is gone (it failed): nothing left to wait for
        pass


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    logging.shutdown()
