"""paddletune: fine-tuning and pre-training of decoder LLMs with PaddlePaddle.

    from paddletune import load_model, load_tokenizer
    model = load_model("path/to/hf_dir")          # paddle.nn.Layer in eval mode
    tok = load_tokenizer("path/to/hf_dir")
    out = model(paddle.to_tensor([tok.encode("Hello")]))   # out.logits: [batch, seq, vocab]

    paddletune.Trainer(args, model, tokenizer, train_dataset, eval_dataset).train()  # see README
    paddletune.pipeline("text-generation", model="DIR")("prompt")
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
    from .loading import load_model as _load

    return _load(*args, **kwargs)


def load_tokenizer(*args, **kwargs):
    from .loading import load_tokenizer as _load

    return _load(*args, **kwargs)


def pipeline(task, model=None, tokenizer=None, lora=None, prefix=None, batch_size=8,
             merge_lora=True, **kwargs):
    """A text-generation pipeline, as transformers' pipeline():

        pipe = paddletune.pipeline("text-generation", model="DIR", max_new_tokens=32)
        pipe("Count the words: apple river stone")          # [{"generated_text": prompt + answer}]
        pipe([{"role": "user", "content": "hi"}])           # chat messages: the chat template

    task: "text-generation". model: a checkpoint directory, a built-in name
    (paddletune/tiny-llama, ...) or a loaded model; tokenizer: default the model's. lora /
    prefix: adapter directories applied on the model (merge_lora=False keeps LoRA unmerged).
    batch_size prompts are generated together (left padding). Other keywords are
    GenerationConfig fields (max_new_tokens, decode_strategy greedy_search | sampling,
    temperature, top_k, top_p, repetition_penalty, stop, seed, src_length) and become the
    pipeline's defaults; a call may override them: pipe(text, max_new_tokens=8,
    return_full_text=False). Strings are raw text (the tokenizer's BOS rule), message lists go
    through the chat template."""
    from .text_generation import pipeline as _pipeline

    return _pipeline(task, model=model, tokenizer=tokenizer, lora=lora, prefix=prefix,
                     batch_size=batch_size, merge_lora=merge_lora, **kwargs)


def __getattr__(name):
    """paddletune.Trainer and the argument helpers, imported on first use."""
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    if name in ("parse_args", "TrainingArguments", "ModelArgument", "DataArgument"):
        from . import args

        return getattr(args, name)
    raise AttributeError(f"module 'paddletune' has no attribute {name!r}")
