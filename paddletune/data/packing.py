"""Zero padding: pack tokenised examples into rows of at most max_length tokens.

Each example keeps its own attention (block-diagonal causal: `segment_ids` tell the model where
examples start), its positions restart at 0, and the label of its first token is -100 so no
prediction crosses from one example into the next (position t predicts labels[t+1]). Loss,
gradients and target-token counts therefore equal those of the same examples unpacked.

Packing is deterministic, over the examples in file order, once:
- sequential (`zero_padding`): append to the open pack; when the next example does not fit,
  close it and open a new one;
- greedy (`greedy_zero_padding`): examples are taken in buffers of 500; within a buffer, longest
  first, each goes to the open pack with the most room that fits it (a new pack if none); a
  buffer's packs are closed at its end.
Examples are already cut to max_length by the tokenisation rules; none is dropped.
Packs are then shuffled per epoch by the BatchPlan (collate.py): per_device_train_batch_size
counts packed rows, and each data-parallel rank takes its own packs of every global batch.

Worked example, max_length 8, lengths [5, 4, 3, 2]: sequential -> [[0], [1, 2], [3]];
greedy -> longest first: 5 -> pack A (room 3), 4 -> new B (room 4), 3 -> B (most room, 1
left), 2 -> A (room 1) -> [[0, 3], [1, 2]].
"""
import logging
import math

import numpy as np

from .collate import BatchPlan

IGNORE = -100
GREEDY_BUFFER = 500
logger = logging.getLogger("paddletune")


def pack_sequential(lengths, capacity):
    """Lists of indices into `lengths`, in order, each summing to <= capacity."""
    packs, cur, used = [], [], 0
    for i, n in enumerate(lengths):
        _check_fits(i, n, capacity)
        if cur and used + n > capacity:
            packs.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        packs.append(cur)
    return packs


def pack_greedy(lengths, capacity, buffer=GREEDY_BUFFER):
    """Worst-fit decreasing within consecutive buffers of `buffer` examples (see module doc).
    Within a pack, examples keep file order."""
    packs = []
    for lo in range(0, len(lengths), buffer):
        idx = list(range(lo, min(lo + buffer, len(lengths))))
        for i in idx:
            _check_fits(i, lengths[i], capacity)
        open_packs, room = [], []
        for i in sorted(idx, key=lambda j: (-lengths[j], j)):
            fits = [p for p in range(len(open_packs)) if room[p] >= lengths[i]]
            if fits:
                p = max(fits, key=lambda q: (room[q], -q))
                open_packs[p].append(i)
                room[p] -= lengths[i]
            else:
                open_packs.append([i])
                room.append(capacity - lengths[i])
        packs += [sorted(p) for p in open_packs]
    return packs


def _check_fits(i, n, capacity):
    if n > capacity:
        raise ValueError(f"example {i} has {n} tokens, more than max_length={capacity}: it should have "
                         "been cut when tokenised")


def pack(lengths, capacity, greedy=False):
    return pack_greedy(lengths, capacity) if greedy else pack_sequential(lengths, capacity)


def collate_packed(rows, pad_id, pad_to_multiple_of=None, length=None):
    """rows: list of lists of examples ({"input_ids", "labels"[, "id"]}) -> dict of [B, L] int64:
    input_ids, labels (first token of each example -100), position_ids (restart at 0),
    segment_ids (0, 1, ... per example within the row; trailing pads get their own id),
    attention_mask (1 = real token), and example_ids [n] (the examples in row order)."""
    lens = [sum(len(e["input_ids"]) for e in row) for row in rows]
    L = length or max(lens)
    if pad_to_multiple_of:
        L = int(math.ceil(L / pad_to_multiple_of) * pad_to_multiple_of)
    B = len(rows)
    out = {"input_ids": np.full((B, L), pad_id, np.int64), "labels": np.full((B, L), IGNORE, np.int64),
           "position_ids": np.zeros((B, L), np.int64), "segment_ids": np.zeros((B, L), np.int64),
           "attention_mask": np.zeros((B, L), np.int64)}
    ids = []
    for b, row in enumerate(rows):
        at = 0
        for s, e in enumerate(row):
            n = len(e["input_ids"])
            out["input_ids"][b, at:at + n] = e["input_ids"]
            out["labels"][b, at:at + n] = e["labels"]
            out["labels"][b, at] = IGNORE          # the previous example must not predict it
            out["position_ids"][b, at:at + n] = np.arange(n)
            out["segment_ids"][b, at:at + n] = s
            out["attention_mask"][b, at:at + n] = 1
            at += n
            ids.append(e.get("id", -1))
        out["segment_ids"][b, at:] = len(row)
    out["example_ids"] = np.asarray(ids, np.int64)
    return out


