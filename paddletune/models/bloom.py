"""BLOOM (HF `model_type: "bloom"`, BloomForCausalLM; bigscience/bloom*, bloomz*).

Architecture (L = n_layer blocks, H = hidden_size, N = n_head heads of D = H / N):
    h = word_embeddings_layernorm(word_embeddings(ids))          embedding LayerNorm
    a = dense(attn(query_key_value(input_layernorm(h))))         fused q|k|v, with bias
    h = r + a                  r = h (or input_layernorm(h) with apply_residual_connection_post_layernorm)
    m = dense_4h_to_h(gelu(dense_h_to_4h(post_attention_layernorm(h))))   tanh GeLU, 4H
    h = r + m                  r = h (or post_attention_layernorm(h))
    logits = ln_f(h) @ word_embeddings^T                         tied head
- Positions: none in the embeddings; ALiBi adds slope_n · j to the score of key j in head n
  (layers.alibi_slopes). HF writes slope_n · (number of real keys before j): under left padding
  that differs from j by a constant per row, which the softmax ignores.
- query_key_value's output is per head interleaved: [B, S, N, 3, D] (head n's q, k, v side by
  side), so whole heads are contiguous column blocks and tensor parallelism cuts the layer as one
  part of N heads; the rank's first global head (`head_offset`, set by parallel/ on the layer)
  picks its ALiBi slopes.
Module names equal HF's (transformer.h.N.self_attention.query_key_value, ...).
Written as if for one device: tensor parallelism comes from ModelSpec.tp_plan and tp_parts.
"""
import copy
import math
from dataclasses import dataclass, field

import paddle.nn as nn

from .layers import HeadSlopes, activation, attention, dropout
from .runner import CausalLM
from .spec import ModelSpec, register


@dataclass
class BloomConfig:
    vocab_size: int = 250880
    hidden_size: int = 64
    n_layer: int = 2
    n_head: int = 8
    layer_norm_epsilon: float = 1e-5
    apply_residual_connection_post_layernorm: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    model_type: str = "bloom"
    bos_token_id: object = None
    eos_token_id: object = None
    pad_token_id: object = None
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d):
        H = d.get("hidden_size") or d.get("n_embed")
        layers, heads = d.get("n_layer") or d.get("num_hidden_layers"), d.get("n_head") or d.get("num_attention_heads")
        if not (H and layers and heads and "vocab_size" in d):
            raise ValueError("config.json (model_type bloom) needs hidden_size (n_embed), n_layer, "
                             "n_head and vocab_size")
        if H % heads:
            raise ValueError(f"config.json: hidden_size ({H}) must be a multiple of n_head ({heads})")
        return cls(
            vocab_size=d["vocab_size"], hidden_size=H, n_layer=layers, n_head=heads,
            layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-5),
            apply_residual_connection_post_layernorm=bool(d.get("apply_residual_connection_post_layernorm", False)),
            hidden_dropout=float(d.get("hidden_dropout", 0.0)),
            attention_dropout=float(d.get("attention_dropout", 0.0)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            initializer_range=d.get("initializer_range", 0.02), model_type="bloom",
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"), raw=copy.deepcopy(d))

    def to_dict(self):
        d = copy.deepcopy(self.raw)
        d["vocab_size"] = self.vocab_size
        d["model_type"] = "bloom"
        return d

    num_hidden_layers = property(lambda self: self.n_layer)
    num_attention_heads = property(lambda self: self.n_head)
    num_key_value_heads = property(lambda self: self.n_head)
    head_dim = property(lambda self: self.hidden_size // self.n_head)
    intermediate_size = property(lambda self: 4 * self.hidden_size)
    max_position_embeddings = property(lambda self: self.raw.get("seq_length", 2048))


class BloomAttention(nn.Layer):
    def __init__(self, cfg: BloomConfig, idx: int, slopes: HeadSlopes):
        super().__init__()
        H = cfg.hidden_size
        self.head_dim, self.layer_idx, self.slopes = cfg.head_dim, idx, slopes
        self.query_key_value = nn.Linear(H, 3 * H)
        self.dense = nn.Linear(H, H)
        self.dropout = cfg.attention_dropout

    def forward(self, x, ctx):
        B, S, D = x.shape[0], x.shape[1], self.head_dim
        qkv = self.query_key_value(x).reshape([B, S, -1, 3, D])   # per head [q, k, v]
        n = qkv.shape[2]
        q = ctx.rope.apply_heads_first(qkv[:, :, :, 0], 1.0 / math.sqrt(D))
        k = ctx.rope.apply_heads_first(qkv[:, :, :, 1])
        v = qkv[:, :, :, 2].transpose([0, 2, 1, 3])
        if ctx.cache is not None:
            k, v = ctx.cache.update(self.layer_idx, k, v)
        slopes = self.slopes.get(getattr(self.query_key_value, "head_offset", 0), n)
        out = attention(q, k, v, ctx.mask, self.dropout, self.training, scale=1.0, flash=ctx.flash,
                        dropout_fn=ctx.dropout, alibi=slopes,
                        recompute=ctx.recompute == "core_attn")
        return self.dense(out)


class BloomMLP(nn.Layer):
    def __init__(self, cfg: BloomConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size)
        self.dense_4h_to_h = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)
        self.act = activation("gelu_new")   # Bloom's GeLU is the tanh approximation

    def forward(self, x):
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class BloomBlock(nn.Layer):
    def __init__(self, cfg: BloomConfig, idx: int, slopes: HeadSlopes):
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, epsilon=eps)
        self.self_attention = BloomAttention(cfg, idx, slopes)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, epsilon=eps)
        self.mlp = BloomMLP(cfg)
        self.post = cfg.apply_residual_connection_post_layernorm
        self.p = cfg.hidden_dropout

    def forward(self, h, ctx):
        ln = self.input_layernorm(h)
        h = (ln if self.post else h) + dropout(self.self_attention(ln, ctx), self.p, self.training)
        ln = self.post_attention_layernorm(h)
        return (ln if self.post else h) + dropout(self.mlp(ln), self.p, self.training)


