"""A recorder of the collectives a process issues, for tests (what was communicated, in which
dtype, over which ranks).

    with recorder.record() as log:          # in one process: log is a list of dicts
        ...
    PADDLETUNE_RECORD_COLLECTIVES=DIR       # in launched workers: parallel.init installs it and
                                            # each rank appends JSON lines to DIR/rank<R>.jsonl

Two levels are recorded, each entry a dict:
  {"level": "pg",  "op": "all_reduce", "ranks": [0, 1], "shapes": [[4, 8]], "dtypes": ["float32"],
   "bytes": 128, "tag": ...}
      one per call of a `paddle.base.core.ProcessGroup` method (the wire: what gloo / NCCL is
      asked to move; `*_on_calc_stream` variants included, op named with the suffix);
  {"level": "api", "op": "all_reduce", ...}
      one per call of a `paddle.distributed` function (all_reduce, broadcast, all_gather, send,
      recv, ...), which then issues one "pg" entry (or none where it fails); it also carries
      "group": the id of the Group passed (None when none was), so two groups over the same
      ranks are told apart.
`bytes` sums numel x element size over the tensors passed (for all_gather the output list and the
input: count what you need from `shapes`). `ranks` are the group's global ranks (the world when
no group is found). `tag` is the innermost `recorder.tag(name)` active in this process, else None.

What it cannot see: collectives issued from C++ without passing through Python - the
`paddle.DataParallel` reducer's bucketed all-reduces during backward (EagerReducer), and on GPU
builds the communication ops run inside kernels (`c_identity`, `mp_allreduce_sum`, `c_concat`,
the static-graph / to_static comm ops, NCCL calls of fused optimizers). A test that needs to
know those ran checks their effect (e.g. gradients equal across ranks right after backward).
"""
import contextlib
import json
import os

_PG_METHODS = ("all_reduce", "all_reduce_on_calc_stream", "broadcast", "broadcast_on_calc_stream",
               "all_gather", "all_gather_on_calc_stream", "all_gather_into_tensor",
               "all_gather_into_tensor_on_calc_stream", "send", "send_on_calc_stream", "recv",
               "recv_on_calc_stream", "reduce", "reduce_on_calc_stream", "scatter", "gather",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "all_to_all_tensor", "alltoall", "alltoall_single", "barrier")
_API_FUNCS = ("all_reduce", "broadcast", "all_gather", "send", "recv", "isend", "irecv", "reduce",
              "scatter", "gather", "reduce_scatter", "alltoall", "alltoall_single", "barrier",
              "all_gather_object", "broadcast_object_list")

_state = {"sinks": [], "tags": [], "originals": None}


def _tensors(value):
    """The paddle Tensors in a call argument (a tensor, or a list / tuple of them)."""
    import paddle

    if isinstance(value, paddle.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _group_ranks(pg):
    """Global ranks of the paddle Group whose process_group is `pg` (None: the world)."""
    import paddle.distributed.collective as collective

    for g in collective._get_group_map().values():
        if getattr(g, "process_group", None) is pg:
            return list(g.ranks)
    return None


def _entry(level, op, args, kwargs, ranks):
    ts = [t for a in list(args) + list(kwargs.values()) for t in _tensors(a)]
    shapes, dtypes, nbytes = [], [], 0
    for t in ts:
        shapes.append([int(s) for s in t.shape])
        dtypes.append(str(t.dtype).replace("paddle.", ""))
        try:
            nbytes += int(t.numel()) * t.element_size()
        except Exception:   # an uninitialized receive buffer: its shape is still known
            pass
    return {"level": level, "op": op, "ranks": ranks, "shapes": shapes, "dtypes": dtypes,
            "bytes": nbytes, "tag": _state["tags"][-1] if _state["tags"] else None}


def _emit(entry):
    for sink in _state["sinks"]:
        sink(entry)


def _wrap_pg(name, original):
    def method(self, *args, **kwargs):
        if _state["sinks"]:
            _emit(_entry("pg", name, args, kwargs, _group_ranks(self)))
        return original(self, *args, **kwargs)
    return method


def _wrap_api(name, original):
    def fn(*args, **kwargs):
        if _state["sinks"]:
            group = kwargs.get("group")
            ranks = list(group.ranks) if group is not None and hasattr(group, "ranks") else None
            entry = _entry("api", name, args, kwargs, ranks)
            entry["group"] = getattr(group, "id", None)   # which group object (None: the default)
            _emit(entry)
        return original(*args, **kwargs)
    fn.__wrapped__ = original
    return fn


def _install():
    """Patch ProcessGroup methods and paddle.distributed functions once (idempotent); the
    wrappers do nothing but call through while no sink is attached."""
    if _state["originals"] is not None:
        return
    import paddle.distributed as dist
    from paddle.base import core

    pg_cls = core.ProcessGroup
    originals = {"pg": {}, "api": {}}
    for name in _PG_METHODS:
        if hasattr(pg_cls, name):
            originals["pg"][name] = getattr(pg_cls, name)
            setattr(pg_cls, name, _wrap_pg(name, originals["pg"][name]))
    for name in _API_FUNCS:
        if hasattr(dist, name):
            originals["api"][name] = getattr(dist, name)
            setattr(dist, name, _wrap_api(name, originals["api"][name]))
    _state["originals"] = originals


def uninstall():
    """Restore paddle's methods and functions (tests)."""
    originals = _state["originals"]
    if originals is None:
        return
    import paddle.distributed as dist
    from paddle.base import core

    for name, fn in originals["pg"].items():
        setattr(core.ProcessGroup, name, fn)
    for name, fn in originals["api"].items():
        setattr(dist, name, fn)
    _state["originals"] = None
    _state["sinks"].clear()


@contextlib.contextmanager
def record():
    """Within the block, every collective of this process is appended to the yielded list."""
    _install()
    log = []
    _state["sinks"].append(log.append)
    try:
        yield log
    finally:
        _state["sinks"].remove(log.append)


@contextlib.contextmanager
def tag(name):
    """Label the entries recorded within the block (e.g. a test case or a training phase)."""
    _state["tags"].append(name)
    try:
        yield
    finally:
        _state["tags"].pop()


ENV = "PADDLETUNE_RECORD_COLLECTIVES"


def install_from_env(rank):
    """When $PADDLETUNE_RECORD_COLLECTIVES names a directory, append every collective of this
    process to DIR/rank<rank>.jsonl (one JSON object a line, flushed per line) for the rest of the
    process. Called by parallel.init in launched workers; returns the file path or None."""
    out = os.environ.get(ENV)
    if not out:
        return None
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"rank{rank}.jsonl")
    f = open(path, "a", buffering=1)
    _install()
    _state["sinks"].append(lambda e: f.write(json.dumps(e) + "\n"))
    return path


def read(path):
    """The entries of one rank's JSON-lines file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
