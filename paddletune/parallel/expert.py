"""Expert parallel for the Mixture-of-Experts models (models/moe.py), and the router statistics of
any data-parallel MoE run.

Layout (Megatron's / PaddleNLP's convention): expert-parallel ranks are data-parallel ranks. With
ep = expert_parallel_degree, E experts per sparse layer and El = E / ep, the data ranks form
expert groups of ep consecutive ranks (topology.py: "ep"); expert e lives on ep rank e // El.
Dense parameters (attention, router, norms, shared expert, embeddings) are replicated on every
data rank and their gradients summed over all data ranks as without EP; an expert's gradient is
summed over the data ranks holding the same experts ("ep_data", data_degree / ep ranks).
A block keeps its experts in a LayerDict keyed by the global expert id, so parameter names are the
full model's ("...experts.3.w1.weight"): checkpoints, LoRA targets and the HF key map are unchanged.

Dispatch / combine of one sparse layer (x [T, H] this rank's tokens, w / idx [T, k] routing):
- gloo (CPU) and every build without NCCL: exact all-gather fallback. T is padded to the group's
  largest T (Tm); [x | w | idx] is all-gathered ([ep*Tm, H+2k]), each rank runs its local experts
  on the assignments routed to them and writes weighted outputs into a [ep*Tm, H] buffer, which is
  summed over the group (all_reduce) and sliced to this rank's rows. Collectives and their adjoints:
      gather_rows:  forward all_gather,            backward all_reduce + own slice (reduce-scatter)
      combine_rows: forward all_reduce + own slice, backward all_gather
  Bytes per layer and direction: all_gather ep*Tm*(H+2k)*4, all_reduce ep*Tm*H*4 (vs all-to-all's
  ~T*k*H*4*(ep-1)/ep sent): correct but not cost-representative; gloo has no all-to-all.
- NCCL: all-to-all (alltoall_single) of the token rows to their experts' ranks and back; see
  `alltoall_dispatch`. Its logic is tested on CPU through cpu_compat's exact all-gather emulation
  of alltoall_single (tests/test_moe_ep.py); NCCL's own all-to-all has NOT been run here (no GPU).

Why hand-written collectives (docs/design.md rule 6): the dispatch is data-dependent (each rank sends a
different number of rows to each expert, every step), which DTensor placements do not express;
paddle's own MoE exchange (moe_utils.global_scatter / global_gather, incubate MoELayer) has no CPU
kernel, and the engine's Shard->Shard reshard on CPU is itself an all-gather + slice
(docs/parallel.md). So, as tensor.py runs TP locally with Megatron's two collectives, EP runs
locally with the PyLayer collectives above, each with its adjoint written next to it.

Why the groups are ours, not fleet's EPHybridCommunicateGroup (probed at run time, paddle 3.3.1,
tests/test_expert_groups_fleet.py, 4 ranks at ep 2 and ep 4): fleet refuses expert parallel over
data-parallel ranks - its constructor asserts dp_degree == 1 ("must be 1 in MoE"; other ranks fail
earlier, its context grid being built from the sharding axis alone; moe_sharding > 1 makes
dense_sharding = sharding // moe_sharding = 0, an empty grid). Laid out its way - data 1,
sharding = the data ranks, moe_sharding = data / ep, expert = ep - its expert groups equal "ep" and
its moe_sharding groups "ep_data", but the dense data-parallel ranks are then fleet's sharding
axis (its data group is each rank alone), so paddle.DataParallel and HybridParallelOptimizer
would treat them as sharding ranks, and it would replace the HybridCommunicateGroup that
Topology wraps. So "ep" / "ep_data" stay ours, created by topology.create_groups like "data".

Router statistics (load-balancing loss): every data-parallel rank's micro-batch is part of one
global micro-batch; the counts / prob sums / token counts are summed over all data ranks
(`global_aux`), so aux is the one-process value of that micro-batch. See global_aux for the
gradient scaling. The global micro-batch m is the union of every data rank's micro-batch m: with
gradient_accumulation_steps 1 that is the one-process batch; with more, a one-process run groups
the step's examples into micro-batches differently (BatchPlan: each rank's share is contiguous),
so its aux (a per-micro-batch quantity) differs slightly. Evaluation keeps per-batch statistics
(each eval batch is whole on one rank, as in one process).
"""
import contextlib
import copy
import types

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn as nn
from paddle.autograd import PyLayer


