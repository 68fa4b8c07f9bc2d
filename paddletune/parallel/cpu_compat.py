"""CPU-only shims of paddle internals (paddle 3.3.1), installed on CPU builds only.

Each shim is gated on `not paddle.is_compiled_with_cuda()` and does nothing on NCCL builds; each
has a test (tests/test_cpu_compat.py) that fails loudly if paddle changes the internal it wraps.

1. gloo groups (`new_group`): paddle creates every gloo process group over the one global
   TCPStore with no per-group key prefix, so groups formed one after another repeat the same
   handshake keys and a 4-process job with overlapping groups ([0,1],[2,3] and [0,2],[1,3])
   fails with "Connection refused" (gloo pair.cc). Each non-global gloo group gets its own
   TCPStore instead, hosted by the group's first rank on a free port it publishes through the
   job's store (the host: that rank's address from PADDLE_TRAINER_ENDPOINTS, 127.0.0.1 when
   absent). The shim wraps paddle.distributed.collective._new_process_group_impl for the duration
   of one new_group call.
   `fleet_groups(world)` applies the same per-group store to every group fleet.init creates
   (HybridCommunicateGroup calls paddle.distributed.new_group per axis, check and p2p group)
   and to the shared-weight groups PipelineLayer creates for a tied embedding (pipeline.py:
   one per pipeline, over its first and last stage; TP2 x PP2 gives [0, 2] and [1, 3] beside
   the mp groups [0, 1], [2, 3]).
2. all-to-all (`alltoall_single`): gloo has none ("ProcessGroupGLOO does not support alltoall");
   on CPU builds an exact emulation by all_gather (every rank's rows and split sizes, each rank
   keeps the blocks addressed to it), so the expert-parallel all-to-all dispatch written for
   NCCL (parallel/expert.py) is tested here. It moves ep x the data: not for speed (CPU runs use
   the all-gather dispatch by default). On CUDA builds it is paddle's alltoall_single.
3. fleet's tensor-parallel f / g (`fleet.layers.mpu.mp_ops._c_identity`, `_mp_allreduce`):
   on CPU `_c_identity`'s forward runs the `c_identity` kernel, a stub ("Do not support
   c_identity for cpu kernel now"), and both run their all-reduce with `use_calc_stream`, which
   gloo refuses ("ProcessGroupGLOO does not support all_reduce with sync_op and use_calc_stream
   flag"). `install_mp_ops()` (parallel.init, CPU builds only) replaces the two module functions
   by PyLayers with the same signatures and math over dist.all_reduce: _c_identity = identity
   forward, sum of the gradient over the group backward; _mp_allreduce = sum forward, identity
   backward. Callers that look them up as `mp_ops._c_identity` / `mp_ops._mp_allreduce` (paddle's
   mp_layers and parallel/tensor.py) run the shim. Nothing relaxed: same group-membership return,
   same op check (SUM only) as paddle's.
4. `group_sharded_parallel` (sharding stage 2 "os_g" / stage 3 "p_g_os"): paddle refuses a CPU
   device at three call sites (group_sharded.py `group_sharded_parallel`: device in gpu / xpu /
   custom devices; group_sharded_optimizer_stage2.py and group_sharded_stage3.py `__init__`:
   compiled with CUDA / XPU or a custom device), reads the device id as
   `int(paddle.get_device().split(":")[1])` ("cpu" has no id) in GroupShardedOptimizerStage2's
   `__init__`, and ParamStorage.add_rank_params(convert_gpu=True) moves each parameter to the
   host (`_add_param_as_view`: `param.cpu()`, on CPU the tensor itself) and then
   `_clear_data()`s it: "Tensor not initialized" on CPU. `install_group_sharded()` makes "cpu"
   a custom device for those three callers only (the caller's file and function are checked),
   gives that one caller "cpu:0", and passes convert_gpu=False (the copy into the storage buffer happens either way). Measured
   (PARALLEL_NOTES.md): with these, stage 2 and 3 equal one process on gloo.
   Its groups: given no group (sharding over the whole world), GroupShardedStage2 /
   GroupShardedStage3 / GroupShardedOptimizerStage2 `__init__` create one with
   `collective.new_group(_get_global_group().ranks)` over the job's store, whose handshake keys
   the job's first world group already wrote: a peer can read the old address before the new
   one is written, "Connection refused" (gloo pair.cc), seen as tests/test_sharding_scripts.py's
   4-rank launch failing in its second case (rank 0 / 3: "connect [127.0.0.1]:25522: Connection
   refused" from group_sharded_stage2.py:91), intermittently, more often on a loaded machine.
   For those callers only (file and function checked) new_group runs through shim 1's
   per-group store, as fleet.init's groups do (`fleet_groups`).
5. fleet's pipeline engine (`pipeline_on_gloo`, parallel/pipeline.py): PipelineLayer.__init__
   reads `ParallelEnv().device_id`, whose `_device_id` paddle sets for CUDA / XPU / custom
   builds only (distributed/parallel.py:757-764: AttributeError on CPU) -> 0; and
   `pp_configs.use_batch_p2p_comm` off: batched p2p (batch_isend_irecv) sends on the calc
   stream, which gloo refuses; the plain isend / irecv path is fleet's own alternative.
6. fleet's pipeline p2p on 3+ stages (`route_p2p_over_pairs`): fleet sends activations,
   gradients and their meta messages over the whole pipeline group (p2p_communication's `_hcg.
   get_pipe_parallel_group()`). A gloo process group numbers every operation, sends and
   receives included, from one per-group counter and uses the number as the message tag, so a
   send matches its receive only if both ranks issued equally many operations on the group
   before; a middle stage talks to two neighbours, and its counter runs ahead of theirs (4
   stages: a gloo TIMEOUT in the first step). NCCL matches p2p per peer. On gloo the module's
   `_hcg` becomes a view of fleet's hcg whose pipeline group routes each send / receive to the
   2-rank group of the two stages (created collectively, one TCPStore each as in 1.); all
   other calls go to fleet's hcg unchanged. 2 stages need nothing (the group is the pair).
7. fleet's DygraphShardingOptimizerV2 (`split_param`, `install_split_param`): its fused buffers
   (tensor_fusion_helper.py) pad each parameter to `alignment[device type]` bytes x S, and the
   device type of a CPU build is "unknown" (CPUPlace has no get_device_type; the table lists
   gpu / npu / xpu only: AssertionError "tensor fusion helper now only support"): "cpu" gets the
   GPU's 256 bytes, so the padding and every rank's range are the ones a GPU run has. And gloo
   has no reduce_scatter ("ProcessGroupGLOO does not support reduce_scatter"):
   `paddle.distributed.reduce_scatter`, which V2's buffer calls for its gradients, becomes an
   emulation that all-reduces a copy of the input over the group and keeps this rank's
   contiguous part (S x the traffic of a reduce_scatter; the sums are the same). The update
   (paddletune's, on the owned flat slices) and V2's all_gather of the updated parameters are
   paddle's own.
8. stage 3 offload (`group_sharded_parallel(..., offload=True)`, level "p_g_os"; installed with
   shim 4): paddle keeps each slice on the host and moves it to the device for the gathers with
   `Tensor.to(DEV + ":" + str(DEV_ID))` (group_sharded_stage3.py `_cpu2device`) and, for the
   tensors it keeps whole, `param.to(self._default_device + ":" + str(DEV_ID))`
   (`GroupShardedStage3._clear_gradients`). On a CPU build the device is "cpu", and "cpu:0" is
   not a device string paddle accepts (ValueError from paddle.device._convert_to_place). For
   those two callers only (file and function checked) `Tensor.to("cpu:<n>")` is a copy to
   CPUPlace, what the device copy is on a GPU (a new tensor). And `_device2cpu` takes
   `trans_param.cpu()` and then `trans_param._clear_data()`: on a CPU tensor `.cpu()` returns the
   tensor itself, so the "host copy" is emptied with its source ("Tensor holds no memory" in the
   next gather); for that caller only `.cpu()` of a host tensor is a copy. Everything else in paddle's offload
   path (host slices, float32 host masters, the optimizer step under device_guard("cpu"), the
   gradient slices copied to the host) runs as paddle wrote it, with host = device.
"""
import contextlib
import os

