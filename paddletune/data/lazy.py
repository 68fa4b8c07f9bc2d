"""Lazy datasets (`lazy: true`): stream the train JSON-lines files, never loading them whole.

The train files are read as one byte stream (their concatenation, in sorted order). Data-parallel
rank r of W owns the lines that *start* in bytes [r*T/W, (r+1)*T/W) of the T-byte stream, so the
ranks' shares are disjoint and cover every line, and each rank reads only its own bytes.
Each rank walks its share in file order (no shuffling), again and again: the number of steps
per epoch is unknown, so training needs max_steps.

Lines are read in chunks of CHUNK examples; a chunk becomes rows (one example per row, or packs
of examples with zero padding, packed exactly as packing.py does), and each optimizer step takes
micro_batch x accumulation rows. The position after a step is
    {"pass": p, "offset": byte offset of the chunk's first line, "skip": rows of it already used}
which the Trainer saves in every checkpoint (one per rank) and hands back on resume, so training
continues at the next unseen row after one seek, however far into the file.
Memory: one chunk of tokenised examples, whatever the file size.

Every line is checked (`lazy_check`, DataArgument): by default (true) in one streaming pass by
rank 0 before training (the other ranks wait for it in their first collective); with false, for
corpora too large to wait for, the same pass runs on rank 0 in a background thread while training
runs, and the first bad line it finds ends the job at the next step (one error line naming file
and line), however far into the file it is. A pass still running when training ends is left
unfinished: the lines trained on were checked as they were streamed.
"""
import logging
import os
import threading
import time

import numpy as np

from .collate import pad_batch
from .packing import GREEDY_BUFFER, collate_packed, pack
from .sft import DataError, LineSkipper, parse_json_line, read_json_lines

CHUNK = GREEDY_BUFFER


def _rank():
    try:
        return int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    except ValueError:
        return 0
logger = logging.getLogger("paddletune")


