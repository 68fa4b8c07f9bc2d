"""Test-only reference: paddletune's own AdamW as it was before the optimizer moved onto
paddle.optimizer.AdamW (trainer/optim.py up to commit 75dca72), kept unchanged in its update
and its checkpoint layout so that tests compare the new optimizer with it (5 trainer steps) and
resume checkpoints it wrote. Not imported by the package.

Own implementation (not paddle.optimizer.AdamW) so that optimizer state is named like the model
(layout-independent checkpoints, no pickle) and gradients arrive explicitly (after the
data-parallel reduction and clipping done by the trainer). paddle's fused adamw_ kernel does the
update where it exists; `_reference_update` is the same formula in plain ops. As torch.optim.AdamW:
    p <- p * (1 - lr * wd)                                  (decay params only)
    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
"""
import math

import numpy as np
import paddle


_FUSED = {}


def _fused_adamw():
    """paddle's fused in-place AdamW kernel (one pass over each tensor instead of ~8 with
    temporaries: 7x faster on a [32000, 256] embedding), or None when this paddle lacks it or
    PADDLETUNE_FUSED_ADAMW=0. It computes the same update with the bias corrections folded:
    p -= lr sqrt(1-b2^t)/(1-b1^t) m / (sqrt(v) + eps sqrt(1-b2^t)); tests pin it to the reference."""
    if "op" not in _FUSED:
        import os

        op = getattr(getattr(paddle, "_C_ops", None), "adamw_", None)
        _FUSED["op"] = op if os.environ.get("PADDLETUNE_FUSED_ADAMW", "1") != "0" else None
    return _FUSED["op"]


def no_decay(name, param):
    """Norm weights, biases and other 1-D tensors get no weight decay."""
    return len(param.shape) < 2 or name.endswith(".bias") or "norm" in name


class AdamW:
    """offload: the moments (and, for a float16 / bfloat16 parameter, its float32 master copy,
    made at the first step) live in host memory and the update runs there (sharding's
    "stage2 / stage3 offload" on a GPU where paddletune's own sharding runs): per tensor, the gradient is copied to the host, the host copy
    updated, and the parameter copied back. Written for GPUs, where it is untested; a CPU build
    has one memory, and the trainer does not turn it on there."""

    def __init__(self, named_params, lr_scales=None, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, offload=False):
        self.params = dict(named_params)
        self.b1, self.b2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.lr_scales = lr_scales or {}  # name -> multiplier (e.g. LoRA+ for B matrices)
        self.decay = {n: not no_decay(n, p) for n, p in self.params.items()}
        self.offload = offload
        self.master = {}   # offload: name -> float32 host copy of a low-precision parameter
        self.exp_avg = {n: self._zeros(p.shape) for n, p in self.params.items()}
        self.exp_avg_sq = {n: self._zeros(p.shape) for n, p in self.params.items()}
        self.t = 0

    def _zeros(self, shape):
        z = paddle.zeros(shape, "float32")
        return z.cpu() if self.offload else z

    def _full(self, value):
        t = paddle.full([1], value, "float32")
        return t.cpu() if self.offload else t

    def _host_copy(self, n, param):
        """Offload: the float32 host tensor the update runs on (a kept master copy for a low-
        precision parameter, else a fresh copy of the parameter)."""
        if param.dtype == paddle.float32:
            return param.cpu()
        if n not in self.master:
            self.master[n] = param.cpu().astype("float32")
        return self.master[n]

    @paddle.no_grad()
    def step(self, grads, lr):
        """grads: {name: tensor}; parameters without a gradient are left untouched."""
        self.t += 1
        fused = _fused_adamw()
        if fused is not None:
            lrs = {}   # lr tensor per distinct scale (the kernel's lr_ratio is not applied on CPU)
            pows = (self._full(self.b1 ** self.t), self._full(self.b2 ** self.t))
        for n, param in self.params.items():
            g = grads.get(n)
            if g is None:
                continue
            p = param
            if self.offload:   # the update on host copies; the parameter copied back below
                p, g = self._host_copy(n, param), g.cpu().astype("float32")
            if fused is not None and p.dtype == paddle.float32 and g.dtype == paddle.float32:
                scale = self.lr_scales.get(n, 1.0)
                if scale not in lrs:
                    lrs[scale] = self._full(lr * scale)
                fused(p, g, lrs[scale], self.exp_avg[n], self.exp_avg_sq[n], None, pows[0], pows[1],
                      None, None, self.b1, self.b2, self.eps, 1.0,
                      self.weight_decay if self.decay[n] else 0.0, self.decay[n], False, 1000,
                      False, True, False)
            else:
                self._reference_update(n, p, g, lr)
            if self.offload:
                param.set_value(p.astype(param.dtype))

    def _reference_update(self, n, p, g, lr):
        """The update written out in paddle ops (the docstring's formula)."""
        bc1 = 1 - self.b1 ** self.t
        bc2_sqrt = math.sqrt(1 - self.b2 ** self.t)
        g = g.astype("float32")
        plr = lr * self.lr_scales.get(n, 1.0)
        m, v = self.exp_avg[n], self.exp_avg_sq[n]
        m.scale_(self.b1).add_(g.scale(1 - self.b1))
        v.scale_(self.b2).add_((g * g).scale(1 - self.b2))
        if self.decay[n] and self.weight_decay:
            p.scale_(1 - plr * self.weight_decay)
        denom = v.sqrt().scale(1.0 / bc2_sqrt).add_(paddle.full([], self.eps, "float32"))
        p.subtract_((m / denom).scale(plr / bc1).astype(p.dtype))

    def state_dict(self):
        """{name.exp_avg / name.exp_avg_sq: np.ndarray}, plus the step count (for JSON)."""
        tensors = {}
        for n in self.params:
            tensors[f"{n}.exp_avg"] = self.exp_avg[n].numpy()
            tensors[f"{n}.exp_avg_sq"] = self.exp_avg_sq[n].numpy()
        return tensors, {"step": self.t}

    def load_state_dict(self, tensors, meta):
        for n in self.params:
            for key, store in ((f"{n}.exp_avg", self.exp_avg), (f"{n}.exp_avg_sq", self.exp_avg_sq)):
                if key not in tensors:
                    raise ValueError(f"optimizer state lacks {key}: checkpoint from a different setup?")
                store[n].set_value(np.asarray(tensors[key], np.float32))
        self.t = int(meta["step"])