def packing_stats(lengths, packs, capacity, micro_batch=1):
    """Real tokens / row slots, packed (rows of `capacity`) vs padded (each example its own row,
    padded to the longest in groups of micro_batch consecutive examples)."""
    real = int(sum(lengths))
    padded = sum(max(lengths[i:i + micro_batch]) * len(lengths[i:i + micro_batch])
                 for i in range(0, len(lengths), micro_batch))
    return {"examples": len(lengths), "packs": len(packs), "real_tokens": real,
            "packed_efficiency": real / max(len(packs) * capacity, 1),
            "padded_efficiency": real / max(padded, 1)}


class PackedSource:
    """Training batches of packed rows (Trainer `train_source`). Packs are built once from the
    dataset; a BatchPlan over packs decides each step's rows (shuffled per epoch, DP shares)."""

    def __init__(self, dataset, capacity, micro_batch, accumulation, dp_world=1, dp_rank=0, seed=42,
                 greedy=False, pad_id=0, pad_to_multiple_of=None, pad_to_max_length=False, drop_last=False):
        self.dataset, self.capacity, self.pad_id = dataset, capacity, pad_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.length = capacity if pad_to_max_length else None
        lengths = [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
        self.packs = pack(lengths, capacity, greedy)
        self.stats = packing_stats(lengths, self.packs, capacity, micro_batch)
        self.plan = BatchPlan(len(self.packs), micro_batch, accumulation, dp_world, dp_rank, seed=seed,
                              drop_last=drop_last)

    @property
    def steps_per_epoch(self):
        return self.plan.steps_per_epoch

    def collate(self, pack_indices):
        rows = [[self.dataset[i] for i in self.packs[p]] for p in pack_indices]
        return collate_packed(rows, self.pad_id, self.pad_to_multiple_of, self.length)

    def iterate(self, epoch, start_step=0):
        for step, micro in self.plan.iterate(epoch, start_step):
            yield step, [self.collate(idx) for idx in micro]

    def log(self):
        s = self.stats
        logger.info("zero padding: %d examples -> %d packs of <= %d tokens; efficiency %.1f%% packed "
                    "vs %.1f%% padded (real tokens / computed positions)", s["examples"], s["packs"],
                    self.capacity, 100 * s["packed_efficiency"], 100 * s["padded_efficiency"])


def build_train_source(data_args, args, tok, train_ds, topo=None):
    """The Trainer's `train_source` for zero padding and/or lazy data; None means the default
    (in-memory examples, right-padded batches). `topo` (parallel.Topology; None: one process)
    gives this rank's share of the data."""
    dp_degree, dp_rank = (topo.data_degree, topo.data_rank) if topo is not None else (1, 0)
    zero = bool(data_args.zero_padding or data_args.greedy_zero_padding)
    common = dict(pad_id=tok.pad_token_id or 0, pad_to_multiple_of=data_args.pad_to_multiple_of,
                  pad_to_max_length=data_args.pad_to_max_length)
    if data_args.lazy:
        from .lazy import LazySource

        return LazySource(train_ds, args.per_device_train_batch_size, args.gradient_accumulation_steps,
                          dp_degree, dp_rank, zero_padding=zero,
                          greedy=data_args.greedy_zero_padding, capacity=data_args.max_length, **common)
    if not zero:
        return None
    source = PackedSource(train_ds, data_args.max_length, args.per_device_train_batch_size,
                          args.gradient_accumulation_steps, dp_degree, dp_rank,
                          seed=args.data_seed if args.data_seed is not None else args.seed,
                          greedy=data_args.greedy_zero_padding, drop_last=args.dataloader_drop_last, **common)
    if topo is None or topo.is_main:
        source.log()
    return source
