"""Low-rank bottleneck adapters: the adapter of adapter.py with both projections factorised.

For y = base(x) [.., H], bottleneck width m, rank r:
    down(y) = (y @ Da) @ Db + bd      Da [H, r], Db [r, m]
    up(z)   = (z @ Ua) @ Ub + bu      Ua [m, r], Ub [r, H]   (Ub, bu start at zero: identity)
    y' = y + up(gelu(down(y)))
Parameters per adapted layer: H*r + r*m + m + m*r + r*H + H (instead of 2*H*m + m + H).
Same placement (ModelSpec.adapter_targets) and own file format as adapter.py.
"""
import os

import paddle.nn as nn

from ..io import read_json
from . import adapter as _adapter
from .adapter import AdapterLinear, _kaiming
from .common import OWN_CONFIG

PEFT_TYPE = "LOWRANK_ADAPTER"


class LowRankAdapterLinear(AdapterLinear):
    def __init__(self, base_layer, size, rank):
        nn.Layer.__init__(self)
        self.base_layer = base_layer
        self.in_features, self.out_features = _adapter.linear_dims(base_layer)
        H, zero = self.out_features, nn.initializer.Constant(0.0)
        self.adapter_down = nn.Sequential(
            nn.Linear(H, rank, weight_attr=_kaiming(H), bias_attr=False),
            nn.Linear(rank, size, weight_attr=_kaiming(rank), bias_attr=zero))
        self.adapter_up = nn.Sequential(
            nn.Linear(size, rank, weight_attr=_kaiming(size), bias_attr=False),
            nn.Linear(rank, H, weight_attr=zero, bias_attr=zero))

    def forward(self, x):
        y = self.base_layer(x)
        dtype = self.adapter_up[1].weight.dtype
        return y + self.bottleneck(y.astype(dtype)).astype(y.dtype)


def _make(size, rank):
    return lambda base: LowRankAdapterLinear(base, size, rank)


def apply(model, model_args):
    size, rank = model_args.adapter_size, model_args.lowrank_adapter_rank
    assert size > 0 and rank > 0, (   # args.py checks argument files
        f"adapter_size and lowrank_adapter_rank must be positive, got {size}, {rank}")
    trainable, _ = _adapter.setup(model, _make(size, rank),
                                  f"low-rank adapter (size {size}, rank {rank})")
    return trainable


def export_fn(model, model_args, tokenizer=None):
    return _adapter.export_fn(model, model_args, tokenizer, PEFT_TYPE,
                              {"lowrank_adapter_rank": model_args.lowrank_adapter_rank})


def load(model, path, trainable=False):
    conf = read_json(os.path.join(path, OWN_CONFIG), "adapter config")
    make = _make(int(conf.get("adapter_size", 0)), int(conf.get("lowrank_adapter_rank", 0)))
    return _adapter.load(model, path, trainable, PEFT_TYPE, make)
