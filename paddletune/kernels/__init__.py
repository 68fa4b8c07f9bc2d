"""Optional CPU kernels (cpu_kernels.cc), compiled with the system C++ compiler on first use.

    ops = cpu_ops()       # the compiled module, or None: callers then use paddle's own kernels
    loss = ops.pt_softmax_xent(logits, targets)     # [n]; logits become softmax - onehot (in place)
    probs = ops.pt_masked_softmax(scores, mask)                        # [B, H, S, T]
    dscores = ops.pt_masked_softmax_bwd(probs, dprobs, mask)
    y, rstd = ops.pt_rms_norm(x, weight, eps)                          # RMSNorm over the last axis
    out = ops.pt_swiglu(gate, up)                                      # silu(gate) * up
    out = ops.pt_rope(x, cos, sin, scale)          # rotary embedding, [B, S, N, D] -> [B, N, S, D]
(and their *_bwd); the autograd wrappers below (masked_softmax, rms_norm, swiglu, rope) pick them.
    out, lse = ops.pt_flash_attn(q, k, v, mask, starts, window, scale, causal, use_mask, use_starts, use_window)
blocked attention with an online softmax (attention_core.h, as ops in attention.cc; wrapper and
masks: attention.py, used by models/ops.cpu_attention), memory linear in the sequence.

Why: paddle 3.3.1's CPU softmax and cross-entropy kernels run on one thread and take several
passes, and RMSNorm / SwiGLU are chains of broadcast elementwise ops with as many gradient nodes;
on the docs/design.md section 5 LoRA step the loss alone took ~45 ms of ~400 (the kernel: ~13).
Built through paddle.utils.cpp_extension into $PADDLETUNE_HOME/kernels/<key> (key = hash of the
source, paddle version, compiler flags and CPU, since -march=native code is CPU-specific), under
a file lock so launched ranks build once; later processes load the built library (~1 s).
Linked to paddle's libiomp5 so their OpenMP threads are the ones MKL already runs.

Off (paddle's kernels, same results to float32 rounding) when: PADDLETUNE_KERNELS=0, a CUDA build
of paddle, no C++ compiler, or the build fails (the reason is logged once).
"""
import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import time


logger = logging.getLogger("paddletune")
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.cc")
SOURCES = [SOURCE, os.path.join(os.path.dirname(SOURCE), "attention.cc")]   # attention.py: the latter's ops
HEADERS = ("fast_exp.h", "attention_core.h")   # included by the sources: part of the build key
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
OPS = ("pt_softmax_xent", "pt_masked_softmax", "pt_masked_softmax_bwd", "pt_rms_norm", "pt_rms_norm_bwd",
       "pt_swiglu", "pt_swiglu_bwd", "pt_rope", "pt_rope_bwd", "pt_flash_attn", "pt_flash_attn_bwd")
_STATE = {}


def _why_not():
    import paddle

    if os.environ.get("PADDLETUNE_KERNELS", "1") == "0":
        return "PADDLETUNE_KERNELS=0"
    if paddle.is_compiled_with_cuda():
        return "CUDA build of paddle (these kernels are CPU-only)"
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return f"{sys.platform}/{platform.machine()}: only Linux x86-64 is supported"
    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
        return "no C++ compiler (install g++)"
    if not os.path.exists(os.path.join(os.path.dirname(paddle.__file__), "libs", "libiomp5.so")):
        return "paddle has no libiomp5 (not an MKL build)"
    return None


def _cpu_id():
    try:
        with open("/proc/cpuinfo") as f:
            keep = [l for l in f if l.startswith(("model name", "flags"))][:2]
        return "".join(keep)
    except OSError:
        return platform.processor()


