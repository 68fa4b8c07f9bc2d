"""The CPU-only shims of paddle internals (parallel/cpu_compat.py): each test fails loudly when
paddle changes what a shim wraps, so the shim is revisited rather than silently skipped."""
import contextlib
import inspect

import paddle
import pytest

from paddletune.parallel import cpu_compat


def test_gloo_group_shim_wraps_the_internal_it_expects():
    import paddle.distributed.collective as collective

    impl = collective._new_process_group_impl    # the function the shim replaces per new_group
    names = list(inspect.signature(impl).parameters)
    assert names[:7] == ["backend", "store", "rank", "world_size", "group_name", "pg_options",
                         "group_id"], names
    src = inspect.getsource(collective.new_group)
    # new_group must still hand the default store to _new_process_group_impl, else the per-group
    # store is never used and 4-process grids hit "Connection refused" again
    assert "_new_process_group_impl(" in src and "_default_store" in src
    assert hasattr(paddle.base.core, "TCPStore")


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="the shim is CPU-only")
def test_gloo_group_shim_is_scoped_to_one_call():
    import paddle.distributed.collective as collective

    before = collective._new_process_group_impl
    with cpu_compat._own_store([0, 1], 4):
        assert collective._new_process_group_impl is not before
    assert collective._new_process_group_impl is before
    # the 4-process grids that need it run in tests/test_tensor_parallel.py (DP2 x TP2)


# ---------------------------------------------------------------- fleet's mp_ops (tensor parallel f / g)

def _mp_ops_originals():
    from paddle.distributed.fleet.layers.mpu import mp_ops

    return (cpu_compat.MP_OPS_ORIGINALS.get("_c_identity", mp_ops._c_identity),
            cpu_compat.MP_OPS_ORIGINALS.get("_mp_allreduce", mp_ops._mp_allreduce))


def test_mp_ops_shims_pin_paddles_signatures():
    c_identity, mp_allreduce = _mp_ops_originals()
    assert str(inspect.signature(c_identity)) == str(inspect.signature(cpu_compat.c_identity)) == \
        "(tensor, group=None, skip_c_identity_dynamic=False)"
    assert list(inspect.signature(mp_allreduce).parameters) == \
        list(inspect.signature(cpu_compat.mp_allreduce).parameters) == \
        ["tensor", "op", "group", "use_calc_stream", "use_model_parallel", "skip_c_identity_dynamic"]
    assert inspect.signature(mp_allreduce).parameters["use_calc_stream"].default is True


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="the shim is CPU-only")
def test_paddles_c_identity_still_fails_on_cpu():
    import types

    c_identity, _ = _mp_ops_originals()
    group = types.SimpleNamespace(id=0, is_member=lambda: True)
    with pytest.raises(RuntimeError, match="Do not support c_identity for cpu kernel"):
        c_identity(paddle.ones([2]), group=group)
    # when this passes, paddle has a CPU kernel: remove the _c_identity shim (cpu_compat.py 3.)


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="the shim is CPU-only")
def test_paddles_mp_allreduce_still_fails_on_gloo(monkeypatch):
    import socket
    import types

    from paddle.base import core

    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = core.TCPStore("127.0.0.1", port, True, 1, 30)
    pg = core.ProcessGroupGloo.create(store, 0, 1, 9001)      # a real one-rank gloo group
    group = types.SimpleNamespace(id=9001, process_group=pg, is_member=lambda: True)
    _, mp_allreduce = _mp_ops_originals()
    with pytest.raises(NotImplementedError, match="GLOO does not support all_reduce with sync_op "
                                                  "and use_calc_stream"):
        mp_allreduce(paddle.ones([2]), group=group)
    # when this passes, gloo runs calc-stream all-reduces: remove the _mp_allreduce shim


def test_nothing_is_patched_on_a_cuda_build(monkeypatch):
    import paddle.distributed as dist
    from paddle.distributed.fleet.layers.mpu import mp_ops

    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    before = (mp_ops._c_identity, mp_ops._mp_allreduce, dist.new_group)
    assert cpu_compat.install_mp_ops() is False
    with cpu_compat.fleet_groups(4):
        assert dist.new_group is before[2]
    assert (mp_ops._c_identity, mp_ops._mp_allreduce, dist.new_group) == before


