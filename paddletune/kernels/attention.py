"""Blocked attention on the CPU kernels (attention.cc): memory O(S) instead of the dense path's
[B, N, S, T] scores and probabilities.

    out = blocked_attention(q, k, v, scale, causal=True)                    # [B, S, N*D]
    out = blocked_attention(q, k, v, scale, mask=blocked)                   # bool [B|1, 1, S, T]
    out = blocked_attention(q, k, v, scale, causal=True, starts=starts)     # packed rows
    out = blocked_attention(q, k, v, scale, causal=True, window=window)     # padded rows

out_i = sum_j softmax_j(scale * q_i . k_j over the keys query i may see) v_j, q [B, N, S, D],
k / v [B, K, T, D] (query head n reads KV head n // (N / K)). A query with no visible key gets
the mean of v over all T keys (uniform weights), as masked_fill(-1e9) + softmax gives.
window: int32 [B, 2], row b's unpadded keys [window[b, 0], window[b, 1]) (left or right padding,
see padding_window): the same attention as a [B, 1, 1, T] padding mask, without a mask tensor.
Backward: the kernel recomputes score blocks from the saved per-row logsumexp [B, N, S], so a
layer keeps q, k, v, out and lse for it (all O(S)). Returns None when the kernels are off or the
inputs are not float32 CPU tensors (the caller then runs the dense path).

Recompute (ReuseOutputs): a region recomputed in backward (a whole decoder layer) runs this
forward twice on the same q, k, v. Inside `with slot:` the first pass keeps each call's (out,
lse) and the second pass takes them instead of running the kernel forward again: the same
values (the second pass reproduces q, k, v exactly), one kernel forward less per layer per step,
for B*S*N*(D+1) floats held per layer between forward and backward.
"""
import numpy as np


class _Masks:
    """The non-differentiable inputs, kept out of PyLayer's tensor arguments."""

    def __init__(self, mask, starts, window, given=None, keep=None):
        import paddle

        self.given, self.keep = given, keep   # ReuseOutputs: (out, lse) to use / a list to append to
        self.use = (mask is not None, starts is not None, window is not None)
        dummy_b, dummy_i = paddle.zeros([1], "bool"), paddle.zeros([1], "int32")
        self.mask = mask if mask is not None else dummy_b
        self.starts = starts if starts is not None else dummy_i
        self.window = window if window is not None else dummy_i


def _layer():
    import paddle

    from . import cpu_ops

    class BlockedAttention(paddle.autograd.PyLayer):
        @staticmethod
        def forward(ctx, q, k, v, masks, scale, causal):
            if masks.given is not None:   # the recomputed pass: the first pass's results
                out, lse = (t.detach() for t in masks.given)
            else:
                out, lse = cpu_ops().pt_flash_attn(q, k, v, masks.mask, masks.starts, masks.window, scale,
                                                   causal, *masks.use)
                if masks.keep is not None:
                    masks.keep.append((out.detach(), lse))
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.args = (masks, scale, causal)
            ctx.want = (not q.stop_gradient, not k.stop_gradient, not v.stop_gradient)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensor()
            masks, scale, causal = ctx.args
            grads = cpu_ops().pt_flash_attn_bwd(q, k, v, out, lse, dout.contiguous(), masks.mask, masks.starts,
                                                masks.window, scale, causal, *masks.use)
            return tuple(gr if w else None for gr, w in zip(grads, ctx.want))

    return BlockedAttention


_STATE = {}


class ReuseOutputs:
    """One recompute region's kernel results: `with slot:` around the region's function, which
    runs twice (forward, then again in backward). Pass 1 records (out, lse) per kernel call in
    call order; pass 2 hands call i record i (when its key -- shapes, scale, masks used --
    matches, else it computes) and drops the records. Any later pass computes as usual."""

    enabled = True   # False: every pass runs the kernel (the A/B in benchmarks/recompute_ab.py)

    def __init__(self):
        self.records, self.passes, self.at, self.prev = [], 0, 0, None

    def __enter__(self):
        self.passes, self.at, self.prev = self.passes + 1, 0, _STATE.get("reuse")
        _STATE["reuse"] = self if ReuseOutputs.enabled else None
        return self

    def __exit__(self, *exc):
        _STATE["reuse"] = self.prev
        if self.passes > 1:
            self.records = []

    def masks(self, key, mask, starts, window):
        """_Masks for the next kernel call of this pass, carrying the record to use or keep."""
        if self.passes == 1:
            self.records.append([key])
            return _Masks(mask, starts, window, keep=self.records[-1])
        rec = self.records[self.at] if self.at < len(self.records) else None
        self.at += 1
        given = rec[1] if rec is not None and rec[0] == key and len(rec) == 2 else None
        return _Masks(mask, starts, window, given=given)


def blocked_attention(q, k, v, scale, causal=False, mask=None, starts=None, window=None):
    """See the module docstring; None when the kernel path does not apply."""
    import paddle

    from . import _fits

    if len(q.shape) != 4 or len(k.shape) != 4 or q.shape[1] % k.shape[1] or not _fits(q, k, v):
        return None
    B, S, T = q.shape[0], q.shape[2], k.shape[2]
    if mask is not None and (mask.dtype != paddle.bool or len(mask.shape) != 4 or mask.shape[1] != 1
                             or list(mask.shape[2:]) != [S, T] or mask.shape[0] not in (1, B)):
        return None   # a mask of another shape (broadcast over heads, say): the dense path takes it
    if (causal and T < S) or (starts is not None and (T != S or list(starts.shape) != [B, S])):
        return None
    if window is not None and (window.dtype != paddle.int32 or list(window.shape) != [B, 2]):
        return None
    if "layer" not in _STATE:
        _STATE["layer"] = _layer()
    q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
    reuse = _STATE.get("reuse")
    if reuse is not None:
        key = (tuple(q.shape), tuple(k.shape), float(scale), bool(causal), mask is not None, starts is not None,
               window is not None)
        masks = reuse.masks(key, mask, starts, window)
    else:
        masks = _Masks(mask, starts, window)
    return _STATE["layer"].apply(q, k, v, masks, float(scale), bool(causal))


def example_starts(runs, S):
    """int32 [B, S] from per-row example runs [(start, end)]: each position's example start (the
    first key a packed-row query may see)."""
    out = np.zeros((len(runs), S), np.int32)
    for b, row in enumerate(runs):
        for s, e in row:
            out[b, s:e] = s
    return out


def padding_window(attention_mask):
    """int32 [B, 2] (first, end) of each row's 1s when every row of attention_mask [B, T] (1 real,
    0 pad) is one contiguous run of 1s (left or right padding, or none); None otherwise (a mask
    with holes keeps the bool-mask path). Host-side: one [B, T] copy to numpy."""
    am = np.asarray(attention_mask.numpy() if hasattr(attention_mask, "numpy") else attention_mask) != 0
    if am.ndim != 2:
        return None
    first = np.argmax(am, axis=1)
    count = am.sum(axis=1)
    end = np.where(count > 0, first + count, 0)
    idx = np.arange(am.shape[1])[None, :]
    if not np.array_equal(am, (idx >= first[:, None]) & (idx < end[:, None])):
        return None
    return np.stack([np.where(count > 0, first, 0), end], axis=1).astype(np.int32)