import paddle
from paddle.autograd import PyLayer


def _endpoint_host(global_rank):
    eps = [e for e in os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e]
    return eps[global_rank].rsplit(":", 1)[0] if global_rank < len(eps) else "127.0.0.1"


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _own_store(ranks, world, whole_world_too=False):
    import paddle.distributed.collective as collective

    original = collective._new_process_group_impl

    def impl(backend, store, rank, world_size, group_name, pg_options, group_id=0, *args, **kwargs):
        if backend == "gloo" and 1 < world_size and (whole_world_too or world_size < world):
            # the group's first rank picks a free port and publishes it through the job's store
            key = f"paddletune/group_store/{group_id}"
            if rank == 0:
                port = _free_port()
                store.set(key, str(port).encode())
            else:
                port = int(bytes(store.get(key)).decode())
            store = paddle.base.core.TCPStore(_endpoint_host(ranks[0]), port, rank == 0, world_size, 900)
        return original(backend, store, rank, world_size, group_name, pg_options, group_id,
                        *args, **kwargs)

    collective._new_process_group_impl = impl
    try:
        yield
    finally:
        collective._new_process_group_impl = original


def new_group(ranks, world):
    """paddle.distributed.new_group(ranks); on CPU builds through the per-group-store shim."""
    import paddle.distributed as dist

    ranks = sorted(ranks)
    if paddle.is_compiled_with_cuda():
        return dist.new_group(ranks)
    with _own_store(ranks, world):
        return dist.new_group(ranks)


