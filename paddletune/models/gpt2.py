"""GPT-3-style decoder in the GPT-2 checkpoint layout (HF `model_type: "gpt2"`, GPT2LMHeadModel).

Architecture (pre-LayerNorm decoder, L = n_layer blocks, H = n_embd, N = n_head, D = H / N):
    h = wte(ids) + wpe(positions)                     learned absolute positions 0 .. n_positions-1
    h = h + c_proj(attn(c_attn(ln_1(h))))             c_attn fused [q | k | v], with bias
    h = h + mlp.c_proj(act(c_fc(ln_2(h))))            act: gelu_new (tanh GeLU) by default
    logits = ln_f(h) @ wte^T                          tied head (an lm_head.weight if untied)
Scores are q·k / sqrt(D) (scale_attn_weights), divided by layer_idx + 1 as well with
scale_attn_by_inverse_layer_idx. Dropouts: embd_pdrop after the embedding sum, attn_pdrop on the
probabilities, resid_pdrop on each branch before its residual add.

Weight layout: GPT-2's Conv1D stores its weight [in, out], which is paddle's nn.Linear layout;
ModelSpec.stored_in_out names those tensors so hf.py leaves them as they are (every other Linear
weight is transposed there). Module names equal HF's (transformer.h.N.attn.c_attn, ...).
Written as if for one device: tensor parallelism comes from ModelSpec.tp_plan and tp_parts (c_attn
is cut part by part, by whole heads: each rank holds [q_r | k_r | v_r]).
"""
import copy
import math
from dataclasses import dataclass, field

import paddle
import paddle.nn as nn

from .layers import activation, attention, check_positions, dropout
from .runner import CausalLM
from .spec import ModelSpec, register, require_keys


