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
It is an estimate of the weights alone (training adds gradients and optimizer state for the
trainable part), so it refuses only what cannot fit at all.
"""
import logging
import math
import os

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


def check_fits(path, config, topology=None, quant=None):
    """Refuse a model whose weights on this host's ranks exceed min(MemTotal, cgroup limit);
    warn above 80% of it. Called by load_model before any layer is built."""
    from ..runtime import local_process_count

    algo = getattr(quant, "weight_quantize_algo", None) or getattr(quant, "algo", None)
    tp, pp, ep = (getattr(topology, a, 1) or 1 for a in ("tp_degree", "pp_degree", "ep_degree"))
    per_rank, parts = weight_bytes(config, tp, pp, ep, algo)
    ranks, total = local_process_count(), host_memory()
    need = per_rank * ranks
    if not total or need <= 0.8 * total:
        return need
    key, (value, _) = max(parts.items(), key=lambda kv: kv[1][1])
    says = (f"{os.path.join(path, 'config.json')}: the model's weights ({key}={value}) take "
            f"{per_rank} bytes ({per_rank / 2**30:.1f} GiB) per rank (tp {tp}, pp {pp}, ep {ep}, "
            f"{algo or 'float32'}) x {ranks} rank(s) on this host = {need} bytes ({need / 2**30:.1f} GiB)")
    if need > total:
        raise MemoryError(f"{says}, more than this host's {total} bytes ({total / 2**30:.1f} GiB) of memory "
                          "(the smaller of MemTotal and the cgroup limit): use more ranks per "
                          "model (tensor / pipeline parallel), weight-only quantization, or a "
                          "bigger machine; or the config.json is damaged")
    logger.warning("%s, above 80%% of this host's %.1f GiB of memory", says, total / 2**30)
    return need
