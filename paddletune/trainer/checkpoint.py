"""The one training-checkpoint format, for every parallel layout.

checkpoint-N/
  model_state.safetensors    trainable tensors, full-model names, paddle layout, float32
  optimizer.safetensors      "<name>.exp_avg", "<name>.exp_avg_sq"
  shards.json                per tensor: global shape and which slice this file holds
                             ({"axis": null} = whole tensor); parallel layouts add rank files
  trainer_state.json         step, epoch, data position, optimizer step count, RNG state,
                             log history, best metric and checkpoint
A checkpoint directory is built under a temp name and renamed when complete, so every directory
called checkpoint-N is complete; `latest_checkpoint` also requires trainer_state.json.
"""
import os
import re
import shutil

import numpy as np
import paddle

from ..io import atomic_dir, read_json, write_json
from ..models.hf import SafetensorsFile, write_safetensors

CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def rng_state():
    """paddle generator states as JSON-able lists (GeneratorState.__getstate__ gives ints)."""
    return [list(_jsonable(s.__getstate__())) for s in paddle.get_rng_state()]


def set_rng_state(state):
    current = paddle.get_rng_state()
    restored = []
    for cur, saved in zip(current, state):
        s = type(cur).__new__(type(cur))
        s.__setstate__(tuple(saved))
        restored.append(s)
    paddle.set_rng_state(restored)


def _jsonable(x):
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, bytes):
        return list(x)
    return x


def save_checkpoint(path, model_state, optim_tensors, trainer_state):
    """Write checkpoint dir `path` atomically. model_state: {name: np.ndarray}."""
    with atomic_dir(path) as tmp:
        write_safetensors(os.path.join(tmp, "model_state.safetensors"), model_state)
        write_safetensors(os.path.join(tmp, "optimizer.safetensors"), optim_tensors)
        write_json(os.path.join(tmp, "shards.json"), {
            "files": {"model_state.safetensors": {n: {"global_shape": list(a.shape), "axis": None,
                                                      "start": 0} for n, a in model_state.items()}}})
        write_json(os.path.join(tmp, "trainer_state.json"), trainer_state)
    return path


def read_tensors(path):
    st = SafetensorsFile(path)
    return {k: st.get(k) for k in st.keys()}


def load_checkpoint(path):
    """(model_state, optimizer tensors, trainer_state) of checkpoint dir `path`."""
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer_state.json)")
    return (read_tensors(os.path.join(path, "model_state.safetensors")),
            read_tensors(os.path.join(path, "optimizer.safetensors")),
            read_json(os.path.join(path, "trainer_state.json")))


def list_checkpoints(output_dir):
    """Complete checkpoint dirs in output_dir, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = CKPT_RE.match(name)
        full = os.path.join(output_dir, name)
        if m and os.path.isfile(os.path.join(full, "trainer_state.json")):
            found.append((int(m.group(1)), full))
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir):
    ckpts = list_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def rotate_checkpoints(output_dir, limit, keep=None):
    """Delete the oldest checkpoints beyond `limit`, never the one named `keep` (the best)."""
    if not limit or limit <= 0:
        return
    ckpts = list_checkpoints(output_dir)
    excess = len(ckpts) - limit
    for p in ckpts:
        if excess <= 0:
            break
        if keep and os.path.abspath(p) == os.path.abspath(keep):
            continue
        shutil.rmtree(p, ignore_errors=True)
        excess -= 1


def clean_temp_dirs(output_dir):
    """Remove temp dirs left by an interrupted save (never picked up by resume)."""
    if not os.path.isdir(output_dir):
        return
    for name in os.listdir(output_dir):
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)


def arrays(named_tensors):
    return {n: np.asarray(t.numpy(), np.float32) for n, t in named_tensors.items()}
