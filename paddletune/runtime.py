"""Process set-up that must happen before (or right after) paddle is imported.

The one place that decides: CPU thread count and MKL code path, the device (cpu / gpu), seeds,
and what the precision switches mean on this device.

Why the thread settings matter (measured on a 2-core AMD EPYC, paddle 3.3.1, 1024^3 fp32 matmul):
paddle's MKL runs 1 thread by default (~40 GFLOP/s); OMP_NUM_THREADS=2 gives ~75; adding
MKL_DEBUG_CPU_TYPE=5 on AMD (MKL otherwise takes its slow non-Intel path) gives ~160-230.
These variables are read when paddle loads MKL, so `configure_cpu_env()` runs from
`paddletune/__init__.py` before paddle is imported. What the set-up decided is an immutable
RuntimeChoices record (`paddletune.RUNTIME`), which `log_runtime` logs once.
"""
import contextlib
import functools
import logging
import os
import random
import sys
from dataclasses import dataclass
from typing import Tuple

logger = logging.getLogger("paddletune")

_WARNED = set()


@dataclass(frozen=True)
class RuntimeChoices:
    """The process set-up's decisions, in the order they were made: ((setting, value), ...),
    e.g. (("OMP_NUM_THREADS", "2"), ("MKL_DEBUG_CPU_TYPE", "5 (AMD host)")). A later decision
    makes a new record (plus), so a record never changes after it is handed out."""
    items: Tuple[Tuple[str, str], ...] = ()

    def plus(self, key, value):
        return RuntimeChoices(self.items + ((key, str(value)),))

    def describe(self):
        return ", ".join(f"{k}={v}" for k, v in self.items)


def physical_cores():
    """Number of physical cores usable by this process (hyper-threads counted once)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    cores = set()
    try:
        phys = core = None
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                elif not line.strip():
                    if core is not None:
                        cores.add((phys, core))
                    phys = core = None
    except OSError:
        pass
    return max(1, min(usable, len(cores) or usable))


def cpu_vendor():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":")[1].strip()
    except OSError:
        pass
    return "unknown"


def local_process_count():
    """Processes sharing this machine under paddle.distributed.launch (1 when run alone)."""
    for key in ("PADDLE_LOCAL_SIZE", "PADDLE_TRAINERS_NUM"):
        if os.environ.get(key, "").isdigit():
            return max(1, int(os.environ[key]))
    return 1


@functools.lru_cache(maxsize=None)   # decided once per process; later calls return that record
def configure_cpu_env():
    """Set OMP/MKL threads = physical cores / local processes (or PADDLETUNE_NUM_THREADS), and
    MKL_DEBUG_CPU_TYPE=5 on AMD, unless the user set them. Must run before paddle is imported;
    no-op (with a note) after. Returns the RuntimeChoices made."""
    choices = RuntimeChoices()
    if "paddle" in sys.modules:
        return choices.plus("note", "paddle was imported before paddletune: thread settings left as they are")
    forced = os.environ.get("PADDLETUNE_NUM_THREADS")
    threads = int(forced) if forced else max(1, physical_cores() // local_process_count())
    launched = "PADDLE_LOCAL_SIZE" in os.environ
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        user = os.environ.get(key)
        # paddle.distributed.launch imports paddle, which exports OMP_NUM_THREADS=1 to every
        # worker; that is paddle's default, not the user's choice (PADDLETUNE_NUM_THREADS is).
        launcher_default = launched and key == "OMP_NUM_THREADS" and user == "1"
        if user is not None and not forced and not launcher_default:
            choices = choices.plus(key, user + " (user)")
        else:
            os.environ[key] = str(threads)
            choices = choices.plus(key, threads)
    if cpu_vendor() == "AuthenticAMD":
        if "MKL_DEBUG_CPU_TYPE" in os.environ:
            choices = choices.plus("MKL_DEBUG_CPU_TYPE", os.environ["MKL_DEBUG_CPU_TYPE"] + " (user)")
        else:
            os.environ["MKL_DEBUG_CPU_TYPE"] = "5"
            choices = choices.plus("MKL_DEBUG_CPU_TYPE", "5 (AMD host)")
    return choices


def reuse_freed_memory():
    """Make glibc malloc reuse freed memory instead of mapping fresh pages for every large tensor.

    paddle's CPU allocator calls malloc/free per tensor; glibc serves large blocks with mmap and
    returns them with munmap, so each new activation, gradient or optimizer temporary of a training
    step page-faults its memory in again. Measured on the 2-core dev machine (paddle 3.3.1): an add
    of two [1024, 688] tensors 1.25 -> 0.29 ms, softmax [4, 8, 256, 256] 10.7 -> 2.5 ms; the
    docs/design.md section 5 full fine-tune step +28% tokens/s (benchmarks/README.md). Freed memory
    stays in the process for reuse, so this is switched on when training starts (Trainer), not at
    import: loading a model (quantizing tensor by tensor) keeps glibc's default and its low peak.
    PADDLETUNE_MALLOC=default opts out. Returns what was chosen (None: left as it is); runs once
    per process (later calls return the first answer)."""
    return _malloc_choice()


@functools.lru_cache(maxsize=None)
def _malloc_choice():
    if os.environ.get("PADDLETUNE_MALLOC") == "default" or not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        ok = libc.mallopt(m_mmap_max, 0) == 1 and libc.mallopt(m_trim_threshold, 1 << 30) == 1
    except (OSError, AttributeError):   # not glibc
        ok = False
    choice = "heap reuse (no mmap)" if ok else "default"
    logger.info("malloc: %s", choice)
    return choice


def prefer_copies(choices):
    """Turn off paddle's strided views (FLAGS_use_stride_kernel) on CPU-only builds, unless the user
    set that flag. With views on, transpose/slice return strided tensors, and the next matmul or
    reshape makes them contiguous with paddle's generic strided-copy kernel: the attention of the
    docs/design.md section 5 Llama (q/k/v transposed to [B, heads, S, D]) took 40 ms fwd + bwd per layer
    instead of 16, the LoRA step 0.50 -> 0.41 s (benchmarks/README.md). Copies cost memory only for
    a moment. Set here, at import (paddle.set_flags, not the environment: child processes such as
    other libraries' benchmark peers keep paddle's default). Returns `choices` (RuntimeChoices)
    plus this decision."""
    import paddle

    if "FLAGS_use_stride_kernel" in os.environ:
        return choices.plus("strided views", os.environ["FLAGS_use_stride_kernel"] + " (user)")
    if not paddle.is_compiled_with_cuda():
        paddle.set_flags({"FLAGS_use_stride_kernel": False})
        return choices.plus("strided views", "off")
    return choices


class _BannerFilter:
    """stderr wrapper dropping paddle's import-time OMP_NUM_THREADS banner (we log the choice)."""

    def __init__(self, stream):
        self.stream = stream
        self.dropped = False

    def write(self, text):
        # print() writes its text and then the line end separately: drop that line end too, so
        # the banner leaves no blank lines behind
        if ("OMP_NUM_THREADS" in text and ("WISELY" in text or "not 1" in text)) or (
                self.dropped and text == "\n"):
            self.dropped = text != "\n"
            return len(text)
        self.dropped = False
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def quiet_paddle_banner():
    import warnings

    old = sys.stderr
    sys.stderr = _BannerFilter(old)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="No ccache found")
            yield
    finally:
        sys.stderr = old