class BloomModel(nn.Layer):
    def __init__(self, cfg: BloomConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.word_embeddings_layernorm = nn.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_epsilon)
        slopes = HeadSlopes(cfg.n_head)
        self.h = nn.LayerList([BloomBlock(cfg, i, slopes) for i in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_epsilon)


class BloomForCausalLM(CausalLM):
    """Bloom parts for the shared runner (models/runner.py): no rotary tables (ALiBi lives in
    the attention), the embedding LayerNorm in finish_embedding."""

    def __init__(self, cfg: BloomConfig):
        super().__init__(cfg, SPEC)
        self.transformer = BloomModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias_attr=False)

    def finish_embedding(self, h, ctx):
        return self.transformer.word_embeddings_layernorm(h)


def _prefix_layout(cfg):
    return cfg.n_layer, cfg.n_head, cfg.head_dim


def _tp_parts(cfg):
    """query_key_value is one part of N whole heads (each head's q, k, v side by side)."""
    return {"query_key_value": [(3 * cfg.hidden_size, cfg.n_head)]}


_TINY = {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "vocab_size": 512,
         "hidden_size": 64, "n_layer": 2, "n_head": 4, "layer_norm_epsilon": 1e-5,
         "hidden_dropout": 0.0, "attention_dropout": 0.0, "tie_word_embeddings": True,
         "apply_residual_connection_post_layernorm": False}

SPEC = register(ModelSpec(
    module_paths={"embeddings": "transformer.word_embeddings", "layers": "transformer.h",
                  "norm": "transformer.ln_f", "head": "lm_head"},
    attention_module="self_attention",
    model_type="bloom", config_cls=BloomConfig, model_cls=BloomForCausalLM,
    architectures=("BloomForCausalLM",), not_linear=("transformer.word_embeddings.weight",),
    lora_targets=(r".*\.query_key_value$", r".*\.dense$", r".*\.dense_h_to_4h$",
                  r".*\.dense_4h_to_h$"),
    tp_plan={"query_key_value": "column", "dense": "row", "dense_h_to_4h": "column",
             "dense_4h_to_h": "row", "word_embeddings": "vocab", "lm_head": "column"},
    prefix_layout=_prefix_layout,
    adapter_targets=(r".*\.self_attention\.dense$", r".*\.dense_4h_to_h$"),
    tiny_config=_TINY, default_chat_template="plain", tp_parts=_tp_parts, base_prefix="transformer."))
