"""AdamW with state keyed by full-model parameter names, and learning-rate schedules.

Own implementation (not paddle.optimizer.AdamW) so that optimizer state is named like the model
(layout-independent checkpoints, no pickle) and gradients arrive explicitly (after the
data-parallel reduction and clipping done by the trainer). Update, as torch.optim.AdamW:
    p <- p * (1 - lr * wd)                                  (decay params only)
    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
"""
import math

import numpy as np
import paddle


def no_decay(name, param):
    """Norm weights, biases and other 1-D tensors get no weight decay."""
    return len(param.shape) < 2 or name.endswith(".bias") or "norm" in name


class AdamW:
    def __init__(self, named_params, lr_scales=None, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0):
        self.params = dict(named_params)
        self.b1, self.b2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.lr_scales = lr_scales or {}  # name -> multiplier (e.g. LoRA+ for B matrices)
        self.decay = {n: not no_decay(n, p) for n, p in self.params.items()}
        self.exp_avg = {n: paddle.zeros(p.shape, "float32") for n, p in self.params.items()}
        self.exp_avg_sq = {n: paddle.zeros(p.shape, "float32") for n, p in self.params.items()}
        self.t = 0

    @paddle.no_grad()
    def step(self, grads, lr):
        """grads: {name: tensor}; parameters without a gradient are left untouched."""
        self.t += 1
        bc1 = 1 - self.b1 ** self.t
        bc2_sqrt = math.sqrt(1 - self.b2 ** self.t)
        for n, p in self.params.items():
            g = grads.get(n)
            if g is None:
                continue
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


def lr_at(step, total, base_lr, warmup=0, kind="linear", min_lr=0.0):
    """Learning rate for optimizer step `step` (0-based) of `total`: linear warmup from 0 over
    `warmup` steps, then linear / cosine decay to min_lr, or constant."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    if kind in ("constant", "constant_with_warmup"):
        return base_lr
    progress = (step - warmup) / max(1, total - warmup)
    progress = min(max(progress, 0.0), 1.0)
    if kind == "cosine":
        return min_lr + (base_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    return min_lr + (base_lr - min_lr) * (1 - progress)


def clip_factor(sq_norm_sum, max_norm):
    """Global-norm clipping factor min(1, max_norm / (norm + 1e-6)); returns (norm, factor)."""
    norm = math.sqrt(sq_norm_sum)
    if max_norm and max_norm > 0 and norm > max_norm:
        return norm, max_norm / (norm + 1e-6)
    return norm, 1.0
