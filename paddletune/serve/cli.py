"""`python llm/server.py` / `python -m paddletune.serve`: arguments, model loading, uvicorn.

    python llm/server.py --model_name_or_path OUT --port 8000
    python llm/server.py --model_name_or_path BASE --lora_path LORA_OUT --api_key SECRET
    python -m paddletune.serve server.json --port 8001        # keys from a JSON file, as llm/*.py

Every argument is checked, and the port is bound, before the model is loaded; bad input is one
`error:` line and exit code 2.
"""
import dataclasses
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Optional

from .. import cli, runtime
from ..args import ArgumentError, F, _convert, read_argv

logger = logging.getLogger("paddletune")


@dataclass
class ServerArgument:
    model_name_or_path: str = F(None, "checkpoint directory (HF format), a built-in name such as paddletune/tiny-qwen2, or an adapter directory (its base comes from adapter_config.json)")
    lora_path: Optional[str] = F(None, "LoRA adapter directory applied on the model (merged into the weights)")
    prefix_path: Optional[str] = F(None, "prefix-tuning directory applied on the model")
    tokenizer_name_or_path: Optional[str] = F(None, "tokenizer directory when it differs from the model's")
    chat_template: Optional[str] = F(None, "chat template for /v1/chat/completions: a built-in name, a file, or 'none'; default: the checkpoint's, else the model family's")
    served_model_name: Optional[str] = F(None, "the name clients pass as 'model' (default: model_name_or_path as given)")
    host: str = F("127.0.0.1", "address to listen on; 0.0.0.0 exposes the server to the network (use --api_key)")
    port: int = F(8000, "TCP port (0: any free port, printed at start)")
    api_key: Optional[str] = F(None, "bearer token every /v1 request must send (Authorization: Bearer KEY)")
    max_batch_size: int = F(8, "requests decoded together at most")
    batch_window_ms: float = F(20.0, "how long the first request of a batch waits for others to join")
    max_length: Optional[int] = F(None, "prompt + answer tokens per request at most (default: the model's max positions, else 2048)")
    max_request_bytes: int = F(1 << 20, "largest request body accepted (413 above)")
    device: str = F("auto", "auto, cpu or gpu", choices=["auto", "cpu", "gpu"])
    dtype: Optional[str] = F(None, "model dtype: float32, float16, bfloat16 or float64 (default: the checkpoint's torch_dtype, as llm/predictor.py); float16 / bfloat16 compute in float32 on CPU", choices=[None, "float32", "float16", "bfloat16", "float64"])
    tensor_parallel_degree: int = F(1, "refused above 1: the server runs on one process")


FIELDS = {f.name: f for f in dataclasses.fields(ServerArgument)}


def parse(argv):
    """argv -> ServerArgument; raises ArgumentError on an unknown key or a bad value."""
    import difflib

    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\nkeys:")
        for name, f in FIELDS.items():
            print(f"  --{name} (default {f.default})\n      {f.metadata['help']}")
        raise SystemExit(0)
    values, sources = read_argv(list(argv), lambda k: False)
    kwargs = {}
    for k, v in values.items():
        if k not in FIELDS:
            near = difflib.get_close_matches(k, list(FIELDS), n=1)
            hint = f"; did you mean '{near[0]}'?" if near else "; see --help"
            raise ArgumentError(f"{sources[k]}: unknown key '{k}'{hint}")
        kwargs[k] = _convert(k, v, FIELDS[k], sources[k])
        choices = FIELDS[k].metadata["choices"]
        if choices and kwargs[k] not in choices:
            raise ArgumentError(f"{sources[k]}: '{k}' must be one of {choices}, got {kwargs[k]!r}")
    return ServerArgument(**kwargs)


