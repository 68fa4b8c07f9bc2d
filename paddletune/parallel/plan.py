"""Tensor-parallel plan: which slice of every tensor a tensor-parallel rank holds, from ModelSpec.

The model files say nothing about parallelism; ModelSpec.tp_plan names, by module-name suffix,
how each Linear / Embedding is cut (paddle layout: Linear weight [in, out], Embedding [V, H]):

    "column"  weight split along axis 1 (output features), bias along axis 0; fused layers
              (ModelSpec.fused_parts, e.g. ChatGLM2's query_key_value = [q | k | v]) split every
              part separately and keep the rank's slices side by side: [q_r | k_r | v_r]
    "row"     weight split along axis 0 (input features); the bias is whole on every rank and
              added once, after the partial outputs are summed
    "vocab"   an embedding [V, H] split along axis 0 (vocabulary rows)
The LM head is a "column" layer whose output axis is the vocabulary. Vocabulary axes (the "vocab"
embedding and the LM head) are padded to a multiple of the degree: V = 601 at TP 2 gives each rank
301 rows (rank 1's last row is padding, masked out of every softmax and never exported).

Adapters follow their base layer: LoRA A [in, r] is split along axis 0 under a row layer (B whole),
LoRA B [r, out] along axis 1 under a column layer (A whole, parts as the base); learned prefixes
[L, K, P, D] split along the key/value heads (axis 1); everything else (norms, bottleneck
adapters, row biases) is replicated.

`Split` describes one tensor's cut; slice_array / merge_arrays are the pure numpy functions over
it (round trip: merge(split(x)) == x), and `boxes` gives the global boxes a rank's slice covers
(one per part), which is how checkpoints record and re-read slices.
"""
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np


