"""How much memory a model's weights take on one rank, checked against the host before any layer
is built (a config.json is untrusted input: `num_hidden_layers: 10000000` must be refused in a
second, not after minutes of building layers).

`weight_bytes(config, tp, pp, ep, algo)` is pure: config values -> bytes of this rank's weights.
For a decoder with hidden size H, vocabulary V, L layers, intermediate size I, attention heads n
(head size d = H / n unless head_dim is set) and key/value heads k:
    block      = attention + MLP + 2 norms
    attention  = H*(n*d) [q] + 2*H*(k*d) [k, v] + (n*d)*H [o]
    MLP        = 3*H*I  (gate, up, down; MoE: E experts of 3*H*I_moe plus the router H*E)
    embeddings = V*H, plus V*H for an untied head
Per rank: block matrices / tp, layers / pp (rounded up), experts / ep, embeddings / tp. Block
matrices take 4 bytes per value (float32: the CPU kernels), or int8 1 / 4-bit 0.5 when weight-only
quantized (+ ~1/16 for scales). Worked example, the built-in tiny-llama (H 128, V 600, L 4,
I 352, n 4, k 2, d 32, untied): block = 128*128*2 + 2*128*64 + 3*128*352 + 2*128 = 184,576;
4*184,576 + 2*600*128 + 128 (final norm) = 892,032 values = 3,568,128 bytes, its exact size.

Training adds, per rank (`training_bytes`; T = trainable values on the rank, 4-byte float32):
    gradients   4*T                      (/ sharding degree from stage2 on)
    optimizer   8*T  AdamW's two moments (/ sharding degree from stage1 on)
    master      4*T  float32 master weights, only when the parameters are 16-bit (bf16 / fp16)
    activations 4 * b*s * [ceil(L/pp) * (10*H + 3*I + 2*n*s) / tp + 2*V/tp]
                (per token and layer: ~10 hidden-size tensors kept for backward (norms, q/k/v,
                attention output, residuals), 3 of intermediate size (gate, up, SwiGLU), and the
                n*s attention scores and probabilities; plus the logits and their gradient.
                recompute keeps only each layer's input: ceil(L/pp) * H instead of the bracket.)
with T = all the rank's values for full fine-tuning, and for LoRA of rank r on every linear
    T = ceil(L/pp) * r * (2*(H + n*d) + 2*(H + k*d) + 3*(H + I)) / tp   (A [r, in] + B [out, r] each)
(the targets a user picks are a subset: this bounds them). b = per-device batch, s = max_length.
Worked example, tiny-llama full fine-tuning, b 2, s 128, fp32, one rank: T = 892,032;
gradients 3,568,128 + optimizer 7,136,256 bytes; activations 4*256*[4*(1280 + 1056 + 1024) + 1200]
= 14,991,360; with the weights 29,263,872 bytes. LoRA r 8: T = 4*8*2336 = 74,752.
The activation term is coarse (kernels keep more or less): the check refuses only what cannot
fit at all, and warns above 80%.
"""
import logging
import math
import os
import re

logger = logging.getLogger("paddletune")

BYTES = {None: 4.0, "": 4.0, "int8": 1 + 1 / 16, "weight_only_int8": 1 + 1 / 16}
FOUR_BIT = 0.5 + 1 / 16


def _get(config, *names, default=None):
    raw = getattr(config, "raw", None) or {}
    for n in names:
        v = getattr(config, n, None)
        if v is None and isinstance(raw, dict):
            v = raw.get(n)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return default