def is_expert_param(name):
    """True for a routed expert's tensor (its LoRA included); the shared expert is dense."""
    return ".experts." in name


def check_experts(config, degree):
    """Refuse, before anything is loaded, an expert degree that does not divide the experts."""
    moe = getattr(config, "moe", None)
    if degree <= 1:
        return
    if not moe:
        raise ValueError(f"expert_parallel_degree {degree} needs a Mixture-of-Experts model; "
                         f"{config.model_type!r} is dense: set expert_parallel_degree to 1")
    E = moe["num_experts"]
    if E % degree:
        raise ValueError(f"expert_parallel_degree ({degree}) does not divide the number of experts "
                         f"({E}); choose a divisor of {E}")


class ExpertParallel:
    """This rank's expert group (degree, index, paddle group) and the data-parallel router
    statistics. `log`, when a list, records every collective as (op, shape, bytes sent)."""

    def __init__(self, topo):
        self.topo = topo
        self.degree = topo.ep_degree
        self.rank = topo.ep_rank if self.degree > 1 else 0
        self.group = topo._group("ep")[0] if self.degree > 1 else None
        self.log = None
        self.use_alltoall = self.degree > 1 and _nccl()

    # ------------------------------------------------------------------ collectives
    def _record(self, op, t, factor=1.0):
        if self.log is not None:
            self.log.append((op, list(t.shape), int(t.numel()) * t.element_size() * factor))

    def all_gather(self, x):
        """[ep * n, ...] = this group's x [n, ...] stacked in ep-rank order (equal shapes)."""
        self._record("all_gather", x, self.degree - 1)
        parts = []
        dist.all_gather(parts, x, group=self.group)
        return paddle.concat(parts)

    def all_reduce(self, x):
        """x summed over the group, in place (recorded at the ring's 2 (ep-1)/ep bytes)."""
        self._record("all_reduce", x, 2.0 * (self.degree - 1) / self.degree)
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def alltoall(self, x, send, recv):
        """Rows of x [sum(send), ...] in blocks of send[d] rows to rank d; returns the
        [sum(recv), ...] rows received, in source order. NCCL: paddle's alltoall_single; CPU: its
        exact all-gather emulation (cpu_compat; recorded as the all-to-all it stands for)."""
        from .cpu_compat import alltoall_single

        mine = send[self.rank]
        self._record("alltoall", x, (x.shape[0] - mine) / max(x.shape[0], 1))
        out = paddle.empty([int(sum(recv))] + list(x.shape[1:]), x.dtype)
        alltoall_single(out, x.contiguous() if hasattr(x, "contiguous") else x, send, recv, self.group)
        return out

    def max_tokens(self, n):
        t = paddle.to_tensor([n], dtype="int64")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.numpy()[0])

    # ------------------------------------------------------------------ router statistics
    def global_aux(self, router_logits, moe, token_mask, n_local):
        """(aux, term): the load-balancing loss over the global micro-batch (statistics summed
        over the data ranks) and this rank's part of CE's companion term, with
        sum over ranks of term = aux * n_global (n = target tokens), the one-process value.

        Gradient: the Trainer sums the ranks' gradients of loss_sum / N. The statistics are summed
        forward with an identity backward, so rank r's own prob sums receive only its own term's
        gradient; the one process's gradient on them is d(aux * n_global)/d(aux) = n_global, so
        term = aux.detach() * n_r + (aux - aux.detach()) * n_global: value aux * n_r, gradient
        n_global. (No collective in backward: nothing to order against the dispatch's.)"""
        from ..models.moe import load_balancing_loss

        box = {}

        def reduce(stats):
            full = paddle.concat([stats, n_local.reshape([1]).astype("float32")])
            summed = _SumOverData.apply(full, self)
            box["n"] = summed[-1].detach()
            return summed[:-1]

        aux = load_balancing_loss(router_logits, moe["num_experts"], moe["top_k"], token_mask, reduce)
        n = n_local.astype("float32")
        return aux, aux.detach() * n + (aux - aux.detach()) * box["n"]

    # ------------------------------------------------------------------ trainer helpers
    def reduce_grads(self, names, grads):
        """Dense gradients summed over all data ranks, experts' over their ep_data group."""
        expert = [is_expert_param(n) for n in names]
        if self.degree <= 1:
            return self.topo.all_reduce_grads(grads)
        dense = iter(self.topo.all_reduce_grads([g for g, e in zip(grads, expert) if not e]))
        own = iter(self.topo.all_reduce_grads([g for g, e in zip(grads, expert) if e], axis="ep_data"))
        return [next(own) if e else next(dense) for e in expert]

    def norm_squares(self, names, squares):
        """Squares of the gradient norm parts with the experts' summed over the expert group (each
        rank holds other experts): [dense part, all experts' part]."""
        dense = [s for n, s in zip(names, squares) if not is_expert_param(n)]
        own = [s for n, s in zip(names, squares) if is_expert_param(n)]
        total = paddle.add_n(own) if own else paddle.zeros([], "float32")
        if self.degree > 1:
            total = total.clone()
            self.topo.all_reduce_sum(total, "ep")
        return dense + [total]

    @property
    def writer(self):
        """Checkpoint writers: the first expert group (data ranks 0 .. ep-1)."""
        return self.topo.data_rank < self.degree

    def reads(self, name):
        """Whether this rank holds tensor `name`: every dense one, its own experts' only."""
        if self.degree <= 1 or not is_expert_param(name):
            return True
        return self.expert_range[0] <= expert_id(name) < self.expert_range[1]

    def writes(self, name):
        """Whether this (writer) rank writes tensor `name`: dense ones on data rank 0 only."""
        return is_expert_param(name) or self.topo.data_rank == 0