@contextlib.contextmanager
def fleet_groups(world):
    """Within the block (fleet.init), paddle.distributed.new_group(ranks, ...) runs through the
    per-group-store shim of new_group above, groups of the whole world included (fleet creates
    such groups again when a process starts it a second time with another layout, and a second
    world-sized group over the job's store repeats the first one's keys). A no-op on CUDA
    builds."""
    import paddle.distributed as dist

    if paddle.is_compiled_with_cuda():
        yield
        return
    original = dist.new_group

    def new_group_own_store(ranks=None, *args, **kwargs):
        with _own_store(sorted(ranks) if ranks else list(range(world)), world, True):
            return original(ranks, *args, **kwargs)

    dist.new_group = new_group_own_store
    try:
        yield
    finally:
        dist.new_group = original


def alltoall_single(out, x, in_split_sizes, out_split_sizes, group=None):
    """paddle.distributed.alltoall_single(out, x, in_split_sizes, out_split_sizes, group); on a
    build without it (gloo: "ProcessGroupGLOO does not support alltoall") an exact emulation by
    all_gather: every rank's rows (padded to the longest) and split sizes are gathered and each
    rank keeps the blocks addressed to it, in source order. Moves ep x the data: for testing the
    all-to-all dispatch logic on CPU, not for speed. `out` is filled in place."""
    import numpy as np
    import paddle.distributed as dist

    if paddle.is_compiled_with_cuda():
        return dist.alltoall_single(out, x, in_split_sizes=in_split_sizes,
                                    out_split_sizes=out_split_sizes, group=group)
    sizes = []
    dist.all_gather(sizes, paddle.to_tensor(np.asarray(in_split_sizes, np.int64)), group=group)
    sizes = np.stack([s.numpy() for s in sizes])             # [source, destination]
    me = (group.rank if group is not None else dist.get_rank())
    longest = int(sizes.sum(1).max())
    padded = paddle.concat([x, paddle.zeros([longest - x.shape[0]] + list(x.shape[1:]), x.dtype)]) \
        if longest > x.shape[0] else x
    parts = []
    dist.all_gather(parts, padded, group=group)
    starts = np.concatenate([np.zeros([len(sizes), 1], np.int64), np.cumsum(sizes, 1)], 1)
    blocks = [parts[s][int(starts[s, me]):int(starts[s, me + 1])] for s in range(len(sizes))]
    assert [int(b.shape[0]) for b in blocks] == [int(v) for v in out_split_sizes]
    out.set_value(paddle.concat(blocks) if blocks else out)
    return None


