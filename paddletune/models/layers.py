"""Building blocks shared by the model files: RMSNorm, rotary tables, ALiBi, attention, SwiGLU,
activations.

Shapes: B batch, S new tokens, T keys (past + new), N query heads, K key/value heads,
D head_dim, H hidden, V vocab. Linear weights are paddle layout [in, out].
"""
import math

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from .. import kernels
from . import ops

_NEG = {"float32": -1e9, "float64": -1e9, "bfloat16": -1e9, "float16": -6e4}


_MEAN = {}   # (H, dtype) -> [H, 1] column of 1/H (RMSNorm)


def wide(dtype):
    """The dtype reductions (norm statistics, softmax) run in: float32 for 16-bit inputs, else
    the input's own (float64 stays float64)."""
    return paddle.float32 if dtype in (paddle.float16, paddle.bfloat16) else dtype


class RMSNorm(nn.Layer):
    """y = x / sqrt(mean(x^2, -1) + eps) * weight, statistics in float32 (models.ops picks the
    implementation: CPU kernel / CPU-tuned ops, or paddle's fused_rms_norm)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x):
        if ops.gpu():
            return ops.rms_norm(x, self.weight, self.eps)
        fused = kernels.rms_norm(x, self.weight, self.eps)   # one pass fwd and bwd on the CPU kernels
        if fused is not None:
            return fused
        dtype, H = x.dtype, x.shape[-1]
        x32 = x.astype(wide(dtype))
        if (H, x32.dtype) not in _MEAN:
            _MEAN[(H, x32.dtype)] = paddle.full([H, 1], 1.0 / H, x32.dtype)
        # paddle's CPU kernels, fwd + bwd on [1024, 256]: square, not pow(2) (~100x slower); the
        # mean as a product with a [H, 1] column of 1/H; every factor expanded to x's full shape,
        # since broadcast multiplies (and their gradients' reductions) are the slow ones: 2.8 -> 1.0 ms
        r = paddle.rsqrt(paddle.matmul(paddle.square(x32), _MEAN[(H, x32.dtype)]) + self.eps).expand(x32.shape)
        return self.weight.expand(x.shape) * (x32 * r).astype(dtype)


def activation(name):
    """Hugging Face `hidden_act` / `activation_function` name -> f(x). "gelu_new",
    "gelu_pytorch_tanh" and Bloom's GeLU are the tanh approximation
    0.5·x·(1 + tanh(sqrt(2/pi)·(x + 0.044715·x^3))); "gelu" is the exact erf form."""
    table = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "swish": F.silu,
             "gelu_new": lambda x: F.gelu(x, approximate=True),
             "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate=True),
             "gelu_fast": lambda x: F.gelu(x, approximate=True)}
    if name not in table:
        raise ValueError(f"activation {name!r} is not supported ({', '.join(sorted(table))})")
    return table[name]


def dropout(x, p, training):
    """F.dropout, skipped (no op at all) when p is 0 or not training."""
    return F.dropout(x, p, training=True) if (training and p > 0) else x


def swiglu(gate, up):
    """silu(gate) * up: paddle's F.swiglu (gpu column), else one pass forward and backward on the
    CPU kernels (else paddle's ops)."""
    if ops.gpu():
        return ops.swiglu(gate, up)
    fused = kernels.swiglu(gate, up)
    return fused if fused is not None else F.silu(gate) * up


# ----------------------------------------------------------------------------- rotary embeddings

def rope_inv_freq(dim, rope, seq_len=None, max_position_embeddings=2048):
    """Inverse frequencies [dim/2] (float32) for a normalised rope dict
    {"rope_type": default|linear|dynamic|llama3, "rope_theta", "factor", ...}.

    default: 1 / theta^(2i/dim).  linear: default / factor.  dynamic (NTK): theta is raised to
    theta * (factor*L/Lmax - (factor-1))^(dim/(dim-2)) where L = max(seq_len, Lmax).
    llama3: wavelengths longer than Lorig/low_freq_factor are divided by factor, shorter than
    Lorig/high_freq_factor kept, the band between interpolated smoothly."""
    kind = rope.get("rope_type", "default")
    base = float(rope.get("rope_theta", 10000.0))
    if kind == "dynamic":
        factor = float(rope["factor"])
        L = max(seq_len or 0, max_position_embeddings)
        base = base * ((factor * L / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv = (np.float32(1.0) / (np.float32(base) ** exps)).astype(np.float32)
    if kind == "linear":
        inv = inv / np.float32(rope["factor"])
    elif kind == "llama3":
        factor = rope["factor"]
        low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        old = rope.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    elif kind not in ("default", "dynamic"):
        raise ValueError(f"rope_type '{kind}' is not supported (default, linear, dynamic, llama3)")
    return inv


def rope_cos_sin(position_ids, inv_freq):
    """position_ids [B, S] int -> cos, sin [B, S, 2*len(inv_freq)] (halves repeated)."""
    freqs = position_ids.astype("float32").unsqueeze(-1) * paddle.to_tensor(inv_freq).reshape([1, 1, -1])
    emb = paddle.concat([freqs, freqs], axis=-1)
    return paddle.cos(emb), paddle.sin(emb)


_ROTATE = {}


def rotate_half(x):
    """[x1, x2] -> [-x2, x1] on the last axis, as a product with a signed permutation matrix:
    exact, and on CPU ~10x faster (fwd + bwd) than paddle's split + concat."""
    key = (x.shape[-1], str(x.dtype))
    if key not in _ROTATE:
        d = x.shape[-1] // 2
        r = np.zeros((2 * d, 2 * d), np.float32)
        r[np.arange(d) + d, np.arange(d)] = -1.0     # out[:d] = -x2
        r[np.arange(d), np.arange(d) + d] = 1.0      # out[d:] = x1
        _ROTATE[key] = paddle.to_tensor(r).astype(x.dtype)
    return paddle.matmul(x, _ROTATE[key])


def apply_rope(x, cos, sin):
    """x [B, S, heads, D]; cos/sin [B, S, D]."""
    cos, sin = cos.unsqueeze(2).astype(x.dtype), sin.unsqueeze(2).astype(x.dtype)
    return x * cos + rotate_half(x) * sin


class RopeTables:
    """cos/sin [B, S, D] of one forward pass, shared by all layers. `apply(x)` rotates x
    [B, S, heads, D]; the tables are expanded once per head count to x's full shape, because
    paddle's CPU multiply with a broadcast [B, S, 1, D] operand is ~3x slower (fwd + bwd) than a
    same-shape one."""

    def __init__(self, cos, sin):
        self.cos, self.sin = cos, sin
        self._full = {}

    def apply(self, x, scale=1.0):
        """Rotated x, times `scale` (folded into the tables: attention passes 1/sqrt(D) here for
        q instead of scaling the [B, heads, S, T] scores, ~1 ms fwd + bwd per layer saved)."""
        key = (x.shape[2], x.dtype, scale)
        if key not in self._full:
            shape = list(x.shape)
            self._full[key] = tuple((t.unsqueeze(2).astype(x.dtype) * scale).expand(shape).clone()
                                    for t in (self.cos, self.sin))
        cos, sin = self._full[key]
        return x * cos + rotate_half(x) * sin

    def apply_heads_first(self, x, scale=1.0):
        """apply(x, scale) transposed to [B, heads, S, D]: paddle's fused rope (gpu column), else
        one CPU kernel when available."""
        if ops.gpu():
            return ops.rope(x, self.cos, self.sin, scale)
        fused = kernels.rope_heads_first(x, self.cos, self.sin, scale)
        return fused if fused is not None else self.apply(x, scale).transpose([0, 2, 1, 3])


class NoRotary:
    """The rope object of families without rotary positions (learned positions, ALiBi)."""

    def apply_heads_first(self, x, scale=1.0):
        """x [B, S, heads, D] (times `scale`) as [B, heads, S, D]."""
        return (x if scale == 1.0 else x * scale).transpose([0, 2, 1, 3])


def check_positions(positions, limit, key):
    """Learned position tables have `limit` rows: a position past them is an error naming the
    config key, not an index crash."""
    top = int(positions.max()) if positions.shape[-1] else 0
    if top >= limit:
        raise ValueError(f"position {top} is past the model's learned positions ({key}={limit}); "
                         "shorten the sequence (max_length / src_length + max_new_tokens)")


def alibi_slopes(num_heads):
    """ALiBi slopes [num_heads] (float32, Press et al.): for n a power of two, head h (1-based)
    gets 2^(-8h/n); otherwise the n' = 2^floor(log2 n) slopes of n' heads, then the odd-indexed
    slopes of 2n' heads for the remaining n - n'. Example: n = 4 -> [1/4, 1/16, 1/64, 1/256];
    n = 6 -> [1/4, 1/16, 1/64, 1/256, 1/2, 1/8]. Attention adds slope_h · j to the score of key j
    (the softmax ignores the missing -slope_h · i per query row)."""
    c = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * h / c) for h in range(1, c + 1)]
    slopes += [2.0 ** (-8.0 * h / (2 * c)) for h in range(1, 2 * (num_heads - c), 2)]
    return np.asarray(slopes, np.float32)


class HeadSlopes:
    """ALiBi slopes of num_heads heads; `get(first, count)` -> the slopes of heads first ..
    first+count-1 as a float32 tensor (made once per slice: a tensor-parallel rank asks for its own)."""

    def __init__(self, num_heads):
        self.all = alibi_slopes(num_heads)
        self._made = {}

    def get(self, first, count):
        if (first, count) not in self._made:
            self._made[(first, count)] = paddle.to_tensor(self.all[first:first + count])
        return self._made[(first, count)]


class NormHead(nn.Linear):
    """An LM head whose vocabulary vectors are unit-normalised in every forward (Baichuan2):
    logits = h @ weight_transform(W), W [H, V] (paddle layout), each column v divided by its
    L2 norm (the rows of the HF weight [V, H]). `weight_transform` is the one place the
    normalisation is written: the loss's chunked head (models/loss.py) and tensor parallelism's
    column executor (on the rank's columns) apply it to the weight they read."""

    @staticmethod
    def weight_transform(w):
        return F.normalize(w, p=2, axis=0)

    def forward(self, x):
        return paddle.matmul(x, self.weight_transform(self.weight))


# ------------------------------------------------------------------------------------- attention

def attention_bias(batch, q_len, past, attention_mask=None, segment_ids=None, dtype="float32", dense=False):
    """Which keys each query may NOT see: a bool mask [B or 1, 1, S, T] (True = blocked), or None
    when plain causal attention over a single new token needs no mask.

    - causal: query i (absolute position past+i) sees keys j <= past+i;
    - attention_mask [B, T] (1 real, 0 pad) blocks padded keys;
    - segment_ids [B, S] (packed sequences, no past) blocks keys of other segments; alone
      (no past, no attention_mask) they give a PackedRows instead of a dense mask;
    - a padding-only attention_mask (each row's 1s one run: left or right padding) with no past,
      with the CPU kernels on, gives a PaddedRows (the blocked kernel reads each row's key window;
      `dense` forces the bool mask, which PaddedRows.dense() builds for the other paths).
    A boolean mask applied with masked_fill, not an additive float bias: paddle's CPU kernels add
    a broadcast [1, 1, S, T] bias ~30x slower than they fill a broadcast bool mask."""
    if segment_ids is not None and past == 0 and attention_mask is None and not dense:
        return PackedRows(segment_ids, dtype)
    if (attention_mask is not None and segment_ids is None and attention_mask.place.is_cpu_place()
            and not bool((attention_mask == 0).any())):
        # no padding at all (uniform batches): the plain causal mask, which the CPU attention
        # kernel runs by position (no [B, 1, S, T] mask built or read); the same attention
        attention_mask = None
    T = past + q_len
    if (attention_mask is not None and segment_ids is None and past == 0 and q_len > 1 and not dense
            and attention_mask.place.is_cpu_place() and kernels.cpu_ops() is not None):
        window = kernels.padding_window(attention_mask)   # left / right padding: no [B, 1, S, T] mask
        if window is not None:
            return PaddedRows(window, lambda: attention_bias(batch, q_len, 0, attention_mask, dtype=dtype,
                                                             dense=True))
    blocked = None
    if q_len > 1:
        blocked = causal_mask(q_len, past)
    if attention_mask is not None:
        pad = (attention_mask == 0).reshape([batch, 1, 1, T])
        blocked = pad if blocked is None else paddle.logical_or(blocked, pad)
    if segment_ids is not None:
        other = (segment_ids.unsqueeze(2) != segment_ids.unsqueeze(1)).unsqueeze(1)   # [B, 1, S, S]
        blocked = other if blocked is None else paddle.logical_or(blocked, other)
    return blocked


_CAUSAL = {}   # (S, past) -> the plain causal mask, made once: ops tells it apart by identity


def causal_mask(q_len, past=0):
    """bool [1, 1, S, past+S], True above the diagonal shifted by `past` (blocked keys)."""
    key = (q_len, past)
    if key not in _CAUSAL:
        T = past + q_len
        _CAUSAL[key] = paddle.triu(paddle.ones([q_len, T], dtype="bool"), diagonal=past + 1).reshape([1, 1, q_len, T])
    return _CAUSAL[key]


def is_plain_causal(bias, q_len):
    """True when `bias` is the causal mask of q_len new tokens and no past (no padding, no
    packing): the case flash attention's causal=True covers."""
    return bias is not None and bias is _CAUSAL.get((q_len, 0))


class PaddedRows:
    """Causal attention over left- or right-padded rows without a [B, 1, S, T] mask: window int32
    [B, 2] = (first, end) of row b's real keys (kernels.padding_window). The blocked CPU kernel
    reads the window (ops.cpu_attention); every other path calls dense() for the bool mask that
    attention_bias builds for the same attention_mask (made once, kept)."""

    def __init__(self, window, make_dense):
        self.window = paddle.to_tensor(window)
        self._make, self._dense = make_dense, None

    def dense(self):
        if self._dense is None:
            self._dense = self._make()
        return self._dense


class PackedRows:
    """Attention layout of packed rows (zero padding), built once per forward from segment_ids
    [B, S] (equal ids = one example, occupying a contiguous run).

    Exact CPU path without a dense [S, S] mask: each row is cut at example boundaries into
    blocks of whole examples (consecutive examples merged while the block stays <= BLOCK tokens;
    a longer example is a block by itself). Attention runs per block with a causal,
    same-example mask of the block's size only. No example crosses a block, so this equals
    block-diagonal attention over the row, at cost sum(block^2) instead of S^2.
    Example: segments [0,0,0,1,1,2] with BLOCK 4 -> blocks [0:5) (examples 0,1) and [5:6).

    GPU with the model's flash_attention switch on: paddle's variable-length flash attention
    (flash_attn_unpadded) over the examples with cumulative sequence lengths. UNTESTED here
    (no GPU on the development machines); any failure falls back to the exact path."""
    BLOCK = 256

    def __init__(self, segment_ids, dtype="float32"):
        seg = np.asarray(segment_ids.numpy() if hasattr(segment_ids, "numpy") else segment_ids)
        self.shape, self.dtype = seg.shape, dtype
        self.runs = []       # per row: [(start, end)] of each example
        for row in seg:
            cut = np.flatnonzero(row[1:] != row[:-1]) + 1
            edges = [0] + cut.tolist() + [len(row)]
            self.runs.append(list(zip(edges[:-1], edges[1:])))
        self._causal = {}    # size -> causal bias, shared by single-example blocks
        self.blocks = []     # (row, start, end, bias [1, 1, L, L])
        for b, runs in enumerate(self.runs):
            group = []
            for r in runs + [None]:
                if group and (r is None or r[1] - group[0][0] > self.BLOCK):
                    self.blocks.append((b, group[0][0], group[-1][1], self._bias(group)))
                    group = []
                if r is not None:
                    group.append(r)

    def _bias(self, group):
        """Bool [1, 1, n, n] mask of one block (True = blocked): causal and same example."""
        n = group[-1][1] - group[0][0]
        if len(group) == 1 and n in self._causal:
            return self._causal[n]
        local = np.concatenate([np.full(e - s, i) for i, (s, e) in enumerate(group)])
        ok = (local[:, None] == local[None, :]) & np.tril(np.ones((n, n), bool))
        blocked = paddle.to_tensor(~ok).reshape([1, 1, n, n])
        if len(group) == 1:
            self._causal[n] = blocked
        return blocked

    def whole_row_mask(self):
        """[B, 1, S, S] bool mask when each row is exactly one block (typical when max_length is
        within BLOCK), so attention runs as one batched call; else None."""
        B, S = self.shape
        if len(self.blocks) != B or any(lo != 0 or hi != S for _, lo, hi, _ in self.blocks):
            return None
        if not hasattr(self, "_whole"):
            self._whole = paddle.concat([m for _, _, _, m in self.blocks], axis=0)
        return self._whole

    def key_ends(self):
        """int32 [B, S]: for each key, the end (exclusive) of its example in its row: the first
        query row that may not see it (flashmask_attention's startend_row_indices, causal)."""
        ends = np.zeros(self.shape, np.int32)
        for b, runs in enumerate(self.runs):
            for s, e in runs:
                ends[b, s:e] = e
        return ends

    def cu_seqlens(self):
        """int32 [num_examples + 1] over the flattened [B*S] tokens (varlen flash attention)."""
        S, starts = self.shape[1], [0]
        for b, runs in enumerate(self.runs):
            starts += [b * S + e for _, e in runs]
        return np.asarray(starts, np.int32)


_WARNED = set()


def _packed_flash(q, k, v, layout, dropout, training, scale):
    from paddle.nn.functional.flash_attention import flash_attn_unpadded

    B, N, S, D = q.shape
    g = N // k.shape[1]
    if g > 1:   # repeat KV heads to the query heads (kernel GQA support not assumed)
        k, v = (paddle.repeat_interleave(t, g, axis=1) for t in (k, v))
    flat = lambda t: t.transpose([0, 2, 1, 3]).reshape([B * S, N, D])  # noqa: E731
    cu = paddle.to_tensor(layout.cu_seqlens())
    longest = int(max(e - s for runs in layout.runs for s, e in runs))
    out, _ = flash_attn_unpadded(flat(q), flat(k), flat(v), cu, cu, longest, longest, scale,
                                 dropout=dropout if training else 0.0, causal=True, training=training)
    return out.reshape([B, S, N * D])


def _dtype_name(t):
    return str(t.dtype).replace("paddle.", "")


def _packed_attention(q, k, v, layout, dropout, training, scale, flash=False, dropout_fn=None,
                      alibi=None, plain=False):
    if flash and alibi is None and "gpu" in str(q.place).lower():
        try:
            return _packed_flash(q, k, v, layout, dropout, training, scale)
        except Exception as e:  # untested kernel path: stay correct, say why once
            if "flash" not in _WARNED:
                _WARNED.add("flash")
                import logging
                logging.getLogger("paddletune").warning("varlen flash attention failed (%s); using "
                                                        "the exact blocked path", e)
    whole = layout.whole_row_mask()
    if whole is not None:   # every row is one block: a single batched call, no slicing
        return _dense_attention(q, k, v, whole, dropout, training, scale, dropout_fn, alibi, plain)
    rows = [[] for _ in range(q.shape[0])]
    for b, lo, hi, bias in layout.blocks:
        sl = lambda t: t[b:b + 1, :, lo:hi]  # noqa: E731
        # ALiBi over a block's own key positions: per query row a constant shift (every key it
        # sees is in its example), which the softmax ignores
        rows[b].append(_dense_attention(sl(q), sl(k), sl(v), bias, dropout, training, scale, dropout_fn,
                                        alibi, plain))
    return paddle.concat([paddle.concat(r, axis=1) if len(r) > 1 else r[0] for r in rows], axis=0)


def attention(q, k, v, bias=None, dropout=0.0, training=False, scale=None, flash=False,
              dropout_fn=None, alibi=None, recompute=False):
    """Scaled dot-product attention with grouped KV heads and no K/V repetition.

    q [B, N, S, D]; k, v [B, K, T, D] with N = K * g; bias: bool mask broadcastable to
    [B, 1, S, T] (True = blocked, from attention_bias), or a PackedRows (zero padding). Query heads k*g .. k*g+g-1 share KV head k (as HF's repeat_kv).
    `scale` multiplies the scores: None = 1/sqrt(D); 1.0 when q was scaled already (RopeTables).
    `flash`: packed rows may use the GPU varlen flash-attention kernel (see PackedRows).
    `dropout_fn(probs, p, training)` replaces F.dropout on the probabilities when given.
    `alibi`: slopes [N] (float32 tensor) of these query heads: score(i, j) += slope · j for key j
    (0-based over the T keys, cached and learned-prefix keys included).
    `recompute`: keep only q, k, v for backward and run softmax(q k^T) v again then
    (recompute_granularity core_attn; the dropout masks are replayed from the saved RNG state).
    Returns [B, S, N*D]."""
    if recompute and training and not (q.stop_gradient and k.stop_gradient and v.stop_gradient):
        from paddle.distributed.fleet.utils import recompute as run_again

        return run_again(lambda q_, k_, v_: attention(q_, k_, v_, bias, dropout, training, scale, flash,
                                                      dropout_fn, alibi), q, k, v, use_reentrant=False)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if isinstance(bias, PaddedRows) and ops.gpu():
        bias = bias.dense()
    if ops.gpu():   # paddle's fused attention ops; ALiBi and a custom dropout: plain paddle ops
        if alibi is None and dropout_fn is None:
            causal = is_plain_causal(bias, q.shape[2]) and k.shape[2] == q.shape[2]
            return ops.attention(q, k, v, bias, dropout, training, scale, causal, _NEG[_dtype_name(q)])
        if isinstance(bias, PackedRows):
            return _packed_attention(q, k, v, bias, dropout, training, scale, False, dropout_fn, alibi,
                                     plain=True)
        return _dense_attention(q, k, v, bias, dropout, training, scale, dropout_fn, alibi, plain=True)
    if not (flash and "gpu" in str(q.place).lower()):   # the op table's CPU attention row
        out = ops.cpu_attention(q, k, v, bias, dropout, training, scale, alibi, dropout_fn)
        if out is not None:
            return out
    if isinstance(bias, PaddedRows):
        bias = bias.dense()
    if isinstance(bias, PackedRows):
        return _packed_attention(q, k, v, bias, dropout, training, scale, flash, dropout_fn, alibi)
    return _dense_attention(q, k, v, bias, dropout, training, scale, dropout_fn, alibi)


def _dense_attention(q, k, v, bias=None, dropout=0.0, training=False, scale=None, dropout_fn=None,
                     alibi=None, plain=False):
    """Dense attention on [B, K, g*S, T] matmuls (see attention); `plain`: paddle's ops only, never
    the CPU masked-softmax kernel (the op table's gpu column for ALiBi / custom dropout)."""
    B, N, S, D = q.shape
    K, T = k.shape[1], k.shape[2]
    g = N // K
    qg = q.reshape([B, K, g * S, D])
    scores = paddle.matmul(qg, k, transpose_y=True)                        # [B, K, g*S, T]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if scale != 1.0:
        scores = scores * scale
    if alibi is not None:   # + slope_n · j: [1, N, 1, T] over [B, N, S, T]
        keys = paddle.arange(T, dtype=scores.dtype).reshape([1, 1, 1, T])
        extra = alibi.astype(scores.dtype).reshape([1, N, 1, 1]) * keys
        scores = (scores.reshape([B, N, S, T]) + extra).reshape([B, K, g * S, T])
    probs = None
    if bias is not None and not plain:   # bool [B|1, 1, S, T], True = blocked; one CPU kernel pass
        probs = kernels.masked_softmax(scores.reshape([B, N, S, T]), bias)
    if probs is not None:
        probs = probs.reshape([B, K, g * S, T])
    else:
        if bias is not None:
            neg = _NEG[_dtype_name(scores)]
            scores = paddle.masked_fill(scores.reshape([B, K, g, S, T]), bias.unsqueeze(1), neg)
            scores = scores.reshape([B, K, g * S, T])
        probs = F.softmax(scores.astype(wide(scores.dtype)), axis=-1).astype(q.dtype)
    if dropout > 0 and training:
        probs = (dropout_fn(probs, dropout, True) if dropout_fn is not None
                 else F.dropout(probs, dropout, training=True))
    out = paddle.matmul(probs, v)                                          # [B, K, g*S, D]
    return out.reshape([B, N, S, D]).transpose([0, 2, 1, 3]).reshape([B, S, N * D])


def init_weights(model, std=0.02, seed=0):
    """Deterministic N(0, std) init of Linear/Embedding weights (numpy RNG), zero biases, unit
    norms. Used for tiny test models; real weights come from checkpoints."""
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            val = np.zeros(p.shape, np.float32)
        elif len(p.shape) == 1:
            val = np.ones(p.shape, np.float32)
        else:
            val = (rng.standard_normal(p.shape) * std).astype(np.float32)
        # the same float32 draw for every dtype (a float64 model starts from the float32 one)
        p.set_value(val if p.dtype == paddle.float32 else paddle.to_tensor(val).astype(p.dtype))