class LazyDataset:
    """Train files + the example builder; rows are tokenised when read. No __len__."""

    def __init__(self, files, builder, check_lines=8, skip_invalid_lines=False, check_all=False,
                 background=False):
        """check_all: every line checked now (rank 0); else the first `check_lines` lines of each
        file, and with `background` the rest in a background pass (rank 0; module docstring)."""
        self.files = list(files)
        self.sizes = [os.path.getsize(f) for f in self.files]
        self.builder = builder
        self.skipper = LineSkipper(skip_invalid_lines)
        self.total = sum(self.sizes)
        if self.total == 0:
            raise DataError(f"train data is empty ({', '.join(self.files)})")
        self.background = None   # {"error", "done", "checked"} of the background pass (lazy_check: false)
        if skip_invalid_lines:    # bad lines are skipped and counted when streamed
            return
        if check_all and _rank() == 0:
            self.check_every_line()   # the other ranks wait for rank 0 in their first collective
            return
        for path in self.files:   # fail early on a malformed head, before any work
            for n, (lineno, row) in enumerate(read_json_lines(path)):
                builder(row, f"{path}:{lineno}")
                if n + 1 >= check_lines:
                    break
        if background and _rank() == 0:
            self.start_background_check()

    def start_background_check(self):
        """Run check_every_line in a daemon thread (lazy_check: false); raise_background_error
        reports what it found. The thread only reads the files and tokenises (no paddle)."""
        state = self.background = {"error": None, "done": False, "checked": 0}

        def run():
            t0 = time.time()
            try:
                if self.check_every_line(progress=state):
                    logger.info("lazy_check: the background pass found every train line valid (%.0f s)",
                                time.time() - t0)
            except Exception as e:   # noqa: BLE001 - raised on the main thread at the next step
                state["error"] = e
            state["done"] = True
        threading.Thread(target=run, name="lazy-check", daemon=True).start()

    def stop_background(self):
        """End the background pass at its next line (training is over)."""
        if self.background is not None:
            self.background["stop"] = True

    def raise_background_error(self, step=None):
        """Raise the background pass's error (a DataError naming file and line), if any."""
        bg = self.background
        if bg is not None and bg["error"] is not None:
            e, bg["error"] = bg["error"], None
            if isinstance(e, DataError):
                at = f" at training step {step}" if step is not None else ""
                raise DataError(f"{e} (found by the background check of the train data{at}; "
                                "lazy_check: true checks every line before training)") from None
            raise e

    def check_every_line(self, progress_s=10.0, progress=None):
        """One streaming pass over every train line (JSON and the example builder's checks:
        the same as when streamed), before training: a bad line fails now, naming file and line,
        not after hundreds of steps. Memory: one line at a time. A progress line every
        `progress_s` seconds on large files. `progress` (the background pass's state dict)
        receives the bytes checked so far."""
        done, last, t0 = 0, time.time(), time.time()
        for path, size in zip(self.files, self.sizes):
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):
                        line = line[3:]
                    done += len(line)
                    if progress is not None:
                        progress["checked"] = done
                        if progress.get("stop"):   # training ended: the pass is not needed
                            return False
                    if line.strip():
                        where = f"{path}:{lineno}"
                        self.builder(parse_json_line(line, where), where)
                    if time.time() - last > progress_s:
                        last = time.time()
                        logger.info("lazy_check: checked %.0f%% of the train data (%d of %d bytes, "
                                    "%s line %d)%s", 100 * done / self.total, done, self.total, path,
                                    lineno, " in the background" if progress is not None else
                                    "; lazy_check: false checks in the background instead")
        if time.time() - t0 > progress_s and progress is None:
            logger.info("lazy_check: every train line is valid (%.0f s)", time.time() - t0)
        return True

    def share(self, rank, world):
        """Byte range [lo, hi) of the stream whose lines belong to `rank`."""
        return self.total * rank // world, self.total * (rank + 1) // world

    def read(self, start, end, limit):
        """Up to `limit` examples whose lines start in [start, end), beginning at the first line
        starting at or after `start`. Returns (examples, offset after the last line read);
        each example's "id" is the global byte offset of its line."""
        out, base, at = [], 0, start
        for path, size in zip(self.files, self.sizes):
            if at >= base + size or len(out) >= limit:
                base += size
                continue
            with open(path, "rb") as f:
                local = max(at - base, 0)
                if local > 0:          # align to the next line start
                    f.seek(local - 1)
                    if f.read(1) != b"\n":
                        f.readline()
                pos = f.tell()
                while len(out) < limit and base + pos < end:
                    line = f.readline()
                    if not line:
                        break
                    if line.strip():
                        ex = self._example(line, path, base, pos)
                        if ex is not None:
                            out.append(ex)
                    pos += len(line)
                at = base + pos
            base += size
            if at >= end:
                break
        return out, max(at, start)

    def _example(self, line, path, base, pos):
        """The example of the line at byte `pos` of `path` (global offset base + pos), or None
        when it is invalid and skip_invalid_lines is on. Errors name the file and line number
        (counted only then: the stream itself keeps byte offsets)."""
        try:
            ex = self.builder(parse_json_line(line, path), path)
        except DataError:
            where = f"{path}:{line_number(path, pos)}"
            try:
                self.builder(parse_json_line(line, where), where)
            except DataError as e:
                self.skipper.skip(e)
                return None
            raise   # not reproducible with the line number: the first message stands
        ex["id"] = base + pos
        return ex


def line_number(path, offset, chunk=1 << 20):
    """1-based number of the line starting at byte `offset` of `path`."""
    n, done = 1, 0
    with open(path, "rb") as f:
        while done < offset:
            block = f.read(min(chunk, offset - done))
            if not block:
                break
            n += block.count(b"\n")
            done += len(block)
    return n


