"""The one training-checkpoint format, for every parallel layout.

checkpoint-N/
  model_state-RRRRR.safetensors   trainable tensors written by rank R: full-model names, paddle
                                  layout, float32; each holds the slice of the tensor that R owns
  optimizer-RRRRR.safetensors     "<name>.exp_avg", "<name>.exp_avg_sq", sliced like the tensor
  shards.json                     {"version": 2, "model": {name: {"global_shape": [...],
                                  "pieces": [{"file": ..., "start": [...], "shape": [...]}]}},
                                  "optimizer": {...}, "files": {file: {"bytes", "sha256"}}}:
                                  where every slice of every tensor lives, and a checksum of
                                  every other file of the directory, verified when it is read
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
requires trainer_state.json. Before a save, each writing rank checks that the disk has room for
its files (refused with the bytes needed and free); a disk that fills up during the save leaves
no partial directory. Bit-rot is caught on resume: a file whose checksum differs from shards.json
is refused by name, and the previous complete checkpoint is named. Version-1 checkpoints
(model_state.safetensors + optimizer.safetensors, whole tensors) are still read. No pickle
anywhere: safetensors + JSON.
"""
import dataclasses
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import List

import numpy as np
import paddle

from ..io import _fsync_dir, inside, read_json, write_json
from ..models.hf import SafetensorsFile, file_digest, write_safetensors
from .. import outdir
from ..outdir import check_space, human, space_error

logger = logging.getLogger("paddletune")

CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
# files this process found intact: (path, size, mtime, sha256); a second reader skips the hash
_VERIFIED = set()
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


def set_rng_state(state, where="trainer_state.json"):
    current = paddle.get_rng_state()
    restored = []
    try:
        if not isinstance(state, list) or len(state) != len(current):
            raise ValueError(f"{len(current)} generator states expected")
        for cur, saved in zip(current, state):
            s = type(cur).__new__(type(cur))
            s.__setstate__(tuple(saved))
            restored.append(s)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{where}: the saved random-generator state is not valid "
                         f"({str(e).splitlines()[0][:120]}); the file was edited or damaged: resume "
                         "from another checkpoint") from None
    paddle.set_rng_state(restored)


def restore_rng(rngs, rank, path):
    """Set this rank's generator states from trainer_state.json's "rng" list (one per rank)."""
    where = os.path.join(path, "trainer_state.json")
    if not isinstance(rngs, list) or rank >= len(rngs):
        raise ValueError(f"{where}: \"rng\" must list the generator states of every rank "
                         f"(rank {rank} needs one); the file was edited or damaged")
    saved = rngs[rank]
    set_rng_state(saved["state"] if isinstance(saved, dict) else saved, where)


def _jsonable(x):
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, bytes):
        return list(x)
    return x


# ------------------------------------------------------------------------------ writing

def _temp_path(path):
    return os.path.join(os.path.dirname(os.path.abspath(path)), ".tmp-" + os.path.basename(path))


