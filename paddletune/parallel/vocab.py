"""Vocabulary-parallel operations on local logit shards: the loss, argmax, log-softmax.

Rank r of a tensor-parallel group of degree t holds vocabulary columns [r*Vl, (r+1)*Vl) of the LM
head (Vl = ceil(V / t); columns >= V on the last rank are padding and never win a softmax). The
full-vocabulary logits are never formed or gathered; per row only a few numbers cross ranks.

Cross-entropy of row i with target y (z_v = h_i . W_v over this rank's columns):
    M = max over ranks of max_v z_v                     all-reduce MAX  [n]
    S = sum over ranks of sum_v exp(z_v - M)            all-reduce SUM  [n, 2] (with the next)
    T = z_y on the rank that owns y, 0 elsewhere, summed
    loss_i = log S + M - T;   dL/dz_v = softmax_v - [v == y]   (local columns only)
    dL/dh = sum over ranks of (p - onehot) W^T          all-reduce SUM  [n, H] in backward
    dL/dW_local = h^T (p - onehot)                      local
Forward: two small all-reduces per block of rows; backward: one [n, H] all-reduce (the head's
input is replicated, its gradient is a sum over vocabulary shards). Why by hand: paddle's
engine computes cross-entropy on Shard(-1) logits by all-gathering them first ([n, V] per rank).

On a CUDA build (`fleet_ce_route()`), M, S, T and the softmax of each block come from fleet's
kernel instead: `mp_ops._c_softmax_with_cross_entropy(z_block, t_block, group=<mp group>,
return_softmax=True)`, the op `fleet.layers.mpu.ParallelCrossEntropy` runs (called directly
because the layer returns the loss only and its softmax gives dL/dz = p - onehot here). It
returns loss [rows, 1] per row (no mean: the block losses are summed as on CPU, and the trainer
divides by the target count). The rows stay in blocks of BLOCK_ELEMENTS / 4 / Vl, each block's
gradients formed before the next block's logits exist, so [n, Vl] logits are never all alive.
The padded vocabulary columns (>= V, last rank) are set to NEG before the kernel sees them:
fleet cannot mask them (ParallelCrossEntropy / the op take no mask, and fleet's
VocabParallelEmbedding / ColumnParallelLinear assert that V divides by the degree).

What stays ours, and why:
  - the vocabulary cross-entropy's CPU path (`sharded_ce_rows`): paddle's CPU kernel of
    c_softmax_with_cross_entropy is a stub ("Do not support c_softmax_with_cross_entropy for cpu
    kernel now", paddle 3.3.1), so on gloo the same math runs over dist.all_reduce;
  - the sharded symmetric KL of R-Drop (`sharded_symmetric_kl`), argmax / accuracy
    (`sharded_argmax`), per-token log-probabilities (`sharded_token_logprobs`, DPO) and
    sampling (parallel/sampling.py): fleet has no vocabulary-parallel form of any of them (its
    only sharded-vocabulary op is the cross-entropy), and gathering [n, V] logits to use a dense
    op is what this module exists to avoid;
  - the [n, H] all-reduce of the head input's gradient in VocabParallelCE.backward (the
    gradients are formed in forward, outside autograd, so fleet's f cannot carry it).
"""
import paddle
from paddle.autograd import PyLayer

from ..models.linear_ce import LinearCrossEntropy
from ..models.loss import LossOutput, MODEL_KEYS, linear_head, select_targets
from .tensor import copy_to_tp

NEG = -1e30


def _local_logits(h, w, transposed, tp, vocab):
    """[n, Vl] float32 logits of this rank's columns; padding columns at NEG."""
    z = paddle.matmul(h, w, transpose_y=transposed).astype("float32")
    vl = z.shape[-1]
    pad = (tp.rank + 1) * vl - vocab
    if pad > 0:
        keep = paddle.arange(vl) < vl - pad
        z = paddle.where(keep.unsqueeze(0), z, paddle.full_like(z, NEG))
    return z


def _target_parts(z, t, tp):
    """(local column of each target or 0, mask of targets this rank owns)."""
    vl = z.shape[-1]
    loc = t - tp.rank * vl
    mine = (loc >= 0) & (loc < vl)
    return paddle.where(mine, loc, paddle.zeros_like(loc)), mine


def fleet_ce_route():
    """Whether the cross-entropy runs fleet's c_softmax_with_cross_entropy (CUDA builds; its CPU
    kernel is a stub)."""
    return paddle.is_compiled_with_cuda()