# ---------------------------------------------------------------- group_sharded_parallel (stage 2 / 3)

def test_group_sharded_shim_pins_paddles_device_gates():
    """The three device gates, the device-id parse and the convert_gpu path shim 4 answers are
    still in paddle's code; if one goes (paddle learned CPU), the shim's part for it goes too."""
    from paddle.distributed.fleet.meta_parallel.sharding import (group_sharded_optimizer_stage2 as opt2,
                                                                 group_sharded_stage3 as s3,
                                                                 group_sharded_storage as storage)
    from paddle.distributed.sharding import group_sharded as entry

    src = inspect.getsource(entry.group_sharded_parallel)
    assert "paddle.device.get_all_custom_device_type()" in src and "only support gpu, xpu" in src
    src = inspect.getsource(opt2.GroupShardedOptimizerStage2.__init__)
    assert "core.get_all_custom_device_type()" in src
    assert 'int(paddle.get_device().split(":")[1])' in src
    assert "core.get_all_custom_device_type()" in inspect.getsource(s3.GroupShardedStage3.__init__)
    assert list(inspect.signature(storage.ParamStorage.add_rank_params).parameters) == [
        "self", "trainable_params", "param2align", "convert_gpu"]
    assert "convert_gpu" in inspect.getsource(storage.ParamStorage.add_rank_params)   # handed on to:
    src = inspect.getsource(storage.ParamStorage._add_param_as_view)
    assert "if convert_gpu:" in src and "param._clear_data()" in src
    for name in cpu_compat.GROUP_SHARDED_GATES:   # the gated callers' files are where they were
        assert name[0] in {"group_sharded.py", "group_sharded_optimizer_stage2.py", "group_sharded_stage3.py"}
    assert {f[0] for f in cpu_compat.GROUP_SHARDED_GATES} == {
        entry.__file__.rsplit("/", 1)[-1], opt2.__file__.rsplit("/", 1)[-1], s3.__file__.rsplit("/", 1)[-1]}


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="the shim is CPU-only")
def test_paddles_group_sharded_still_refuses_cpu_without_the_shim():
    """Without shim 4 paddle refuses the CPU device at its entry (so the shim is still needed);
    with it, only the gated callers see "cpu" and everything else sees paddle's answer."""
    from paddle.distributed.sharding import group_sharded_parallel

    model = paddle.nn.Linear(4, 4)
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    if not cpu_compat.GROUP_SHARDED_ORIGINALS:
        with pytest.raises(AssertionError, match="only support gpu, xpu and custom_device"):
            group_sharded_parallel(model, opt, level="os_g")
    assert cpu_compat.install_group_sharded() is True
    assert "cpu" not in paddle.device.get_all_custom_device_type()   # not for other callers
    assert "cpu" not in paddle.base.core.get_all_custom_device_type()
    assert paddle.get_device() == cpu_compat.GROUP_SHARDED_ORIGINALS["get_device"]()


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="the shim is CPU-only")
def test_group_sharded_world_groups_get_their_own_store(monkeypatch):
    """paddle's group_sharded classes still create their whole-world group with new_group over the
    job's store (the call sites shim 4 gates: "Connection refused" in test_sharding_scripts'
    second 4-rank case without it); with the shim a call from those callers (file and function
    checked) runs inside shim 1's per-group store, any other caller's does not."""
    import types

    import paddle.distributed.collective as collective
    from paddle.distributed.fleet.meta_parallel.sharding import (group_sharded_optimizer_stage2 as opt2,
                                                                 group_sharded_stage2 as s2,
                                                                 group_sharded_stage3 as s3)

    world_group = "collective.new_group(collective._get_global_group().ranks)"
    assert world_group in inspect.getsource(s2.GroupShardedStage2.__init__)
    assert world_group in inspect.getsource(s3.GroupShardedStage3.__init__)
    assert "new_group(_get_global_group().ranks)" in inspect.getsource(opt2.GroupShardedOptimizerStage2.__init__)
    assert "new_group(ranks)" in inspect.getsource(opt2.GroupShardedOptimizerStage2._set_broadcast_overlap)
    assert "from paddle.distributed.collective import _get_global_group, new_group" in inspect.getsource(opt2)
    assert {f for f, _ in cpu_compat.GROUP_SHARDED_NEW_GROUP} == {
        m.__file__.rsplit("/", 1)[-1] for m in (s2, s3, opt2)}
    assert cpu_compat.install_group_sharded() is True
    assert collective.new_group is not cpu_compat.GROUP_SHARDED_ORIGINALS["new_group"]
    assert opt2.new_group is not cpu_compat.GROUP_SHARDED_ORIGINALS["opt2_new_group"]
    stores, made = [], []

    @contextlib.contextmanager
    def own_store(ranks, world, whole_world_too=False):
        stores.append((ranks, world, whole_world_too))
        yield

    monkeypatch.setattr(cpu_compat, "_own_store", own_store)
    monkeypatch.setattr(collective, "_get_global_group", lambda: types.SimpleNamespace(nranks=4))
    for key in ("new_group", "opt2_new_group"):
        monkeypatch.setitem(cpu_compat.GROUP_SHARDED_ORIGINALS, key, lambda ranks=None, *a, **k: made.append(ranks))
    gated = {}   # a function named like paddle's caller, in a file named like its file
    exec(compile("def __init__(new_group):\n    return new_group([3, 0, 1, 2])\n",
                 "/paddle/x/group_sharded_stage2.py", "exec"), gated)
    gated["__init__"](collective.new_group)
    assert stores == [([0, 1, 2, 3], 4, True)] and made == [[3, 0, 1, 2]]
    collective.new_group([0, 1])   # any other caller: paddle's new_group as it is
    opt2.new_group([0, 1])
    assert stores == [([0, 1, 2, 3], 4, True)] and made == [[3, 0, 1, 2], [0, 1], [0, 1]]


