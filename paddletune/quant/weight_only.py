"""Weight-only quantization of frozen Linear weights: int8, int4, nf4, fp4 (QLoRA-style).

A frozen weight W is stored in Hugging Face layout [out, in] (row r = output feature r) as codes
and scales only; the forward computes y = x @ W^T (+ bias) by dequantizing W into the compute
dtype row-chunk by row-chunk, and the backward dequantizes again for dx = dy @ W (W is frozen: no
dW), so no full-precision copy of W is ever kept, not even for autograd.

Algorithms (one row each in ALGORITHMS: quantize / dequantize / matmul):

  weight_only_int8  symmetric per output row: s_r = max_i |W[r, i]| / 127,
                    q = round(W / s_r) in [-127, 127] (int8), W ~ q * s_r.
  weight_only_int4  symmetric per block of `blocksize` consecutive elements of W flattened
                    row-major: a_b = max |block|, code k in 1..15, W ~ (k - 8) / 7 * a_b.
  nf4               same blocks; W ~ NF4[k] * a_b, NF4 = the 16 NormalFloat levels of the
                    QLoRA paper (Dettmers et al. 2023, appendix E).
  fp4               same blocks; W ~ FP4[k] * a_b, FP4 = the e2m1 levels / 6 (code bits
                    s e1 e0 m: (-1)^s * (m/2 if e == 0 else 2^(e-1) * (1 + m/2))).

4-bit codes are nearest-level indices packed two per byte, element 2j in the high nibble:
byte = (k[2j] << 4) | k[2j+1]. Double quantization (optional, 4-bit only) stores the block
absmaxes a_b as int8: a_b ~ qa_b * c_g + m, where m = mean(a), c_g = max_{b in g} |a_b - m| / 127
over groups g of `double_quant_blocksize` blocks.

Bytes per weight element (fp32 = 4): int8 1 + 4/in; 4-bit 0.5 + 4/blocksize (0.5625 at 64),
with double quantization 0.5 + 1/blocksize + 4/(blocksize * 256) (~0.516 at 64/256).
"""
import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import paddle
import paddle.nn as nn
from paddle.autograd import PyLayer

from ..models import hf

# QLoRA paper, appendix E: NormalFloat4 levels (quantiles of N(0, 1), normalised to [-1, 1]).
NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)
# e2m1 (OCP MX FP4) levels for codes 0..15; code 8 is -0.
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
FP4 = FP4_E2M1 / np.float32(6.0)          # block absmax maps to the largest level, 6
INT4 = (np.arange(16, dtype=np.float32) - 8) / np.float32(7.0)   # code 0 (-8/7) is never used

QUANT_CHUNK = 1 << 22     # elements quantized at a time at load (bounds numpy temporaries)
DEQUANT_CHUNK = 1 << 24   # elements of W dequantized at a time in forward/backward


# ----------------------------------------------------------------------------- packing

def pack_nibbles(codes):
    """uint8 codes in [0, 16), even length n -> n/2 bytes; codes[2j] goes to the high nibble."""
    c = np.asarray(codes, np.uint8).reshape(-1, 2)
    return ((c[:, 0] << 4) | c[:, 1]).astype(np.uint8)


def unpack_nibbles(packed):
    """Inverse of pack_nibbles: n bytes -> 2n codes."""
    p = np.asarray(packed, np.uint8)
    return np.stack([p >> 4, p & 15], axis=-1).reshape(-1)


def _encoder(codebook):
    """Nearest-level encoder for a codebook: (midpoints between sorted distinct levels, code of
    each sorted level). For duplicate levels (fp4 +0/-0) the first code wins."""
    order = np.argsort(codebook, kind="stable")
    vals, first = np.unique(codebook[order], return_index=True)
    return (vals[1:] + vals[:-1]) / 2, order[first].astype(np.uint8)


# ----------------------------------------------------------------------------- quantize (numpy)

