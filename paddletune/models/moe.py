"""Mixture-of-Experts MLP for the Llama family (Mixtral, Qwen2-MoE), single device, dropless.

Shapes: T = B*S tokens, H hidden, E experts, k experts per token, I an expert's width.

    logits = gate(x)                         [T, E]   (router: nn.Linear H -> E, no bias)
    p = softmax(logits in float32)           [T, E]
    w, idx = topk(p, k)                      [T, k]   w /= sum(w) when norm_topk_prob
    y_t = sum_j w_tj * expert_{idx_tj}(x_t)  every routed token is computed (no capacity drop)
    Qwen2-MoE adds a shared expert: y += sigmoid(shared_expert_gate(x)) * shared_expert(x)

Each expert is a SwiGLU MLP of three nn.Linear ([in, out] here), named as the checkpoints that
transformers 5 writes name them (Mixtral: block_sparse_moe.experts.N.w1 = gate, w3 = up, w2 =
down; Qwen2-MoE: mlp.experts.N.gate_proj / up_proj / down_proj), so LoRA, quantization and the
HF layout rule apply to experts unchanged. transformers 5 holds experts fused in memory
(experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]); hf.py reads that layout too.

Load-balancing loss (Switch Transformer eq. 4-6, as transformers' load_balancing_loss_func),
over the router logits of every sparse layer and the real (attention_mask = 1) tokens:
    f_e = (tokens that chose e among their top-k, summed over layers) / (tokens x layers)
    P_e = (sum of p_e over tokens and layers) / (tokens x layers)
    aux = E * sum_e f_e * P_e
Example: E = 2, k = 1, two tokens with p = [.9, .1] and [.2, .8]: f = [.5, .5], P = [.55, .45],
aux = 2 * (.5*.55 + .5*.45) = 1.0. Perfectly balanced routing gives k (sum_e f_e = k); the
built-in tiny models start near 2 with k = 2.
The training loss is token cross-entropy + router_aux_loss_coef * aux when output_router_logits
is true (transformers' rule); models/loss.py adds it.
"""
import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from .layers import swiglu

# config.json keys of a capacity limit: tokens over an expert's capacity would be dropped, which
# is not built (routing here is dropless)
CAPACITY_KEYS = ("capacity_factor", "moe_capacity_factor", "expert_capacity", "train_capacity_factor")


def moe_settings(d, names):
    """config.json dict -> the MoE settings (a dict) of a Mixtral / Qwen2-MoE config, with
    `names` = (block attribute, expert gate/up/down Linear names); None for a dense model."""
    mixtral = "num_local_experts" in d
    E = d.get("num_local_experts") if mixtral else d.get("num_experts")
    if not E:
        return None
    for key in CAPACITY_KEYS:
        if d.get(key) not in (None, 0, 0.0, -1):
            raise ValueError(f"config.json: {key}={d[key]!r} asks for capacity-limited routing "
                             "(tokens over an expert's capacity dropped), which is not built: "
                             f"routing here is dropless; remove {key} or set it to null")
    k = d.get("num_experts_per_tok", 2)
    if not 1 <= k <= E:
        raise ValueError(f"config.json: num_experts_per_tok ({k}) must be between 1 and the number "
                         f"of experts ({E})")
    inter = d["intermediate_size"] if mixtral else d.get("moe_intermediate_size", d["intermediate_size"])
    return dict(
        num_experts=E, top_k=k, block=names[0], linear_names=tuple(names[1:]),
        norm_topk_prob=True if mixtral else bool(d.get("norm_topk_prob", False)),
        expert_size=inter, shared_size=0 if mixtral else int(d.get("shared_expert_intermediate_size") or 0),
        sparse_step=1 if mixtral else int(d.get("decoder_sparse_step", 1) or 1),
        mlp_only_layers=() if mixtral else tuple(d.get("mlp_only_layers") or ()),
        aux_coef=float(d.get("router_aux_loss_coef", 0.001) or 0.0),
        output_router_logits=bool(d.get("output_router_logits", False)),
        jitter=float(d.get("router_jitter_noise", 0.0) or 0.0))


def is_sparse_layer(moe, idx):
    """Qwen2-MoE's rule (Mixtral: every layer): layer idx is sparse unless listed in
    mlp_only_layers, and when (idx + 1) is a multiple of decoder_sparse_step."""
    return moe is not None and idx not in moe["mlp_only_layers"] and (idx + 1) % moe["sparse_step"] == 0


class Expert(nn.Layer):
    """One SwiGLU expert: down(silu(gate(x)) * up(x)); Linear names from the checkpoint layout."""

    def __init__(self, H, I, names, act):
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(H, I, bias_attr=False))
        setattr(self, up, nn.Linear(H, I, bias_attr=False))
        setattr(self, down, nn.Linear(I, H, bias_attr=False))
        self.act = act

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        g, u = gate(x), up(x)
        return down(swiglu(g, u) if self.act is F.silu else self.act(g) * u)