def _build():
    import fcntl

    import paddle
    from paddle.utils.cpp_extension import load

    libs = os.path.join(os.path.dirname(paddle.__file__), "libs")
    ldflags = [f"-L{libs}", "-liomp5", f"-Wl,-rpath,{libs}"]
    src = b""
    for path in SOURCES + [os.path.join(os.path.dirname(SOURCE), h) for h in HEADERS]:   # + what they include
        with open(path, "rb") as f:
            src += f.read()
    key = hashlib.sha256(b"\0".join([src, paddle.__version__.encode(), " ".join(CFLAGS + ldflags).encode(),
                                     _cpu_id().encode(), sys.version.encode()])).hexdigest()[:12]
    home = os.environ.get("PADDLETUNE_HOME", os.path.join(os.path.expanduser("~"), ".cache", "paddletune"))
    build_dir = os.path.join(home, "kernels", key)
    name = f"paddletune_cpu_{key}"
    done = os.path.join(build_dir, "built.ok")   # written after a complete build and load
    mod = _load_built(name, os.path.join(build_dir, name)) if os.path.exists(done) else None
    if mod is not None:
        return mod
    os.makedirs(build_dir, exist_ok=True)
    # the compile is silent (its output goes to a temp file): say what the pause is, and when it ends
    logger.info("CPU kernels: building them once for this machine and paddle version (~15-45 s; "
                "later runs load them in ~1 s) into %s", build_dir)
    t0 = time.time()
    with open(build_dir + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # one build per key, however many ranks start at once
        try:
            # another process may have finished the build while this one waited for the lock:
            # building again would replace the library under the processes already loading it
            mod = _load_built(name, os.path.join(build_dir, name)) if os.path.exists(done) else None
            if mod is not None:
                return mod
            with _quiet_build():
                mod = load(name=name, sources=SOURCES, extra_cxx_cflags=CFLAGS,
                           extra_ldflags=ldflags, build_directory=build_dir, verbose=False)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    logger.info("CPU kernels: built in %.0f s", time.time() - t0)
    # paddle registers a library's ops once per process; a second load returns an empty module
    missing = [n for n in OPS if not hasattr(mod, n)]
    if missing:
        raise RuntimeError(f"the built library lacks {missing} (loaded twice in one process?)")
    with open(done, "w") as f:
        f.write(name + "\n")
    return mod


def _load_built(name, directory):
    """The already built library without paddle's ~1 s rebuild check (a setup.py run in a child
    process); None if that private helper is missing or fails, and the normal path runs."""
    try:
        from paddle.utils.cpp_extension.extension_utils import _import_module_from_library

        with _quiet_build():
            mod = _import_module_from_library(name, directory, False)
        return mod if all(hasattr(mod, n) for n in OPS) else None
    except Exception:
        return None


@contextlib.contextmanager
def _quiet_build():
    """cpp_extension compiles in a child process that writes to our stdout/stderr file
    descriptors and logs every step at INFO: both go to a temp file while it runs (its tail
    becomes the error message when the build fails)."""
    import tempfile

    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    previous = logging.root.manager.disable
    with tempfile.TemporaryFile(mode="w+") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        logging.disable(logging.INFO)
        try:
            yield
        except Exception as e:
            sink.seek(0)
            tail = [l for l in sink.read().splitlines() if "error" in l.lower()][-3:]
            raise RuntimeError("; ".join(tail) or str(e)) from e
        finally:
            logging.disable(previous)
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def cpu_ops():
    """The compiled kernels module, or None (the reason is logged once)."""
    if "ops" in _STATE:
        return _STATE["ops"]
    ops, reason = None, _why_not()
    if reason is None:
        try:
            ops = _build()
        except Exception as e:   # a failed build must never stop training: paddle's kernels remain
            reason = f"build failed: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__}"
    _STATE["ops"] = ops
    if reason:
        logger.info("CPU kernels: off (%s); paddle's kernels are used", reason)
    else:   # the default case is said too (README: "the log says which")
        logger.info("CPU kernels: on (paddletune's cross-entropy, masked softmax, RMSNorm, SwiGLU, rope, "
                    "blocked attention)")
    return ops


def _layers():
    """PyLayers over the kernels (built once, when first needed)."""
    import paddle

    class MaskedSoftmax(paddle.autograd.PyLayer):
        """softmax(masked_fill(scores, mask, -1e9), -1)."""

        @staticmethod
        def forward(ctx, scores, mask):
            probs = cpu_ops().pt_masked_softmax(scores, mask)
            ctx.save_for_backward(probs, mask)
            return probs

        @staticmethod
        def backward(ctx, dprobs):
            probs, mask = ctx.saved_tensor()
            return cpu_ops().pt_masked_softmax_bwd(probs, dprobs, mask)

    class RmsNorm(paddle.autograd.PyLayer):
        """weight * x / sqrt(mean(x^2, -1) + eps)."""

        @staticmethod
        def forward(ctx, x, weight, eps):
            y, rstd = cpu_ops().pt_rms_norm(x, weight, eps)
            ctx.save_for_backward(x, weight, rstd)
            ctx.want_dw = not weight.stop_gradient
            return y

        @staticmethod
        def backward(ctx, dy):
            x, weight, rstd = ctx.saved_tensor()
            dx, dw = cpu_ops().pt_rms_norm_bwd(x, weight, rstd, dy, ctx.want_dw)
            return dx, (dw if ctx.want_dw else None)

    class Swiglu(paddle.autograd.PyLayer):
        """silu(gate) * up."""

        @staticmethod
        def forward(ctx, gate, up):
            ctx.save_for_backward(gate, up)
            return cpu_ops().pt_swiglu(gate, up)

        @staticmethod
        def backward(ctx, dout):
            gate, up = ctx.saved_tensor()
            return tuple(cpu_ops().pt_swiglu_bwd(gate, up, dout))

    class Rope(paddle.autograd.PyLayer):
        """scale * (x * cos + rotate_half(x) * sin), heads moved before the sequence axis."""

        @staticmethod
        def forward(ctx, x, cos, sin, scale):
            ctx.save_for_backward(cos, sin)
            ctx.scale = scale
            return cpu_ops().pt_rope(x, cos, sin, scale)

        @staticmethod
        def backward(ctx, dout):
            cos, sin = ctx.saved_tensor()
            return cpu_ops().pt_rope_bwd(dout, cos, sin, ctx.scale), None, None

    return {"masked_softmax": MaskedSoftmax, "rms_norm": RmsNorm, "swiglu": Swiglu, "rope": Rope}


def _apply(kind, *args):
    """The kernel's PyLayer, or without autograd (no_grad, or no input needing a gradient: the
    decode step) the forward kernel alone: the same op, without PyLayer.apply's per-call cost
    (~0.1-0.4 ms on a loaded 2-core machine, ~20 calls per decode step of a 4-layer model)."""
    import paddle

    if not paddle.is_grad_enabled() or all(getattr(a, "stop_gradient", True) for a in args):
        return _INFERENCE[kind](*args)
    if "layers" not in _STATE:
        _STATE["layers"] = _layers()
    return _STATE["layers"][kind].apply(*args)


_INFERENCE = {   # the PyLayers' forward kernels (see _layers), for _apply without autograd
    "masked_softmax": lambda scores, mask: cpu_ops().pt_masked_softmax(scores, mask),
    "rms_norm": lambda x, weight, eps: cpu_ops().pt_rms_norm(x, weight, eps)[0],
    "swiglu": lambda gate, up: cpu_ops().pt_swiglu(gate, up),
    "rope": lambda x, cos, sin, scale: cpu_ops().pt_rope(x, cos, sin, scale),
}


def _fits(*tensors):
    """float32 tensors on CPU, and the kernels built."""
    import paddle

    ok = all(t.dtype == paddle.float32 and t.place.is_cpu_place() for t in tensors)
    return ok and cpu_ops() is not None


def rms_norm(x, weight, eps):
    """Kernel path for weight * x / sqrt(mean(x^2, -1) + eps) (float32, CPU), else None."""
    if not _fits(x, weight) or len(weight.shape) != 1 or x.shape[-1] != weight.shape[0]:
        return None
    return _apply("rms_norm", x, weight, float(eps))


def rope_heads_first(x, cos, sin, scale=1.0):
    """Kernel path for scale * (x * cos + rotate_half(x) * sin) transposed to [B, N, S, D], from
    x [B, S, N, D] and cos / sin [B, S, D] (float32, CPU); None otherwise."""
    if (len(x.shape) != 4 or x.shape[-1] % 2 or list(cos.shape) != [x.shape[0], x.shape[1], x.shape[3]]
            or list(sin.shape) != list(cos.shape) or not _fits(x, cos, sin)):
        return None
    return _apply("rope", x, cos, sin, float(scale))


def swiglu(gate, up):
    """Kernel path for silu(gate) * up (same shapes, float32, CPU), else None."""
    if gate.shape != up.shape or not _fits(gate, up):
        return None
    return _apply("swiglu", gate, up)


def masked_softmax(scores, mask):
    """Kernel path for softmax(masked_fill(scores, mask, -1e9), -1): scores [B, H, S, T] float32
    on CPU, mask bool [B or 1, 1, S, T]; None when the kernels are off or the inputs do not fit
    (the caller then runs paddle's ops)."""
    import paddle

    if (mask.dtype != paddle.bool or len(scores.shape) != 4 or len(mask.shape) != 4 or mask.shape[1] != 1
            or mask.shape[2:] != scores.shape[2:] or mask.shape[0] not in (1, scores.shape[0])
            or not _fits(scores)):
        return None
    return _apply("masked_softmax", scores, mask)


def softmax_xent_(logits, targets):
    """Kernel path for the per-row cross-entropy [n] of float32 CPU logits [n, V] and int64
    targets [n] (all labelled), OVERWRITING logits with softmax - onehot (their gradient); None
    when unavailable (logits untouched: use paddle's ops)."""
    if len(logits.shape) != 2 or not _fits(logits):
        return None
    return cpu_ops().pt_softmax_xent(logits, targets.astype("int64"))


def blocked_attention(q, k, v, scale, causal=False, mask=None, starts=None, window=None):
    """Blocked attention (kernels/attention.py): [B, S, N*D], or None when unavailable."""
    from .attention import blocked_attention as run

    return run(q, k, v, scale, causal, mask, starts, window)


def example_starts(runs, S):
    from .attention import example_starts as starts

    return starts(runs, S)


def padding_window(attention_mask):
    from .attention import padding_window as window

    return window(attention_mask)