def _write_pieces(tmp, rank, kind, pieces, digests=None):
    """One safetensors file of this rank's pieces of `kind`; returns their index entries and
    puts the file's checksum into `digests`."""
    if not pieces:
        return {}
    fname = f"{FILE_PREFIX[kind]}-{rank:05d}.safetensors"
    digest = write_safetensors(os.path.join(tmp, fname), {p.key or p.name: p.array for p in pieces})
    if digests is not None:
        digests[fname] = digest
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
    index["files"] = {}
    for part in parts:
        index["files"].update(part.get("files", {}))
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
    nothing. Each rank first checks the disk has room for what it writes (NoSpaceError naming
    the bytes needed and free, before anything is written). Rank 0 prepares the temp dir, then
    every writer writes its files, then rank 0 writes shards.json (with every file's checksum) +
    trainer_state.json (+ meta.json: what the run trained, for the merge tool) and renames the dir
    into place. A failed write (ENOSPC included) removes the temp dir: no partial checkpoint."""
    tmp = _temp_path(path)
    need = sum(int(p.array.nbytes) for p in list(model_pieces) + list(optim_pieces)) if writer else 0
    need += (1 << 20) if topo.is_main else 0   # the JSON files, generously
    check_space(os.path.dirname(os.path.abspath(path)), need, os.path.basename(path))
    try:
        if topo.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        topo.barrier()
        mine, digests = {}, {}
        if writer:
            mine = {"model": _write_pieces(tmp, topo.rank, "model", model_pieces, digests),
                    "optimizer": _write_pieces(tmp, topo.rank, "optimizer", optim_pieces, digests),
                    "files": digests}
        parts = topo.all_gather_json(mine)
        if topo.is_main:
            index = dict(version=2, **_merge_index(parts))
            for name, obj in (("trainer_state.json", trainer_state), ("meta.json", meta)):
                if obj is not None:
                    write_json(os.path.join(tmp, name), obj)
                    index["files"][name] = file_digest(os.path.join(tmp, name))
            write_json(os.path.join(tmp, "shards.json"), index)
            _fsync_dir(tmp)
            if os.path.exists(path):
                old = tmp + ".old"
                os.rename(path, old)
                os.rename(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, path)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise space_error(e, path, need) from None
    topo.barrier()
    return path


# ------------------------------------------------------------------------------ reading

class CheckpointReader:
    """Reads any box of any tensor of a checkpoint directory, whatever layout wrote it."""

    def __init__(self, path, verify=True):
        if not os.path.isfile(os.path.join(path, "trainer_state.json")):
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer_state.json)")
        self.path = path
        where = os.path.join(path, "shards.json")
        index = read_json(where, "checkpoint index")
        if not isinstance(index, dict):
            raise ValueError(f"{where}: must hold one JSON object")
        self.digests = {}
        if index.get("version") == 2:
            if not all(isinstance(index.get(k), dict) for k in KINDS):
                raise ValueError(f"{where}: lacks the \"model\" / \"optimizer\" tables (damaged?)")
            self.index = {k: index[k] for k in KINDS}
            self.digests = index.get("files") or {}   # absent in checkpoints of older versions
        else:   # version 1: one file per kind holding whole tensors
            self.index = {kind: self._whole_file_index(f"{FILE_PREFIX[kind]}.safetensors")
                          for kind in KINDS}
        self.verify = verify
        self._files = {}
        if verify:
            for name in ("trainer_state.json", "meta.json"):
                self._verify(name)

    def _verify(self, fname):
        """The file's size and sha256 against shards.json (when it records them)."""
        want = self.digests.get(fname)
        if not self.verify or not isinstance(want, dict):
            return
        full = inside(self.path, fname, os.path.join(self.path, "shards.json"))
        try:
            st = os.stat(full)
            stamp = (os.path.abspath(full), st.st_size, st.st_mtime_ns, want.get("sha256"))
        except FileNotFoundError:
            stamp = None
        if stamp in _VERIFIED:
            return
        got = file_digest(full) if stamp else {"bytes": 0, "sha256": "(missing)"}
        if got == {"bytes": want.get("bytes"), "sha256": want.get("sha256")}:
            _VERIFIED.add(stamp)
        else:
            prev = previous_checkpoint(self.path)
            offer = (f"the previous complete checkpoint is {prev}: resume from it with "
                     f"resume_from_checkpoint={prev}" if prev else
                     "there is no earlier complete checkpoint beside it")
            raise ValueError(f"{full} is not the file that was saved: shards.json records "
                             f"{want.get('bytes')} bytes with sha256 {str(want.get('sha256'))[:16]}..., "
                             f"it now has {got['bytes']} bytes with sha256 {got['sha256'][:16]}... "
                             f"(disk or copy corruption, or an edit); {offer}")

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
            full = inside(self.path, fname, os.path.join(self.path, "shards.json"))
            self._verify(fname)
            self._files[fname] = SafetensorsFile(full)
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
        where = os.path.join(self.path, "trainer_state.json")
        state = read_json(where, "trainer state")
        count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
        ok = isinstance(state, dict) and count(state.get("global_step")) and all(
            count(state[k]) for k in ("epoch", "step_in_epoch") if k in state)
        if not ok:
            raise ValueError(f"{where}: global_step, epoch and step_in_epoch must be counts "
                             "(the file was edited or damaged); resume from another checkpoint")
        return state

    def release(self):
        for st in self._files.values():
            st.release()


def verify_checkpoint(path):
    """Every file of checkpoint `path` against the checksums in its shards.json (one read of the
    directory; remembered, so the resume's own reads do not hash again). The scripts call this
    before the model is loaded: a damaged file is refused by name with the previous checkpoint
    offered, before any work."""
    reader = CheckpointReader(path)
    for fname in reader.digests:
        reader._verify(fname)
    return reader


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


def previous_checkpoint(path):
    """The newest complete checkpoint in `path`'s directory older than `path`, or None."""
    m = CKPT_RE.match(os.path.basename(os.path.normpath(path)))
    if not m:
        return None
    older = [p for p in list_checkpoints(os.path.dirname(os.path.abspath(path)))
             if int(CKPT_RE.match(os.path.basename(p)).group(1)) < int(m.group(1))]
    return older[-1] if older else None


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
    """Delete the oldest checkpoints beyond `limit`, never the one named `keep` (the best) nor
    the newest (what a rerun resumes from). So save_total_limit 1 with a best that is not the
    last keeps two, as transformers' Trainer does, and a finished run rerun has nothing left to
    train instead of resuming from the best step and training the rest again."""
    if not limit or limit <= 0:
        return
    ckpts = list_checkpoints(output_dir)
    protected = {os.path.abspath(p) for p in ([keep] if keep else []) + ckpts[-1:]}
    excess = len(ckpts) - limit
    for p in ckpts:
        if excess <= 0:
            break
        if os.path.abspath(p) in protected:
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
    """{name: float32 numpy copy}. A 16-bit tensor (AMP O2 weights) is widened by paddle first:
    its .numpy() gives the raw uint16 words, not values."""
    return {n: np.asarray((t.astype("float32") if t.dtype in (paddle.bfloat16, paddle.float16) else t).numpy(),
                          np.float32) for n, t in named_tensors.items()}


# ------------------------------------------------------------------------------ run facts

def warn_space(output_dir, saves, limit, trainable_numel):
    """Warn at the start when the disk cannot hold the checkpoints a run will keep (trainable
    tensors + two AdamW moments, float32 each), so a full disk is no surprise at step 10000;
    each save checks its own size again before writing (save_checkpoint)."""
    kept = min(saves, limit) if limit and limit > 0 else saves
    one = 3 * 4 * trainable_numel
    free = outdir.free_bytes(output_dir)
    if kept > 0 and kept * one > free:
        logger.warning("%s has %s free, the %d checkpoints this run keeps need about %s (%s each): "
                       "the disk will fill up; free space, or set save_total_limit / save_steps",
                       output_dir, human(free), kept, human(kept * one), human(one))


def jsonable_args(args):
    """The run's TrainingArguments as a JSON object (kept in trainer_state.json as "args")."""
    if not dataclasses.is_dataclass(args):
        return {}
    return {k: v for k, v in dataclasses.asdict(args).items()
            if v is None or isinstance(v, (bool, int, float, str, list))}


def report_changed_args(saved, args, path):
    """Resuming with other hyperparameters continues with the new ones (PaddleNLP's behaviour);
    say which changed, so a typo or a stale argument file is seen."""
    if not isinstance(saved, dict):
        return
    now = jsonable_args(args)
    skip = ("resume_from_checkpoint", "output_dir", "overwrite_output_dir")
    changed = [f"{k} {saved[k]!r} -> {now[k]!r}" for k in sorted(saved)
               if k in now and k not in skip and saved[k] != now[k]]
    if changed:
        logger.warning("resuming %s with %d changed argument(s): %s; training continues with the "
                       "new values", path, len(changed), ", ".join(changed))
