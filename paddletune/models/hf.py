"""Hugging Face checkpoints in and out: config.json, safetensors (single or sharded), layouts.

This is the only module that converts weight layouts (docs/design.md rule 7): HF/torch Linear weights
are [out, in], paddle nn.Linear weights are [in, out]. Every 2-D ".weight" is a Linear weight
except the names in `ModelSpec.not_linear` (embeddings), which keep their layout; Linear weights
whose checkpoint stores them [in, out] already (GPT-2's Conv1D: `ModelSpec.stored_in_out`) keep
theirs too. Code elsewhere
that moves a Linear weight (or its shape) between the two layouts calls:
    linear_to_hf(w) / linear_to_paddle(w)        one Linear weight (numpy array or paddle tensor)
    to_hf_layout / to_paddle_layout(spec, name, arr)   any named tensor (only Linear weights change)
    hf_shape / paddle_shape(spec, name, shape)   the same rule for shapes
A transpose elsewhere is arithmetic (e.g. y = x @ W^T), not a change of stored layout.

safetensors are read with our own small parser over a memory map, so tensors are read one at a
time (or one slice at a time, for tensor parallelism) and bf16/fp16 checkpoints load without
torch. Pickle formats (.bin, .pdparams) are refused; tools/convert_checkpoint.py converts them.
"""
import glob
import hashlib
import json
import os
import re
import struct

import numpy as np

from ..io import inside, open_regular, read_json

_NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
       "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_CODE = {np.dtype(v): k for k, v in _NP.items()}
_SIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
         "U8": 1, "BOOL": 1}
DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """Round-to-nearest-even float32 -> bfloat16 bit patterns (uint16)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    return ((u + rounding) >> 16).astype(np.uint16)


class SafetensorsFile:
    """Lazy reader: header parsed once, tensors copied out of a memory map on request.

    The header is checked against the file before any tensor is read: known dtypes, shapes
    whose byte size matches the tensor's data range, every range inside the file. So a truncated
    download, a wrong header length or an unknown dtype is one error naming the file and the
    tensor, not a failed reshape or a MemoryError later."""

    MAX_HEADER = 100 << 20   # the safetensors format's own limit

    def __init__(self, path):
        self.path = path
        # a FIFO would block open(), a device never end: refused, naming the file
        with os.fdopen(open_regular(path, "safetensors file"), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, self.MAX_HEADER):
                raise ValueError(f"{path}: not a safetensors file, or truncated: its header length "
                                 f"says {n} bytes, the file has {size} bytes")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
        meta = header.pop("__metadata__", None)
        self.metadata = meta if isinstance(meta, dict) else {}
        self.header = header
        self.offset = 8 + n
        for name, info in header.items():
            _check_entry(path, name, info, size - self.offset)
        _check_disjoint(path, header)
        # bytes past the last tensor are never mapped (a huge file of junk costs no address space)
        self._end = self.offset + max([info["data_offsets"][1] for info in header.values()] + [0])
        self._mm = None
    def keys(self):
        return list(self.header)

    def shape(self, name):
        return list(self.header[name]["shape"])

    def dtype(self, name):
        return self.header[name]["dtype"]

    def _raw(self, name):
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r", shape=(self._end,))
        info = self.header[name]
        a, b = info["data_offsets"]
        code = info["dtype"]
        buf = self._mm[self.offset + a:self.offset + b]
        view = buf.view(np.uint16 if code == "BF16" else _NP[code])
        return view.reshape(info["shape"]), code

    def get(self, name, axis=None, start=None, stop=None):
        """Tensor (or the slice [start:stop) along `axis`) as a new numpy array; bf16 -> float32."""
        index = None
        if axis is not None:
            index = [slice(None)] * len(self.shape(name))
            index[axis] = slice(start, stop)
        return self.get_box(name, index)

    def get_box(self, name, index=None):
        """Tensor[index] (a tuple/list of slices, one per axis; None = all) as a new numpy array,
        reading only the selected bytes from the map; bf16 -> float32."""
        view, code = self._raw(name)
        if index is not None:
            view = view[tuple(index)]
        arr = np.array(view)  # copy out of the memory map
        return bf16_to_f32(arr) if code == "BF16" else arr

    def release(self):
        """Unmap the file: pages read so far stop counting toward this process's RSS (streaming
        merges read every tensor once and would otherwise keep the whole file resident)."""
        self._mm = None


def _check_disjoint(path, header):
    """Tensors' data ranges must not overlap (the format lays them end to end): two tensors over
    the same bytes are a crafted or damaged header."""
    spans = sorted((info["data_offsets"][0], info["data_offsets"][1], name) for name, info in header.items()
                   if info["data_offsets"][1] > info["data_offsets"][0])
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"{path}: tensors {an!r} (bytes {a0}-{a1}) and {bn!r} (bytes {b0}-{b1}) "
                             "overlap in the safetensors header: the file is damaged or crafted; "
                             "copy it again")


def _check_entry(path, name, info, data_bytes):
    """One header entry: a known dtype, a shape of naturals, a data range of exactly
    prod(shape) x itemsize bytes inside the data section (`data_bytes` long)."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise ValueError(f"{where}: corrupt header entry {info!r:.80}")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if code not in _SIZE:
        raise ValueError(f"{where} has dtype {code!r}, which is not supported here (supported: "
                         f"{', '.join(_SIZE)})")
    ints = lambda v, n=None: (isinstance(v, list) and (n is None or len(v) == n) and  # noqa: E731
                              all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v))
    if not ints(shape) or not ints(offsets, 2) or offsets[0] > offsets[1]:
        raise ValueError(f"{where}: corrupt header entry (shape {shape!r}, data_offsets {offsets!r})")
    need = int(np.prod(shape, dtype=np.int64)) * _SIZE[code]
    if offsets[1] - offsets[0] != need:
        raise ValueError(f"{where}: shape {shape} of {code} needs {need} bytes, its data range "
                         f"holds {offsets[1] - offsets[0]}: corrupt header")
    if offsets[1] > data_bytes:
        raise ValueError(f"{where} ends at byte {offsets[1]} of the data, which has {data_bytes} "
                         "bytes: the file is truncated (an interrupted download or copy?)")


