"""A launched worker for tests/test_finish.py: tensor parallel 2 x data parallel 2 on 4 ranks
(per-group TCPStores hosted by ranks 0 and 2, the job's store by rank 0), ranks reaching the end
at different times (DELAYS, seconds), then parallel.finish twice:

    python -m paddle.distributed.launch --nproc_per_node 4 tests/finish_worker.py OUT_DIR

1. finish(leave=False) returns after the barrier and the store handshake: each rank writes
   OUT_DIR/rank<R>.json with when it arrived and when finish returned, and the handshake's two
   counters as the job's store holds them afterwards;
2. finish(3) ends the process: the launch exits 3, and nothing after it runs (no "after" file,
   not the sys.exit(9) below)."""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import paddletune  # noqa: E402,F401  (CPU threads before paddle)

DELAYS = [0.0, 1.5, 0.5, 2.5]   # rank 0 (the job's store host) first, rank 3 last


def main(out_dir):
    import paddle
    import paddle.distributed as dist
    from paddle.distributed import collective

    from conftest import training_args
    from paddletune import parallel
    from paddletune.parallel import engine

    rank = int(os.environ["PADDLE_TRAINER_ID"])
    topo = parallel.init(training_args(out_dir, tensor_parallel_degree=2))
    sums = {}
    for axis in ("tp", "dp"):   # each group's store and gloo pairs in use
        t = paddle.to_tensor([float(rank)])
        sums[axis] = float(topo.all_reduce_sum(t, axis).numpy()[0])
    time.sleep(DELAYS[rank])
    arrived = time.time()
    engine.finish(0, leave=False)
    returned = time.time()
    call = len(engine._finishes)
    store = collective._default_store
    counts = {phase: int(store.add(engine.FINISH_KEY.format(call, phase), 0)) for phase in ("passed", "left")}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "arrived": arrived, "returned": returned, "counts": counts,
                   "sums": sums, "groups": {a: topo.ranks(a) for a in ("tp", "dp")}}, f)
    dist.barrier()   # the host keeps the store up until every rank has read it
    parallel.finish(3)
    open(os.path.join(out_dir, f"after{rank}"), "w").close()   # never reached
    sys.exit(9)


if __name__ == "__main__":
    main(sys.argv[1])
