"""Low-rank bottleneck adapters: the adapter of adapter.py with both projections factorised.

For y = base(x) [.., H], bottleneck width m, rank r:
    down(y) = (y @ Da) @ Db + bd      Da [H, r], Db [r, m]
    up(z)   = (z @ Ua) @ Ub + bu      Ua [m, r], Ub [r, H]   (Ub, bu start at zero: identity)
    y' = y + up(gelu(down(y)))
Parameters per adapted layer: H*r + r*m + m + m*r + r*H + H (instead of 2*H*m + m + H).
Same placement (ModelSpec.adapter_targets) and own file format as adapter.py.
"""
import functools
import os

import paddle.nn as nn

from ..io import read_json
from . import adapter as _adapter
from .adapter import AdapterLinear, _kaiming
from .common import OWN_CONFIG

PEFT_TYPE = "LOWRANK_ADAPTER"


def lowrank_projections(H, size, rank):
    """(down, up), each two Linears through rank r (saved as adapter_down.0 / .1, adapter_up.0 /
    .1); only the second of each has a bias, and up's second starts at zero (identity)."""
    zero = nn.initializer.Constant(0.0)
    down = nn.Sequential(nn.Linear(H, rank, weight_attr=_kaiming(H), bias_attr=False),
                         nn.Linear(rank, size, weight_attr=_kaiming(rank), bias_attr=zero))
    up = nn.Sequential(nn.Linear(size, rank, weight_attr=_kaiming(size), bias_attr=False),
                       nn.Linear(rank, H, weight_attr=zero, bias_attr=zero))
    return down, up


class LowRankAdapterLinear(AdapterLinear):
    """AdapterLinear with both projections factorised through `rank`."""

    def __init__(self, base_layer, size, rank):
        super().__init__(base_layer, size, functools.partial(lowrank_projections, rank=rank))


def _make(size, rank):
    return lambda base: LowRankAdapterLinear(base, size, rank)


def apply(model, model_args):
    size, rank = model_args.adapter_size, model_args.lowrank_adapter_rank
    assert size > 0 and rank > 0, (   # args.py checks argument files
        f"adapter_size and lowrank_adapter_rank must be positive, got {size}, {rank}")
    trainable, _ = _adapter.wrap_targets(model, _make(size, rank),
                                         f"low-rank adapter (size {size}, rank {rank})")
    return trainable


def export_fn(model, model_args, tokenizer=None):
    return _adapter.export_fn(model, model_args, tokenizer, PEFT_TYPE,
                              {"lowrank_adapter_rank": model_args.lowrank_adapter_rank})


def setup(model, model_args, tokenizer=None):
    """(trainable, lr_scales, export_fn) for peft.apply."""
    return apply(model, model_args), None, export_fn(model, model_args, tokenizer)


def load(model, path, trainable=False):
    conf = read_json(os.path.join(path, OWN_CONFIG), "adapter config")
    make = _make(int(conf.get("adapter_size", 0)), int(conf.get("lowrank_adapter_rank", 0)))
    return _adapter.load(model, path, trainable, PEFT_TYPE, make)