class _CIdentity(PyLayer):
    @staticmethod
    def forward(ctx, x, group, skip):
        ctx.group = group
        return x if skip else x.clone()

    @staticmethod
    def backward(ctx, dy):
        import paddle.distributed as dist

        dy = dy.clone()
        dist.all_reduce(dy, group=ctx.group)
        return dy


class _MpAllReduce(PyLayer):
    @staticmethod
    def forward(ctx, x, group):
        import paddle.distributed as dist

        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, dy):
        return dy


def c_identity(tensor, group=None, skip_c_identity_dynamic=False):
    """mp_ops._c_identity on gloo: identity forward (a copy, as c_identity; the tensor itself
    with skip_c_identity_dynamic, as paddle), gradient summed over `group` backward."""
    if group is not None and not group.is_member():
        return None
    return _CIdentity.apply(tensor, group, skip_c_identity_dynamic)


def mp_allreduce(tensor, op=0, group=None, use_calc_stream=True, use_model_parallel=True,
                 skip_c_identity_dynamic=False):
    """mp_ops._mp_allreduce on gloo: sum over `group` forward (into a new tensor; paddle's writes
    the input in place and returns it), identity backward."""
    import paddle.distributed as dist
    import paddle.distributed.collective as collective

    if group is not None and not group.is_member():
        return None
    assert op == dist.ReduceOp.SUM, f"Unknown parameter: {op}."
    group = collective._get_default_group() if group is None else group
    return _MpAllReduce.apply(tensor, group)


MP_OPS_ORIGINALS = {}


def install_mp_ops():
    """Replace mp_ops._c_identity / _mp_allreduce by the shims above on CPU builds (once per
    process); returns whether they are installed. Nothing is patched on CUDA builds."""
    if paddle.is_compiled_with_cuda():
        return False
    from paddle.distributed.fleet.layers.mpu import mp_ops

    if not MP_OPS_ORIGINALS:
        MP_OPS_ORIGINALS.update(_c_identity=mp_ops._c_identity, _mp_allreduce=mp_ops._mp_allreduce)
    mp_ops._c_identity, mp_ops._mp_allreduce = c_identity, mp_allreduce
    return True


# the callers (file, function) that may see "cpu" as an allowed device (shim 4)
GROUP_SHARDED_GATES = {("group_sharded.py", "group_sharded_parallel"),
                       ("group_sharded_optimizer_stage2.py", "__init__"),
                       ("group_sharded_stage3.py", "__init__")}
# the callers whose new_group gets its own store (shim 4's groups)
GROUP_SHARDED_NEW_GROUP = {("group_sharded_stage2.py", "__init__"), ("group_sharded_stage3.py", "__init__"),
                           ("group_sharded_optimizer_stage2.py", "__init__"),
                           ("group_sharded_optimizer_stage2.py", "_set_broadcast_overlap")}
# the callers whose Tensor.to("cpu:0") is a host copy (shim 8: stage 3 offload)
GROUP_SHARDED_OFFLOAD = {("group_sharded_stage3.py", "_cpu2device"),
                         ("group_sharded_stage3.py", "_clear_gradients")}
# the caller whose Tensor.cpu() must be a copy (shim 8: it clears the source right after)
GROUP_SHARDED_TO_HOST = {("group_sharded_stage3.py", "_device2cpu")}
GROUP_SHARDED_ORIGINALS = {}


def _caller_is(gates, depth=2):
    import sys

    code = sys._getframe(depth).f_code
    return (os.path.basename(code.co_filename), code.co_name) in gates


