"""Tensor parallelism on paddle's auto-parallel engine: DTensor parameters, local execution.

Parameters are DTensors on the tensor-parallel ProcessMesh, placed by the model's plan
(parallel/plan.py: Shard along the split axis, or Replicate). Each rank creates only its slice
(`dtensor_from_local` from the slice read off the checkpoint; no rank ever holds a full weight).

Compute runs on the local shards. Every module that holds parameters (each decoder block, the
embedding, the final norm, the head, the prefix encoder) runs with its DTensor parameters swapped
for their differentiable local views (`dtensor_to_local`, the engine's boundary op; gradients land
on the DTensors with their placements) - so the model code, paddletune's CPU kernels, the KV cache
and packed-row attention run unchanged on local tensors. Why not the engine's per-op SPMD
propagation: measured here (paddle 3.3.1, gloo), it all-gathers the vocab-sharded embedding
weight (forward and backward), the attention scores around masked_fill and the logits before
cross-entropy, and all-reduces partial input gradients once per consumer (3x for q/k/v); custom
CPU kernels cannot take DTensors at all, and dense caches that meet a DTensor turn into DTensors in
place. Running locally with Megatron's two collectives gives exactly the communication TP needs:

    f  (copy_to_tp):     forward identity,   backward all-reduce   - the input of a column layer
    g  (reduce_from_tp): forward all-reduce, backward identity     - the output of a row layer

f and g are fleet's `mp_ops._c_identity` / `_mp_allreduce` over HybridCommunicateGroup's model-
parallel group (what fleet's ColumnParallelLinear / RowParallelLinear run; on gloo through
cpu_compat.install_mp_ops). Per decoder layer that is one all-reduce of [tokens, H] after
attention and one after the MLP in forward, and one per column-layer input group in backward
(q/k/v share one: the last input seen is remembered, so layers fed the same tensor enter the parallel region once). The vocabulary-
parallel embedding is a masked local lookup followed by g. LoRA under a column layer runs its A
(replicated) before f on the rank-r activation; under a row layer its A (split) ends in g on the
rank-r activation, so adapters add only [tokens, r] all-reduces. Dropout on a split activation
draws the full-shape mask from the shared generator and keeps this rank's slice, so masks equal
the single-process run's.
"""
import contextlib
import logging
import types

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from .plan import local_heads, module_kind, param_split, partial_grad, slice_array

logger = logging.getLogger("paddletune")


class TensorParallel:
    """This rank's tensor-parallel group: degree, index, paddle group, ProcessMesh. `log`, when a
    list, records every collective as (op, shape) (tests assert what was communicated)."""

    def __init__(self, topo):
        self.topo = topo
        self.degree, self.rank = topo.tp_degree, topo.tp_rank
        ranks = topo.ranks("tp")
        self.group = None if len(ranks) == topo.world_size else topo.groups["tp"]
        # fleet's model-parallel group (mp_ops needs a Group, also when it is the whole world)
        self.mp_group = topo.hcg.get_model_parallel_group() if topo.hcg is not None else self.group
        self.mesh = dist.ProcessMesh(ranks, dim_names=["tp"])
        self.log = None
        self._memo = (None, None)   # (last column-layer input, its f(.)): q/k/v share one f
        self._replica_groups = {}   # c -> group of the c consecutive TP ranks sharing a head

    # The vocabulary-parallel forms of models/loss.py's functions (parallel/vocab.py), found
    # through the model's `tensor_parallel`: models/ never imports parallel/.
    @property
    def causal_lm_loss(self):
        from .vocab import tp_causal_lm_loss

        return tp_causal_lm_loss

    @property
    def hidden_loss(self):
        from .vocab import tp_hidden_loss

        return tp_hidden_loss

    def symmetric_kl(self, z1, z2):
        """R-Drop's per-row symmetric KL over vocabulary shards (vocab.sharded_symmetric_kl)."""
        from .vocab import sharded_symmetric_kl

        return sharded_symmetric_kl(z1, z2, self)

    def replica_group(self, c):
        """The group of the c consecutive tensor-parallel ranks (this one among them) that hold
        the same replicated key/value head. Created on first use by every rank of the job, in the
        same order (group creation is collective): call it from code every rank runs."""
        if c not in self._replica_groups:
            if c == self.degree:
                self._replica_groups[c] = self.group
            else:
                from .topology import create_groups, group_ranks

                def chunks(r):   # rank r's tensor-parallel group cut into runs of c
                    tp_ranks = group_ranks(r, self.topo.degrees, "tp")
                    return [tp_ranks[i:i + c] for i in range(0, len(tp_ranks), c)]

                self._replica_groups[c] = create_groups(self.topo.rank, self.topo.world_size, chunks)
        return self._replica_groups[c]

    def local_heads(self, heads):
        """Heads of a `heads`-head part on this rank under the plan (plan.local_heads): what the
        attention's local key/value projections produce, so what the KV cache must hold."""
        return local_heads(heads, self.degree)

    def all_reduce(self, t, op="sum"):
        if self.log is not None:
            self.log.append((f"all_reduce_{op}", list(t.shape)))
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        return t

    def placements(self, split):
        return [dist.Replicate()] if split.axis is None else [dist.Shard(split.axis)]

    def enter(self, x):
        """f on a column layer's input, once per distinct input tensor."""
        last, fx = self._memo
        if last is x:
            return fx
        fx = copy_to_tp(x, self)
        self._memo = (x, fx)
        return fx