@dataclass
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int = 3072
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    model_type: str = "gpt2"
    bos_token_id: object = None
    eos_token_id: object = None
    pad_token_id: object = None
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d):
        if d.get("add_cross_attention"):
            raise ValueError("config.json: add_cross_attention (GPT-2 as an encoder-decoder) is not "
                             "built; only the decoder-only GPT-2 layout is")
        require_keys(d, ("n_embd", "n_layer", "n_head", "vocab_size"), "model_type gpt2")
        H, N = d["n_embd"], d["n_head"]
        if H % N:
            raise ValueError(f"config.json: n_embd ({H}) must be a multiple of n_head ({N})")
        cfg = cls(
            vocab_size=d["vocab_size"], n_positions=d.get("n_positions", 1024), n_embd=H,
            n_layer=d["n_layer"], n_head=N, n_inner=d.get("n_inner") or 4 * H,
            activation_function=d.get("activation_function", "gelu_new"),
            resid_pdrop=float(d.get("resid_pdrop", 0.1)), embd_pdrop=float(d.get("embd_pdrop", 0.1)),
            attn_pdrop=float(d.get("attn_pdrop", 0.1)),
            layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-5),
            scale_attn_weights=bool(d.get("scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(d.get("scale_attn_by_inverse_layer_idx", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            initializer_range=d.get("initializer_range", 0.02), model_type="gpt2",
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"), raw=copy.deepcopy(d))
        activation(cfg.activation_function)   # a clear error for an unknown name
        return cfg

    def to_dict(self):
        d = copy.deepcopy(self.raw)
        d["vocab_size"] = self.vocab_size
        d["model_type"] = "gpt2"
        return d

    # names the rest of the library uses for every model type
    hidden_size = property(lambda self: self.n_embd)
    num_hidden_layers = property(lambda self: self.n_layer)
    num_attention_heads = property(lambda self: self.n_head)
    num_key_value_heads = property(lambda self: self.n_head)
    head_dim = property(lambda self: self.n_embd // self.n_head)
    intermediate_size = property(lambda self: self.n_inner)
    max_position_embeddings = property(lambda self: self.n_positions)


class GPT2Attention(nn.Layer):
    def __init__(self, cfg: GPT2Config, idx: int):
        super().__init__()
        H = cfg.n_embd
        self.head_dim, self.layer_idx = cfg.head_dim, idx
        self.c_attn = nn.Linear(H, 3 * H)
        self.c_proj = nn.Linear(H, H)
        scale = 1.0 / math.sqrt(self.head_dim) if cfg.scale_attn_weights else 1.0
        self.scale = scale / (idx + 1) if cfg.scale_attn_by_inverse_layer_idx else scale
        self.dropout, self.resid_pdrop = cfg.attn_pdrop, cfg.resid_pdrop

    def forward(self, x, ctx):
        B, S = x.shape[0], x.shape[1]
        # [q | k | v] of equal widths (a tensor-parallel rank holds its heads of each part)
        q, k, v = paddle.chunk(self.c_attn(x), 3, axis=-1)
        q = ctx.rope.apply_heads_first(q.reshape([B, S, -1, self.head_dim]), self.scale)
        k = ctx.rope.apply_heads_first(k.reshape([B, S, -1, self.head_dim]))
        v = v.reshape([B, S, -1, self.head_dim]).transpose([0, 2, 1, 3])
        if ctx.cache is not None:
            k, v = ctx.cache.update(self.layer_idx, k, v)
        out = attention(q, k, v, ctx.mask, self.dropout, self.training, scale=1.0, flash=ctx.flash,
                        dropout_fn=ctx.dropout,
                        recompute=ctx.recompute == "core_attn")
        return dropout(self.c_proj(out), self.resid_pdrop, self.training)


class GPT2MLP(nn.Layer):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.n_inner)
        self.c_proj = nn.Linear(cfg.n_inner, cfg.n_embd)
        self.act, self.resid_pdrop = activation(cfg.activation_function), cfg.resid_pdrop

    def forward(self, x):
        return dropout(self.c_proj(self.act(self.c_fc(x))), self.resid_pdrop, self.training)


class GPT2Block(nn.Layer):
    def __init__(self, cfg: GPT2Config, idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon)
        self.attn = GPT2Attention(cfg, idx)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon)
        self.mlp = GPT2MLP(cfg)

    def forward(self, h, ctx):
        h = h + self.attn(self.ln_1(h), ctx)
        return h + self.mlp(self.ln_2(h))


class GPT2Model(nn.Layer):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.LayerList([GPT2Block(cfg, i) for i in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon)


class GPT2LMHeadModel(CausalLM):
    """GPT-2 parts for the shared runner (models/runner.py): no rotary tables; positions enter
    through wpe in finish_embedding."""

    def __init__(self, cfg: GPT2Config):
        super().__init__(cfg, SPEC)
        self.transformer = GPT2Model(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias_attr=False)

    def finish_embedding(self, h, ctx):
        check_positions(ctx.positions, self.config.n_positions, "n_positions")
        h = h + self.transformer.wpe(ctx.positions).astype(h.dtype)
        return dropout(h, self.config.embd_pdrop, self.training)


def _prefix_layout(cfg):
    return cfg.n_layer, cfg.n_head, cfg.head_dim


def _tp_parts(cfg):
    """c_attn's output is [q | k | v], N heads each: every part is cut by whole heads."""
    H, N = cfg.n_embd, cfg.n_head
    return {"c_attn": [(H, N), (H, N), (H, N)]}


_TINY = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 512,
         "n_positions": 512, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 128,
         "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
         "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}

SPEC = register(ModelSpec(
    learned_positions=True,
    module_paths={"embeddings": "transformer.wte", "layers": "transformer.h",
                  "norm": "transformer.ln_f", "head": "lm_head"},
    attention_module="attn",
    model_type="gpt2", config_cls=GPT2Config, model_cls=GPT2LMHeadModel,
    architectures=("GPT2LMHeadModel",),
    not_linear=("transformer.wte.weight", "transformer.wpe.weight"),
    stored_in_out=(r".*\.(c_attn|c_proj|c_fc)\.weight",),
    lora_targets=(r".*\.c_attn$", r".*\.c_proj$", r".*\.c_fc$"),
    tp_plan={"c_attn": "column", "c_proj": "row", "c_fc": "column", "wte": "vocab",
             "lm_head": "column"},
    prefix_layout=_prefix_layout, adapter_targets=(r".*\.attn\.c_proj$", r".*\.mlp\.c_proj$"),
    tiny_config=_TINY, default_chat_template="plain", tp_parts=_tp_parts, base_prefix="transformer."))
