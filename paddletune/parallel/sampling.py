"""Token choice on vocabulary shards: generation's processors and sampler under tensor parallelism.

Rank r of a group of degree t holds logits z [B, Vl] of vocabulary columns [r*Vl, (r+1)*Vl)
(parallel/plan.py; columns >= V on the last rank are padding, set to -inf here first, so they are
never chosen). Every rank runs the same steps on its shard and ends with the same ids, decided
from all-reduced numbers only; no [B, V] tensor is formed or communicated. The rules and the
order are generation.choose_tokens', and so are the results (masses are summed in float64 on
both paths, so a different summation order cannot move a boundary). Per step:

  repetition penalty, temperature   elementwise on the shard (the `seen` mask is per shard too)
  greedy argmax                     vocab.sharded_argmax: 2 all-reduces [B] (lowest index on ties)
  row maximum M                     all-reduce MAX [B, 1] (from the top-k candidates when top_k)
  top-k                             small k: local top-k values all-gathered [B, t*min(k, Vl)]; the
                                    global k-th largest value is the k-th largest of them (each
                                    rank's k largest hold every global top-k member of its shard).
                                    k with t*k > 1024 or k >= Vl: the count search below
  top-p (nucleus)                   the mass search below: ~8 all-reduces [B, 16, 2] (fewer after
                                    top-k, whose k-th value bounds the search from below)
  inverse-CDF draw                  local cumulative sums, shard totals all-gathered [B, t] (an
                                    exclusive prefix over ranks places each shard in the global
                                    order), the counts of positions below u * total summed: [B]

Nucleus, generation.filter_top_k_top_p's rule: with tokens ordered by logit (descending, lowest
index first among equal logits) a token is dropped when the mass before it reaches top_p. With
e_v = exp(z_v - M), S = sum e and G(c) = sum of e_v over tokens with logit > c, the mass before
the j-th (0-based) of the tokens tied at z_v is G(z_v) + j * e_v, so the kept tokens are exactly
those with logit > tau plus the first tied ones at tau, where tau is the smallest logit with
G(tau) < top_p * S. G falls as c rises, so tau is found by a search over the order-preserving
integer keys of float32 values (consecutive floats have consecutive keys; an interval spans at
most 2^32): each round evaluates G and the count of tokens above at 15 keys of the current
interval (each rank from its sorted shard and float64 suffix sums, then one all-reduce [B, 16, 2])
and keeps the sixteenth where G crosses top_p * S, until one key is left. The bookkeeping is on the
host ([B, 16] numbers; a search round needs its answer anyway) and every rank takes the same steps
because they depend on all-reduced numbers only. Only when a tie group straddles the boundary
(equal float logits: rare) is one more all-gather [B, t] needed, of the ranks' tie counts, to
number the tied tokens in vocabulary order. Top-k with a large k is the same search on the counts:
the k-th value is the smallest logit with fewer than k logits above it.

Why by hand (DESIGN rule 6): paddle's engine has no vocabulary-parallel top-k / nucleus / draw; on
Shard(-1) logits it would all-gather them. Generation runs without autograd: there are no
backward collectives.
"""
import numpy as np
import paddle
import paddle.distributed as dist

from .vocab import sharded_argmax

NEG_INF = float("-inf")
FLOAT_MAX = float(np.finfo(np.float32).max)
SEARCH_WAYS = 16          # sub-intervals per search round: 15 keys evaluated per row per round
MAX_CANDIDATES = 1024     # top-k: all-gather at most this many candidates per row, else search


def gather_ranks(x, tp):
    """x [B, n] of every rank of the group -> [B, t*n] in rank order (one all-gather)."""
    if tp.log is not None:
        tp.log.append(("all_gather", list(x.shape)))
    parts = []
    dist.all_gather(parts, x, group=tp.group)
    return paddle.concat(parts, axis=-1)


# ------------------------------------------------------------------------------ shard bookkeeping

def mask_padding(z, tp, vocab_size):
    """-inf at this shard's padding columns (global index >= vocab_size)."""
    vl = z.shape[-1]
    real = vocab_size - tp.rank * vl
    if real >= vl:
        return z
    keep = (paddle.arange(vl) < real).unsqueeze(0)
    return paddle.where(keep, z, paddle.full_like(z, NEG_INF))


def local_seen(rows, tp, vl):
    """The repetition-penalty mask of this shard: float32 [B, Vl], 1 where row i's ids (a list of
    global ids per row) fall in columns [rank*Vl, (rank+1)*Vl)."""
    seen = np.zeros((len(rows), vl), np.float32)
    lo = tp.rank * vl
    for i, ids in enumerate(rows):
        ids = np.asarray(ids, np.int64)
        seen[i, ids[(ids >= lo) & (ids < lo + vl)] - lo] = 1.0
    return paddle.to_tensor(seen)