def write_safetensors(path, tensors, metadata=None, dtype=None):
    """Write {name: np.ndarray} as safetensors. `dtype` ('float32', 'bfloat16', 'float16') converts
    floating tensors; others keep their dtype. Tensors are streamed to disk one by one. Returns
    {"bytes": file size, "sha256": hex digest} of what was written (hashed on the way out)."""
    header, plan, off = {}, [], 0
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        code = _CODE.get(arr.dtype)
        if arr.dtype.kind == "f" and dtype:
            code = DTYPE_NAMES[dtype]
        if code is None:
            raise TypeError(f"cannot store {name} of dtype {arr.dtype} in safetensors")
        nbytes = int(np.prod(arr.shape, dtype=np.int64)) * _SIZE[code]
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [off, off + nbytes]}
        plan.append((arr, code))
        off += nbytes
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    digest, size = hashlib.sha256(), 0
    with open(path, "wb") as f:
        for part in _parts(blob, plan):
            f.write(part)
            digest.update(part)
            size += len(part)
    return {"bytes": size, "sha256": digest.hexdigest()}


def _parts(blob, plan):
    yield struct.pack("<Q", len(blob))
    yield blob
    for arr, code in plan:
        data = f32_to_bf16(arr) if code == "BF16" else np.ascontiguousarray(arr, dtype=_NP[code])
        yield data.reshape(-1).view(np.uint8).data if data.size else b""