def quantize_int8(w, cfg):
    """w [out, in] float32 -> {"codes": int8 [out, in], "scale": float32 [out]}."""
    out = w.shape[0]
    codes = np.empty(w.shape, np.int8)
    scale = np.empty([out], np.float32)
    rows = max(1, QUANT_CHUNK // max(w.shape[1], 1))
    for r0 in range(0, out, rows):
        blk = np.asarray(w[r0:r0 + rows], np.float32)
        s = np.abs(blk).max(axis=1) / np.float32(127.0)
        s = np.where(s > 0, s, np.float32(1.0)).astype(np.float32)   # zero row: any scale
        codes[r0:r0 + rows] = np.clip(np.rint(blk / s[:, None]), -127, 127).astype(np.int8)
        scale[r0:r0 + rows] = s
    return {"codes": codes, "scale": scale}


def quantize_4bit(w, cfg, codebook):
    """w [out, in] float32 -> {"codes": uint8 [ceil(n/bs)*bs/2], "absmax": float32 [n_blocks]}
    (or the double-quantized absmax fields), n = out*in flattened row-major, last block
    zero-padded."""
    bs = cfg.blocksize
    flat = np.asarray(w).reshape(-1)
    n = flat.size
    nb = -(-n // bs)
    codes = np.empty([nb * bs // 2], np.uint8)
    absmax = np.empty([nb], np.float32)
    mids, sorted_codes = _encoder(codebook)
    step = max(1, QUANT_CHUNK // bs) * bs
    for e0 in range(0, nb * bs, step):
        e1 = min(e0 + step, nb * bs)
        blk = np.zeros([e1 - e0], np.float32)
        part = flat[e0:min(e1, n)]
        blk[:part.size] = part
        blk = blk.reshape(-1, bs)
        a = np.abs(blk).max(axis=1)
        v = blk / np.where(a > 0, a, np.float32(1.0))[:, None]
        k = sorted_codes[np.searchsorted(mids, v)]
        codes[e0 // 2:e1 // 2] = pack_nibbles(k)
        absmax[e0 // bs:e1 // bs] = a
    if cfg.double_quant:
        return {"codes": codes, **double_quantize(absmax, cfg.double_quant_blocksize)}
    return {"codes": codes, "absmax": absmax}


def double_quantize(absmax, group):
    """Block absmaxes a [nb] -> int8 codes around their mean, one float32 scale per `group`."""
    m = np.float32(absmax.mean()) if absmax.size else np.float32(0.0)
    r = absmax - m
    ng = -(-r.size // group)
    padded = np.zeros([ng * group], np.float32)
    padded[:r.size] = r
    c = np.abs(padded.reshape(ng, group)).max(axis=1) / np.float32(127.0)
    c = np.where(c > 0, c, np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(padded.reshape(ng, group) / c[:, None]), -127, 127).astype(np.int8)
    return {"absmax_q": q.reshape(-1)[:r.size], "absmax_scale": c,
            "absmax_offset": np.array([m], np.float32)}


# ----------------------------------------------------------------------------- dequantize (paddle)

_PAIR_TABLES = {}


def _pair_table(codebook, dtype):
    """[256, 2] table: byte -> (level of high nibble, level of low nibble), cached per dtype and
    device; one gather over the packed bytes replaces unpacking."""
    key = (codebook.tobytes(), str(dtype), str(paddle.get_device()))
    if key not in _PAIR_TABLES:
        b = np.arange(256)
        pairs = np.stack([codebook[b >> 4], codebook[b & 15]], axis=1).astype(np.float32)
        _PAIR_TABLES[key] = paddle.to_tensor(pairs).astype(dtype)
    return _PAIR_TABLES[key]


def dequantize_int8(layer, r0, r1, dtype):
    """Rows r0:r1 of W [out, in] in `dtype`."""
    return layer.codes[r0:r1].astype(dtype) * layer.scale[r0:r1].astype(dtype).unsqueeze(1)


def _absmax(layer, b0, b1):
    if hasattr(layer, "absmax"):
        return layer.absmax[b0:b1]
    g = layer.double_quant_blocksize
    idx = paddle.arange(b0, b1, dtype="int64") // g
    return (layer.absmax_q[b0:b1].astype("float32") * paddle.gather(layer.absmax_scale, idx)
            + layer.absmax_offset)


def dequantize_4bit(layer, r0, r1, dtype, codebook):
    """Rows r0:r1 of W [out, in] in `dtype`; r0*in must fall on a block boundary."""
    bs, cols = layer.blocksize, layer.in_features
    e0, e1 = r0 * cols, r1 * cols
    b0, b1 = e0 // bs, -(-e1 // bs)
    idx = layer.codes[b0 * bs // 2:b1 * bs // 2].astype("int32")
    vals = paddle.gather(_pair_table(codebook, dtype), idx).reshape([b1 - b0, bs])
    w = vals * _absmax(layer, b0, b1).astype(dtype).unsqueeze(1)
    return w.reshape([-1])[:e1 - e0].reshape([r1 - r0, cols])


# ----------------------------------------------------------------------------- matmul

def row_chunks(layer):
    """[(r0, r1)] covering the output rows, each dequantized chunk <= DEQUANT_CHUNK elements and
    starting on a block boundary (4-bit blocks run over the row-major flattened W)."""
    out, cols = layer.out_features, max(layer.in_features, 1)
    align = 1 if layer.algo.bits == 8 else layer.blocksize // math.gcd(cols, layer.blocksize)
    rows = max(align, (DEQUANT_CHUNK // cols) // align * align)
    return [(r, min(r + rows, out)) for r in range(0, out, rows)]


class _QuantMatmul(PyLayer):
    """y = x @ W^T with W dequantized per row chunk; backward dx = dy @ W (W frozen, so nothing
    but the layer reference is saved: no dequantized weight survives the forward)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        chunks = row_chunks(layer)
        # transpose_y is the arithmetic of y = x @ W^T over rows of W [out, in], not a layout change
        ys = [paddle.matmul(x, layer.dequantize_rows(r0, r1, x.dtype), transpose_y=True)
              for r0, r1 in chunks]
        return ys[0] if len(ys) == 1 else paddle.concat(ys, axis=-1)

    @staticmethod
    def backward(ctx, dy):
        layer = ctx.layer
        dx = None
        for r0, r1 in row_chunks(layer):
            part = dy if (r0, r1) == (0, layer.out_features) else dy[..., r0:r1]
            t = paddle.matmul(part, layer.dequantize_rows(r0, r1, dy.dtype))
            dx = t if dx is None else dx + t
        return dx


def matmul_reference(x, layer):
    return _QuantMatmul.apply(x, layer)


def matmul_fused_or_reference(x, layer):
    """paddle's fused weight_only_linear where it can run (CUDA, fp16/bf16 input, int8/int4);
    the reference path everywhere else. See gpu.py: UNTESTED here (no GPU on our machines)."""
    from . import gpu

    y = gpu.try_fused(x, layer)
    return y if y is not None else _QuantMatmul.apply(x, layer)


@dataclass(frozen=True)
class Algorithm:
    name: str
    bits: int
    quantize: Callable       # (w [out, in] float32 numpy, cfg) -> {field: numpy array}
    dequantize: Callable     # (layer, r0, r1, dtype) -> paddle [r1 - r0, in]
    matmul: Callable         # (x [..., in], layer) -> [..., out]
    codebook: Optional[np.ndarray] = None
    fused_dtype: Optional[str] = None   # weight_dtype of paddle's weight_only_linear


def _four_bit(name, codebook, fused=None):
    return Algorithm(name, 4, lambda w, cfg: quantize_4bit(w, cfg, codebook),
                     lambda layer, r0, r1, dt: dequantize_4bit(layer, r0, r1, dt, codebook),
                     matmul_fused_or_reference if fused else matmul_reference, codebook, fused)


ALGORITHMS = {
    "weight_only_int8": Algorithm("weight_only_int8", 8, quantize_int8, dequantize_int8,
                                  matmul_fused_or_reference, None, "int8"),
    "weight_only_int4": _four_bit("weight_only_int4", INT4, "int4"),
    "nf4": _four_bit("nf4", NF4),
    "fp4": _four_bit("fp4", FP4),
}


@dataclass(frozen=True)
class QuantConfig:
    algo: str = "nf4"
    blocksize: int = 64
    double_quant: bool = False
    double_quant_blocksize: int = 256

    def __post_init__(self):
        # argument files are checked in args.py (choices, _check_quant); these asserts are for
        # programmatic callers building a QuantConfig themselves
        assert self.algo in ALGORITHMS, f"algo {self.algo!r} is not one of {sorted(ALGORITHMS)}"
        assert self.blocksize > 0 and self.blocksize % 2 == 0, (
            f"blocksize {self.blocksize} must be positive and even (two 4-bit codes per byte)")
        assert self.double_quant_blocksize > 0, (
            f"double_quant_blocksize {self.double_quant_blocksize} must be positive")


# ----------------------------------------------------------------------------- the layer

class QuantizedLinear(nn.Layer):
    """Frozen Linear y = x @ W^T + b with W [out, in] held as codes + scales only.

    Exposes in_features, out_features, bias and forward(x), so adapters (LoRA) wrap it like an
    nn.Linear. `weight_name` is the checkpoint tensor it is loaded from. dequantize() returns the
    dequantized weight in paddle layout [in, out] (a fresh tensor, never cached)."""

    FIELDS = ("codes", "scale", "absmax", "absmax_q", "absmax_scale", "absmax_offset")

    def __init__(self, in_features, out_features, cfg: QuantConfig, bias=None, weight_name=None):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.cfg, self.algo = cfg, ALGORITHMS[cfg.algo]
        self.blocksize = cfg.blocksize
        self.double_quant_blocksize = cfg.double_quant_blocksize
        self.bias = bias
        if bias is not None:
            bias.stop_gradient = True
        self.weight_name = weight_name
        self.fused = None   # set by gpu.py when paddle's fused layout replaces ours

    @property
    def loaded(self):
        return hasattr(self, "codes")

    def set_weight(self, w_hf):
        """Quantize w_hf [out, in] (HF layout; numpy, any float dtype) into this layer."""
        w_hf = np.asarray(w_hf)
        if list(w_hf.shape) != [self.out_features, self.in_features]:
            raise ValueError(f"{self.weight_name or 'weight'}: shape {list(w_hf.shape)}, expected "
                             f"[{self.out_features}, {self.in_features}] (HF layout [out, in])")
        if w_hf.dtype != np.float32:
            w_hf = w_hf.astype(np.float32)
        state = self.algo.quantize(w_hf, self.cfg)
        for name in self.FIELDS:
            if name in self._buffers:
                del self._buffers[name]
        for name, arr in state.items():
            self.register_buffer(name, paddle.to_tensor(arr), persistable=False)
        self.fused = None
        return self

    def state_arrays(self):
        """{field: numpy array} of the stored codes and scales."""
        return {n: t.numpy() for n, t in self._buffers.items() if n in self.FIELDS}

    def nbytes(self):
        """Bytes held for W: codes + every scale (bias excluded, as it is not quantized)."""
        return sum(int(np.prod(t.shape)) * t.element_size() for n, t in self._buffers.items()
                   if n in self.FIELDS or n.startswith("fused_"))

    def dequantize_rows(self, r0, r1, dtype="float32"):
        return self.algo.dequantize(self, r0, r1, dtype)

    def dequantize(self, dtype="float32"):
        """W in paddle layout [in, out]."""
        if self.fused is not None:
            from . import gpu

            return gpu.dequantize_fused(self, dtype)
        return hf.linear_to_paddle(self.dequantize_rows(0, self.out_features, dtype))

    def forward(self, x):
        if not self.loaded and self.fused is None:
            raise RuntimeError(f"QuantizedLinear {self.weight_name}: weight not loaded yet")
        y = self.algo.matmul(x, self)
        return y if self.bias is None else y + self.bias.astype(y.dtype)

    def extra_repr(self):
        dq = ", double_quant" if self.cfg.double_quant and self.algo.bits == 4 else ""
        bs = f", blocksize={self.blocksize}" if self.algo.bits == 4 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.algo.name}{bs}{dq}"