def mark_seen(seen, ids, tp):
    """Set seen [B, Vl] to 1 at the new global ids [B, 1] this shard holds."""
    vl = seen.shape[-1]
    loc = ids - tp.rank * vl
    inside = (loc >= 0) & (loc < vl)
    col = paddle.where(inside, loc, paddle.zeros_like(loc))
    # rows whose id is elsewhere rewrite column 0 with its own value (no change)
    val = paddle.where(inside, paddle.ones_like(seen[:, :1]), paddle.take_along_axis(seen, col, axis=-1))
    return paddle.put_along_axis(seen, col, val, axis=-1)


# ------------------------------------------------------------------------------ processors

def float_keys(x):
    """int64 keys of float32 values (numpy) with a < b <=> key(a) < key(b) and -0.0 = 0.0: the bit
    pattern of the magnitude, negated for negative numbers. Consecutive floats have consecutive
    keys, so an integer interval of keys is an interval of floats with nothing in between."""
    bits = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
    return np.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


def key_floats(keys):
    """float32 values of float_keys (inverse)."""
    mag = np.abs(keys).astype(np.int32).view(np.float32)
    return np.where(keys >= 0, mag, -mag)


class MassAbove:
    """above(points) for float32 points c [B, P] (numpy): (G(c), count of tokens with logit > c),
    summed over ranks, numpy float64 [B, P] each; G(c) = sum of exp(z - m) over those tokens.
    Each rank looks c up in its sorted shard and the suffix sums of e in that order (e rises with
    z, so sorting z sorts e); then one all-reduce [B, P, 2]. Built on the logits before top-k, it
    serves top-p too: for c at or above the k-th value the tokens above c are the same."""

    def __init__(self, z, m, tp):
        # -inf as the lowest finite float: paddle.searchsorted misplaces -inf (3.3.1 answers "after
        # everything" for an -inf point), and such tokens carry no mass either way
        self.sorted = paddle.sort(paddle.clip(z, min=-FLOAT_MAX), axis=-1)
        e = paddle.exp(self.sorted - m).astype("float64")          # float64 sums: as generation's
        tail = paddle.flip(paddle.cumsum(paddle.flip(e, [1]), axis=-1), [1])
        self.tail = paddle.concat([tail, paddle.zeros_like(tail[:, :1])], axis=-1)   # [B, Vl + 1]
        self.tp, self.vl = tp, z.shape[-1]

    def __call__(self, points):
        pos = paddle.searchsorted(self.sorted, paddle.to_tensor(points, dtype="float32"), right=True)
        mass = paddle.take_along_axis(self.tail, pos, axis=-1)
        count = (self.vl - pos).astype("float64")
        both = self.tp.all_reduce(paddle.stack([mass, count], axis=-1)).numpy()
        return both[..., 0], both[..., 1]


def _search(above, lo, hi, column, limit):
    """The smallest key c in (lo, hi] with F(c) < limit(F(lo)), F = above's mass (column 0) or
    count (column 1), which falls as c rises; the caller's F(lo) is >= that limit, F(hi) = 0 (hi:
    the row maximum). Keys numpy [B, 1]. Returns c, (G, n) at c, (G, n) at c - 1 and the limit.
    Every rank takes the same steps: they depend on all-reduced numbers only."""
    at_hi = [np.zeros(lo.shape), np.zeros(lo.shape)]      # nothing lies above the row maximum
    steps = np.arange(1, SEARCH_WAYS)[None, :]
    at_lo = thr = None
    while True:
        points = lo + (hi - lo) * steps // SEARCH_WAYS               # [B, 15] in [lo, hi)
        if thr is None:                                               # first round: F(lo) too
            points = np.concatenate([lo, points], axis=-1)
        vals = list(above(key_floats(points)))
        if thr is None:
            at_lo, thr = [v[:, :1] for v in vals], limit(vals[column][:, :1])
            points, vals = points[:, 1:], [v[:, 1:] for v in vals]
        # F falls along the points: keep the step from the last point with F >= limit to the next
        ext = [np.concatenate(x, axis=-1) for x in ((lo, points, hi),) + tuple(zip(at_lo, vals, at_hi))]
        # (at least 1: a model emitting -inf logits can leave fewer than k finite ones; all kept)
        cut = np.maximum((ext[1 + column] >= thr).sum(-1, keepdims=True), 1)
        lo, *at_lo = (np.take_along_axis(x, cut - 1, axis=-1) for x in ext)
        hi, *at_hi = (np.take_along_axis(x, cut, axis=-1) for x in ext)
        if (hi - lo).max() <= 1:
            return hi, at_hi, at_lo, thr