def test_group_sharded_shim_does_nothing_on_a_cuda_build(monkeypatch):
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    before = (paddle.device.get_all_custom_device_type, paddle.get_device)
    assert cpu_compat.install_group_sharded() is False
    assert (paddle.device.get_all_custom_device_type, paddle.get_device) == before
# ---------------------------------------------------------------- fleet's pipeline engine on gloo

def test_pipeline_shims_pin_what_fleet_reads():
    """pipeline_on_gloo sets ParallelEnv._device_id (which PipelineLayer reads and paddle sets
    for CUDA / XPU / custom builds only) and pp_configs.use_batch_p2p_comm False (the batched
    path sends on the calc stream, refused by gloo): both still exist and are still read."""
    import paddle.distributed as dist
    from paddle.distributed import fleet
    from paddle.distributed.fleet.meta_parallel import pipeline_parallel
    from paddle.distributed.fleet.meta_parallel.parallel_layers import pp_layers
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication

    assert "dist.ParallelEnv().device_id" in inspect.getsource(pp_layers.PipelineLayer.__init__)
    assert "self._device_id" in inspect.getsource(dist.ParallelEnv.device_id.fget)
    env_src = inspect.getsource(dist.ParallelEnv.__init__)
    assert "is_compiled_with_cuda()" in env_src and "self._device_id = int(" in env_src
    assert "_batched_p2p_ops if batch_p2p_comm else _p2p_ops" in inspect.getsource(p2p_communication._p2p_helper)
    assert ".use_batch_p2p_comm" in inspect.getsource(pipeline_parallel.PipelineParallel.__init__)
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"pp_degree": 2}
    set_any = cpu_compat.pipeline_on_gloo(strategy)
    assert set_any == (not paddle.is_compiled_with_cuda())
    if set_any:
        assert strategy.hybrid_configs["pp_configs"].use_batch_p2p_comm is False
        assert dist.ParallelEnv().device_id == 0


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="the shim is CPU-only")
def test_paddles_cpu_parallel_env_still_lacks_a_device_id():
    """The reason for the _device_id shim: on a CPU build ParallelEnv never sets it."""
    import paddle.distributed as dist

    saved = dist.ParallelEnv.__dict__.get("_device_id")
    if saved is not None:
        del dist.ParallelEnv._device_id
    try:
        with pytest.raises(AttributeError):
            dist.ParallelEnv().device_id
    finally:
        if saved is not None:
            dist.ParallelEnv._device_id = saved


