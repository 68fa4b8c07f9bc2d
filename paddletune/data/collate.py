"""Batches: right-padded numpy arrays, and the data-parallel batch plan.

`pad_batch(examples)` -> {"input_ids", "labels", "attention_mask"} [B, L] int64, padded on the
right (labels -100 on pads), L = longest example rounded up to `pad_to_multiple_of`.

`BatchPlan` decides which examples every optimizer step uses:
  global batch size G = micro_batch x accumulation x dp_world
  epoch e visits examples in the order permutation(seed + e) (or 0..n-1 without shuffle)
  global batch g = order[g*G : (g+1)*G]; dp rank r takes its r-th contiguous share, cut into
  `accumulation` micro-batches.
So batch 4 x GA 1, batch 1 x GA 4 and DP 2 x batch 2 see the same 4 examples in a step.
The position (epoch, batch index) fully determines what comes next: resume is exact.
"""
import math

import numpy as np

IGNORE = -100


def pad_batch(examples, pad_id, pad_to_multiple_of=None, length=None):
    L = length or max(len(e["input_ids"]) for e in examples)
    if pad_to_multiple_of:
        L = int(math.ceil(L / pad_to_multiple_of) * pad_to_multiple_of)
    B = len(examples)
    ids = np.full((B, L), pad_id, np.int64)
    labels = np.full((B, L), IGNORE, np.int64)
    mask = np.zeros((B, L), np.int64)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = e["input_ids"]
        labels[i, :n] = e["labels"]
        mask[i, :n] = 1
    out = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    if all("id" in e for e in examples):
        out["example_ids"] = np.asarray([e["id"] for e in examples], np.int64)
    return out


def padding_collate(pad_id, pad_to_multiple_of=None, pad_to_max_length=False, max_length=None):
    """collate(examples) -> pad_batch(...) with DataArgument's padding settings: every batch padded
    to max_length (pad_to_max_length), else to its longest example rounded up to
    pad_to_multiple_of (when set)."""
    length = max_length if pad_to_max_length else None
    return lambda examples: pad_batch(examples, pad_id, pad_to_multiple_of, length)


class BatchPlan:
    def __init__(self, num_examples, micro_batch, accumulation, dp_world=1, dp_rank=0, seed=42,
                 shuffle=True, drop_last=False):
        self.n = num_examples
        self.micro, self.accum = micro_batch, accumulation
        self.world, self.rank = dp_world, dp_rank
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.global_batch = micro_batch * accumulation * dp_world
        if self.n == 0:
            raise ValueError("the training set is empty")

    @property
    def steps_per_epoch(self):
        if self.drop_last:
            return max(1, self.n // self.global_batch)
        return math.ceil(self.n / self.global_batch)

    def order(self, epoch):
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng(self.seed + epoch).permutation(self.n)

    def step_indices(self, epoch, step, order=None):
        """This rank's micro-batches (lists of example indices) for global batch `step`."""
        order = self.order(epoch) if order is None else order
        g = order[step * self.global_batch:(step + 1) * self.global_batch]
        share = math.ceil(len(g) / self.world)
        mine = g[self.rank * share:(self.rank + 1) * share]
        per_micro = math.ceil(len(mine) / self.accum) if len(mine) < self.micro * self.accum else self.micro
        return [mine[i:i + per_micro].tolist() for i in range(0, len(mine), per_micro)] if len(mine) else []

    def iterate(self, epoch, start_step=0):
        order = self.order(epoch)
        for step in range(start_step, self.steps_per_epoch):
            yield step, self.step_indices(epoch, step, order)
