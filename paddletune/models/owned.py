"""Weights read inside the layer that owns them.

Sharding stage 3 (paddle's group_sharded_parallel "p_g_os", parallel/group_sharded.py) keeps a
parameter whole only while its owning layer runs: a forward pre-hook on the layer gathers the
layer's own parameters (`parameters(include_sublayers=False)`), a post-hook releases them and
arranges the gather again for the layer's backward. A weight read anywhere else (a parent
layer's forward reading `self.child.weight`, the loss reading the LM head's weight) finds a
tensor without storage: `RuntimeError: (PreconditionNotMet) Tensor holds no memory`.

So every read of a parameter outside its own layer's `forward` goes through

    y = as_forward(layer, fn, *args)     # fn(*args) with `layer`'s forward hooks around it

which runs `fn` as if it were `layer`'s forward: paddle's `Layer.__call__` runs the hooks, then
`fn` (set as the instance's forward for this call), so stage 3 gathers before `fn` reads the
weight and releases after it, and in backward the weight is gathered again before `fn`'s
backward runs. A layer without forward hooks (every run except stage 3) calls `fn` directly:
two dict checks, no copy and no extra op on the single-process path.

Users: models/loss.py (the chunked head + cross-entropy reads the head's or the tied
embedding's weight), models/runner.py `logits` (a tied head), peft/lora.py (LoRA's A and B
matrices with the scale on B). The prefix encoder's tensors are excluded from stage 3's
slicing instead (its non-projected prefix is returned as the parameters themselves, which a
release would empty): parallel/group_sharded.py.
"""


def as_forward(layer, fn, *args):
    """fn(*args) as `layer`'s forward: its forward pre- / post-hooks run around it (see above)."""
    if not layer._forward_pre_hooks and not layer._forward_post_hooks:
        return fn(*args)
    had = "forward" in layer.__dict__
    saved = layer.__dict__.get("forward")
    object.__setattr__(layer, "forward", fn)
    try:
        return layer(*args)
    finally:
        if had:
            object.__setattr__(layer, "forward", saved)
        else:
            object.__delattr__(layer, "forward")