def ce_rows(z, t, tp):
    """Per-row cross-entropy [n], softmax p [n, Vl], local target columns and the mask of the
    targets this rank owns, from local logits z [n, Vl] (padding at NEG) and targets t [n] (no
    ignored ones: select_targets removed them). fleet's kernel on CUDA builds, else ours."""
    if not fleet_ce_route():
        return sharded_ce_rows(z, t, tp)
    from paddle.distributed.fleet.layers.mpu import mp_ops

    loss, p = mp_ops._c_softmax_with_cross_entropy(z, t, group=tp.mp_group, return_softmax=True,
                                                   ignore_index=-100)
    loc, mine = _target_parts(z, t, tp)
    return loss.reshape([-1]), p, loc, mine


def sharded_ce_rows(z, t, tp):
    """Per-row cross-entropy [n] and softmax p [n, Vl] from local logits z (no autograd)."""
    m = z.max(axis=-1, keepdim=True)
    tp.all_reduce(m, "max")
    e = paddle.exp(z - m)
    loc, mine = _target_parts(z, t, tp)
    picked = paddle.take_along_axis(z, loc.unsqueeze(-1), axis=-1).squeeze(-1) * mine.astype(z.dtype)
    both = tp.all_reduce(paddle.stack([e.sum(-1), picked], axis=-1))
    loss = paddle.log(both[:, 0]) + m.squeeze(-1) - both[:, 1]
    return loss, e / both[:, :1], loc, mine


