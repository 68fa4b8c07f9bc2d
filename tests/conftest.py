"""Shared test fixtures: tiny checkpoints written by the oracle (transformers), the copy task,
and a runner for launched (multi-process) scripts.

Every model here is built in-process: nothing is downloaded.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the checkout under test wins over any installed copy
    sys.path.insert(0, ROOT)
os.environ.setdefault("PADDLETUNE_HOME", os.path.join(ROOT, ".pytest_cache", "paddletune_home"))
# pytest's temp dirs per checkout: concurrent sessions elsewhere (other worktrees) cannot prune ours
# the end-of-training PNG costs ~0.5 s per run: drawn only in the tests that check it (test_curves.py)
os.environ.setdefault("PADDLETUNE_PLOT", "0")
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", os.path.join(ROOT, ".pytest_cache", "tmp"))
os.makedirs(os.environ["PYTEST_DEBUG_TEMPROOT"], exist_ok=True)

import paddletune  # noqa: E402,F401  (sets CPU threads before paddle is imported)

TINY_TOKENIZER = os.path.join(ROOT, "paddletune", "assets", "tiny-tokenizer")


def rel_err(a, b):
    """max|a-b| / max|b| (the issues' comparison)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def hf_checkpoint(path, kind="llama", tokenizer_dir=TINY_TOKENIZER, max_shard_size=None, seed=0,
                  **config):
    """Save a random tiny model with transformers (the oracle) and copy a tokenizer beside it.
    kind: llama | qwen2 | mistral. Returns (path, torch model in eval mode)."""
    import torch
    import transformers

    cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM")}[kind]
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=600, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2)
    base.update(config)
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls[0])(**base)
    model = getattr(transformers, cls[1])(cfg).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer_dir:
        for name in os.listdir(tokenizer_dir):
            shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))
    return str(path), model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny GQA Llama saved by transformers, with the built-in BPE tokenizer."""
    path, _ = hf_checkpoint(tmp_path_factory.mktemp("tiny_llama"))
    return path


def copy_pairs(n=16, length=8, vocab=600, seed=0, low=3):
    """n examples whose target repeats a random source: src = r, tgt = r (token ids).
    Labels are -100 on the source; the first target token is predictable only by memorising."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        r = rng.integers(low, vocab, size=length).tolist()
        ids = [1] + r + r
        labels = [-100] * (1 + length) + r
        out.append({"input_ids": np.array(ids, np.int64), "labels": np.array(labels, np.int64), "id": i})
    return out


def token_accuracy(model, examples):
    """Teacher-forced argmax accuracy on target tokens; 1.0 means greedy decoding reproduces
    every target exactly."""
    import paddle
    from paddletune.data.collate import pad_batch

    was = model.training
    model.eval()
    with paddle.no_grad():
        b = pad_batch(examples, 0)
        out = lm_loss(model, b["input_ids"], b["labels"])
        acc = float((out.label_logits.argmax(-1) == out.label_targets).astype("float32").mean())
    if was:
        model.train()
    return acc


def lm_loss(model, input_ids, labels, keep_logits=False, **inputs):
    """models.loss.causal_lm_loss on numpy or paddle inputs (what the Trainer computes)."""
    import paddle
    from paddletune.models.loss import causal_lm_loss

    batch = dict(inputs, input_ids=input_ids, labels=labels)
    batch = {k: v if isinstance(v, paddle.Tensor) else paddle.to_tensor(v) for k, v in batch.items()}
    return causal_lm_loss(model, batch, keep_logits=keep_logits)


def training_args(output_dir, **kw):
    from paddletune.args import TrainingArguments

    base = dict(output_dir=str(output_dir), per_device_train_batch_size=16, learning_rate=1e-2,
                max_steps=100, logging_steps=10, save_strategy="no", disable_tqdm=True, seed=0,
                warmup_steps=0, lr_scheduler_type="constant", max_grad_norm=1.0)
    base.update(kw)
    return TrainingArguments(**base)


def load_script(relpath):
    """Import a script of this checkout (e.g. "llm/finetune_generation.py") as a module, to call
    its main() in-process."""
    import importlib.util

    name = os.path.splitext(os.path.basename(relpath))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_script(args, cwd=ROOT, env=None, timeout=600):
    """Run a python command line in a subprocess; returns CompletedProcess (text). `env` replaces
    the environment when given (the checkout is always put first on PYTHONPATH)."""
    e = dict(os.environ if env is None else env)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.run([sys.executable] + list(args), cwd=cwd, env=e, capture_output=True,
                          text=True, timeout=timeout)


def launch(script_args, nproc=2, cwd=ROOT, env=None, timeout=600, log_dir=None):
    """python -m paddle.distributed.launch --nproc_per_node N ... on CPU (gloo)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    args = ["-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
            "--master", f"127.0.0.1:{port}"]
    if log_dir:
        args += ["--log_dir", str(log_dir)]
    return run_script(args + list(script_args), cwd=cwd, env=env, timeout=timeout)


def launch_cases(cases, tmp_path, nproc=2, timeout=600):
    """Run test cases on `nproc` launched ranks in ONE launch (tests/launch_cases.py).

    cases: [(name, "module:function", kwargs)] with functions importable from tests/. Returns
    {name: [result of rank 0, result of rank 1, ...]}; a case that raised on any rank fails here
    with its traceback and the workers' log tails."""
    plan_dir = os.path.join(str(tmp_path), "launch")
    os.makedirs(plan_dir, exist_ok=True)
    plan = os.path.join(plan_dir, "plan.json")
    with open(plan, "w") as f:
        json.dump({"cases": [{"name": n, "target": t, "kwargs": k} for n, t, k in cases]}, f)
    logs = os.path.join(plan_dir, "log")
    r = launch([os.path.join(ROOT, "tests", "launch_cases.py"), plan], nproc=nproc,
               timeout=timeout, log_dir=logs)

    def tails():
        return "\n".join(f"--- {n}\n" + open(os.path.join(logs, n)).read()[-3000:]
                         for n in sorted(os.listdir(logs)) if n.startswith("workerlog"))

    assert r.returncode == 0, tails()
    out = {}
    for name, _, _ in cases:
        ranks = [json.load(open(os.path.join(plan_dir, "results", name, f"rank{i}.json")))
                 for i in range(nproc)]
        errors = [x["error"] for x in ranks if isinstance(x, dict) and "error" in x]
        assert not errors, f"case {name} failed:\n{errors[0]}"
        out[name] = ranks
    return out


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return str(path)


@pytest.fixture(autouse=True)
def _reset_paddletune_logger():
    """Scripts run in-process call runtime.setup_logging (own handler, no propagation); undo it so
    later tests' caplog sees paddletune's records."""
    import logging

    yield
    log = logging.getLogger("paddletune")
    for h in list(log.handlers):
        log.removeHandler(h)
    log.propagate = True