class _CopyToTP(PyLayer):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return ctx.tp.all_reduce(dy.clone())


class _ReduceFromTP(PyLayer):
    @staticmethod
    def forward(ctx, x, tp):
        return tp.all_reduce(x.clone())

    @staticmethod
    def backward(ctx, dy):
        return dy


FLEET_MP_OPS = True   # f / g through fleet's mp_ops; False: the PyLayers above (tests compare)


def _mp_ops():
    from paddle.distributed.fleet.layers.mpu import mp_ops

    return mp_ops


def copy_to_tp(x, tp):
    """f: identity forward, all-reduce of the gradient backward (partial input gradients):
    fleet's mp_ops._c_identity over the model-parallel group (cpu_compat's shim on gloo). `tp.log`
    records the backward all-reduce when the gradient reaches it."""
    if x.stop_gradient:
        return x
    if not FLEET_MP_OPS:
        return _CopyToTP.apply(x, tp)
    y = _mp_ops()._c_identity(x, group=tp.mp_group)
    if tp.log is not None:
        log, shape = tp.log, list(x.shape)
        y.register_hook(lambda g: log.append(("all_reduce_sum", shape)))
    return y


def reduce_from_tp(x, tp):
    """g: all-reduce forward (partial sums of a row layer), identity backward: fleet's
    mp_ops._mp_allreduce over the model-parallel group (cpu_compat's shim on gloo; paddle's own
    sums `x` in place, so x is always a fresh tensor here)."""
    if not FLEET_MP_OPS:
        return _ReduceFromTP.apply(x, tp)
    if tp.log is not None:
        tp.log.append(("all_reduce_sum", list(x.shape)))
    return _mp_ops()._mp_allreduce(x, group=tp.mp_group, use_calc_stream=True,
                                   use_model_parallel=True)


def sliced_dropout(x, p, axis, tp, training=True):
    """Dropout of a tensor split along `axis`: the mask of the full tensor is drawn (as the single
    process draws it) and this rank's slice kept, so every rank's mask is the one-process mask's."""
    if not training or p <= 0:
        return x
    shape = list(x.shape)
    full = shape[:]
    full[axis] = shape[axis] * tp.degree
    mask = F.dropout(paddle.ones(full, x.dtype), p, training=True)
    lo = tp.rank * shape[axis]
    return x * paddle.slice(mask, [axis % len(full)], [lo], [lo + shape[axis]])


# ------------------------------------------------------------------------------ executors

def _linear(layer, x):
    """x @ W without the bias: paddle Linear (W local [in, out], through the layer's
    `weight_transform` when it has one: layers.NormHead) or a quantized linear."""
    if isinstance(layer, nn.Linear):
        transform = getattr(layer, "weight_transform", None)
        return paddle.matmul(x, layer.weight if transform is None else transform(layer.weight))
    return layer.algo.matmul(x, layer)


def column_forward(tp):
    def forward(self, x):
        y = _linear(self, tp.enter(x))
        return y if self.bias is None else y + self.bias.astype(y.dtype)
    return forward


