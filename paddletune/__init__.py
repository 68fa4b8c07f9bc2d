"""paddletune: fine-tuning and pre-training of decoder LLMs with PaddlePaddle.

    from paddletune import load_model, load_tokenizer
    model = load_model("path/to/hf_dir")          # paddle.nn.Layer in eval mode
    tok = load_tokenizer("path/to/hf_dir")
    out = model(paddle.to_tensor([tok.encode("Hello")]))   # out.logits: [batch, seq, vocab]
"""
from . import runtime as _runtime

_cpu_env = _runtime.configure_cpu_env()  # before paddle is imported: threads, MKL code path

try:
    with _runtime.quiet_paddle_banner():
        import paddle  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "paddletune needs PaddlePaddle. Install it with the extra for your machine:\n"
        "  pip install -e .[cpu]    # CPU: paddlepaddle\n"
        "  pip install -e .[gpu]    # NVIDIA GPU: paddlepaddle-gpu"
    ) from e

# strided views off on CPU builds (see runtime.prefer_copies). RUNTIME: the immutable record of
# what the set-up decided, logged by runtime.log_runtime()
RUNTIME = _runtime.prefer_copies(_cpu_env)

__version__ = "0.1.0"


def load_model(*args, **kwargs):
    from .models import load_model as _load

    return _load(*args, **kwargs)


def load_tokenizer(*args, **kwargs):
    from .tokenizer import load_tokenizer as _load

    return _load(*args, **kwargs)


def pipeline(*args, **kwargs):
    from .text_generation import pipeline as _pipeline

    return _pipeline(*args, **kwargs)
