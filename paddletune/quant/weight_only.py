"""Weight-only quantization of frozen Linear weights: int8, int4, nf4, fp4 (QLoRA-style).

A frozen weight W [out, in] (Hugging Face layout: row r = output feature r) is stored as codes
and scales only; the forward computes y = x @ W^T (+ bias) by dequantizing W into the compute
dtype chunk by chunk, and the backward dequantizes again for dx = dy @ W (W is frozen: no dW), so
no full-precision copy of W is ever kept, not even for autograd.

Lines and the block axis (the layout, chosen so tensor parallelism can quantize after slicing).
`block_axis` is the axis of W that blocks and every statistic run along; the other axis indexes
*lines*, the only axis a quantized weight may be split along:

  block_axis "in"   lines = output rows W[r, :]   (out lines of length in):  column-parallel and
                    unsplit layers; as a matrix the lines are W itself, HF layout [out, in].
  block_axis "out"  lines = input columns W[:, c] (in lines of length out):  row-parallel layers;
                    as a matrix the lines are W^T, paddle layout [in, out] (hf.linear_to_paddle).

Each line is quantized on its own, from its own values only, and every stored array has the line
axis first. Hence quantize(W restricted to lines l0:l1) == every array [l0:l1] of quantize(W),
bitwise, for any l0 < l1 (any TP degree, even uneven splits): slice_state below is that rule.

Algorithms (one row each in ALGORITHMS: quantize / dequantize / matmul). With L the line length,
bs = blocksize, nb = ceil(L / bs) blocks per line, the last block of each line zero-padded:

  weight_only_int8  symmetric per line: s = max |line| / 127, q = round(line / s) in [-127, 127];
                    i.e. per output row for block_axis "in", per input column for "out".
  weight_only_int4  symmetric per block: a_b = max |block|, code k in 1..15, W ~ (k - 8) / 7 * a_b.
  nf4               same blocks; W ~ NF4[k] * a_b, NF4 = the 16 NormalFloat levels of the QLoRA
                    paper (Dettmers et al. 2023, appendix E).
  fp4               same blocks; W ~ FP4[k] * a_b, FP4 = the e2m1 levels / 6 (code bits
                    s e1 e0 m: (-1)^s * (m/2 if e == 0 else 2^(e-1) * (1 + m/2))).

4-bit codes are nearest-level indices packed two per byte along the padded line, element 2j in
the high nibble: byte = (k[2j] << 4) | k[2j+1]. Double quantization (optional, 4-bit only) stores
a line's block absmaxes as int8: a_b ~ qa_b * c_g + m, with m = the line's mean absmax and
c_g = max_{b in g} |a_b - m| / 127 over groups g of `double_quant_blocksize` consecutive blocks of
the line (the last group may be short). It is applied only where it saves bytes (see
uses_double_quant): a line of 1-2 blocks keeps float32 absmaxes, which are smaller and exact.

Stored arrays, n lines (shapes are what slice_state cuts along axis 0):
  int8        codes int8 [n, L], scale float32 [n]
  4-bit       codes uint8 [n, nb*bs/2], absmax float32 [n, nb]
  4-bit + dq  codes, absmax_q int8 [n, nb], absmax_scale float32 [n, ceil(nb/g)],
              absmax_offset float32 [n]

Worked example, nf4, bs 64, W [96, 160]. As a column-parallel layer (block_axis "in"): 96 lines
of 160 = 3 blocks (64, 64, 32 values + 32 zeros): codes [96, 96], absmax [96, 3]; TP 2 rank 1
holds output rows 48:96 -> codes[48:96], absmax[48:96]. As a row-parallel layer (block_axis
"out"): 160 lines of 96 = 2 blocks (64, 32 + 32 zeros): codes [160, 64], absmax [160, 2]; TP 2
rank 1 holds input columns 80:160 -> codes[80:160], absmax[80:160].

Bytes per weight element (fp32 = 4), no padding (bs | L): int8 1 + 4/L; 4-bit 0.5 + 4/bs (0.5625
at 64); with double quantization 0.5 + 1/bs + (4*ceil(nb/g) + 4)/L (0.5164 for L = 11008, 0.5176
for L = 4096, at 64/256). Padding adds (nb*bs - L)/L of the line's bytes.
"""
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
BLOCK_AXES = ("in", "out")


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


# ----------------------------------------------------------------------------- lines