def row_forward(tp):
    def forward(self, x):
        y = reduce_from_tp(_linear(self, x), tp)
        return y if self.bias is None else y + self.bias.astype(y.dtype)   # added once, after the sum
    return forward


def vocab_embedding_forward(tp):
    """Local rows [rank*Vl, (rank+1)*Vl) of the vocabulary; other ids give 0 here, g sums."""
    def forward(self, ids):
        vl = self.weight.shape[0]
        loc = ids - tp.rank * vl
        inside = (loc >= 0) & (loc < vl)
        out = F.embedding(paddle.where(inside, loc, paddle.zeros_like(loc)), self.weight)
        return reduce_from_tp(out * inside.unsqueeze(-1).astype(out.dtype), tp)
    return forward


# ------------------------------------------------------------------------------ local views

@contextlib.contextmanager
def local_params(module, skip=()):
    """Within the block, `module`'s DTensor parameters (except those of sub-modules in `skip`) are
    replaced by their differentiable local views; plain tensors stay as they are."""
    swapped = []
    skip_ids = {id(m) for m in skip}
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in skip_ids:
            continue
        for leaf, p in list(m._parameters.items()):
            if p is not None and p.is_dist():
                m._parameters[leaf] = dist.auto_parallel.api.dtensor_to_local(p, p.process_mesh, p.placements)
                swapped.append((m, leaf, p))
        stack.extend(m._sub_layers.values())
    try:
        yield
    finally:
        for m, leaf, p in swapped:
            m._parameters[leaf] = p


def run_locally(module, method="forward", skip=()):
    """Replace module.<method> by the same method run inside local_params(module)."""
    original = getattr(module, method)

    def wrapped(*args, **kwargs):
        with local_params(module, skip):
            return original(*args, **kwargs)
    setattr(module, method, wrapped)


def local(t):
    """The local value of a DTensor (a parameter's shard or a gradient's), else `t`."""
    return t._local_value() if t is not None and t.is_dist() else t


def is_split(p):
    return p.is_dist() and any(isinstance(pl, dist.Shard) for pl in p.placements)


# ------------------------------------------------------------------------------ parameters

def make_param(local_array, split, tp, name, trainable, dtype=None):
    """A DTensor parameter on tp.mesh from this rank's slice (numpy, paddle layout); `dtype`
    names bfloat16 for uint16 words (paddle's numpy form of bfloat16)."""
    from paddle.base.framework import EagerParamBase

    local = paddle.to_tensor(np.ascontiguousarray(local_array), dtype=dtype)
    t = dist.auto_parallel.api.dtensor_from_local(local, tp.mesh, tp.placements(split))
    p = EagerParamBase.from_tensor(t, name=name)
    p.stop_gradient = not trainable
    return p


def set_param(model, name, param):
    head, _, leaf = name.rpartition(".")
    owner = model
    for part in head.split(".") if head else []:
        owner = getattr(owner, part)
    owner._parameters[leaf] = param


def place_dense_params(model, tp):
    """Every parameter still dense (created after loading: adapters, prefixes, BitFit biases)
    becomes a DTensor: its slice under the plan, or replicated. Their values were drawn in the
    same order with the same seed as in one process, so a TP run starts from the same adapter."""
    placed = 0
    for name, p in list(model.named_parameters()):
        if p.is_dist():
            continue
        split = param_split(model.spec, model.config, name, list(p.shape))
        arr = slice_array(p.numpy(), split, tp.rank, tp.degree)
        set_param(model, name, make_param(arr, split, tp, p.name, not p.stop_gradient, p.dtype))
        placed += 1
    return placed


def real_shape(model, p, split):
    """Global shape of a parameter as checkpoints and exports hold it: without vocabulary padding
    and with each replicated key/value head once (the DTensor's shape counts every rank's slice)."""
    shape = list(p.shape)
    if split.pad:
        shape[split.axis] = model.config.vocab_size
    elif split.parts and split.axis is not None:
        shape[split.axis] = sum(split.parts)
    return shape


