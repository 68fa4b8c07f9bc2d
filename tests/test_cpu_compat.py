"""The CPU-only shims of paddle internals (parallel/cpu_compat.py): each test fails loudly when
paddle changes what a shim wraps, so the shim is revisited rather than silently skipped."""
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