@dataclass(frozen=True)
class Split:
    """axis None: replicated. Else the tensor is cut along `axis` into `degree` equal slices of
    every part (`parts`: widths along axis summing to its length; default one part); with
    `pad` the (single) part is first padded to a multiple of the degree."""
    axis: Optional[int] = None
    parts: Optional[Tuple[int, ...]] = None
    pad: bool = False

    def part_widths(self, length):
        return tuple(self.parts) if self.parts else (length,)

    def local_len(self, length, degree):
        if self.pad:
            return math.ceil(length / degree)
        return sum(w // degree for w in self.part_widths(length))

    def local_shape(self, shape, degree):
        if self.axis is None or degree == 1:
            return list(shape)
        out = list(shape)
        out[self.axis] = self.local_len(shape[self.axis], degree)
        return out

    def boxes(self, shape, rank, degree):
        """[(global start, length, local start)] along `axis` (not None) of what `rank` holds:
        one box per part, real rows only (vocabulary padding is not part of the global tensor).
        Example: parts (4, 2, 2) at degree 2, rank 1 -> [(2, 2, 0), (5, 1, 2), (7, 1, 3)]."""
        length = shape[self.axis]
        if degree == 1:
            return [(0, length, 0)]
        out, gstart, lstart = [], 0, 0
        for w in self.part_widths(length):
            n = math.ceil(w / degree) if self.pad else w // degree
            lo = gstart + rank * n
            hi = min(lo + n, gstart + w)
            if hi > lo:
                out.append((lo, hi - lo, lstart))
            gstart += w
            lstart += n
        return out


REPLICATED = Split()


def slice_array(arr, split, rank, degree):
    """The slice of global array `arr` that `rank` of `degree` holds (zero rows for padding)."""
    if split.axis is None or degree == 1:
        return np.array(arr)
    shape = list(arr.shape)
    out = np.zeros(split.local_shape(shape, degree), arr.dtype)
    for g0, n, l0 in split.boxes(shape, rank, degree):
        src = [slice(None)] * arr.ndim
        dst = [slice(None)] * arr.ndim
        src[split.axis], dst[split.axis] = slice(g0, g0 + n), slice(l0, l0 + n)
        out[tuple(dst)] = arr[tuple(src)]
    return out


def merge_arrays(slices, split, shape):
    """Inverse of slice_array: the global array of `shape` from every rank's slice, in rank order
    (a replicated tensor: the first copy)."""
    degree = len(slices)
    if split.axis is None or degree == 1:
        return np.array(slices[0])
    out = np.zeros(shape, slices[0].dtype)
    for rank, local in enumerate(slices):
        for g0, n, l0 in split.boxes(list(shape), rank, degree):
            src = [slice(None)] * out.ndim
            dst = [slice(None)] * out.ndim
            dst[split.axis], src[split.axis] = slice(g0, g0 + n), slice(l0, l0 + n)
            out[tuple(dst)] = local[tuple(src)]
    return out


# ------------------------------------------------------------------------------ per-model rules

def module_kind(spec, module_name):
    """The tp_plan kind ("column" / "row" / "vocab") of a module, or None. Wrapper segments
    (LoRA's base_layer) are looked through: "x.q_proj.base_layer" is a q_proj."""
    parts = [p for p in module_name.split(".") if p != "base_layer"]
    return spec.tp_plan.get(parts[-1]) if parts else None


def _owner(name):
    """(module holding the tensor, adapter role or None, leaf): splits a parameter name such as
    "model.layers.0.self_attn.q_proj.lora_B.weight" into ("...q_proj", "lora_B", "weight")."""
    head, _, leaf = name.rpartition(".")
    role = None
    for r in ("lora_A", "lora_B", "base_layer"):
        if head.endswith("." + r):
            head, role = head[:-len(r) - 1], r
            break
    return head, role, leaf


def param_split(spec, config, name, shape):
    """The Split of tensor `name` (paddle layout, global `shape`) under the model's plan."""
    if name.startswith("prefix_encoder.") and name.endswith(("key_prefix", "value_prefix")):
        return Split(axis=1)                                    # [L, K, P, D] by kv heads
    module, role, leaf = _owner(name)
    kind = module_kind(spec, module)
    if kind is None:
        return REPLICATED
    fused = spec.fused_parts(config) if spec.fused_parts else {}
    parts = fused.get(module.rsplit(".", 1)[-1])
    parts = tuple(parts) if parts else None
    vocab = kind == "vocab" or module == spec.lm_head
    if kind == "vocab":
        return Split(axis=0, pad=True) if leaf == "weight" else REPLICATED
    if kind == "column":
        if role == "lora_A":
            return REPLICATED
        if leaf == "bias" and role in (None, "base_layer"):
            return Split(axis=0, parts=parts, pad=vocab)
        if leaf == "weight":
            return Split(axis=1, parts=parts, pad=vocab)
        return REPLICATED
    if kind == "row":
        if role == "lora_B" or leaf == "bias":
            return REPLICATED
        if leaf == "weight":
            return Split(axis=0)
    return REPLICATED


def check_layout(spec, config, degree):
    """Refuse, before anything is loaded, a tensor-parallel degree the model cannot be cut by.
    Each message names both numbers. (Vocabulary sizes are padded, not refused.)"""
    if degree <= 1:
        return
    if not spec.tp_plan:
        raise ValueError(f"model type {config.model_type!r} declares no tensor-parallel plan "
                         "(ModelSpec.tp_plan): set tensor_parallel_degree to 1")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % degree:
        raise ValueError(f"num_attention_heads ({heads}) is not divisible by tensor_parallel_degree "
                         f"({degree}); choose a degree that divides it")
    if kv < degree:
        raise ValueError(f"num_key_value_heads ({kv}) is smaller than tensor_parallel_degree "
                         f"({degree}): replicating key/value heads across ranks is not built; "
                         f"use a degree <= {kv}")
    if kv % degree:
        raise ValueError(f"num_key_value_heads ({kv}) is not divisible by tensor_parallel_degree "
                         f"({degree}); choose a degree that divides it")
    inter = config.intermediate_size
    if inter % degree:
        raise ValueError(f"intermediate_size ({inter}) is not divisible by tensor_parallel_degree "
                         f"({degree}); choose a degree that divides it")