def full_array(model, name, p, tp):
    """The whole tensor of parameter `p` (global shape, vocabulary padding removed) on every rank:
    one all-gather of its slices. For exports only - never in a training step."""
    from .plan import merge_arrays

    loc = local(p).numpy()
    if not p.is_dist() or not is_split(p):
        return loc
    split = param_split(model.spec, model.config, name, list(p.shape))
    if tp.log is not None:
        tp.log.append(("all_gather_export", list(loc.shape)))
    parts = []
    dist.all_gather(parts, paddle.to_tensor(loc), group=tp.group)
    return merge_arrays([x.numpy() for x in parts], split, real_shape(model, p, split))


def gathered_state(model, tp):
    """(name, whole array) of every parameter, one tensor at a time (a collective each: every
    rank of the group must iterate it in step; only one rank writes)."""
    for name, p in model.named_parameters():
        yield name, full_array(model, name, p, tp)


@contextlib.contextmanager
def full_params(model, tp, names):
    """Within the block, the parameters `names` are whole dense tensors on every rank (gathered
    one by one), so adapter exporters read them as in one process."""
    from paddle.base.framework import EagerParamBase

    params = dict(model.named_parameters())
    saved = []
    for name in names:
        p = params[name]
        full = EagerParamBase.from_tensor(paddle.to_tensor(full_array(model, name, p, tp)), name=p.name)
        saved.append((name, p))
        set_param(model, name, full)
    try:
        yield
    finally:
        for name, p in saved:
            set_param(model, name, p)


def box_pieces(model, name, p, tp):
    """[(global start, shape, local index)] of the boxes of the global tensor this rank's slice
    of `name` covers (several for fused parts), for checkpoints."""
    split = param_split(model.spec, model.config, name, list(p.shape))
    shape = real_shape(model, p, split)
    if not is_split(p):
        return [([0] * len(shape), shape, tuple(slice(None) for _ in shape), tp.degree)]
    shared = {l0: c for l0, _, c in split.replication(tp.degree)}
    out = []
    for g0, n, l0 in split.boxes(shape, tp.rank, tp.degree):
        start, size, idx = [0] * len(shape), list(shape), [slice(None)] * len(shape)
        start[split.axis], size[split.axis], idx[split.axis] = g0, n, slice(l0, l0 + n)
        out.append((start, size, tuple(idx), shared.get(l0, 1)))
    return out


def replicated_columns(model, name, p, tp):
    """[(axis, local start, width, c)] of the replicated key/value parts of `name`'s slice."""
    if not is_split(p):
        return []
    split = param_split(model.spec, model.config, name, list(p.shape))
    return [(split.axis, l0, n, c) for l0, n, c in split.replication(tp.degree)]


def sum_replicated_grads(model, named, grads, tp):
    """A replicated key/value head's gradient on each of its c ranks is the part from that rank's
    query heads: sum it over those c ranks (in place in `grads`, aligned with `named`). A
    "partial" parameter's gradient (a replicated weight applied to each rank's own heads) is
    summed over the whole tensor-parallel group."""
    for i, (name, p) in enumerate(named):
        if partial_grad(model.spec, name):
            g = local(grads[i]) if grads[i].is_dist() else grads[i]
            tp.all_reduce(g)
            continue
        for axis, l0, n, c in replicated_columns(model, name, p, tp):
            g = grads[i]
            part = paddle.slice(g, [axis], [l0], [l0 + n]).clone()
            if tp.log is not None:
                tp.log.append(("all_reduce_sum", list(part.shape)))
            dist.all_reduce(part, group=tp.replica_group(c))
            idx = [slice(None)] * g.ndim
            idx[axis] = slice(l0, l0 + n)
            g[tuple(idx)] = part
    return grads


def replica_square_excess(model, named, grads, tp):
    """The part of the split gradients' squared norm that the tensor-parallel all-reduce counts
    more than once: a replicated head counts c times, it should count once."""
    extra = []
    for i, (name, p) in enumerate(named):
        for axis, l0, n, c in replicated_columns(model, name, p, tp):
            part = paddle.slice(grads[i], [axis], [l0], [l0 + n]).astype("float32")
            extra.append(paddle.square(part).sum() * ((c - 1) / c))
    return paddle.add_n(extra) if extra else None