def sharded_top_k(z, k, tp):
    """(z with logits below the global k-th largest at -inf, k-th value [B, 1], row max [B, 1],
    MassAbove or None). Ties at the k-th value are kept, as generation.filter_top_k_top_p keeps
    them. Small k: local top-k values all-gathered ([B, t*k]); the global k-th largest value is the
    k-th largest of them (each rank's k largest hold every global top-k member of its shard).
    Large k (the candidates would approach the shard): the smallest logit with fewer than k
    logits above it, by the count search (_search on counts)."""
    kl = min(k, z.shape[-1])
    if kl < z.shape[-1] and kl * tp.degree <= MAX_CANDIDATES:
        top = paddle.topk(gather_ranks(paddle.topk(z, kl, axis=-1)[0], tp), k, axis=-1)[0]
        kth, m, above = top[:, -1:], top[:, :1], None
    else:
        m = tp.all_reduce(z.max(axis=-1, keepdim=True), "max")
        above = MassAbove(z, m, tp)
        lo = np.full(m.shape, float_keys(-FLOAT_MAX))               # all V real logits above
        key = _search(above, lo, float_keys(m.numpy()), 1, lambda n: np.full_like(n, k))[0]
        kth = paddle.to_tensor(key_floats(key))
    return paddle.where(z < kth, paddle.full_like(z, NEG_INF), z), kth, m, above


def nucleus_mask(z, m, top_p, tp, kth=None, above=None):
    """bool [B, Vl]: the tokens of this shard inside the nucleus (module docstring). z logits
    (-inf outside top-k / padding), m the global row max [B, 1]; kth (the top-k value) bounds
    the search from below; `above`: a MassAbove already built on these logits (or before top-k)."""
    # G(lo) = S: below the top-k value, or the lowest float (only -inf tokens sit there: no mass)
    lowest = float_keys(-FLOAT_MAX)          # never an -inf point (see MassAbove)
    lo = np.maximum(float_keys(kth.numpy()) - 1, lowest) if kth is not None else np.full(m.shape, lowest)
    above = above or MassAbove(z, m, tp)
    key, (g_tau, n_tau), (_, n_below), thr = _search(above, lo, float_keys(m.numpy()), 0,
                                                      lambda s: top_p * s)
    n_tau = n_below - n_tau                          # tokens at tau: above tau - 1, not above tau
    tau = paddle.to_tensor(key_floats(key))
    e_tau = paddle.exp(tau - m).numpy().astype(np.float64)          # as each tied token's e
    # the j-th token tied at tau is kept while G(tau) + j * e_tau < top_p * S: the first m_keep
    m_keep = np.where(e_tau > 0, np.maximum(np.ceil((thr - g_tau) / np.maximum(e_tau, 1e-300)), 1), n_tau)
    ties = z == tau
    keep = z > tau
    if not (m_keep < n_tau).any():           # the same answer on every rank: all-reduced inputs
        return keep | ties
    counts = gather_ranks(ties.astype("float64").sum(-1, keepdim=True), tp)    # [B, t]
    before = counts[:, :tp.rank].sum(-1, keepdim=True) if tp.rank else paddle.zeros_like(counts[:, :1])
    order = paddle.cumsum(ties.astype("float64"), axis=-1) - 1 + before        # global tie index
    return keep | (ties & (order < paddle.to_tensor(m_keep)))


# ------------------------------------------------------------------------------ the draw

def sample_from_shards(e, u, tp, vocab_size):
    """Inverse-CDF draw over the global vocabulary order, as generation.sample_from: e [B, Vl]
    unnormalised probabilities (0 = never), u [B, 1] in (0, 1]. Returns ids [B] (same on every
    rank): the first global index whose cumulative mass reaches u * total."""
    cdf = paddle.cumsum(e.astype("float64"), axis=-1)          # float64, as generation.sample_from
    totals = gather_ranks(cdf[:, -1:], tp)                     # [B, t]
    # the exclusive prefix over ranks, added in rank order: rank r's last position then equals
    # rank r+1's offset exactly, so the global cumulative sums rise monotonically to `total`
    acc, offset = paddle.zeros_like(totals[:, :1]), None
    for r in range(tp.degree):
        if r == tp.rank:
            offset = acc
        acc = acc + totals[:, r:r + 1]
    target = u.astype("float64") * acc
    below = ((offset + cdf) < target).astype("int64").sum(-1)
    idx = tp.all_reduce(below, "sum")
    return paddle.clip(idx, max=vocab_size - 1)


def choose_tokens(logits, cfg, seen, u, tp, vocab_size, penalize_repetition):
    """generation.choose_tokens on this rank's shard: logits [B, Vl] float32 -> ids [B] int64.
    `penalize_repetition` is generation's (elementwise, so it applies to a shard as is; passed
    in because generation sits above parallel/)."""
    z = mask_padding(logits, tp, vocab_size)
    if cfg.repetition_penalty != 1.0 and seen is not None:
        z = penalize_repetition(z, seen, cfg.repetition_penalty)
    if cfg.decode_strategy == "greedy_search":
        return sharded_argmax(z, tp)
    z = z / cfg.temperature
    kth = above = None
    if 0 < cfg.top_k < vocab_size:
        z, kth, m, above = sharded_top_k(z, cfg.top_k, tp)
    else:
        m = tp.all_reduce(z.max(axis=-1, keepdim=True), "max")
    e = paddle.exp(z - m)
    if cfg.top_p < 1.0:
        e = paddle.where(nucleus_mask(z, m, cfg.top_p, tp, kth, above), e, paddle.zeros_like(e))
    return sample_from_shards(e, u, tp, vocab_size)