def install_group_sharded():
    """Shim 4 on CPU builds (once per process); returns whether it is installed. Nothing is
    patched on CUDA builds."""
    if paddle.is_compiled_with_cuda():
        return False
    if GROUP_SHARDED_ORIGINALS:
        return True
    from paddle.base import core
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_storage as storage

    originals = GROUP_SHARDED_ORIGINALS
    originals.update(device_types=paddle.device.get_all_custom_device_type,
                     core_device_types=core.get_all_custom_device_type, get_device=paddle.get_device,
                     add_rank_params=storage.ParamStorage.add_rank_params)

    def gate(original):
        def device_types(*args, **kwargs):
            found = original(*args, **kwargs)
            return list(found) + ["cpu"] if _caller_is(GROUP_SHARDED_GATES) else found
        return device_types

    def get_device():
        if _caller_is({("group_sharded_optimizer_stage2.py", "__init__")}):
            return "cpu:0"
        return originals["get_device"]()

    def add_rank_params(self, trainable_params, param2align, convert_gpu=True):
        return originals["add_rank_params"](self, trainable_params, param2align, False)

    import paddle.distributed.collective as collective
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_optimizer_stage2 as opt2

    originals.update(new_group=collective.new_group, opt2_new_group=opt2.new_group)

    def own_store_for(key):
        def new_group(ranks=None, *args, **kwargs):
            original = originals[key]
            if not _caller_is(GROUP_SHARDED_NEW_GROUP):
                return original(ranks, *args, **kwargs)
            world = collective._get_global_group().nranks
            with _own_store(sorted(ranks) if ranks else list(range(world)), world, True):
                return original(ranks, *args, **kwargs)
        return new_group

    collective.new_group = own_store_for("new_group")
    opt2.new_group = own_store_for("opt2_new_group")   # (imported by name there)
    originals.update(tensor_to=paddle.Tensor.to, tensor_cpu=paddle.Tensor.cpu)

    def tensor_to(self, *args, **kwargs):   # shim 8: "cpu:<n>" from the offload callers
        device = args[0] if args else kwargs.get("device")
        if (isinstance(device, str) and device.startswith("cpu:") and len(args) + len(kwargs) == 1
                and _caller_is(GROUP_SHARDED_OFFLOAD)):
            return self._copy_to(paddle.CPUPlace(), True)
        return originals["tensor_to"](self, *args, **kwargs)

    def tensor_cpu(self, *args, **kwargs):   # shim 8: the host copy _device2cpu then clears the source of
        if _caller_is(GROUP_SHARDED_TO_HOST) and self.place.is_cpu_place():
            return self._copy_to(paddle.CPUPlace(), True)
        return originals["tensor_cpu"](self, *args, **kwargs)

    paddle.Tensor.to = tensor_to
    paddle.Tensor.cpu = tensor_cpu
    paddle.device.get_all_custom_device_type = gate(originals["device_types"])
    core.get_all_custom_device_type = gate(originals["core_device_types"])
    paddle.get_device = get_device
    storage.ParamStorage.add_rank_params = add_rank_params
    return True
def pipeline_on_gloo(strategy):
    """Settings fleet's PipelineParallel needs on a CPU (gloo) build, on `strategy` (fleet's
    DistributedStrategy) before fleet.distributed_model: ParallelEnv._device_id = 0 (once) and
    hybrid_configs.pp_configs.use_batch_p2p_comm = False. Returns whether anything was set
    (nothing on CUDA builds)."""
    if paddle.is_compiled_with_cuda():
        return False
    import paddle.distributed as dist

    if not hasattr(dist.ParallelEnv(), "_device_id"):
        dist.ParallelEnv._device_id = 0
    strategy.hybrid_configs["pp_configs"].use_batch_p2p_comm = False
    return True