def _nccl():
    """All-to-all exists on NCCL builds running on GPU; gloo has none (docs/parallel.md)."""
    return paddle.is_compiled_with_cuda() and paddle.device.get_device().startswith("gpu")


class _SumOverData(PyLayer):
    """Forward: sum over the data-parallel ranks; backward: identity (see global_aux)."""

    @staticmethod
    def forward(ctx, x, ep):
        out = x.clone()
        if ep.log is not None:
            ep.log.append(("router_all_reduce", list(x.shape), int(x.numel()) * 4))
        return ep.topo.all_reduce_sum(out, "data")

    @staticmethod
    def backward(ctx, dy):
        return dy


class _GatherRows(PyLayer):
    """all_gather forward; reduce-scatter (all_reduce + own rows) backward."""

    @staticmethod
    def forward(ctx, x, ep):
        ctx.ep, ctx.n = ep, x.shape[0]
        return ep.all_gather(x)

    @staticmethod
    def backward(ctx, dy):
        g = ctx.ep.all_reduce(dy.clone())
        r, n = ctx.ep.rank, ctx.n
        return g[r * n:(r + 1) * n].clone()


class _CombineRows(PyLayer):
    """all_reduce + own rows forward; all_gather backward."""

    @staticmethod
    def forward(ctx, part, ep):
        ctx.ep = ep
        n = part.shape[0] // ep.degree
        s = ep.all_reduce(part.clone())
        return s[ep.rank * n:(ep.rank + 1) * n].clone()

    @staticmethod
    def backward(ctx, dy):
        return ctx.ep.all_gather(dy.contiguous() if hasattr(dy, "contiguous") else dy)