class SparseMoeBlock(nn.Layer):
    """forward(x [B, S, H], ctx) -> [B, S, H]; appends this layer's router logits [T, E] to
    ctx.router_logits (the runner's list) for the load-balancing loss."""

    def __init__(self, cfg, shared_mlp=None):
        super().__init__()
        m = cfg.moe
        H, act = cfg.hidden_size, getattr(F, cfg.hidden_act)
        self.num_experts, self.top_k, self.norm_topk = m["num_experts"], m["top_k"], m["norm_topk_prob"]
        self.jitter = m["jitter"]
        self.gate = nn.Linear(H, self.num_experts, bias_attr=False)     # the router, [H, E]
        self.experts = nn.LayerList([Expert(H, m["expert_size"], m["linear_names"], act)
                                     for _ in range(self.num_experts)])
        if shared_mlp is not None:   # Qwen2-MoE
            self.shared_expert = shared_mlp
            self.shared_expert_gate = nn.Linear(H, 1, bias_attr=False)

    def route(self, x):
        """x [T, H] -> (router logits [T, E], weights [T, k] float32, expert ids [T, k])."""
        logits = self.gate(x)
        probs = F.softmax(logits.astype("float32"), axis=-1)
        w, idx = paddle.topk(probs, self.top_k, axis=-1)
        if self.norm_topk:
            w = w / w.sum(axis=-1, keepdim=True)
        return logits, w, idx

    def forward(self, x, ctx=None):
        B, S, H = x.shape
        if self.training and self.jitter > 0:   # Mixtral's router_jitter_noise (training only)
            x = x * paddle.uniform(x.shape, x.dtype, 1.0 - self.jitter, 1.0 + self.jitter)
        flat = x.reshape([-1, H])
        logits, w, idx = self.route(flat)
        if ctx is not None and ctx.router_logits is not None:
            ctx.router_logits.append(logits)
        out = self.dispatch(flat, w, idx)
        if hasattr(self, "shared_expert"):
            shared = F.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
            out = out + shared.astype(out.dtype)
        return out.reshape([B, S, H])

    def dispatch(self, flat, w, idx):
        """sum_j w_tj * expert_{idx_tj}(x_t) for every token, dropless. The T*k assignments are
        sorted by expert once (one host read of idx), the tokens gathered in that order and split
        into one contiguous run per expert hit (split's backward is a concat: no full-size
        gradient buffer per expert), then weighted and added back to their tokens.
        Example, k = 1, idx = [2, 0, 2]: order [1, 0, 2] -> runs {0: [x1], 2: [x0, x2]}."""
        k = idx.shape[-1]
        chosen = idx.numpy().reshape(-1)   # [T*k] expert of each assignment (token t, slot j)
        order = np.argsort(chosen, kind="stable")
        counts = np.bincount(chosen, minlength=self.num_experts)
        tok = paddle.to_tensor((order // k).astype(np.int64))
        runs = paddle.split(paddle.gather(flat, tok), [int(c) for c in counts if c > 0])
        ys = [self.experts[e](r) for e, r in zip(np.flatnonzero(counts), runs)]
        y = paddle.concat(ys) if len(ys) > 1 else ys[0]
        scale = paddle.gather(w.reshape([-1]), paddle.to_tensor(order.astype(np.int64)))
        # (cast: under AMP the experts' output may be half precision, the sum is x's dtype)
        y = (y * scale.astype(y.dtype).unsqueeze(-1)).astype(flat.dtype)
        return paddle.index_add(paddle.zeros_like(flat), tok, 0, y)


def load_balancing_loss(router_logits, num_experts, top_k, token_mask=None, reduce=None):
    """The auxiliary loss of the module docstring: router_logits a list of [T, E] (one per sparse
    layer), token_mask [B, S] (1 = real token; T = B*S) or None (every token). float32 scalar.
    `reduce`, when given, maps the statistics [counts (E) | prob sums (E) | rows (1)] to their
    sums over the data-parallel ranks (parallel/expert.py), so aux is over the global batch."""
    counts = paddle.zeros([num_experts], "float32")
    prob_sum = paddle.zeros([num_experts], "float32")
    rows = paddle.zeros([], "float32")
    m = None if token_mask is None else token_mask.reshape([-1, 1]).astype("float32")
    for logits in router_logits:
        p = F.softmax(logits.astype("float32"), axis=-1)
        _, sel = paddle.topk(p, top_k, axis=-1)
        chosen = F.one_hot(sel, num_experts).sum(axis=1)     # [T, E], 0/1
        if m is None:
            counts, prob_sum = counts + chosen.sum(0), prob_sum + p.sum(0)
            rows = rows + float(p.shape[0])
        else:
            counts, prob_sum = counts + (chosen * m).sum(0), prob_sum + (p * m).sum(0)
            rows = rows + m.sum()
    if reduce is not None:
        stats = reduce(paddle.concat([counts, prob_sum, rows.reshape([1])]))
        counts, prob_sum, rows = stats[:num_experts], stats[num_experts:2 * num_experts], stats[-1]
    rows = paddle.clip(rows, min=1.0)
    return (counts / rows * (prob_sum / rows)).sum() * float(num_experts)