def test_pair_routing_pins_the_p2p_path_it_redirects():
    """route_p2p_over_pairs replaces p2p_communication's module-global `_hcg` by a view whose
    pipeline group routes by peer: fleet must still take its p2p group from that global, and
    paddle's send / recv must still ask the group for the peer's rank before its process_group.
    (4 stages on gloo without it: a TIMEOUT; with it: tests/test_pipeline_fleet.py pp4 / vpp.)"""
    import importlib

    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    assert "_hcg = hcg" in inspect.getsource(p2p.initialize_p2p_groups)
    assert "group = hcg.get_pipe_parallel_group()" in inspect.getsource(p2p._p2p_ops)
    assert "_hcg.get_pipe_parallel_group()" in inspect.getsource(p2p.P2pHelper._send_meta)
    for fn in ("send", "recv"):
        mod = importlib.import_module(f"paddle.distributed.communication.stream.{fn}")
        src = inspect.getsource(getattr(mod, fn))
        # the peer's rank is asked first, then _<fn>_in_dygraph uses group.process_group
        assert src.index("_get_or_throw_group_rank(") < src.index(f"_{fn}_in_dygraph("), fn
        assert f"group.process_group.{fn}(" in inspect.getsource(getattr(mod, f"_{fn}_in_dygraph"))

    class Pair:
        def __init__(self, ranks):
            self.ranks, self.process_group = ranks, object()

        def get_group_rank(self, r):
            return self.ranks.index(r)

    class PP:
        ranks, nranks, rank, id, name = [0, 1, 2], 3, 1, 7, "pp"

    pairs = {0: Pair([0, 1]), 2: Pair([1, 2])}
    routes = cpu_compat._PairRoutes(PP(), pairs)
    assert routes.get_group_rank(2) == 1 and routes.process_group is pairs[2].process_group
    assert routes.get_group_rank(0) == 0 and routes.process_group is pairs[0].process_group


# ---------------------------------------------------------------- DygraphShardingOptimizerV2 (split_param)
def _gloo_group(gid):
    """A real one-rank gloo process group and a Group-like view of it."""
    import socket
    import types

    from paddle.base import core

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = core.TCPStore("127.0.0.1", port, True, 1, 30)
    pg = core.ProcessGroupGloo.create(store, 0, 1, gid)
    return types.SimpleNamespace(id=gid, process_group=pg, is_member=lambda: True, nranks=1, rank=0,
                                 ranks=[0], world_size=1), store


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="the shim is CPU-only")
def test_paddles_gloo_still_lacks_reduce_scatter(monkeypatch):
    """What shim 7 stands in for: gloo's reduce_scatter (V2's gradient reduction) and the fused
    buffer's alignment table on a CPU build. When these pass, remove the parts of the shim."""
    import paddle.distributed as dist
    from paddle.distributed.fleet.utils import tensor_fusion_helper as tfh

    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "1")
    group, _store = _gloo_group(9002)
    original = cpu_compat.SPLIT_PARAM_ORIGINALS.get("reduce_scatter", dist.reduce_scatter)
    with pytest.raises(NotImplementedError, match="GLOO does not support reduce_scatter"):
        original(paddle.zeros([2]), paddle.ones([2]), group=group, sync_op=False)
    alignment = cpu_compat.SPLIT_PARAM_ORIGINALS.get("alignment", tfh.alignment)
    assert "cpu" not in alignment and alignment["gpu"] == 256
    monkeypatch.setattr(tfh, "__current_device_type__", None)
    monkeypatch.setattr(tfh, "alignment", alignment)
    with pytest.raises(AssertionError, match="tensor fusion helper now only support"):
        tfh.get_current_device_type()


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="the shim is CPU-only")
def test_split_param_shim_installs_what_v2_reads(monkeypatch):
    """After shim 7: the name V2's buffer calls (paddle.distributed.reduce_scatter) is the
    emulation, "cpu" aligns as "gpu" (256 bytes), and the device type is "cpu"; the emulation
    writes the group's sum into a view of the input (as V2 passes it), SUM and AVG."""
    import paddle.distributed as dist
    from paddle.distributed import ReduceOp
    from paddle.distributed.fleet.utils import tensor_fusion_helper as tfh

    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "1")
    assert cpu_compat.install_split_param() is True
    assert dist.reduce_scatter is cpu_compat.reduce_scatter
    assert tfh.alignment["cpu"] == 256 and tfh.get_current_device_type() == "cpu"
    group, _store = _gloo_group(9003)
    buf = paddle.arange(4, dtype="float32") + 1.0
    view = buf._slice(0, 4)
    cpu_compat.reduce_scatter(view, buf, group=group, sync_op=False).wait()
    assert buf.numpy().tolist() == [1.0, 2.0, 3.0, 4.0]   # one rank: its part is the whole sum
    out = paddle.zeros([4])
    cpu_compat.reduce_scatter(out, [paddle.ones([2]), paddle.full([2], 3.0)], op=ReduceOp.AVG, group=group)
    assert out.numpy().tolist() == [1.0, 1.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="SUM or AVG only"):
        cpu_compat.reduce_scatter(out, buf, op=ReduceOp.MAX, group=group)