def line_shape(out_features, in_features, block_axis):
    """(number of lines, line length) of W [out, in] whose blocks run along `block_axis`."""
    if block_axis not in BLOCK_AXES:
        raise ValueError(f"block_axis {block_axis!r} must be one of {BLOCK_AXES} (the axis of "
                         "W [out, in] that quantization blocks run along)")
    return (out_features, in_features) if block_axis == "in" else (in_features, out_features)


def _lines(w_hf, block_axis, l0, l1):
    """Lines l0:l1 of W [out, in] as float32 [l1 - l0, L]: rows of W (block_axis "in", HF layout)
    or rows of W^T (block_axis "out", i.e. paddle layout [in, out] of input columns l0:l1)."""
    if block_axis == "in":
        return np.asarray(w_hf[l0:l1], np.float32)
    return np.asarray(hf.linear_to_paddle(np.asarray(w_hf[:, l0:l1])), np.float32)


def _chunks(n_lines, line_elems, budget):
    """[(l0, l1)] covering n_lines, each chunk <= budget elements (at least one line)."""
    per = max(1, budget // max(line_elems, 1))
    return [(l, min(l + per, n_lines)) for l in range(0, n_lines, per)]


def uses_double_quant(cfg, n_blocks):
    """Whether a line of n_blocks blocks stores its absmaxes double-quantized: only when that is
    smaller than float32, n_blocks + 4*ceil(n_blocks/g) + 4 < 4*n_blocks bytes (so never for
    lines of 1-2 blocks). It depends on the line length only, which no split changes."""
    g = cfg.double_quant_blocksize
    return bool(cfg.double_quant) and n_blocks + 4 * -(-n_blocks // g) + 4 < 4 * n_blocks


# ----------------------------------------------------------------------------- quantize (numpy)

def quantize_int8(w_hf, cfg, block_axis="in"):
    """w_hf [out, in] float -> {"codes": int8 [n, L], "scale": float32 [n]}, one scale per line."""
    n, length = line_shape(*w_hf.shape, block_axis)
    codes = np.empty([n, length], np.int8)
    scale = np.empty([n], np.float32)
    for l0, l1 in _chunks(n, length, QUANT_CHUNK):
        blk = _lines(w_hf, block_axis, l0, l1)
        s = np.abs(blk).max(axis=1) / np.float32(127.0)
        s = np.where(s > 0, s, np.float32(1.0)).astype(np.float32)   # zero line: any scale
        codes[l0:l1] = np.clip(np.rint(blk / s[:, None]), -127, 127).astype(np.int8)
        scale[l0:l1] = s
    return {"codes": codes, "scale": scale}


def quantize_4bit(w_hf, cfg, codebook, block_axis="in"):
    """w_hf [out, in] float -> {"codes": uint8 [n, nb*bs/2], "absmax": float32 [n, nb]} (or the
    double-quantized absmax fields): nb blocks per line, the last one zero-padded."""
    bs = cfg.blocksize
    n, length = line_shape(*w_hf.shape, block_axis)
    nb = -(-length // bs)
    codes = np.empty([n, nb * bs // 2], np.uint8)
    absmax = np.empty([n, nb], np.float32)
    mids, sorted_codes = _encoder(codebook)
    for l0, l1 in _chunks(n, nb * bs, QUANT_CHUNK):
        blk = np.zeros([l1 - l0, nb * bs], np.float32)   # the padding stays zero
        blk[:, :length] = _lines(w_hf, block_axis, l0, l1)
        blk = blk.reshape(l1 - l0, nb, bs)
        a = np.abs(blk).max(axis=2)
        v = blk / np.where(a > 0, a, np.float32(1.0))[..., None]
        k = sorted_codes[np.searchsorted(mids, v)]
        codes[l0:l1] = pack_nibbles(k).reshape(l1 - l0, -1)
        absmax[l0:l1] = a
    if uses_double_quant(cfg, nb):
        return {"codes": codes, **double_quantize(absmax, cfg.double_quant_blocksize)}
    return {"codes": codes, "absmax": absmax}


def double_quantize(absmax, group):
    """Block absmaxes a [n, nb] (one row per line) -> int8 codes around each line's mean, one
    float32 scale per `group` consecutive blocks of a line. Each row is computed from that row
    alone (the mean is summed in float64 per row), so rows of a slice come out bitwise the same."""
    n, nb = absmax.shape
    m = (absmax.astype(np.float64).sum(axis=1) / nb).astype(np.float32)
    ng = -(-nb // group)
    r = np.zeros([n, ng * group], np.float32)    # a short last group is padded with zeros,
    r[:, :nb] = absmax - m[:, None]              # which never raise its max
    r = r.reshape(n, ng, group)
    c = np.abs(r).max(axis=2) / np.float32(127.0)
    c = np.where(c > 0, c, np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(r / c[..., None]), -127, 127).astype(np.int8).reshape(n, -1)[:, :nb]
    return {"absmax_q": np.ascontiguousarray(q), "absmax_scale": c, "absmax_offset": m}


def quantize_weight(w_hf, cfg, block_axis="in"):
    """The quantized state {field: numpy array} of W [out, in] (HF layout; any float dtype)."""
    w_hf = np.asarray(w_hf)
    if w_hf.ndim != 2:
        raise ValueError(f"quantize_weight: expected a 2-D weight [out, in], got shape "
                         f"{list(w_hf.shape)}")
    return ALGORITHMS[cfg.algo].quantize(w_hf, cfg, block_axis)


def slice_state(state, block_axis, axis, start, stop):
    """The quantized state of W restricted to [start:stop) along `axis` ("out": output rows, a
    column-parallel split; "in": input columns, a row-parallel split), cut out of the state of
    the whole W: every array's line axis (axis 0) sliced. Bitwise equal to quantize_weight of the
    slice with the same cfg and block_axis. The split axis must be the lines' axis (not
    block_axis): blocks and statistics along block_axis span the whole of it.

    Example: nf4 W [96, 160], block_axis "out" -> codes [160, 64]; slice_state(s, "out", "in",
    80, 160) -> codes [80, 64] etc., the state of W[:, 80:160]."""
    if block_axis not in BLOCK_AXES or axis not in BLOCK_AXES:
        raise ValueError(f"block_axis {block_axis!r} and axis {axis!r} must be in {BLOCK_AXES}")
    if axis == block_axis:
        other = "out" if axis == "in" else "in"
        raise ValueError(
            f"cannot split along {axis!r} a weight quantized with blocks along {axis!r}: blocks "
            f"and their scales span that axis. Quantize it with block_axis={other!r} (blocks along the "
            f"axis that is not split), or quantize each slice after splitting.")
    n = state["codes"].shape[0]
    if not 0 <= start < stop <= n:
        raise ValueError(f"slice [{start}:{stop}) along {axis!r} is outside 0..{n}")
    return {k: np.ascontiguousarray(v[start:stop]) for k, v in state.items()}


def state_shapes(out_features, in_features, cfg, block_axis="in"):
    """{field: (shape, numpy dtype)} of the quantized state of W [out, in]: what
    QuantizedLinear.load_state checks (and a TP rank can size before quantizing)."""
    n, length = line_shape(out_features, in_features, block_axis)
    if ALGORITHMS[cfg.algo].bits == 8:
        return {"codes": ([n, length], np.int8), "scale": ([n], np.float32)}
    bs, g = cfg.blocksize, cfg.double_quant_blocksize
    nb = -(-length // bs)
    shapes = {"codes": ([n, nb * bs // 2], np.uint8)}
    if uses_double_quant(cfg, nb):
        shapes.update(absmax_q=([n, nb], np.int8), absmax_scale=([n, -(-nb // g)], np.float32),
                      absmax_offset=([n], np.float32))
    else:
        shapes["absmax"] = ([n, nb], np.float32)
    return shapes


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


def dequantize_int8(layer, l0, l1, dtype):
    """Lines l0:l1 [l1 - l0, L] in `dtype` (see QuantizedLinear.dequantize_lines)."""
    return layer.codes[l0:l1].astype(dtype) * layer.scale[l0:l1].astype(dtype).unsqueeze(1)


def _absmax(layer, l0, l1):
    """Block absmaxes of lines l0:l1, float32 [l1 - l0, nb]."""
    if hasattr(layer, "absmax"):
        return layer.absmax[l0:l1]
    nb = layer.absmax_q.shape[1]
    group_of_block = paddle.arange(nb, dtype="int64") // layer.double_quant_blocksize
    c = paddle.index_select(layer.absmax_scale[l0:l1], group_of_block, axis=1)
    return layer.absmax_q[l0:l1].astype("float32") * c + layer.absmax_offset[l0:l1].unsqueeze(1)


def dequantize_4bit(layer, l0, l1, dtype, codebook):
    """Lines l0:l1 [l1 - l0, L] in `dtype`: gather levels, scale per block, drop the padding."""
    n, bs = l1 - l0, layer.blocksize
    idx = layer.codes[l0:l1].reshape([-1]).astype("int32")
    vals = paddle.gather(_pair_table(codebook, dtype), idx).reshape([n, -1, bs])
    w = vals * _absmax(layer, l0, l1).astype(dtype).unsqueeze(2)
    return w.reshape([n, -1])[:, :layer.line_length]


# ----------------------------------------------------------------------------- matmul

def line_chunks(layer):
    """[(l0, l1)] covering the layer's lines, each dequantized chunk (padding included) <=
    DEQUANT_CHUNK elements; lines are independent, so any line is a chunk boundary."""
    return _chunks(layer.n_lines, layer.padded_line_length, DEQUANT_CHUNK)


def _concat_products(a, layer):
    """concat over chunks of a @ lines^T: the lines' own axis becomes the last axis of the result
    (y's output features for block_axis "in", dx's input features for "out"). transpose_y is the
    arithmetic of the product over lines, not a layout change."""
    parts = [paddle.matmul(a, layer.dequantize_lines(l0, l1, a.dtype), transpose_y=True)
             for l0, l1 in line_chunks(layer)]
    return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=-1)


def _summed_products(a, layer):
    """sum over chunks of a[..., l0:l1] @ lines[l0:l1]: the lines' axis is contracted (dx = dy @ W
    for block_axis "in"; y = x @ W^T for "out", whose lines are W^T's rows)."""
    total, n = None, layer.n_lines
    for l0, l1 in line_chunks(layer):
        part = a if (l0, l1) == (0, n) else a[..., l0:l1]
        t = paddle.matmul(part, layer.dequantize_lines(l0, l1, a.dtype))
        total = t if total is None else total + t
    return total


class _QuantMatmul(PyLayer):
    """y = x @ W^T with W dequantized per chunk of lines; backward dx = dy @ W (W frozen, so
    nothing but the layer reference is saved: no dequantized weight survives the forward).
    Lines are W's rows (block_axis "in") or W^T's rows ("out"), hence the two product forms."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        if layer.block_axis == "in":
            return _concat_products(x, layer)
        return _summed_products(x, layer)

    @staticmethod
    def backward(ctx, dy):
        if ctx.layer.block_axis == "in":
            return _summed_products(dy, ctx.layer)
        return _concat_products(dy, ctx.layer)


def matmul_reference(x, layer):
    return _QuantMatmul.apply(x, layer)


def matmul_fused_or_reference(x, layer):
    """paddle's fused weight_only_linear where it can run (CUDA, fp16/bf16 input, int8/int4,
    blocks along "in"); the reference path everywhere else. See gpu.py: UNTESTED here (no GPU)."""
    from . import gpu

    y = gpu.try_fused(x, layer)
    return y if y is not None else _QuantMatmul.apply(x, layer)


@dataclass(frozen=True)
class Algorithm:
    name: str
    bits: int
    quantize: Callable       # (w [out, in] numpy, cfg, block_axis) -> {field: numpy array}
    dequantize: Callable     # (layer, l0, l1, dtype) -> paddle lines [l1 - l0, L]
    matmul: Callable         # (x [..., in], layer) -> [..., out]
    codebook: Optional[np.ndarray] = None
    fused_dtype: Optional[str] = None   # weight_dtype of paddle's weight_only_linear


def _four_bit(name, codebook, fused=None):
    return Algorithm(name, 4, lambda w, cfg, ax: quantize_4bit(w, cfg, codebook, ax),
                     lambda layer, l0, l1, dt: dequantize_4bit(layer, l0, l1, dt, codebook),
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
    nn.Linear. `weight_name` is the checkpoint tensor it is loaded from. `block_axis` ("in" or
    "out", see the module docstring) is the axis of W the blocks run along: "in" for column-
    parallel and unsplit layers, "out" for row-parallel ones (quant.model picks it from the TP
    plan). dequantize() returns W in paddle layout [in, out] (a fresh tensor, never cached)."""

    FIELDS = ("codes", "scale", "absmax", "absmax_q", "absmax_scale", "absmax_offset")

    def __init__(self, in_features, out_features, cfg: QuantConfig, bias=None, weight_name=None,
                 block_axis="in"):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.cfg, self.algo = cfg, ALGORITHMS[cfg.algo]
        self.blocksize = cfg.blocksize
        self.double_quant_blocksize = cfg.double_quant_blocksize
        self.block_axis = block_axis
        self.resize(self.in_features, self.out_features)
        self.bias = bias
        if bias is not None:
            bias.stop_gradient = True
        self.weight_name = weight_name
        self.fused = None   # set by gpu.py when paddle's fused layout replaces ours

    def resize(self, in_features, out_features):
        """Set the weight's dimensions (before set_weight): tensor parallelism gives a layer the
        size of its slice."""
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.n_lines, self.line_length = line_shape(self.out_features, self.in_features, self.block_axis)
        bs = self.blocksize
        self.padded_line_length = (self.line_length if self.algo.bits == 8
                                   else -(-self.line_length // bs) * bs)

    @property
    def loaded(self):
        return hasattr(self, "codes")

    def set_weight(self, w_hf):
        """Quantize w_hf [out, in] (HF layout; numpy, any float dtype) into this layer."""
        w_hf = np.asarray(w_hf)
        if list(w_hf.shape) != [self.out_features, self.in_features]:
            raise ValueError(f"{self.weight_name or 'weight'}: shape {list(w_hf.shape)}, expected "
                             f"[{self.out_features}, {self.in_features}] (HF layout [out, in])")
        return self.load_state(quantize_weight(w_hf, self.cfg, self.block_axis))

    def load_state(self, state):
        """Hold a quantized state {field: numpy array} (quantize_weight / slice_state output),
        checked field by field against this layer's shape, cfg and block_axis."""
        expect = state_shapes(self.out_features, self.in_features, self.cfg, self.block_axis)
        got = {k: (list(np.shape(v)), np.asarray(v).dtype) for k, v in state.items()}
        if got != {k: (s, np.dtype(d)) for k, (s, d) in expect.items()}:
            raise ValueError(f"{self.weight_name or 'QuantizedLinear'}: quantized state "
                             f"{got} does not fit {self.extra_repr()} (expected {expect})")
        for name in self.FIELDS:
            self._buffers.pop(name, None)
        for name, arr in state.items():
            self.register_buffer(name, paddle.to_tensor(arr), persistable=False)
        self.fused = None
        return self

    def state_arrays(self):
        """{field: numpy array} of the stored codes and scales."""
        return {n: t.numpy() for n, t in self._buffers.items() if n in self.FIELDS}

    def slice_state(self, axis, start, stop):
        """State of W [start:stop) along `axis` ("out" or "in"); see the module's slice_state."""
        return slice_state(self.state_arrays(), self.block_axis, axis, start, stop)

    def nbytes(self):
        """Bytes held for W: codes + every scale (bias excluded, as it is not quantized)."""
        return sum(int(np.prod(t.shape)) * t.element_size() for n, t in self._buffers.items()
                   if n in self.FIELDS or n.startswith("fused_"))

    def dequantize_lines(self, l0, l1, dtype="float32"):
        """Lines l0:l1 as [l1 - l0, L]: W[l0:l1, :] (HF rows) for block_axis "in", W[:, l0:l1]^T
        (paddle layout rows [in, out]) for "out"."""
        return self.algo.dequantize(self, l0, l1, dtype)

    def dequantize(self, dtype="float32"):
        """W in paddle layout [in, out]."""
        if self.fused is not None:
            from . import gpu

            return gpu.dequantize_fused(self, dtype)
        lines = self.dequantize_lines(0, self.n_lines, dtype)
        return hf.linear_to_paddle(lines) if self.block_axis == "in" else lines

    def forward(self, x):
        if not self.loaded and self.fused is None:
            raise RuntimeError(f"QuantizedLinear {self.weight_name}: weight not loaded yet")
        y = self.algo.matmul(x, self)
        return y if self.bias is None else y + self.bias.astype(y.dtype)

    def extra_repr(self):
        dq = ", double_quant" if self.cfg.double_quant and self.algo.bits == 4 else ""
        bs = f", blocksize={self.blocksize}" if self.algo.bits == 4 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.algo.name}{bs}{dq}, block_axis={self.block_axis}")