def check(a):
    """Checks needing no model. Returns the bound listening socket (the port is ours from now)."""
    from ..parallel import world_from_env

    if not a.model_name_or_path:
        raise ArgumentError("'model_name_or_path' is required (a checkpoint directory or a built-in name)")
    for key in ("max_batch_size", "max_request_bytes"):
        if getattr(a, key) <= 0:
            raise ArgumentError(f"'{key}' must be positive, got {getattr(a, key)}")
    if a.max_length is not None and a.max_length <= 1:
        raise ArgumentError(f"'max_length' must be at least 2 (prompt + answer tokens), got {a.max_length}")
    if a.batch_window_ms < 0:
        raise ArgumentError(f"'batch_window_ms' must be >= 0, got {a.batch_window_ms}")
    if a.tensor_parallel_degree not in (-1, 0, 1) or world_from_env()[0] > 1:
        raise ArgumentError("the server runs on one process: tensor / pipeline parallel serving is not "
                            "built; start it without paddle.distributed.launch and with "
                            "--tensor_parallel_degree 1")
    if not 0 <= a.port <= 65535:
        raise ArgumentError(f"'port' must be in 0..65535, got {a.port}")
    for key in ("lora_path", "prefix_path"):
        if getattr(a, key) and not os.path.isdir(getattr(a, key)):
            raise ArgumentError(f"{key}={getattr(a, key)!r} is not a directory")
    if a.host not in ("127.0.0.1", "localhost", "::1") and not a.api_key:
        logger.warning("listening on %s without --api_key: anyone who can reach this address can "
                       "use the model", a.host)
    sock = socket.socket(socket.AF_INET6 if ":" in a.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((a.host, a.port))
    except OSError as e:
        sock.close()
        raise ArgumentError(f"cannot listen on {a.host}:{a.port} ({e.strerror}); pick another --port") from None
    return sock


def adapter_base(a):
    """--model_name_or_path naming an adapter directory means its base with that adapter
    (loading.adapter_as_model, as predictor.py does)."""
    from ..loading import adapter_as_model

    try:
        adapter_as_model(a)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def load_served_model(a):
    """(model, tokenizer, checkpoint dir, eos ids, pad id, max_length): the one place that loads,
    with what predictor.py uses (loading.load_for_generation)."""
    from ..generation import checkpoint_defaults
    from ..loading import load_for_generation, load_tokenizer
    from ..models import (check_checkpoint, check_tokenizer, declared_dtype, load_config, ops, position_limit,
                          resolve_model_path)

    adapter_base(a)
    path = resolve_model_path(a.model_name_or_path)
    spec, config = load_config(path)
    tok = load_tokenizer(a.tokenizer_name_or_path or path)
    check_tokenizer(config, tok, path)
    check_checkpoint(path, config)
    if a.chat_template is not None:
        tok.set_chat_template(a.chat_template)
    elif tok.template is None and spec.default_chat_template is not None:
        logger.warning("the checkpoint has no chat template: chat requests use %r, this model "
                       "family's default (pass --chat_template to choose)", spec.default_chat_template)
        tok.set_chat_template(spec.default_chat_template)
    limit = position_limit(config)[0] or 2048
    max_length = a.max_length or limit
    if max_length > limit:
        raise ArgumentError(f"max_length={max_length} is over the model's {limit} positions "
                            f"({path}/config.json)")
    dtype = ops.compute_dtype(a.dtype, declared_dtype(config))   # --dtype, else the checkpoint's
    model, tok, _ = load_for_generation(path, tok, a.lora_path, a.prefix_path, dtype=dtype)
    d = checkpoint_defaults(path, tok)
    eos, pad = d["eos_token_id"], d["pad_token_id"]
    return model, tok, path, eos, pad if pad is not None else (eos[0] if eos else 0), max_length


@cli.entry
def main(argv=None):
    runtime.setup_logging(stream=sys.stderr)
    try:
        a = parse(sys.argv[1:] if argv is None else argv)
        name = a.served_model_name or a.model_name_or_path
        sock = check(a)
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        import uvicorn  # noqa: F401
        import starlette  # noqa: F401
    except ImportError:
        print("error: the server needs its extra: pip install 'paddletune[serve]' (starlette, uvicorn)",
              file=sys.stderr)
        return 2
    runtime.set_device(a.device)
    model, tok, path, eos, pad, max_length = load_served_model(a)
    from .app import Server
    from .engine import BatchEngine

    engine = BatchEngine(model, tok, eos, pad, a.max_batch_size, a.batch_window_ms / 1000).start()
    server = Server(engine, tok, name, max_length, eos, a.api_key, a.max_request_bytes)
    host, port = sock.getsockname()[:2]
    print(f"serving {name} ({path}) on http://{host}:{port} (chat page at /, API at /v1)",
          file=sys.stderr, flush=True)
    import uvicorn

    config = uvicorn.Config(server.app(), log_level="warning", timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
