"""Parent side of the peer benchmarks: the shared model and data, each peer's interpreter (own
venv where its pins demand it), the runtime environment, and running one peer as a child.

Nothing here imports paddle or torch: the parent must not fix thread settings for its children.

Shared inputs (written once per invocation into a temporary work directory):
- checkpoint/: a HF Llama directory (config.json + model.safetensors, weights N(0, 0.02) in
  HF [out, in] layout, norms 1) that paddletune, PaddleFormers and transformers all load, so all
  peers start from the same weights;
- data-<mode>.safetensors: the batches (see common.py), identical for every peer.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
VENVS = os.environ.get("PADDLETUNE_BENCH_VENVS",
                       os.path.join(os.path.expanduser("~"), ".cache", "paddletune", "bench-venvs"))
sys.path.insert(0, HERE)
from common import LORA_TARGETS, MARK  # noqa: E402

# docs/design.md section 5 configuration; SMOKE is the 1-step test-suite size
DESIGN = {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 8, "seq": 256, "batch": 4}
SMOKE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "seq": 32, "batch": 2}
LORA = {"lora_rank": 8, "lora_alpha": 16, "lora_targets": list(LORA_TARGETS)}
PAD_ID = 0


def describe(cfg):
    return (f"Llama {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, "
            f"intermediate {cfg['intermediate_size']}, vocab {cfg['vocab_size']}, sequence {cfg['seq']}, "
            f"batch {cfg['batch']}")


# ----------------------------------------------------------------------------- shared inputs

def write_checkpoint(path, cfg, seed=0):
    """HF Llama directory with deterministic random weights (numpy, HF layout)."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D = H // cfg["num_attention_heads"]
    KV = cfg["num_key_value_heads"] * D
    conf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": H,
            "intermediate_size": I, "num_hidden_layers": cfg["num_hidden_layers"],
            "num_attention_heads": cfg["num_attention_heads"], "num_key_value_heads": cfg["num_key_value_heads"],
            "max_position_embeddings": max(1024, cfg["seq"]), "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02, "attention_bias": False,
            "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": PAD_ID, "torch_dtype": "float32"}
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "model.norm.weight": (H,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (KV, H),
                       p + "self_attn.v_proj.weight": (KV, H), p + "self_attn.o_proj.weight": (H, H),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,),
                       p + "post_attention_layernorm.weight": (H,)})
    tensors = {n: (np.ones(s, np.float32) if len(s) == 1 else (rng.standard_normal(s) * 0.02).astype(np.float32))
               for n, s in shapes.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    return path


def token_sampler(vocab, rng):
    """Tokens with Zipf-like frequencies (p ~ 1/(rank+10)) over a fixed random permutation of
    ids 3..vocab-1: text-like statistics whose unigram part a model learns within a few steps,
    so "loss after N steps" moves and shows whether the peers train alike."""
    ids = rng.permutation(np.arange(3, vocab))
    p = 1.0 / (np.arange(len(ids)) + 10.0)
    p /= p.sum()
    return lambda size: rng.choice(ids, size=size, p=p).astype(np.int64)


def uniform_batches(cfg, n, seed=0):
    """n batches [batch, seq] of text-like tokens, every token labelled, no padding."""
    rng = np.random.default_rng(seed)
    draw = token_sampler(cfg["vocab_size"], rng)
    out = []
    for _ in range(n):
        ids = draw((cfg["batch"], cfg["seq"]))
        out.append({"input_ids": ids, "labels": ids.copy(), "attention_mask": np.ones_like(ids)})
    return out


def sft_examples(cfg, steps, seed=0):
    """Variable-length SFT examples, enough to fill `steps` batches of packed rows: lengths like
    instruction data (~85% short, lognormal around seq/4; ~15% long, up to seq), the first
    30-70% of each example a prompt (label -100), the rest labelled."""
    rng = np.random.default_rng(seed)
    draw = token_sampler(cfg["vocab_size"], rng)
    seq, out, total = cfg["seq"], [], 0
    while total < steps * cfg["batch"] * seq * 1.05 + seq or len(out) < steps * cfg["batch"]:
        if rng.random() < 0.85:
            n = int(np.clip(rng.lognormal(np.log(seq / 4), 0.6), 8, seq))
        else:
            n = int(rng.integers(seq // 4, seq + 1))
        ids = draw(n)
        labels = ids.copy()
        labels[:int(n * rng.uniform(0.3, 0.7))] = -100
        out.append({"input_ids": ids, "labels": labels})
        total += n
    return out


def pad_examples(examples, batch):
    """Consecutive groups of `batch` examples, right-padded to the group's longest (the default
    of HF's DataCollatorForSeq2Seq and of PaddleFormers without max_seq_len)."""
    out = []
    for i in range(0, len(examples) - batch + 1, batch):
        group = examples[i:i + batch]
        L = max(len(e["input_ids"]) for e in group)
        b = {"input_ids": np.full((batch, L), PAD_ID, np.int64), "labels": np.full((batch, L), -100, np.int64),
             "attention_mask": np.zeros((batch, L), np.int64)}
        for r, e in enumerate(group):
            n = len(e["input_ids"])
            b["input_ids"][r, :n], b["labels"][r, :n], b["attention_mask"][r, :n] = e["input_ids"], e["labels"], 1
        out.append(b)
    return out


def write_data(path, batches, examples=None):
    from safetensors.numpy import save_file

    flat = {f"padded.{i}.{k}": np.ascontiguousarray(v) for i, b in enumerate(batches) for k, v in b.items()}
    if examples is not None:
        lens = [len(e["input_ids"]) for e in examples]
        flat["examples.input_ids"] = np.concatenate([e["input_ids"] for e in examples])
        flat["examples.labels"] = np.concatenate([e["labels"] for e in examples])
        flat["examples.offsets"] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    save_file(flat, path)
    return path


# ----------------------------------------------------------------------------- environment

def load_runtime():
    """paddletune/runtime.py loaded as a plain module (its package __init__ would import paddle)."""
    spec = importlib.util.spec_from_file_location("_pt_runtime", os.path.join(ROOT, "paddletune", "runtime.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


THREAD_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DEBUG_CPU_TYPE")


def peer_env(mode="same", threads=None):
    """Environment for a peer. "same": every peer gets paddletune's tuned settings explicitly
    (threads = physical cores, MKL_DEBUG_CPU_TYPE=5 on AMD); "defaults": the variables are
    removed, so each library uses its own defaults (paddletune then tunes itself)."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_KEYS + ("PYTHONPATH",)}
    if mode == "same":
        rt = load_runtime()
        n = str(threads or rt.physical_cores())
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = n
        if rt.cpu_vendor() == "AuthenticAMD":
            env["MKL_DEBUG_CPU_TYPE"] = "5"
    return env


def env_text(env):
    return " ".join(f"{k}={env[k]}" for k in THREAD_KEYS if k in env) or "(none set)"


def cpu_text():
    rt = load_runtime()
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {rt.physical_cores()} physical cores usable"


# ----------------------------------------------------------------------------- peers and venvs

PEERS = {
    "paddletune": {"script": "paddletune_train.py", "label": "paddletune", "imports": ("paddle",), "venv": None},
    "paddleformers": {"script": "paddleformers_train.py", "label": "PaddleFormers", "imports": ("paddleformers",),
                      "venv": "paddleformers", "packages": ["paddlepaddle=={paddle}", "paddleformers==1.2.0"]},
    "hf": {"script": "hf_peft_train.py", "label": "transformers+peft (torch)", "imports": ("torch", "transformers", "peft"),
           "venv": "hf", "packages": ["torch==2.13.0", "transformers", "peft", "safetensors", "numpy"]},
}


def _has(python, modules):
    code = "import importlib.util,sys; sys.exit(0 if all(importlib.util.find_spec(m) for m in sys.argv[1:]) else 1)"
    return subprocess.run([python, "-c", code, *modules], capture_output=True).returncode == 0


def interpreter(peer):
    """(python, None) for the interpreter that runs `peer`, or (None, why it is skipped)."""
    info = PEERS[peer]
    if info["venv"]:
        vdir = os.path.join(VENVS, info["venv"])
        py = os.path.join(vdir, "bin", "python")
        if os.path.exists(py) and _has(py, info["imports"]):
            return py, None
    if _has(sys.executable, info["imports"]):
        return sys.executable, None
    if not info["venv"]:
        return None, f"{sys.executable} cannot import {', '.join(info['imports'])}"
    failed = os.path.join(VENVS, info["venv"], "SETUP_FAILED.txt")
    if os.path.exists(failed):
        return None, "install failed: " + open(failed).read().strip().replace("\n", " | ")[-600:]
    return None, (f"not installed ({', '.join(info['imports'])} not importable); run "
                  f"`python benchmarks/compare_peers.py --setup` (venv under {VENVS})")


def _paddle_version():
    try:
        from importlib.metadata import version

        return version("paddlepaddle")
    except Exception:
        return "3.3.1"


def _pip(py, args, log):
    cmd = [py, "-m", "pip", "install", *args]
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    return cmd, r.returncode


def _cpu_torch_guard(py, log):
    """Refuse to install a CUDA torch: ask pip what torch==2.13.0 resolves to first."""
    report = os.path.join(os.path.dirname(os.path.dirname(py)), "torch-resolve.json")
    cmd, rc = _pip(py, ["--dry-run", "--no-deps", "--quiet", "--report", report, "torch==2.13.0"], log)
    if rc:
        return f"`{' '.join(cmd)}` failed (exit {rc})"
    with open(report) as f:
        item = json.load(f)["install"][0]
    version, url = item["metadata"]["version"], item["download_info"]["url"]
    if "+cpu" not in version:
        return (f"pip would install torch {version} from {url}, not a CPU build; refusing. Install a CPU "
                f"wheel (pip install torch==2.13.0 with the CPU wheel on a find-links path) and rerun --setup")
    return None


def setup(peers, out=sys.stdout):
    """Create the venvs the chosen peers need (skipping peers the current interpreter runs).
    A failure is recorded in VENV/SETUP_FAILED.txt (command + error tail) and reported."""
    for peer in peers:
        info = PEERS[peer]
        if not info["venv"] or (peer == "hf" and _has(sys.executable, info["imports"])):
            print(f"{peer}: runs in {sys.executable} (nothing to install)", file=out)
            continue
        vdir = os.path.join(VENVS, info["venv"])
        py = os.path.join(vdir, "bin", "python")
        if os.path.exists(py) and _has(py, info["imports"]):
            print(f"{peer}: {vdir} ready", file=out)
            continue
        shutil.rmtree(vdir, ignore_errors=True)
        os.makedirs(VENVS, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", vdir], check=True)
        pkgs = [p.format(paddle=_paddle_version()) for p in info["packages"]]
        t0 = time.time()
        with open(os.path.join(vdir, "setup.log"), "w") as log:
            error = _cpu_torch_guard(py, log) if peer == "hf" else None
            if error is None:
                cmd, rc = _pip(py, pkgs, log)
                error = f"`{' '.join(cmd)}` exited {rc}" if rc else None
        if error is None and not _has(py, info["imports"]):
            error = f"installed, but {py} cannot import {', '.join(info['imports'])}"
        if error:
            tail = open(os.path.join(vdir, "setup.log")).read().strip().splitlines()[-15:]
            with open(os.path.join(vdir, "SETUP_FAILED.txt"), "w") as f:
                f.write(error + "\n" + "\n".join(tail) + "\n")
            print(f"{peer}: SETUP FAILED: {error}\n  " + "\n  ".join(tail), file=out)
        else:
            print(f"{peer}: installed {' '.join(pkgs)} into {vdir} ({time.time() - t0:.0f} s)", file=out)


# ----------------------------------------------------------------------------- one child run

def run_peer(peer, spec, env, workdir, timeout=3600):
    """Run one peer once; returns its result dict with status ok | pending | skipped | failed."""
    py, why = interpreter(peer)
    if py is None:
        return {"status": "skipped", "reason": why}
    path = os.path.join(workdir, f"spec-{peer}-{spec['mode']}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    child_env = dict(env)
    if peer == "paddletune":
        child_env["PYTHONPATH"] = ROOT
    try:
        r = subprocess.run([py, os.path.join(HERE, PEERS[peer]["script"]), path], env=child_env, cwd=workdir,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"timed out after {timeout} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(MARK)]
    if r.returncode != 0 or not lines:
        err = (r.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return {"status": "failed", "reason": f"exit {r.returncode}: {err}", "stderr": r.stderr[-4000:]}
    res = json.loads(lines[-1][len(MARK):])
    res["python"] = py
    return res