class LazySource:
    """Trainer `train_source` over a LazyDataset: steps_per_epoch None, iterate never ends,
    state_dict()/load_state_dict() give the exact resume position (see module docstring)."""
    steps_per_epoch = None

    def __init__(self, dataset, micro_batch, accumulation, dp_world=1, dp_rank=0, pad_id=0,
                 zero_padding=False, greedy=False, capacity=None, pad_to_multiple_of=None,
                 pad_to_max_length=False):
        self.ds, self.micro, self.accum = dataset, micro_batch, accumulation
        self.lo, self.hi = dataset.share(dp_rank, dp_world)
        self.world, self.rank = dp_world, dp_rank
        self.pad_id, self.zero_padding, self.greedy, self.capacity = pad_id, zero_padding, greedy, capacity
        self.pad_to_multiple_of = pad_to_multiple_of
        self.length = capacity if pad_to_max_length else None
        self._state = {"pass": 0, "offset": self.lo, "skip": 0}
        self._loaded = False
        self.stats = {"real_tokens": 0, "row_slots": 0}

    def state_dict(self):
        return dict(self._state, world=self.world, rank=self.rank)

    def load_state_dict(self, state):
        if state.get("world", self.world) != self.world:
            logger.warning("lazy data: checkpoint was written with %s ranks, now %d: restarting the "
                           "data stream", state.get("world"), self.world)
            return
        self._state = {"pass": int(state["pass"]), "offset": int(state["offset"]), "skip": int(state["skip"])}
        self._loaded = True

    def _rows(self, state):
        """Yield (row examples, position after this row) forever from `state`."""
        p, off, skip = state["pass"], state["offset"], state["skip"]
        while True:
            examples, nxt = self.ds.read(off, self.hi, CHUNK)
            if not examples:
                if off == self.lo:
                    raise DataError(f"data-parallel rank {self.rank} of {self.world} has no lines in its "
                                    f"share of the train data ({self.ds.total} bytes); use fewer ranks")
                p, off, skip = p + 1, self.lo, 0
                continue
            lengths = [len(e["input_ids"]) for e in examples]
            rows = pack(lengths, self.capacity, self.greedy) if self.zero_padding else [[i] for i in range(len(examples))]
            for j in range(skip, len(rows)):
                after = {"pass": p, "offset": off, "skip": j + 1} if j + 1 < len(rows) else \
                    {"pass": p, "offset": nxt, "skip": 0}
                yield [examples[i] for i in rows[j]], after
            off, skip = nxt, 0

    def collate(self, rows):
        if self.zero_padding:
            batch = collate_packed(rows, self.pad_id, self.pad_to_multiple_of, self.length)
        else:
            batch = pad_batch([r[0] for r in rows], self.pad_id, self.pad_to_multiple_of, self.length)
        self.stats["real_tokens"] += int(batch["attention_mask"].sum())
        self.stats["row_slots"] += int(batch["attention_mask"].size)
        return batch

    def iterate(self, epoch, start_step=0):
        """(step, [micro-batch dicts]) from start_step on, forever. Without a loaded position,
        start_step > 0 replays (reads and discards) the rows of the earlier steps."""
        rows = self._rows(self._state)
        per_step = self.micro * self.accum
        if start_step and not self._loaded:
            logger.warning("lazy data: no saved stream position; re-reading %d steps to resume", start_step)
            for _ in range(start_step * per_step):
                next(rows)
        step = start_step
        try:
            while True:
                self.ds.raise_background_error(step)   # lazy_check: false: a bad line found meanwhile
                taken = [next(rows) for _ in range(per_step)]
                self._state = taken[-1][1]
                micro = [self.collate([r for r, _ in taken[i:i + self.micro]]) for i in range(0, per_step, self.micro)]
                if self.zero_padding and self.rank == 0 and (step - start_step) % 1000 == 0:
                    logger.info("lazy zero padding: efficiency so far %.1f%% (real tokens / computed positions)",
                                100 * self.efficiency())
                yield step, micro
                step += 1
        finally:   # the trainer closed the stream (training over, or failed)
            self.ds.stop_background()

    def efficiency(self):
        return self.stats["real_tokens"] / max(self.stats["row_slots"], 1)


def example_ids(batch):
    """Example ids (byte offsets) in a micro-batch, either layout."""
    return np.asarray(batch["example_ids"]).reshape(-1).tolist()
