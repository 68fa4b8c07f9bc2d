"""NEFTune: uniform noise on the input embeddings while training (Jain et al., 2023).

    h' = h + u * alpha / sqrt(L * d)      u ~ U(-1, 1) elementwise, h [B, L, d] (L = padded length)
Eval mode (and alpha 0) returns h unchanged. Installed as the model's `embedding_hook`; as a
paddle Layer it is registered on the model and follows model.train() / model.eval(). The noise
comes from paddle's generator, whose state the trainer checkpoints, so resume stays exact.
"""
import math

import paddle
import paddle.nn as nn


class NEFTune(nn.Layer):
    def __init__(self, alpha):
        super().__init__()
        assert alpha >= 0, f"neftune_noise_alpha must be >= 0, got {alpha}"   # args.py checks files
        self.alpha = float(alpha)

    def forward(self, h):
        if not self.training or self.alpha == 0:
            return h
        scale = self.alpha / math.sqrt(h.shape[1] * h.shape[2])
        return h + paddle.uniform(h.shape, "float32", -scale, scale).astype(h.dtype)


def apply(model, alpha):
    if not hasattr(model, "embedding_hook"):
        raise ValueError(f"{type(model).__name__} has no embedding_hook; NEFTune cannot be attached")
    model.embedding_hook = NEFTune(alpha)
    return model.embedding_hook
