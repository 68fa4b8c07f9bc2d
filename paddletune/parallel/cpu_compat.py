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
2. all-to-all (`alltoall_single`): gloo has none ("ProcessGroupGLOO does not support alltoall");
   on CPU builds an exact emulation by all_gather (every rank's rows and split sizes, each rank
   keeps the blocks addressed to it), so the expert-parallel all-to-all dispatch written for
   NCCL (parallel/expert.py) is tested here. It moves ep x the data: not for speed (CPU runs use
   the all-gather dispatch by default). On CUDA builds it is paddle's alltoall_single.
"""
import contextlib
import os

import paddle


def _endpoint_host(global_rank):
    eps = [e for e in os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e]
    return eps[global_rank].rsplit(":", 1)[0] if global_rank < len(eps) else "127.0.0.1"


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _own_store(ranks, world):
    import paddle.distributed.collective as collective

    original = collective._new_process_group_impl

    def impl(backend, store, rank, world_size, group_name, pg_options, group_id=0, *args, **kwargs):
        if backend == "gloo" and 1 < world_size < world:
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