def file_digest(path, chunk=1 << 24):
    """{"bytes", "sha256"} of a file, as write_safetensors returns them for what it wrote."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for part in iter(lambda: f.read(chunk), b""):
            digest.update(part)
            size += len(part)
    return {"bytes": size, "sha256": digest.hexdigest()}


def stream_safetensors(path, header, tensors, metadata=None):
    """Write a safetensors file whose header is known up front, one tensor at a time.

    header: {name: {"dtype": code, "shape": [...]}} in file order; tensors: iterable of
    (name, np.ndarray) in the same order (floating arrays are converted to the header dtype).
    Only one tensor is held at a time, so a merge of a large checkpoint stays near one tensor."""
    full, off = {}, 0
    for name, info in header.items():
        nbytes = int(np.prod(info["shape"], dtype=np.int64)) * _SIZE[info["dtype"]]
        full[name] = {"dtype": info["dtype"], "shape": list(info["shape"]),
                      "data_offsets": [off, off + nbytes]}
        off += nbytes
    full["__metadata__"] = dict(metadata or {"format": "pt"})
    blob = json.dumps(full, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    order, i = list(header), -1
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for i, (name, arr) in enumerate(tensors):
            if i >= len(order) or name != order[i]:
                raise ValueError(f"{path}: tensor {name!r} arrived out of header order")
            info = full[name]
            if list(arr.shape) != info["shape"]:
                raise ValueError(f"{path}: {name} has shape {list(arr.shape)}, header says {info['shape']}")
            code = info["dtype"]
            data = f32_to_bf16(arr) if code == "BF16" else np.ascontiguousarray(arr, dtype=_NP[code])
            f.write(data.tobytes())
        if i + 1 != len(order):
            raise ValueError(f"{path}: {len(order) - i - 1} tensors of the header were not written")


class CheckpointReader:
    """All tensors of a HF checkpoint directory: model.safetensors, or shards + index."""

    PICKLE = ("pytorch_model*.bin", "*.pdparams", "model_state*.pdparams")

    def __init__(self, path, prefix="model"):
        self.path = path
        index = os.path.join(path, f"{prefix}.safetensors.index.json")
        single = os.path.join(path, f"{prefix}.safetensors")
        files = {}
        if os.path.exists(index):
            idx = read_json(index, "safetensors index")
            wm = idx.get("weight_map") if isinstance(idx, dict) else None
            if not isinstance(wm, dict):
                raise ValueError(f"{index}: has no \"weight_map\" object (tensor name -> file)")
            opened = {}
            for name, fn in wm.items():
                if fn not in opened:
                    full = inside(path, fn, index)
                    if not os.path.exists(full):
                        raise FileNotFoundError(f"{index} names {fn}, which is missing from {path}")
                    opened[fn] = SafetensorsFile(full)
                if name not in opened[fn].header:
                    raise ValueError(f"{index} puts tensor {name!r} in {fn}, which does not hold it")
                files[name] = opened[fn]
        elif os.path.exists(single):
            st = SafetensorsFile(single)
            files = {k: st for k in st.keys()}
        else:
            # shards without an index: HF's "model-00001-of-00003.safetensors" names only
            shards = sorted(glob.glob(os.path.join(path, f"{prefix}-*.safetensors")))
            for fn in shards:
                st = SafetensorsFile(fn)
                files.update({k: st for k in st.keys()})
        if not files:
            pickled = [p for pat in self.PICKLE for p in glob.glob(os.path.join(path, pat))]
            if pickled:
                raise ValueError(
                    f"{path} holds only pickle weights ({os.path.basename(pickled[0])}); paddletune "
                    "never unpickles. Convert them once (trusted files only):\n"
                    f"  python tools/convert_checkpoint.py --input {path} --output {path}-safetensors")
            raise FileNotFoundError(f"no {prefix}.safetensors weights found in {path}")
        self.files, self.names = files, {}   # names: our name -> the file's (see base_prefix)
        base = _base_prefix(path)
        if base and not any(k.startswith(base) for k in files):
            # saved from the base model (bigscience/bloom*, gpt2, facebook/opt-*: "h.0...."),
            # without the head model's prefix that our module names carry
            self.files = {base + k: f for k, f in files.items()}
            self.names = {base + k: k for k in files}
        fused = _fused_expert_names(path)
        if fused:
            self.files = expert_views(self.files, fused)


    def keys(self):
        return list(self.files)

    def __contains__(self, name):
        return name in self.files

    def stored_name(self, name):
        """The name tensor `name` has in its file."""
        return self.names.get(name, name)

    def shape(self, name):
        return self.files[name].shape(self.stored_name(name))

    def dtype(self, name):
        return self.files[name].dtype(self.stored_name(name))

    def file_of(self, name):
        return self.files[name].path

    def get(self, name, axis=None, start=None, stop=None):
        return self.files[name].get(self.stored_name(name), axis, start, stop)

    def release(self):
        for st in set(self.files.values()):
            st.release()


_FUSED = re.compile(r"(.*)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)$")


def _fused_expert_names(path):
    """ModelSpec.fused_experts of the family of path/config.json, or None."""
    conf = os.path.join(path, "config.json")
    if not os.path.exists(conf):
        return None
    try:
        from .spec import spec_for_config

        return spec_for_config(read_json(conf, "config.json")).fused_experts
    except ValueError:
        return None


class ExpertView:
    """Tensors that are parts of a stored one: name -> (stored name, index tuple). Reads only the
    part's bytes (the same interface as SafetensorsFile for the names it holds)."""

    def __init__(self, st):
        self.st, self.parts, self.path = st, {}, st.path

    def _raw(self, name):
        stored, index = self.parts[name]
        view, code = self.st._raw(stored)
        return view[index], code

    def shape(self, name):
        return list(self._raw(name)[0].shape)

    def dtype(self, name):
        return self.st.dtype(self.parts[name][0])

    def get(self, name, axis=None, start=None, stop=None):
        index = None
        if axis is not None:
            index = [slice(None)] * len(self.shape(name))
            index[axis] = slice(start, stop)
        return self.get_box(name, index)

    def get_box(self, name, index=None):
        view, code = self._raw(name)
        arr = np.array(view if index is None else view[tuple(index)])
        return bf16_to_f32(arr) if code == "BF16" else arr

    def release(self):
        self.st.release()