def weight_bytes(config, tp=1, pp=1, ep=1, algo=None):
    """(bytes of this rank's weights, {key: (value, bytes it accounts for)}) — see the module doc."""
    H = _get(config, "hidden_size", "n_embd", "d_model", default=1)
    V = _get(config, "padded_vocab_size", "vocab_size", default=1)
    L = _get(config, "num_hidden_layers", "num_layers", "n_layer", default=1)
    I = _get(config, "intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim", default=4 * H)
    n = _get(config, "num_attention_heads", "n_head", default=1)
    k = _get(config, "num_key_value_heads", "multi_query_group_num", default=n)
    d = _get(config, "head_dim", "kv_channels", default=max(1, H // n))
    E = _get(config, "num_local_experts", "num_experts", default=0)
    mlp = 3 * H * (E * _get(config, "moe_intermediate_size", default=I) / ep + E) if E else 3 * H * I
    attention = H * n * d * 2 + 2 * H * k * d
    per_value = BYTES.get(algo, FOUR_BIT)
    layers = math.ceil(L / pp)
    blocks = layers * ((attention + mlp) / tp * per_value + 2 * H * 4)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embed = (1 if tied else 2) * V * H / tp * 4
    parts = {"num_hidden_layers": (L, blocks), "vocab_size": (V, embed)}
    return int(blocks + embed + H * 4), parts


def trainable_values(config, method="full", r=8, tp=1, pp=1):
    """Trainable values on one rank (module docstring): "full" (every value of the rank's weights)
    or "lora" (rank r on every linear of every layer); other PEFT methods count as LoRA (small)."""
    H, V, L, I, n, k, d = _dims(config)
    if method == "full":
        per_rank, _ = weight_bytes(config, tp, pp)
        return per_rank // 4
    return math.ceil(L / pp) * r * (2 * (H + n * d) + 2 * (H + k * d) + 3 * (H + I)) // tp


def training_bytes(config, trainable, batch, seq, tp=1, pp=1, sharding=1, stage=0, dtype="float32",
                   recompute=False):
    """{term: bytes} of training on one rank beyond the weights (module docstring's formulas):
    gradients, optimizer (AdamW moments), master (16-bit parameters only), activations.
    trainable: values trained on this rank (trainable_values)."""
    H, V, L, I, n, k, d = _dims(config)
    half = str(dtype) in ("bfloat16", "float16", "bf16", "fp16")
    per_layer = H if recompute else (10 * H + 3 * I + 2 * n * seq) / tp
    return {"gradients": int(4 * trainable / (sharding if stage >= 2 else 1)),
            "optimizer": int(8 * trainable / (sharding if stage >= 1 else 1)),
            "master": int(4 * trainable) if half else 0,
            "activations": int(4 * batch * seq * (math.ceil(L / pp) * per_layer + 2 * V / tp))}


def footprint(method, model_args, data_args, args):
    """check_fits's `training` dict from a script's arguments (method: peft.selected(...) or
    None for full fine-tuning); None when the run does not train."""
    if not getattr(args, "do_train", True):
        return None
    stages = [int(c) for c in re.findall(r"stage(\d)", getattr(args, "sharding", "") or "")]
    return {"method": method or "full", "r": getattr(model_args, "lora_rank", 8),
            "batch": args.per_device_train_batch_size, "seq": data_args.max_length,
            "recompute": bool(getattr(args, "recompute", False)), "stage": max(stages or [0])}


def _dims(config):
    H = _get(config, "hidden_size", "n_embd", "d_model", default=1)
    n = _get(config, "num_attention_heads", "n_head", default=1)
    return (H, _get(config, "padded_vocab_size", "vocab_size", default=1),
            _get(config, "num_hidden_layers", "num_layers", "n_layer", default=1),
            _get(config, "intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim", default=4 * H), n,
            _get(config, "num_key_value_heads", "multi_query_group_num", default=n),
            _get(config, "head_dim", "kv_channels", default=max(1, H // n)))


def host_memory():
    """min(MemTotal, the cgroup's memory limit) in bytes, or None when neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for p in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(p) as f:
                v = f.read().strip()
            if v.isdigit() and int(v) < 1 << 60:   # "max" / a huge v1 number: no limit
                found.append(int(v))
        except OSError:
            pass
    return min(found) if found else None


def check_fits(path, config, topology=None, quant=None, training=None):
    """Refuse a model whose weights (plus, given `training`, gradients, optimizer state, master
    weights and activations: training_bytes) on this host's ranks exceed min(MemTotal, cgroup
    limit); warn above 80% of it. Called by load_model before any layer is built.
    training: {"method": "full" | "lora" | ..., "r", "batch", "seq", "dtype", "recompute",
    "stage"} (the scripts' arguments) or None (inference: weights only)."""
    from ..runtime import local_process_count

    algo = getattr(quant, "weight_quantize_algo", None) or getattr(quant, "algo", None)
    tp, pp, ep, sh = (getattr(topology, a, 1) or 1 for a in ("tp_degree", "pp_degree", "ep_degree",
                                                             "sharding_degree"))
    per_rank, parts = weight_bytes(config, tp, pp, ep, algo)
    terms = {}
    if training:
        t = training
        T = trainable_values(config, t.get("method", "full"), t.get("r", 8), tp, pp)
        terms = training_bytes(config, T, t.get("batch", 1), t.get("seq", 1), tp, pp, sh, t.get("stage", 0),
                               t.get("dtype", "float32"), t.get("recompute", False))
    ranks, total = local_process_count(), host_memory()
    rank_need = per_rank + sum(terms.values())
    need = rank_need * ranks
    if not total or need <= 0.8 * total:
        return need
    key, (value, _) = max(parts.items(), key=lambda kv: kv[1][1])
    says = (f"{os.path.join(path, 'config.json')}: the model's weights ({key}={value}) take "
            f"{per_rank} bytes ({per_rank / 2**30:.1f} GiB) per rank (tp {tp}, pp {pp}, ep {ep}, "
            f"{algo or 'float32'})")
    if terms:
        says += "; training adds " + ", ".join(f"{k} {v}" for k, v in terms.items() if v) + \
            f" bytes (batch {training.get('batch', 1)} x max_length {training.get('seq', 1)}, " \
            f"{training.get('method', 'full')}): {rank_need} bytes ({rank_need / 2**30:.1f} GiB)"
    says += f" x {ranks} rank(s) on this host = {need} bytes ({need / 2**30:.1f} GiB)"
    if need > total:
        fix = ("a smaller per_device_train_batch_size or max_length, LoRA (lora: true) instead of "
               "full fine-tuning, weight-only quantization, recompute, " if terms else "weight-only quantization, ")
        raise MemoryError(f"{says}, more than this host's {total} bytes ({total / 2**30:.1f} GiB) of memory "
                          f"(the smaller of MemTotal and the cgroup limit): use {fix}more ranks per "
                          "model (tensor / pipeline parallel, sharding), or a bigger machine; or the "
                          "config.json is damaged")
    logger.warning("%s, above 80%% of this host's %.1f GiB of memory", says, total / 2**30)
    return need