def local_expert_sum(block, x, w, chosen):
    """[N, H]: sum_j w_nj * expert_{chosen_nj}(x_n) over the assignments routed to this rank's
    experts (block.expert_range); zero rows elsewhere. x [N, H], w [N, k], chosen [N, k] numpy
    (-1 = a padding row). The same sorted-runs scheme as SparseMoeBlock.dispatch."""
    lo, hi = block.expert_range
    k = chosen.shape[-1]
    ids = chosen.reshape(-1)
    sel = np.flatnonzero((ids >= lo) & (ids < hi))
    base = x * 0   # keeps the gather in every rank's graph: the same collectives in backward
    if len(sel) == 0:
        return base
    order = sel[np.argsort(ids[sel], kind="stable")]
    counts = np.bincount(ids[sel] - lo, minlength=hi - lo)
    tok = paddle.to_tensor((order // k).astype(np.int64))
    runs = paddle.split(paddle.gather(x, tok), [int(c) for c in counts if c > 0])
    ys = [_expert(block, lo + int(e))(r) for e, r in zip(np.flatnonzero(counts), runs)]
    y = paddle.concat(ys) if len(ys) > 1 else ys[0]
    scale = paddle.gather(w.reshape([-1]), paddle.to_tensor(order.astype(np.int64)))
    y = (y * scale.astype(y.dtype).unsqueeze(-1)).astype(x.dtype)
    return paddle.index_add(base, tok, 0, y)


def allgather_dispatch(block, flat, w, idx):
    """SparseMoeBlock.dispatch under expert parallel, the exact fallback of the module doc."""
    ep = block.expert_parallel
    if ep.use_alltoall:
        return alltoall_dispatch(block, flat, w, idx)
    T, H = flat.shape
    k = idx.shape[-1]
    tm = ep.max_tokens(T)
    packed = paddle.concat([flat.astype("float32"), w.astype("float32"), idx.astype("float32")], -1)
    if tm > T:
        pad = paddle.concat([paddle.zeros([tm - T, H + k], "float32"),
                             paddle.full([tm - T, k], -1.0, "float32")], -1)
        packed = paddle.concat([packed, pad])
    X = _GatherRows.apply(packed, ep)                          # [ep*tm, H + 2k]
    chosen = X[:, H + k:].numpy().astype(np.int64)
    part = local_expert_sum(block, X[:, :H].astype(flat.dtype), X[:, H:H + k], chosen)
    return _CombineRows.apply(part, ep)[:T]


# ---------------------------------------------------------------------- NCCL all-to-all
# Written for NCCL builds (paddle.distributed.alltoall_single). NCCL's kernel is UNTESTED here
# (the dev machine is CPU-only, gloo has no all-to-all); the logic below runs in the tests on CPU
# through cpu_compat.alltoall_single's exact emulation (ExpertParallel.use_alltoall forced on).
# By default it is used only on a CUDA build running on GPU; CPU runs take allgather_dispatch.

class _AllToAll(PyLayer):
    """Rows [sum(send), H] sent in blocks of `send` rows to each rank, `recv` rows received from
    each; the backward is the same exchange reversed."""

    @staticmethod
    def forward(ctx, x, ep, send, recv):
        ctx.ep, ctx.send, ctx.recv = ep, send, recv
        return ep.alltoall(x, send, recv)

    @staticmethod
    def backward(ctx, dy):
        return ctx.ep.alltoall(dy, ctx.recv, ctx.send)


def alltoall_dispatch(block, flat, w, idx):
    """Dispatch by all-to-all (NCCL; untested here, see above): assignments sorted by expert are
    sent to their experts' ranks, computed there, sent back and weighted on the token's owner."""
    ep = block.expert_parallel
    lo, hi = block.expert_range
    E, el, k = block.num_experts, hi - lo, idx.shape[-1]
    chosen = idx.numpy().reshape(-1)
    order = np.argsort(chosen, kind="stable")            # by expert, hence by destination rank
    per_expert = np.bincount(chosen, minlength=E)
    table = ep.all_gather(paddle.to_tensor(per_expert.reshape(1, -1))).numpy()   # [ep, E] per source
    send = [int(c) for c in per_expert.reshape(ep.degree, el).sum(1)]
    recv = [int(c) for c in table[:, lo:hi].sum(1)]
    tok = paddle.to_tensor((order // k).astype(np.int64))
    x_recv = _AllToAll.apply(paddle.gather(flat, tok), ep, send, recv)
    # received rows: per source rank, sorted by expert; regroup by local expert
    src_expert = np.concatenate([np.repeat(np.arange(el), table[s, lo:hi]) for s in range(ep.degree)])
    perm = np.argsort(src_expert, kind="stable")
    counts = np.bincount(src_expert, minlength=el)
    runs = paddle.split(paddle.gather(x_recv, paddle.to_tensor(perm.astype(np.int64))),
                        [int(c) for c in counts if c > 0]) if len(perm) else []
    ys = [_expert(block, lo + int(e))(r) for e, r in zip(np.flatnonzero(counts), runs)]
    y = paddle.concat(ys) if len(ys) > 1 else (ys[0] if ys else x_recv * 0)
    y = paddle.scatter(paddle.zeros_like(x_recv), paddle.to_tensor(perm.astype(np.int64)), y) if len(perm) else y
    y_back = _AllToAll.apply(y, ep, recv, send)
    scale = paddle.gather(w.reshape([-1]), paddle.to_tensor(order.astype(np.int64)))
    y_back = (y_back * scale.astype(y_back.dtype).unsqueeze(-1)).astype(flat.dtype)
    return paddle.index_add(paddle.zeros_like(flat), tok, 0, y_back)


# ---------------------------------------------------------------------- model set-up
def sparse_blocks(model):
    from ..models.moe import SparseMoeBlock

    return [m for m in model.sublayers() if isinstance(m, SparseMoeBlock)]


def install(model, topo):
    """Attach the data-parallel router statistics (every MoE model trained on >1 data rank) and,
    at expert degree > 1, the expert-parallel dispatch. Returns the ExpertParallel object
    (model.expert_parallel). The other ranks' experts stay lazy (never read: `ep.reads`, no
    memory) until `finalize` drops them: PEFT in between wraps them as in one process, so its
    random initial values (drawn in module order) are the one-process run's."""
    ep = ExpertParallel(topo)
    model.expert_parallel = ep
    if ep.degree <= 1:
        return ep
    check_experts(model.config, ep.degree)
    el = model.config.moe["num_experts"] // ep.degree
    ep.expert_range = (ep.rank * el, (ep.rank + 1) * el)
    for block in sparse_blocks(model):
        block.expert_range = ep.expert_range
        block.expert_parallel = ep
        block.dispatch = types.MethodType(allgather_dispatch, block)
    return ep


def expert_id(name):
    """The expert index in a routed expert's tensor name ("...experts.3.w1.weight" -> 3)."""
    return int(name.split(".experts.", 1)[1].split(".", 1)[0])


# Whole decoder blocks recomputed in backward would run the dispatch's collectives again at a
# moment the autograd engine picks per rank (the router's aux-loss branch reaches a block's saved
# tensors before its hidden-state gradient does): ranks then meet in different collectives.
RECOMPUTE_REFUSAL = ("full (whole decoder blocks) cannot be recomputed under expert_parallel_degree "
                     "{}: the recomputed expert dispatch's collectives would run in a different "
                     "order on different ranks; use recompute_granularity full_attn or core_attn "
                     "(attention only), or recompute: false")


def finalize(model, ep, trainable, args=None):
    """Keep only this rank's experts (a LayerDict keyed by the global expert id: parameter names
    unchanged) and drop the others, with whatever PEFT put on them; returns the names of
    `trainable` that remain. Called by the Trainer (`args`: its TrainingArguments); idempotent."""
    if ep.degree <= 1:
        return list(trainable)
    if args is not None and args.recompute and args.recompute_granularity == "full":
        raise ValueError("recompute_granularity " + RECOMPUTE_REFUSAL.format(ep.degree))
    lo, hi = ep.expert_range
    for block in sparse_blocks(model):
        if not isinstance(block.experts, nn.LayerDict):
            block.experts = nn.LayerDict({str(e): block.experts[e] for e in range(lo, hi)})
    return [n for n in trainable if ep.reads(n)]


def _expert(block, e):
    return block.experts[str(e)] if isinstance(block.experts, nn.LayerDict) else block.experts[e]


def check_full_export(model, ep):
    """Refuse, on every rank before training, the full-model export (models.save_pretrained) of a
    quantized backbone under expert parallel. One process refuses it too, but only at the export,
    on rank 0 alone under EP, where the other ranks would then wait in the export's collectives."""
    cfg = getattr(model, "quant_config", None)
    if ep.degree > 1 and cfg is not None:
        raise ValueError(
            f"weight_quantize_algo {cfg.algo} with expert_parallel_degree {ep.degree}: the full "
            "model of a quantized backbone is not exported (as in one process); set lora: true "
            "(QLoRA: the adapter is exported, with every expert's LoRA) and merge it into the "
            "full-precision base with llm/merge_lora_params.py")


def _gathered_copies(mine, ep, e, el, build=True):
    """{global expert id: copy of local expert `mine` (id e) holding ep rank s's values} for
    every other rank s: its parameters AND buffers (a quantized base weight's codes and scales,
    QuantizedLinear.FIELDS, or gpu.py's fused layout) all-gathered over the expert group, so a
    copy is the other expert exactly, quantized weights included. A collective per tensor."""
    from ..quant import QuantizedLinear

    named = list(mine.named_parameters()) + list(mine.named_buffers())
    values = [ep.all_gather(t.detach().unsqueeze(0)) for _, t in named]
    got = {}
    for s in range(ep.degree):
        if s == ep.rank or not build:
            continue
        clone, other = copy.deepcopy(mine), s * el + (e % el)
        tensors = dict(clone.named_parameters())
        tensors.update(clone.named_buffers())
        for (n, _), v in zip(named, values):
            tensors[n].set_value(v[s])
        for m in clone.sublayers(include_self=True):   # the name it reports and is loaded from
            if isinstance(m, QuantizedLinear) and m.weight_name:
                m.weight_name = m.weight_name.replace(f".experts.{e}.", f".experts.{other}.")
        got[other] = clone
    return got


@contextlib.contextmanager
def full_experts(model, ep, build=True):
    """Every expert of every sparse block on this rank for the duration (export): each local
    expert's tensors (parameters and buffers: a quantized backbone's codes too) are all-gathered
    over the expert group (a collective per tensor, every rank takes part); the ranks with `build`
    put the others' experts in (copies of a local expert's module, LoRA included, with the
    gathered values: _gathered_copies), in expert order; restored on exit."""
    saved = []
    for block in sparse_blocks(model):
        lo, hi = block.expert_range
        got = {}
        for e in range(lo, hi):
            got.update(_gathered_copies(block.experts[str(e)], ep, e, hi - lo, build))
        if build:
            got.update({e: block.experts[str(e)] for e in range(lo, hi)})
            saved.append((block, block.experts))
            block.experts = nn.LayerDict({str(e): got[e] for e in sorted(got)})
    try:
        yield model
    finally:
        for block, experts in saved:
            block.experts = experts
