"""Tensor-parallel plan: which slice of every tensor a tensor-parallel rank holds, from ModelSpec.

The model files say nothing about parallelism; ModelSpec.tp_plan names, by module-name suffix,
how each Linear / Embedding is cut (paddle layout: Linear weight [in, out], Embedding [V, H]):

    "column"  weight split along axis 1 (output features), bias along axis 0; layers with parts
              (ModelSpec.tp_parts, e.g. ChatGLM2's query_key_value = [q | k | v]) split every
              part separately, by whole heads, and keep the rank's slices side by side:
              [q_r | k_r | v_r]. A part with fewer heads than ranks (key/value heads, as
              Megatron does) is replicated: head h on ranks h*c .. h*c+c-1, c = degree / heads;
              those ranks' gradients of it are partial and summed over the c ranks
    "row"     weight split along axis 0 (input features); the bias is whole on every rank and
              added once, after the partial outputs are summed
    "vocab"   an embedding [V, H] split along axis 0 (vocabulary rows)
    "partial" a replicated parameter applied inside the split region, to this rank's heads only
              (Qwen3's per-head q_norm / k_norm [D]): whole on every rank, but each rank's
              gradient is the part from its own heads, so the gradients are all-reduced (summed)
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
import logging
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np


def local_heads(heads, degree):
    """How many of a part's `heads` heads one of `degree` tensor-parallel ranks holds: heads /
    degree, or 1 when heads < degree (each head replicated on degree / heads ranks). The local
    width of a head-structured part is this times the head width; the KV cache under TP has
    this many key/value heads (TensorParallel.local_heads)."""
    return heads // degree if heads >= degree else 1


@dataclass(frozen=True)
class Split:
    """axis None: replicated. Else the tensor is cut along `axis` into `degree` slices of every
    part (`parts`: widths along axis summing to its length; default one part). `heads`: per part
    its number of heads (None: no head structure); a part is cut by whole heads, and a part with
    fewer heads than ranks is replicated (each rank holds head rank // (degree / heads)). With
    `pad` the (single) part is first padded to a multiple of the degree."""
    axis: Optional[int] = None
    parts: Optional[Tuple[int, ...]] = None
    pad: bool = False
    heads: Optional[Tuple[Optional[int], ...]] = None

    def part_widths(self, length):
        return tuple(self.parts) if self.parts else (length,)

    def _part_heads(self, n_parts):
        return tuple(self.heads) if self.heads else (None,) * n_parts

    def _piece(self, width, heads, rank, degree):
        """(offset in the part, width) of this rank's piece of one part."""
        if self.pad:
            n = math.ceil(width / degree)
            return rank * n, n
        if heads is not None and heads < degree:     # replicated heads
            n = width // heads * local_heads(heads, degree)
            return (rank // (degree // heads)) * n, n
        n = width // degree
        return rank * n, n

    def replication(self, degree):
        """[(local start, local width, ranks sharing it)] of this rank's replicated parts."""
        out, lstart = [], 0
        widths = self.part_widths(sum(self.parts) if self.parts else 0)
        for w, h in zip(widths, self._part_heads(len(widths))):
            n = self._piece(w, h, 0, degree)[1]
            if h is not None and h < degree:
                out.append((lstart, n, degree // h))
            lstart += n
        return out

    def local_len(self, length, degree):
        if self.pad:
            return math.ceil(length / degree)
        widths = self.part_widths(length)
        return sum(self._piece(w, h, 0, degree)[1] for w, h in zip(widths, self._part_heads(len(widths))))

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
        widths = self.part_widths(length)
        for w, h in zip(widths, self._part_heads(len(widths))):
            off, n = self._piece(w, h, rank, degree)
            lo = gstart + off
            hi = min(lo + n, gstart + w)
            if hi > lo:
                out.append((lo, hi - lo, lstart))
            gstart += w
            lstart += n
        return out


REPLICATED = Split()
logger = logging.getLogger("paddletune")


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


def partial_grad(spec, name):
    """True when parameter `name`'s gradient is a partial sum over the tensor-parallel ranks
    (its module is "partial" in the plan)."""
    return module_kind(spec, _owner(name)[0]) == "partial"


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
        K = spec.prefix_layout(config)[1]                       # [L, K, P, D] by kv heads
        return Split(axis=1, parts=(K,), heads=(K,))
    module, role, leaf = _owner(name)
    kind = module_kind(spec, module)
    if kind is None:
        return REPLICATED
    listed = (spec.tp_parts(config) if spec.tp_parts else {}).get(module.rsplit(".", 1)[-1])
    parts = tuple(w for w, _ in listed) if listed else None
    heads = tuple(h for _, h in listed) if listed else None
    vocab = kind == "vocab" or module == spec.lm_head
    if kind == "vocab":
        return Split(axis=0, pad=True) if leaf == "weight" else REPLICATED
    if kind == "column":
        if role == "lora_A":
            return REPLICATED
        if leaf == "bias" and role in (None, "base_layer"):
            return Split(axis=0, parts=parts, pad=vocab, heads=heads)
        if leaf == "weight":
            return Split(axis=1, parts=parts, pad=vocab, heads=heads)
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
    if kv < degree and degree % kv:
        raise ValueError(f"num_key_value_heads ({kv}) is smaller than tensor_parallel_degree "
                         f"({degree}) and does not divide it: key/value heads can be replicated "
                         f"only when each is on the same number of ranks; choose a multiple of {kv}")
    if kv < degree:
        logger.info("tensor parallel %d with %d key/value heads: each key/value head is replicated "
                    "on %d ranks (their gradients summed over those ranks)", degree, kv, degree // kv)
    elif kv % degree:
        raise ValueError(f"num_key_value_heads ({kv}) is not divisible by tensor_parallel_degree "
                         f"({degree}); choose a degree that divides it")
    moe = getattr(config, "moe", None)
    if moe:
        mixtral = "num_local_experts" in (getattr(config, "raw", None) or {})
        key = "intermediate_size" if mixtral else "moe_intermediate_size"
        if moe["expert_size"] % degree:
            raise ValueError(f"{key} ({moe['expert_size']}, each expert's width) is not divisible "
                             f"by tensor_parallel_degree ({degree}): every expert's gate/up "
                             "columns and down rows are split over the ranks; choose a degree "
                             "that divides it")
        if moe["shared_size"] and moe["shared_size"] % degree:
            raise ValueError(f"shared_expert_intermediate_size ({moe['shared_size']}) is not "
                             f"divisible by tensor_parallel_degree ({degree}); choose a degree "
                             "that divides it")
        from ..models.moe import is_sparse_layer

        dense = any(not is_sparse_layer(moe, i) for i in range(config.num_hidden_layers))
        if not dense:   # Mixtral's intermediate_size is the experts' (checked above)
            return
    inter = config.intermediate_size
    if inter % degree:
        raise ValueError(f"intermediate_size ({inter}) is not divisible by tensor_parallel_degree "
                         f"({degree}); choose a degree that divides it")