def global_grad_norm(sq_terms, split_flags, tp, excess=None):
    """sqrt of the whole model's sum of squared gradients: split parameters' local sums are
    added over the tensor-parallel ranks (minus `excess`, what replicated heads add beyond one
    count), replicated parameters (equal on every rank) counted once."""
    split = [s for s, f in zip(sq_terms, split_flags) if f]
    rep = [s for s, f in zip(sq_terms, split_flags) if not f]
    total = paddle.zeros([], "float32")
    if split:
        local = paddle.add_n(split) if len(split) > 1 else split[0]
        if excess is not None:
            local = local - excess
        total = total + tp.all_reduce(local.clone())
    if rep:
        total = total + paddle.add_n(rep)
    return paddle.sqrt(total)


# ------------------------------------------------------------------------------ installing

def install(model, tp):
    """Put fleet's ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding in place of
    the planned float layers (fleet_layers.parallelize), patch the other planned modules'
    forwards with the executors above, and apply local execution to a model whose parameters
    are DTensors (loading.load_model calls this under TP). Idempotent for adapters added
    later: call `finalize(model, tp)` after PEFT wrapped layers or added parameters."""
    from .fleet_layers import parallelize

    spec = model.spec
    fleet_made = parallelize(model, tp)   # plain float layers: fleet's classes, fleet's forward
    for name, m in model.named_sublayers():
        kind = module_kind(spec, name)
        if (kind not in ("column", "row", "vocab")
                or getattr(m, "_pt_tp", False) and name not in fleet_made
                or not hasattr(m, "weight") and not hasattr(m, "algo")):
            continue
        if name not in fleet_made:   # what fleet's classes cannot express (fleet_layers docstring)
            fwd = {"column": column_forward, "row": row_forward, "vocab": vocab_embedding_forward}[kind](tp)
            m.forward = types.MethodType(fwd, m)
            m._pt_tp = kind
        widths = local_part_widths(model, name, tp)
        if widths is not None:   # the rank's width of every output part (fused q|k|v)
            m.part_widths = widths
        first = local_first_head(model, name, tp)
        if first is not None:    # the global index of the rank's first head (ALiBi slopes)
            m.head_offset = first
    blocks = list(model.decoder_layers())
    for block in blocks:
        run_locally(block)
        attn = getattr(block, spec.attention_module or "", None)
        if attn is not None:   # recompute_granularity full_attn re-runs it outside the block's call
            run_locally(attn)
    run_locally(model, "forward", skip=blocks)
    run_locally(model, "logits", skip=blocks)
    model.tensor_parallel = tp
    model.heads_dropout = lambda x, p, training: sliced_dropout(x, p, 1, tp, training)
    return model


def local_part_widths(model, module_name, tp):
    """This rank's output width of every part of a column module with ModelSpec.tp_parts (more
    than one part), else None."""
    split = param_split(model.spec, model.config, module_name + ".weight", [])
    if split.axis is None or not split.parts or len(split.parts) < 2:
        return None
    return [n for _, n, _ in split.boxes([0, sum(split.parts)], tp.rank, tp.degree)]


def local_first_head(model, module_name, tp):
    """Global index of the first attention head in this rank's output of a column module whose
    ModelSpec.tp_parts give head counts (its first part with heads), else None."""
    split = param_split(model.spec, model.config, module_name + ".weight", [])
    if split.axis is None or not split.heads or all(h is None for h in split.heads):
        return None
    i = next(j for j, h in enumerate(split.heads) if h is not None)
    width, heads = split.part_widths(0)[i], split.heads[i]
    offset, _ = split._piece(width, heads, tp.rank, tp.degree)
    return offset // (width // heads)


def finalize(model, tp):
    """After PEFT: place the new parameters, hook LoRA's collectives and the prefix encoder."""
    from ..peft.lora import LoRALinear

    placed = place_dense_params(model, tp)
    for name, m in model.named_sublayers():
        if isinstance(m, LoRALinear) and not getattr(m, "_pt_tp", False):
            kind = module_kind(model.spec, name)
            if kind == "column":
                m.between = lambda z: copy_to_tp(z, tp)          # f on x @ A [.., r]
            elif kind == "row":
                m.between = lambda z: reduce_from_tp(z, tp)      # g on x_local @ A_local [.., r]
                m.input_dropout = lambda x, p, training: sliced_dropout(x, p, -1, tp, training)
            if getattr(m.base_layer, "part_widths", None) is not None:
                m.part_widths = m.base_layer.part_widths   # the wrapper is what the model calls
            if getattr(m.base_layer, "head_offset", None) is not None:
                m.head_offset = m.base_layer.head_offset
            m._pt_tp = True
    enc = getattr(model, "prefix_encoder", None)
    if enc is not None and not getattr(enc, "_pt_tp", False):
        run_locally(enc, "cache")
        run_locally(enc, "prefix_kv")
        model.cache_hook = enc.cache
        enc._pt_tp = True
    return placed