def test_split_param_shim_does_nothing_on_a_cuda_build(monkeypatch):
    import paddle.distributed as dist

    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    before = dist.reduce_scatter
    assert cpu_compat.install_split_param() is False
    assert dist.reduce_scatter is before


# ---------------------------------------------------------------- stage 3 offload (shim 8)

def test_offload_shim_pins_paddles_host_device_copies():
    """The three call sites shim 8 answers are still in paddle's stage 3 as it reads them: the
    device copy through Tensor.to(DEV + ":" + id) in _cpu2device and _clear_gradients, and
    _device2cpu's .cpu() followed by clearing its source."""
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_stage3 as s3

    flat = lambda f: "".join(inspect.getsource(f).split())   # noqa: E731 (paddle's line breaks vary)
    assert 'param.fw_storage.to(DEV+":"+(str)(DEV_ID))' in flat(s3._cpu2device)
    assert 'param.to(self._default_device+":"+(str)(DEV_ID))' in flat(s3.GroupShardedStage3._clear_gradients)
    src = flat(s3._device2cpu)
    assert "tmp_p=trans_param.cpu()trans_param._clear_data()returntmp_p" in src
    assert "_cpu2device(param)" in flat(s3._allgather_buffer)   # (the gathers' caller, offload only)
    assert "_device2cpu(param.fw_storage)" in flat(s3._release_param)
    files = {f for f, _ in cpu_compat.GROUP_SHARDED_OFFLOAD | cpu_compat.GROUP_SHARDED_TO_HOST}
    assert files == {s3.__file__.rsplit("/", 1)[-1]}
    assert {n for _, n in cpu_compat.GROUP_SHARDED_OFFLOAD} == {"_cpu2device", "_clear_gradients"}
    assert {n for _, n in cpu_compat.GROUP_SHARDED_TO_HOST} == {"_device2cpu"}


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="the shim is CPU-only")
def test_paddles_offload_copies_still_fail_on_cpu_and_the_shim_is_scoped():
    """On a CPU build "cpu:0" is still not a device string paddle takes, and .cpu() of a host
    tensor is still the tensor itself (so _device2cpu empties its own result); with shim 8 only
    functions named like paddle's callers in a file named like its file get host copies."""
    x = paddle.to_tensor([1.0, 2.0, 3.0])
    assert cpu_compat.install_group_sharded() is True
    with pytest.raises(ValueError, match="The device must be a string"):
        x.to("cpu:0")   # any other caller: paddle's answer
    assert x.cpu().data_ptr() == x.data_ptr()
    gated = {}
    exec(compile("def _cpu2device(x):\n    return x.to('cpu:0')\n"
                 "def _device2cpu(x):\n    y = x.cpu()\n    x._clear_data()\n    return y\n",
                 "/paddle/x/group_sharded_stage3.py", "exec"), gated)
    y = gated["_cpu2device"](x)
    assert y.data_ptr() != x.data_ptr() and y.numpy().tolist() == [1.0, 2.0, 3.0]
    z = gated["_device2cpu"](y)
    assert not y._is_initialized() and z.numpy().tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="The device must be a string"):   # another file, same name
        exec(compile("def _cpu2device(x):\n    return x.to('cpu:0')\n", "/paddle/x/other.py", "exec"), gated)
        gated["_cpu2device"](x)


def test_offload_shim_does_nothing_on_a_cuda_build(monkeypatch):
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    before = (paddle.Tensor.to, paddle.Tensor.cpu)
    assert cpu_compat.install_group_sharded() is False
    assert (paddle.Tensor.to, paddle.Tensor.cpu) == before