class VocabParallelCE(PyLayer):
    """VocabParallelCE.apply(h [n, H], w_local, targets [n], transposed, tp, vocab) -> summed CE.
    Rows are processed in blocks (as LinearCrossEntropy); the gradients are formed in forward."""

    @staticmethod
    def forward(ctx, h, w, t, transposed, tp, vocab):
        vl = w.shape[0] if transposed else w.shape[1]
        rows = max(1, LinearCrossEntropy.BLOCK_ELEMENTS // 4 // vl)
        want_dh, want_dw = not h.stop_gradient, not w.stop_gradient
        loss, dh, dw = None, [], None
        with paddle.no_grad():
            hd, wd = h.detach(), w.detach()
            for lo in range(0, h.shape[0], rows):
                hc, tc = hd[lo:lo + rows], t[lo:lo + rows]
                lc, p, loc, mine = ce_rows(_local_logits(hc, wd, transposed, tp, vocab), tc, tp)
                onehot = paddle.nn.functional.one_hot(loc, vl) * mine.astype(p.dtype).unsqueeze(-1)
                g = p - onehot                                            # dL/dz, local columns
                loss = lc.sum() if loss is None else loss + lc.sum()
                if want_dh:
                    dh.append(paddle.matmul(g.astype(wd.dtype), wd, transpose_y=not transposed))
                if want_dw:
                    hc32 = hc.astype("float32")
                    part = paddle.matmul(g, hc32, transpose_x=True) if transposed else paddle.matmul(hc32, g, transpose_x=True)
                    dw = part if dw is None else dw.add_(part)
                del p, g, onehot   # this block's [rows, Vl] tensors go before the next block's
        ctx.tp, ctx.dtypes = tp, (h.dtype, w.dtype)
        ctx.dh = (paddle.concat(dh) if len(dh) > 1 else dh[0]) if want_dh else None
        ctx.dw = dw
        return loss

    @staticmethod
    def backward(ctx, g):
        dh = None
        if ctx.dh is not None:   # the sum over vocabulary shards of every rank's partial dh
            dh = (ctx.tp.all_reduce(ctx.dh.clone()) * g).astype(ctx.dtypes[0])
        dw = (ctx.dw * g).astype(ctx.dtypes[1]) if ctx.dw is not None else None
        return dh, dw


class _ShardedCE(PyLayer):
    """Summed CE over local logits z [n, Vl] (autograd through z): for eval / R-Drop paths that
    keep the logits."""

    @staticmethod
    def forward(ctx, z, t, tp):
        loss, p, loc, mine = ce_rows(z.detach(), t, tp)
        onehot = paddle.nn.functional.one_hot(loc, z.shape[-1]) * mine.astype(p.dtype).unsqueeze(-1)
        ctx.g = p - onehot
        return loss.sum()

    @staticmethod
    def backward(ctx, g):
        return ctx.g * g


def sharded_argmax(z, tp):
    """Global argmax [n] (lowest index on ties, as paddle.argmax) of local logits z [n, Vl]: the
    row maxima are all-reduced (MAX), then the lowest column index reaching it (MAX of -index)."""
    with paddle.no_grad():
        m = z.max(axis=-1)
        top = tp.all_reduce(m.clone(), "max")
        idx = paddle.argmax(z, axis=-1).astype("float64") + tp.rank * z.shape[-1]
        cand = paddle.where(m >= top, -idx, paddle.full_like(idx, -1e300))
        return (-tp.all_reduce(cand, "max")).astype("int64")


def tp_causal_lm_loss(model, batch, keep_logits=False):
    """models.loss.causal_lm_loss for a tensor-parallel model (see the module docstring): the
    hidden states are replicated, the head and its loss run on this rank's vocabulary shard."""
    inputs = {k: v for k, v in batch.items() if k in MODEL_KEYS}
    hidden = model(**inputs, return_hidden=True).hidden_states
    return tp_hidden_loss(model, hidden, batch["labels"], keep_logits)


def tp_hidden_loss(model, hidden, labels, keep_logits=False):
    """models.loss.hidden_loss on this rank's vocabulary shard (hidden [B, S, H] replicated)."""
    tp = model.tensor_parallel
    h_sel, t_sel = select_targets(hidden, labels)
    n = paddle.to_tensor(t_sel.shape[0], dtype="float32")
    head = linear_head(model, view=_local_view)
    if head is None:
        raise ValueError("tensor parallelism needs a plain linear LM head (no LoRA / bias on it)")
    w, transposed = head
    vocab = model.config.vocab_size
    if model.training and not keep_logits and paddle.is_grad_enabled() and t_sel.shape[0] > 0:
        return LossOutput(VocabParallelCE.apply(h_sel, w, t_sel, transposed, tp, vocab), n, None, t_sel)
    z = _local_logits(copy_to_tp(h_sel, tp), w, transposed, tp, vocab)
    return LossOutput(_ShardedCE.apply(z, t_sel, tp), n, z, t_sel, sharded_argmax(z, tp), tp)


def _logsumexp(z, tp):
    """Row log-sum-exp over every shard [n, 1] (no autograd): max all-reduced, then the sum."""
    m = z.max(axis=-1, keepdim=True)
    tp.all_reduce(m, "max")
    s = tp.all_reduce(paddle.exp(z - m).sum(-1, keepdim=True))
    return m + paddle.log(s)


def sharded_token_logprobs(z, targets, tp):
    """log p(target) per row [n] from local logit shards z [n, Vl] (padding columns at NEG, as
    _local_logits leaves them), differentiable, replicated on every rank (DPO's per-token
    log-probabilities under TP). log p_t = z_t - lse with z_t all-reduced from its owner and lse
    from every shard's sum of exponentials; both enter a replicated result, so the collectives'
    backward is the identity: dz_v = [v == t] - softmax_v on the owning rank's columns."""
    from .tensor import reduce_from_tp

    z = z.astype("float32")
    m = z.detach().max(axis=-1, keepdim=True)
    tp.all_reduce(m, "max")
    s = reduce_from_tp(paddle.exp(z - m).sum(-1, keepdim=True), tp)
    loc, mine = _target_parts(z, targets, tp)
    zt = reduce_from_tp(paddle.take_along_axis(z, loc.unsqueeze(-1), axis=-1).squeeze(-1)
                        * mine.astype(z.dtype), tp)
    return zt - (m + paddle.log(s)).squeeze(-1)


class _ShardedSymmetricKL(PyLayer):
    """A = KL(p1||p2) + KL(p2||p1) per row [n] from local shards z1, z2 [n, Vl], with the
    gradient in closed form (per-shard autograd would miss every other shard's dependence on the
    shared normaliser):
        dA/dz1_k = p1_k [(lp1_k - lp2_k) - KL(p1||p2)] + (p1_k - p2_k), and symmetrically for z2.
    Forward: the log-sum-exps (2 x [n, 1] max and sum) and the two KL sums [n, 2] all-reduced."""

    @staticmethod
    def forward(ctx, z1, z2, tp):
        z1, z2 = z1.detach().astype("float32"), z2.detach().astype("float32")
        lp1, lp2 = z1 - _logsumexp(z1, tp), z2 - _logsumexp(z2, tp)
        p1, p2 = paddle.exp(lp1), paddle.exp(lp2)
        d = lp1 - lp2
        kl = tp.all_reduce(paddle.stack([(p1 * d).sum(-1), (p2 * -d).sum(-1)], axis=-1))   # [n, 2]
        ctx.g1 = p1 * (d - kl[:, :1]) + (p1 - p2)
        ctx.g2 = p2 * (-d - kl[:, 1:]) + (p2 - p1)
        return kl.sum(-1)

    @staticmethod
    def backward(ctx, g):
        g = g.unsqueeze(-1)
        return ctx.g1 * g, ctx.g2 * g


def sharded_symmetric_kl(z1, z2, tp):
    """R-Drop's KL(p1||p2) + KL(p2||p1) per row [n] from local logit shards (see
    _ShardedSymmetricKL); z1 and z2 come from f(h) @ W_local, so dh is summed over shards."""
    return _ShardedSymmetricKL.apply(z1, z2, tp)


def _local_view(p):
    """The differentiable local shard of a DTensor parameter (itself when dense)."""
    import paddle.distributed as dist

    return dist.auto_parallel.api.dtensor_to_local(p, p.process_mesh, p.placements) if p.is_dist() else p