# ------------------------------------------------------------------------------ sliced loading

def read_local(reader, spec, name, split, shape, tp, dtype="float32"):
    """This rank's slice of checkpoint tensor `name` (paddle layout, global paddle `shape`),
    reading only its boxes from the file (vocabulary padding rows are zeros), as the numpy form
    of `dtype` (bfloat16: uint16 words): a tensor stored in `dtype` is copied word for word, with
    no float32 copy (hf.read_slice_into; the one-process loader's hf.read_as does the same)."""
    from ..models import hf

    np_dtype = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
    if split.axis is None:
        return hf.read_slice_into(reader, spec, name, np.empty(shape, np_dtype))
    local = split.local_shape(shape, tp.degree)
    out = np.empty(local, np_dtype)
    covered = 0
    for g0, n, l0 in split.boxes(shape, tp.rank, tp.degree):
        idx = [slice(None)] * out.ndim
        idx[split.axis] = slice(l0, l0 + n)
        hf.read_slice_into(reader, spec, name, out[tuple(idx)], split.axis, g0, g0 + n)
        covered += n
    if covered < local[split.axis]:   # vocabulary padding rows
        idx = [slice(None)] * out.ndim
        idx[split.axis] = slice(covered, None)
        out[tuple(idx)] = 0   # also +0.0 as bfloat16 words
    return out


def load_sharded(model, path, tp, reader=None, only=None):
    """Fill a lazily built model with this rank's slices (loading.load_model under TP): every
    parameter becomes a DTensor holding only its slice, in the dtype the model was built in
    (build_model's `dtype`); quantized linears quantize their float32 slice."""
    from ..models import hf
    from ..models import check_checkpoint_shapes

    spec, cfg = model.spec, model.config
    reader = reader or hf.CheckpointReader(path)
    params = dict(model.named_parameters())
    kv = spec.prefix_layout(cfg)[1]
    if kv < tp.degree:   # every rank creates the replica groups now, together
        tp.replica_group(tp.degree // kv)
    quantized = {m.weight_name: m for m in model.sublayers()
                 if getattr(m, "weight_name", None) and hasattr(m, "set_weight")}
    if only is not None:   # a pipeline stage reads its own tensors only
        params = {n: p for n, p in params.items() if only(n)}
        quantized = {n: m for n, m in quantized.items() if only(n)}
    check_checkpoint_shapes(model, path, spec, reader, params, quantized)
    for name, p in params.items():
        split = param_split(spec, cfg, name, list(p.shape))
        dtype = str(p.dtype).rpartition(".")[2]   # "paddle.bfloat16" -> "bfloat16"
        arr = read_local(reader, spec, name, split, list(p.shape), tp, dtype)
        _unmap(reader, name)   # the pages read through the map stop counting as this process's
        set_param(model, name, make_param(arr, split, tp, p.name, not p.stop_gradient, dtype))
        del arr
    for name, q in quantized.items():
        split = param_split(spec, cfg, name, [q.in_features, q.out_features])
        local = read_local(reader, spec, name, split, [q.in_features, q.out_features], tp)
        whole = (q.in_features, q.out_features)
        q.resize(*local.shape)                 # quantize this rank's slice only
        q.set_weight(hf.linear_to_hf(local))
        # in/out_features keep the whole layer's sizes, as a DTensor weight's shape does (LoRA
        # wrappers size their A/B by them and are then sliced like the base)
        q.in_features, q.out_features = whole
        _unmap(reader, name)
    return model


def _unmap(reader, name):
    files = getattr(reader, "files", None)
    f = files.get(name) if isinstance(files, dict) else None
    if f is not None and hasattr(f, "release"):
        f.release()