def expert_views(files, fused):
    """{name: file} with transformers 5's fused MoE tensors replaced by the per-expert tensors the
    model's modules name, fused = (block, gate, up, down) as ModelSpec.fused_experts:
        P.mlp.experts.gate_up_proj [E, 2I, H] -> P.<block>.experts.e.<gate>.weight = [e, :I]
                                                 P.<block>.experts.e.<up>.weight   = [e, I:]
        P.mlp.experts.down_proj    [E, H, I]  -> P.<block>.experts.e.<down>.weight = [e]
        P.mlp.gate.weight          [E, H]     -> P.<block>.gate.weight (the router)
    Each part is [out, in], a Linear weight like any other (the layout rule above applies).
    A checkpoint in the per-expert layout has none of these names and passes unchanged."""
    block, gate, up, down = fused
    out, views = {}, {}
    for name, st in files.items():
        m = _FUSED.fullmatch(name)
        if m is None or (m.group(2) == "gate.weight" and block == "mlp"):
            out[name] = st
            continue
        view = views.setdefault(id(st), ExpertView(st))
        stored, head, kind = name, m.group(1), m.group(2)
        shape = st.shape(stored)
        if kind == "gate.weight":
            view.parts[f"{head}.{block}.gate.weight"] = (stored, (slice(None),) * 2)
        elif kind == "experts.gate_up_proj":
            E, I2 = shape[0], shape[1]
            for e in range(E):
                view.parts[f"{head}.{block}.experts.{e}.{gate}.weight"] = (stored, (e, slice(0, I2 // 2)))
                view.parts[f"{head}.{block}.experts.{e}.{up}.weight"] = (stored, (e, slice(I2 // 2, I2)))
        else:
            for e in range(shape[0]):
                view.parts[f"{head}.{block}.experts.{e}.{down}.weight"] = (stored, (e,))
    for view in views.values():
        out.update({n: view for n in view.parts})
    return out


def _base_prefix(path):
    """ModelSpec.base_prefix of the family of path/config.json ("" when unknown)."""
    conf = os.path.join(path, "config.json")
    if not os.path.exists(conf):
        return ""
    try:
        from .spec import spec_for_config

        return spec_for_config(read_json(conf, "config.json")).base_prefix or ""
    except ValueError:   # not a config this project loads: no renaming
        return ""


# ------------------------------------------------------------------ Linear weight layout
# [out, in] (HF/torch) <-> [in, out] (paddle nn.Linear): the one place this is written down.

def _swap_axes(w):
    """The 2-D transpose both directions share: numpy arrays come back contiguous (they are
    written or handed to kernels next), paddle tensors as a new tensor (Tensor.t())."""
    if isinstance(w, np.ndarray) or not hasattr(w, "t"):
        return np.ascontiguousarray(np.asarray(w).T)
    return w.t()


def linear_to_hf(w):
    """One Linear weight (or LoRA A/B matrix), paddle layout [in, out] -> HF/torch [out, in]."""
    return _swap_axes(w)


def linear_to_paddle(w):
    """One Linear weight (or LoRA A/B matrix), HF/torch layout [out, in] -> paddle [in, out]."""
    return _swap_axes(w)


def is_linear_weight(spec, name, ndim):
    """True when tensor `name` is a Linear weight the HF checkpoint holds as [out, in], i.e. one
    whose layout differs from paddle's [in, out] (not an embedding, not a Conv1D weight)."""
    if ndim != 2 or not name.endswith(".weight") or name in spec.not_linear:
        return False
    return not any(re.fullmatch(p, name) for p in getattr(spec, "stored_in_out", ()))


def read_torch_linear(reader, spec, name):
    """Linear weight `name` from the checkpoint in torch layout [out, in] (what quantizers take),
    whatever layout the checkpoint stores it in."""
    arr = reader.get(name)
    return arr if is_linear_weight(spec, name, arr.ndim) else linear_to_hf(arr)


def to_paddle_layout(spec, name, arr):
    """Tensor `name` read from an HF checkpoint -> paddle layout (only Linear weights change)."""
    return linear_to_paddle(arr) if is_linear_weight(spec, name, arr.ndim) else arr


def to_hf_layout(spec, name, arr):
    """Tensor `name` in paddle layout -> the HF checkpoint's layout (only Linear weights change)."""
    return linear_to_hf(arr) if is_linear_weight(spec, name, arr.ndim) else arr


def hf_shape(spec, name, shape):
    """Shape tensor `name` has in an HF checkpoint, given its paddle shape."""
    shape = list(shape)
    return shape[::-1] if is_linear_weight(spec, name, len(shape)) else shape


def paddle_shape(spec, name, shape):
    """Shape tensor `name` has in paddle, given its HF checkpoint shape."""
    shape = list(shape)
    return shape[::-1] if is_linear_weight(spec, name, len(shape)) else shape


def read_slice(reader, spec, name, axis=None, start=None, stop=None):
    """Read tensor `name` in paddle layout, optionally only [start:stop) along paddle `axis`
    (the HF axis is the other one for Linear weights), without reading the rest."""
    ndim = len(reader.shape(name))
    hf_axis = axis
    if axis is not None and is_linear_weight(spec, name, ndim):
        hf_axis = 1 - axis
    return to_paddle_layout(spec, name, reader.get(name, hf_axis, start, stop))


COMPUTE_DTYPES = ("float32", "float64", "float16", "bfloat16")
_SAME = {("bfloat16", "BF16"), ("float16", "F16"), ("float64", "F64"), ("float32", "F32")}


def read_as(reader, spec, name, dtype="float32"):
    """Tensor `name` in paddle layout, as the numpy form paddle takes for a parameter of `dtype`:
    float32 / float64 / float16 arrays, and for bfloat16 the raw 16-bit words (uint16, paddle's
    numpy form of bfloat16). A tensor stored in `dtype` is copied word for word out of the file
    (a BF16 tensor read for bfloat16 never becomes float32: 2 bytes per value, no rounding);
    any other stored dtype is converted by numpy, to bfloat16 with round-to-nearest-even."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported ({', '.join(COMPUTE_DTYPES)})")
    if dtype == "float32":   # the float32 path as it always was
        return read_slice(reader, spec, name).astype(np.float32, copy=False)
    st = reader.files.get(name) if isinstance(getattr(reader, "files", None), dict) else None
    if st is not None and hasattr(st, "_raw"):
        view, code = st._raw(reader.stored_name(name) if hasattr(reader, "stored_name") else name)
        if (dtype, code) in _SAME:
            return to_paddle_layout(spec, name, np.array(view))
    arr = read_slice(reader, spec, name)
    return f32_to_bf16(arr) if dtype == "bfloat16" else arr.astype(dtype, copy=False)


def read_slice_into(reader, spec, name, out, axis=None, start=None, stop=None, rows=1 << 22):
    """Copy tensor `name` (or its [start:stop) slice along paddle `axis`) in paddle layout into
    `out`, straight from the file's memory map: no intermediate copy of the whole slice (bf16 is
    widened `rows` elements at a time). Linear weights are transposed on the way. `out` is a
    float32 / float64 / float16 array (numpy converts), or uint16 for bfloat16 words: copied word
    for word from a BF16 tensor, else rounded to nearest even from float32 (as read_as)."""
    st = reader.files[name]
    view, code = st._raw(reader.stored_name(name) if hasattr(reader, "stored_name") else name)
    linear = is_linear_weight(spec, name, view.ndim)
    if axis is not None:
        idx = [slice(None)] * view.ndim
        idx[1 - axis if linear else axis] = slice(start, stop)
        view = view[tuple(idx)]
    if linear:
        view = view.T
    words = out.dtype == np.uint16
    if (code == "BF16") == words:   # same dtype (BF16 words into words), or numpy converts
        out[...] = view
        return out
    step = max(1, rows // max(int(np.prod(view.shape[1:])), 1))
    for i in range(0, view.shape[0], step):
        chunk = np.array(view[i:i + step])
        out[i:i + step] = f32_to_bf16(chunk) if words else bf16_to_f32(chunk)
    return out


def parse_size(s):
    if isinstance(s, int):
        return s
    s = s.strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def write_weights(out_dir, hf_tensors, max_shard_size="5GB", dtype=None, prefix="model"):
    """Write an iterable of (hf_name, np.ndarray in HF layout) as one file or shards + index.
    Tensors are consumed one at a time; a shard is flushed once it reaches max_shard_size, so at
    most one shard's worth of arrays is held."""
    limit = parse_size(max_shard_size)
    half = {"bfloat16": 2, "float16": 2}.get(dtype or "")
    shards, cur, cur_size, total = [], {}, 0, 0   # shards: [(temp file, [names])]

    def flush():
        tmp = f".shard-{len(shards) + 1:05d}.safetensors"
        write_safetensors(os.path.join(out_dir, tmp), cur, dtype=dtype)
        shards.append((tmp, list(cur)))

    for name, arr in hf_tensors:
        n = arr.size * (half if (half and arr.dtype.kind == "f") else arr.itemsize)
        if cur and cur_size + n > limit:
            flush()
            cur, cur_size = {}, 0
        cur[name] = arr
        cur_size += n
        total += n
    if cur or not shards:
        flush()
    if len(shards) == 1:
        os.replace(os.path.join(out_dir, shards[0][0]), os.path.join(out_dir, f"{prefix}.safetensors"))
        return [f"{prefix}.safetensors"]
    weight_map, files = {}, []
    for i, (tmp, names) in enumerate(shards, 1):
        final = f"{prefix}-{i:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(out_dir, tmp), os.path.join(out_dir, final))
        weight_map.update({k: final for k in names})
        files.append(final)
    with open(os.path.join(out_dir, f"{prefix}.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files


# ------------------------------------------------------------------ HF-PEFT adapters (peft issue)
# HF-PEFT stores adapter tensors under "base_model.model." + the base model's module name, with
# the adapter name ("default") removed: base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight.
# Our module names equal HF's, so the only differences are that prefix and the Linear layout.
PEFT_KEY_PREFIX = "base_model.model."


def peft_state_to_hf(spec, state):
    """{paddle name: array, paddle layout} -> {HF-PEFT key: array, torch layout}.
    LoRA: lora_A.weight [in, r] -> [r, in]; lora_B.weight [r, out] -> [out, r]."""
    return {PEFT_KEY_PREFIX + n: to_hf_layout(spec, n, np.asarray(a)) for n, a in state.items()}


def peft_state_from_hf(spec, tensors, where="adapter"):
    """Inverse of peft_state_to_hf; keys without the HF-PEFT prefix are refused."""
    out = {}
    for key, arr in tensors.items():
        if not key.startswith(PEFT_KEY_PREFIX):
            raise ValueError(f"{where}: tensor {key!r} is not an HF-PEFT adapter key "
                             f"(expected names starting with {PEFT_KEY_PREFIX!r})")
        name = key[len(PEFT_KEY_PREFIX):]
        out[name] = to_paddle_layout(spec, name, arr)
    return out


def prefix_to_peft(keys, values):
    """Learned prefixes -> HF-PEFT PREFIX_TUNING `prompt_embeddings`.

    keys, values: [L, K, P, D] (layer, kv head, virtual token, head dim). HF-PEFT holds
    [P, L*2*K*D] and views it as [P, L*2, K, D] with index 2l for layer l's keys and 2l+1 for its
    values (peft_model.get_prompt), so element [p, ((2l+kv)*K + k)*D + d]."""
    kv = np.stack([np.asarray(keys), np.asarray(values)], axis=1)   # [L, 2, K, P, D]
    P = kv.shape[3]
    return np.ascontiguousarray(kv.transpose(3, 0, 1, 2, 4).reshape(P, -1))


def prefix_from_peft(prompt, num_layers, kv_heads, head_dim):
    """Inverse of prefix_to_peft: [P, L*2*K*D] -> (keys, values), each [L, K, P, D]."""
    prompt = np.asarray(prompt)
    P = prompt.shape[0]
    if prompt.ndim != 2 or prompt.shape[1] != num_layers * 2 * kv_heads * head_dim:
        raise ValueError(f"prompt_embeddings has shape {list(prompt.shape)}; this model needs "
                         f"[P, {num_layers * 2 * kv_heads * head_dim}] (layers {num_layers} x 2 x "
                         f"kv heads {kv_heads} x head_dim {head_dim})")
    kv = prompt.reshape(P, num_layers, 2, kv_heads, head_dim).transpose(1, 2, 3, 0, 4)
    return np.ascontiguousarray(kv[:, 0]), np.ascontiguousarray(kv[:, 1])
