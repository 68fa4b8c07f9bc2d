"""The one training-checkpoint format, for every parallel layout.

checkpoint-N/
  model_state-RRRRR.safetensors   trainable tensors written by rank R: full-model names, paddle
                                  layout, float32; each holds the slice of the tensor that R owns
  optimizer-RRRRR.safetensors     "<name>.exp_avg", "<name>.exp_avg_sq", sliced like the tensor
  shards.json                     {"version": 2, "model": {name: {"global_shape": [...],
                                  "pieces": [{"file": ..., "start": [...], "shape": [...]}]}},
                                  "optimizer": {...}}: where every slice of every tensor lives
  trainer_state.json              step, epoch, data position, optimizer step count, RNG states per
                                  rank (with the rank's coordinates), log history, best metric,
                                  the layout and the global batch it was written under
  meta.json                       (when the run says) the base model and the model arguments (PEFT
                                  method and settings), so llm/merge_tp_and_pp_params.py can write
                                  the checkpoint as a Hugging Face model or HF-PEFT adapter

Every tensor is stored under its full-model name with its global shape and the box
[start, start + shape) each file holds, so a checkpoint does not depend on the layout that wrote
it: loading reads, for each tensor, exactly the box the current rank needs, from whichever
pieces overlap it (`CheckpointReader.read`). Ranks that hold identical replicas (data-parallel
ranks) write once: only the writer ranks the caller selects write pieces.
Example: a [4, 6] weight written as two column halves (pieces start [0, 0] and [0, 3], shape
[4, 3] each) is read whole by one process, or as rows [2:4) by another layout.

A checkpoint directory is built under a temp name and renamed when complete (after every rank
wrote its files), so every directory called checkpoint-N is complete; `latest_checkpoint` also
requires trainer_state.json. Version-1 checkpoints (model_state.safetensors + optimizer.safetensors,
whole tensors) are still read. No pickle anywhere: safetensors + JSON.
"""
import os
import re
import shutil
from dataclasses import dataclass
from typing import List

import numpy as np
import paddle

from ..io import read_json, write_json, _fsync_dir
from ..models.hf import SafetensorsFile, write_safetensors

CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
KINDS = ("model", "optimizer")
FILE_PREFIX = {"model": "model_state", "optimizer": "optimizer"}


@dataclass
class Piece:
    """A box of a tensor: `array` holds global[start[0]:start[0]+shape[0], ...]. `key` names it in
    the file when one rank holds several boxes of the tensor (fused parts); default the name."""
    name: str
    array: np.ndarray
    global_shape: List[int]
    start: List[int]
    key: str = None


def whole(named_arrays):
    """Pieces for tensors this rank holds entirely: {name: array} -> [Piece]."""
    return [Piece(n, np.asarray(a), list(np.shape(a)), [0] * np.ndim(a)) for n, a in named_arrays.items()]


# ------------------------------------------------------------------------------ RNG state

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


# ------------------------------------------------------------------------------ writing

def _temp_path(path):
    return os.path.join(os.path.dirname(os.path.abspath(path)), ".tmp-" + os.path.basename(path))


def _write_pieces(tmp, rank, kind, pieces):
    """One safetensors file of this rank's pieces of `kind`; returns their index entries."""
    if not pieces:
        return {}
    fname = f"{FILE_PREFIX[kind]}-{rank:05d}.safetensors"
    write_safetensors(os.path.join(tmp, fname), {p.key or p.name: p.array for p in pieces})
    index = {}
    for p in pieces:
        entry = index.setdefault(p.name, {"global_shape": [int(d) for d in p.global_shape], "pieces": []})
        rec = {"file": fname, "start": [int(s) for s in p.start], "shape": [int(d) for d in np.shape(p.array)]}
        if p.key and p.key != p.name:
            rec["key"] = p.key
        entry["pieces"].append(rec)
    return index


def _merge_index(parts):
    index = {k: {} for k in KINDS}
    for part in parts:
        for kind in KINDS:
            for name, entry in part.get(kind, {}).items():
                have = index[kind].setdefault(name, {"global_shape": entry["global_shape"], "pieces": []})
                if have["global_shape"] != entry["global_shape"]:
                    raise ValueError(f"{name}: ranks disagree on its global shape "
                                     f"({have['global_shape']} vs {entry['global_shape']})")
                have["pieces"] += entry["pieces"]
    return index


def save_checkpoint(path, topo, model_pieces, optim_pieces, trainer_state, writer=True, meta=None):
    """Write checkpoint dir `path` atomically; collective over every rank of `topo`.

    Every rank passes its pieces; ranks with `writer` False (replicas of a writer's slices) write
    nothing. Rank 0 prepares the temp dir, then every writer writes its files, then rank 0 writes
    shards.json + trainer_state.json (+ meta.json: what the run trained, for the merge tool) and
    renames the dir into place."""
    tmp = _temp_path(path)
    if topo.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    topo.barrier()
    mine = {}
    if writer:
        mine = {"model": _write_pieces(tmp, topo.rank, "model", model_pieces),
                "optimizer": _write_pieces(tmp, topo.rank, "optimizer", optim_pieces)}
    parts = topo.all_gather_json(mine)
    if topo.is_main:
        write_json(os.path.join(tmp, "shards.json"), dict(version=2, **_merge_index(parts)))
        write_json(os.path.join(tmp, "trainer_state.json"), trainer_state)
        if meta is not None:
            write_json(os.path.join(tmp, "meta.json"), meta)
        _fsync_dir(tmp)
        if os.path.exists(path):
            old = tmp + ".old"
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    topo.barrier()
    return path


