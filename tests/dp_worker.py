"""Worker for data-parallel tests (run alone or under paddle.distributed.launch).

    python tests/dp_worker.py CKPT_DIR OUT_DIR MICRO ACCUM STEPS [resume_step] [save_steps]

Trains the checkpoint on variable-length copy data and writes, per rank, the example ids of every
step (ids-rank{r}.json); rank 0 also writes the logged losses (losses.json) and final weights
(weights.safetensors)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import paddletune  # noqa: E402,F401
from paddletune import parallel, runtime  # noqa: E402
from paddletune.models import hf  # noqa: E402
from paddletune.loading import load_model
from paddletune.trainer import Trainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import training_args  # noqa: E402


def variable_length_data(n=32, seed=0):
    """Copy examples whose source and target lengths differ wildly (1..24 target tokens)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s, t = int(rng.integers(1, 12)), int(rng.integers(1, 25))
        src = rng.integers(3, 600, size=s).tolist()
        tgt = rng.integers(3, 600, size=t).tolist()
        out.append({"input_ids": np.array([1] + src + tgt, np.int64),
                    "labels": np.array([-100] * (1 + s) + tgt, np.int64), "id": i})
    return out


def slow_saves():
    """Test hook: announce and slow down every file written into a checkpoint, so a test can
    SIGKILL the process in the middle of a save."""
    import time

    from paddletune.trainer import checkpoint

    real = checkpoint.write_safetensors

    def slow(path, *a, **k):
        print("WRITING", path, flush=True)
        real(path, *a, **k)
        time.sleep(1.0)

    checkpoint.write_safetensors = slow


def train_case(ckpt_dir, out_dir, micro, accum, steps, resume=None, save_steps=0):
    """Train `ckpt_dir` for `steps` optimizer steps of micro x accum x ranks examples; writes the
    files described in the module docstring and returns the logged losses. A case for
    tests/launch_cases.py and the body of this script's command line."""
    topo = parallel.init()
    runtime.set_seed(0)
    model = load_model(ckpt_dir, topology=topo)
    ids = []
    args = training_args(out_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                         max_steps=steps, logging_steps=1, learning_rate=1e-3, max_grad_norm=0.5,
                         save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                         resume_from_checkpoint=resume, lr_scheduler_type="linear", warmup_steps=1)
    data = variable_length_data()
    trainer = Trainer(model, args, train_dataset=data, export_fn=lambda d: None, topology=topo,
                      callbacks=[lambda tr, info: ids.append([mb["example_ids"].tolist() for mb in info["micro_batches"]])])
    trainer.train()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"ids-rank{topo.rank}.json"), "w") as f:
        json.dump(ids, f)
    with open(os.path.join(out_dir, f"topology-rank{topo.rank}.json"), "w") as f:
        json.dump({"world": topo.world_size, "rank": topo.rank, "data_degree": topo.data_degree,
                   "data_rank": topo.data_rank, "nnodes": os.environ.get("PADDLE_NNODES"),
                   "pid": os.getpid()}, f)
    losses = [e["loss"] for e in trainer.state["log_history"] if "loss" in e]
    if topo.is_main:
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump(losses, f)
        hf.write_safetensors(os.path.join(out_dir, "weights.safetensors"),
                             {n: p.numpy() for n, p in model.named_parameters()})
    return losses


def main():
    if os.environ.get("PT_SLOW_SAVE"):
        slow_saves()
    ckpt_dir, out_dir, micro, accum, steps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    resume = sys.argv[6] if len(sys.argv) > 6 and sys.argv[6] != "-" else None
    save_steps = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    train_case(ckpt_dir, out_dir, micro, accum, steps, resume, save_steps)
    from paddletune import parallel

    parallel.finish(0)   # the ordered end of a launched run (engine.finish); alone: returns


if __name__ == "__main__":
    main()