class _PairRoutes:
    """Stands in for the pipeline group in fleet's p2p module on gloo: dist.send / isend / recv /
    irecv ask it for the peer's rank in the group (_get_or_throw_group_rank), then for its
    process_group; both answer with the 2-rank group of this rank and that peer."""

    def __init__(self, pp_group, pairs):
        self._pp, self._pairs, self._peer = pp_group, pairs, None
        self.ranks, self.nranks, self.rank = pp_group.ranks, pp_group.nranks, pp_group.rank
        self.id, self.name = pp_group.id, pp_group.name

    def is_member(self):
        return True

    def get_group_rank(self, rank):
        self._peer = rank
        return self._pairs[rank].get_group_rank(rank)

    @property
    def process_group(self):
        return self._pairs[self._peer].process_group


class _HcgWithPairs:
    def __init__(self, hcg, routes):
        self._hcg, self._routes = hcg, routes

    def get_pipe_parallel_group(self):
        return self._routes

    def __getattr__(self, name):
        return getattr(self._hcg, name)


def route_p2p_over_pairs(hcg, stage_ranks_of, world):
    """On gloo with 3+ pipeline stages, fleet's p2p module (already initialized by
    PipelineParallel) sends over 2-rank groups (shim 6). stage_ranks_of(rank) -> the global
    ranks of rank's pipeline, in stage order. Every rank calls this (the groups are created
    collectively). Returns the {peer: group} routes, or None where nothing was changed."""
    if paddle.is_compiled_with_cuda() or hcg.get_pipe_parallel_world_size() <= 2:
        return None
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    me = paddle.distributed.get_rank()
    pipelines = sorted({tuple(stage_ranks_of(r)) for r in range(world)})
    n = len(pipelines[0])
    pairs = {}
    for s in range(n):   # the boundary s -> s + 1 (and the ring's last -> first), every pipeline
        for pipe in pipelines:
            a, b = pipe[s], pipe[(s + 1) % n]
            group = new_group([a, b], world)
            if me in (a, b):
                pairs[b if me == a else a] = group
    p2p._hcg = _HcgWithPairs(hcg, _PairRoutes(hcg.get_pipe_parallel_group(), pairs))
    return pairs


class _Done:
    """The task a synchronous emulated collective returns (wait() / is_completed())."""

    def wait(self):
        return True

    def is_completed(self):
        return True


def reduce_scatter(tensor, tensor_or_tensor_list, op=None, group=None, sync_op=True):
    """paddle.distributed.reduce_scatter on gloo (shim 7): all-reduce a copy of the input (the
    concatenation of a list) over `group`, then write this rank's contiguous part into `tensor`
    (in place: V2 passes a view of its gradient buffer). SUM and AVG, as paddle's."""
    import paddle.distributed as dist
    from paddle.distributed import ReduceOp

    op = ReduceOp.SUM if op is None else op
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"reduce_scatter emulation: SUM or AVG only, got {op}")
    src = tensor_or_tensor_list
    with paddle.no_grad():
        full = (paddle.concat([t.reshape([-1]) for t in src]) if isinstance(src, (list, tuple))
                else src.reshape([-1]).clone())
        n, r = (group.nranks, group.rank) if group is not None else (dist.get_world_size(), dist.get_rank())
        dist.all_reduce(full, op=ReduceOp.SUM, group=group)
        if op == ReduceOp.AVG:
            full = full / n
        size = full.shape[0] // n
        paddle.assign(full[r * size:(r + 1) * size].reshape(tensor.shape), output=tensor)
    return _Done()


SPLIT_PARAM_ORIGINALS = {}


def install_split_param():
    """Shim 7 on CPU builds (once per process); returns whether it is installed. Nothing is
    patched on CUDA builds."""
    if paddle.is_compiled_with_cuda():
        return False
    if SPLIT_PARAM_ORIGINALS:
        return True
    import paddle.distributed as dist
    from paddle.distributed.fleet.utils import tensor_fusion_helper as tfh

    SPLIT_PARAM_ORIGINALS.update(reduce_scatter=dist.reduce_scatter, alignment=dict(tfh.alignment),
                                 device_type=tfh.__current_device_type__)
    tfh.alignment.setdefault("cpu", tfh.alignment["gpu"])
    if tfh.__current_device_type__ is None:
        tfh.__current_device_type__ = "cpu"
    dist.reduce_scatter = reduce_scatter
    return True