# ------------------------------------------------------------------------------ reading

class CheckpointReader:
    """Reads any box of any tensor of a checkpoint directory, whatever layout wrote it."""

    def __init__(self, path):
        if not os.path.isfile(os.path.join(path, "trainer_state.json")):
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer_state.json)")
        self.path = path
        index = read_json(os.path.join(path, "shards.json"), "checkpoint index")
        if index.get("version") == 2:
            self.index = {k: index[k] for k in KINDS}
        else:   # version 1: one file per kind holding whole tensors
            self.index = {kind: self._whole_file_index(f"{FILE_PREFIX[kind]}.safetensors")
                          for kind in KINDS}
        self._files = {}

    def _whole_file_index(self, fname):
        st = SafetensorsFile(os.path.join(self.path, fname))
        return {n: {"global_shape": st.shape(n), "pieces": [
            {"file": fname, "start": [0] * len(st.shape(n)), "shape": st.shape(n)}]} for n in st.keys()}

    def names(self, kind="model"):
        return list(self.index[kind])

    def global_shape(self, name, kind="model"):
        return list(self.index[kind][name]["global_shape"])

    def _file(self, fname):
        if fname not in self._files:
            self._files[fname] = SafetensorsFile(os.path.join(self.path, fname))
        return self._files[fname]

    def read(self, name, kind="model", start=None, shape=None):
        """global[start : start + shape] of tensor `name` (whole tensor by default) as float32,
        assembled from the pieces that overlap the box; every element must be covered."""
        entry = self.index[kind].get(name)
        if entry is None:
            raise KeyError(name)
        gshape = entry["global_shape"]
        start = [0] * len(gshape) if start is None else list(start)
        shape = list(gshape) if shape is None else list(shape)
        out = np.empty(shape, np.float32)
        covered = 0
        for piece in entry["pieces"]:
            lo = [max(a, b) for a, b in zip(start, piece["start"])]
            hi = [min(a + n, b + m) for a, n, b, m in zip(start, shape, piece["start"], piece["shape"])]
            if any(h <= l for l, h in zip(lo, hi)) and len(gshape):
                continue
            src = tuple(slice(l - p, h - p) for l, h, p in zip(lo, hi, piece["start"]))
            dst = tuple(slice(l - s, h - s) for l, h, s in zip(lo, hi, start))
            out[dst] = self._file(piece["file"]).get_box(piece.get("key", name), src)
            covered += int(np.prod([h - l for l, h in zip(lo, hi)]))
        if covered < int(np.prod(shape)):
            raise ValueError(f"{self.path}: the pieces of {name} cover {covered} of the "
                             f"{int(np.prod(shape))} elements this rank needs (incomplete checkpoint?)")
        return out

    def trainer_state(self):
        return read_json(os.path.join(self.path, "trainer_state.json"), "trainer state")

    def release(self):
        for st in self._files.values():
            st.release()


def read_tensors(path):
    """{name: array} of every tensor in one safetensors file."""
    st = SafetensorsFile(path)
    return {k: st.get(k) for k in st.keys()}


def load_checkpoint(path):
    """(model_state, optimizer tensors, trainer_state) of checkpoint dir `path`, whole tensors."""
    r = CheckpointReader(path)
    return ({n: r.read(n) for n in r.names("model")},
            {n: r.read(n, "optimizer") for n in r.names("optimizer")}, r.trainer_state())


# ------------------------------------------------------------------------------ directories

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


def resume_path(output_dir, resume_from_checkpoint=None, overwrite_output_dir=False):
    """The checkpoint a run starts from, decided in one place: an explicit directory; "true" = the
    latest complete checkpoint in output_dir (an error if none); unset = the latest one when
    output_dir holds any (PaddleNLP's habit: rerunning continues an interrupted run) unless
    overwrite_output_dir; else None."""
    which = resume_from_checkpoint
    if which is None:
        return None if overwrite_output_dir else latest_checkpoint(output_dir)
    if str(which).lower() == "true":
        path = latest_checkpoint(output_dir)
        if path is None:
            raise FileNotFoundError(f"resume_from_checkpoint=true but {output_dir} holds no "
                                    "complete checkpoint-N directory")
        return path
    if not os.path.isdir(which):
        raise FileNotFoundError(f"resume_from_checkpoint={which!r} is not a directory")
    if not os.path.isfile(os.path.join(which, "trainer_state.json")):
        raise FileNotFoundError(f"resume_from_checkpoint={which!r} is not a complete checkpoint "
                                "(no trainer_state.json)")
    return which


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