def log_runtime(choices=None):
    """Log the set-up's RuntimeChoices once per process; `choices` defaults to the record
    paddletune made at import (paddletune.RUNTIME)."""
    if choices is None:
        from paddletune import RUNTIME as choices
    if choices.items and "runtime" not in _WARNED:
        _WARNED.add("runtime")
        logger.info("CPU runtime: %s", choices.describe())


def device():
    """'gpu' when paddle was built with CUDA and sees a GPU, else 'cpu'. The only device switch."""
    import paddle

    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        return "gpu"
    return "cpu"


def set_device(requested="auto"):
    """Select the device for this process: `requested` is auto | cpu | gpu (TrainingArguments
    `device`); auto takes a GPU when there is one. Asking for a GPU without one is an error."""
    import paddle

    dev = device() if requested in (None, "auto") else requested
    if dev == "gpu" and device() != "gpu":
        raise ValueError("device=gpu but paddle sees no GPU (CPU build, or no visible device); "
                         "install paddlepaddle-gpu or use device=cpu")
    if dev == "gpu":
        from paddle.distributed import ParallelEnv

        paddle.set_device(f"gpu:{ParallelEnv().dev_id}")
    else:
        paddle.set_device("cpu")
    return dev


def warn_once(key, message, *args):
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message, *args)


def amp_cpu_warning(key):
    """The one warning for fp16 / bf16 on CPU (argument check and Trainer say the same, once)."""
    return f"'{key}: true' has no effect on CPU: paddle has float32 kernels only, running float32"


def amp_settings(fp16=False, bf16=False, fp16_opt_level="O1"):
    """Resolve precision switches for this device: (enabled, dtype, level).

    CPU paddle has float32 kernels only, so fp16/bf16 run in float32 there (warned once).
    On GPU they map to paddle AMP at `fp16_opt_level` (O1 or O2) - untested on our machines."""
    if not (fp16 or bf16):
        return False, "float32", "O0"
    if device() == "cpu":
        msg = amp_cpu_warning("bf16" if bf16 else "fp16")
        warn_once(msg, msg)   # the same key as the argument check's warning: said once
        return False, "float32", "O0"
    return True, ("bfloat16" if bf16 else "float16"), fp16_opt_level


def amp_unsupported(dtype, capability=None):
    """The one-line reason this GPU cannot run `dtype` ("bfloat16" / "float16") under paddle AMP,
    or None. paddle's rules (amp/auto_cast.py): bfloat16 needs compute capability >= 8.0 (and
    CUDA >= 11), float16 >= 7.0; below them paddle.amp.decorate returns the model unchanged
    without a word. capability: (major, minor), default the current GPU's (None on CPU: no check,
    CPU runs float32 with amp_cpu_warning)."""
    if capability is None:
        if device() != "gpu":
            return None
        import paddle

        capability = tuple(paddle.device.cuda.get_device_capability())
    major, minor = capability[0], capability[1]
    if dtype == "bfloat16" and major < 8:
        return (f"'bf16' needs compute capability >= 8.0, this GPU has {major}.{minor}; "
                "use --fp16 true (with loss scaling) instead")
    if dtype == "float16" and major < 7:
        return (f"'fp16' needs compute capability >= 7.0, this GPU has {major}.{minor}; "
                "train in float32 (fp16 and bf16 false)")
    return None


def set_seed(seed):
    import numpy as np
    import paddle

    random.seed(seed)
    np.random.seed(seed % (2**32))
    paddle.seed(seed)


def setup_logging(rank=0, stream=None):
    """Plain logging to stdout (or `stream`: the predictor keeps stdout for its answers);
    ranks other than 0 log warnings only."""
    level = logging.INFO if rank == 0 else logging.WARNING
    if not logger.handlers:
        handler = logging.StreamHandler(stream or sys.stdout)
        prefix = "" if rank == 0 else f"[rank {rank}] "
        handler.setFormatter(logging.Formatter(prefix + "[%(asctime)s] %(levelname)s %(message)s",
                                               "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
    return logger
