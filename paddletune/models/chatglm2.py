"""ChatGLM2 / ChatGLM3 (THUDM `model_type: "chatglm"`, also GLM-4-9B's layout).

Architecture (pre-norm decoder, `L = num_layers` blocks):
    h = word_embeddings(ids)
    h = h + dense(attn(rope(qkv(rmsnorm(h)))))          query_key_value fused, with bias
    h = h + dense_4h_to_h(silu(a) * b), [a | b] = dense_h_to_4h(rmsnorm(h))
    logits = output_layer(final_layernorm(h))           width padded_vocab_size

- Attention: N = num_attention_heads query heads of D = kv_channels dims; multi-query attention
  with G = multi_query_group_num key/value heads (query head n reads group n // (N/G)); without
  multi_query_attention G = N. query_key_value.weight is [H, (N + 2G)·D] here (paddle [in, out])
  with columns [q (N·D) | k (G·D) | v (G·D)].
- Rotary: only the first R = D/2 dims of every head rotate, in interleaved pairs
  (x[2i], x[2i+1]) by angle pos·θ_i, θ_i = base^(-2i/R), i < R/2; the other D/2 dims pass.
  `rope_ratio` r stretches the context in one of two ways that THUDM's checkpoints share a
  config key for: "base" (ChatGLM3-32k/128k, GLM-4: base = 10000·r) or "position"
  (ChatGLM2-6B-32K: pos / r). `rope_ratio_mode` in config.json says which (r = 1: irrelevant).
- Module names equal THUDM's (transformer.embedding.word_embeddings, transformer.encoder.layers.N
  .self_attention.query_key_value, ..., transformer.encoder.final_layernorm,
  transformer.output_layer), so the HF key map is the identity; hf.py transposes Linear weights.
Written as if for one device: tensor parallelism comes from ModelSpec.tp_plan and tp_parts.
"""
import copy
import os
from dataclasses import dataclass, field

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from .layers import RMSNorm, attention, rope_inv_freq, swiglu
from .runner import CausalLM
from .spec import ModelSpec, register, require_keys

# THUDM config keys whose other values describe architectures this file does not build.
_FIXED = {"rmsnorm": True, "apply_residual_connection_post_layernorm": False,
          "post_layer_norm": True}


@dataclass
class ChatGLM2Config:
    padded_vocab_size: int = 65024
    hidden_size: int = 4096
    ffn_hidden_size: int = 13696
    num_layers: int = 28
    num_attention_heads: int = 32
    kv_channels: int = 128
    multi_query_attention: bool = True
    multi_query_group_num: int = 2
    layernorm_epsilon: float = 1e-5
    add_qkv_bias: bool = True
    add_bias_linear: bool = False
    seq_length: int = 32768
    rope_ratio: float = 1.0
    rope_ratio_mode: str = "base"
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    initializer_range: float = 0.02
    model_type: str = "chatglm"
    bos_token_id: object = None
    eos_token_id: object = None
    pad_token_id: object = None
    raw: dict = field(default_factory=dict)   # config.json as read; written back on save

    @classmethod
    def from_dict(cls, d):
        if "position_encoding_2d" in d or ("padded_vocab_size" not in d and "inner_hidden_size" in d):
            raise ValueError("config.json describes ChatGLM-6B (v1: 2-D positions, GeLU); only "
                             "ChatGLM2/ChatGLM3 checkpoints (padded_vocab_size, "
                             "multi_query_attention) are supported")
        require_keys(d, ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads"),
                     "model_type chatglm", "; is it a ChatGLM2/3 config?")
        for key, want in _FIXED.items():
            if key in d and bool(d[key]) != want:
                raise ValueError(f"config.json: '{key}: {d[key]}' is not supported (ChatGLM2/3 use "
                                 f"{want}); this variant is not built")
        if d.get("quantization_bit"):
            raise ValueError(f"config.json: quantization_bit={d['quantization_bit']} marks THUDM's "
                             "int4/int8 checkpoint; use the float checkpoint (and "
                             "weight_quantize_algo to quantize here)")
        heads = d["num_attention_heads"]
        vocab = d.get("padded_vocab_size") or d.get("vocab_size")
        if vocab is None:
            raise ValueError("config.json (model_type chatglm) has neither 'padded_vocab_size' "
                             "nor 'vocab_size'")
        mqa = bool(d.get("multi_query_attention", False))
        ratio = float(d.get("rope_ratio", 1) or 1)
        mode = d.get("rope_ratio_mode")
        if mode is None and ratio != 1:
            raise ValueError(
                f"config.json: rope_ratio={ratio:g} means base = 10000*rope_ratio in ChatGLM3/GLM-4 "
                "but positions / rope_ratio in ChatGLM2-6B-32K, and the config does not say which. "
                "Add \"rope_ratio_mode\": \"base\" or \"position\" to config.json (its "
                "modeling_chatglm.py shows which: `base = base * self.rope_ratio` -> base); "
                "tools/convert_checkpoint.py sets it from that file")
        cfg = cls(
            padded_vocab_size=vocab, hidden_size=d["hidden_size"],
            ffn_hidden_size=d["ffn_hidden_size"], num_layers=d["num_layers"],
            num_attention_heads=heads, kv_channels=d.get("kv_channels") or d["hidden_size"] // heads,
            multi_query_attention=mqa,
            multi_query_group_num=d.get("multi_query_group_num", 1) if mqa else heads,
            layernorm_epsilon=d.get("layernorm_epsilon", 1e-5),
            add_qkv_bias=bool(d.get("add_qkv_bias", False)),
            add_bias_linear=bool(d.get("add_bias_linear", False)),
            seq_length=d.get("seq_length", 2048), rope_ratio=ratio, rope_ratio_mode=mode or "base",
            attention_dropout=float(d.get("attention_dropout", 0.0) or 0.0),
            hidden_dropout=float(d.get("hidden_dropout", 0.0) or 0.0),
            initializer_range=d.get("initializer_range", 0.02), model_type="chatglm",
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"), raw=copy.deepcopy(d))
        cfg.validate()
        return cfg

    def validate(self):
        N, G, D = self.num_attention_heads, self.multi_query_group_num, self.kv_channels
        if G <= 0 or N % G:
            raise ValueError(f"config.json: num_attention_heads ({N}) must be a multiple of "
                             f"multi_query_group_num ({G})")
        if D % 4:
            raise ValueError(f"config.json: kv_channels ({D}) must be a multiple of 4 (rotary "
                             "pairs over half of each head)")
        if self.rope_ratio_mode not in ("base", "position") or self.rope_ratio <= 0:
            raise ValueError(f"config.json: rope_ratio_mode must be 'base' or 'position' and "
                             f"rope_ratio > 0, got {self.rope_ratio_mode!r}, {self.rope_ratio}")

    def to_dict(self):
        d = copy.deepcopy(self.raw)
        d["padded_vocab_size"] = self.padded_vocab_size
        if "vocab_size" in d:  # THUDM's config class sets vocab_size = padded_vocab_size
            d["vocab_size"] = self.padded_vocab_size
        d["model_type"] = "chatglm"
        if self.rope_ratio != 1:
            d["rope_ratio_mode"] = self.rope_ratio_mode
        return d

    # names the rest of the library uses for every model type
    num_hidden_layers = property(lambda self: self.num_layers)
    vocab_size = property(lambda self: self.padded_vocab_size)
    intermediate_size = property(lambda self: self.ffn_hidden_size)
    num_key_value_heads = property(lambda self: self.multi_query_group_num)
    head_dim = property(lambda self: self.kv_channels)
    max_position_embeddings = property(lambda self: self.seq_length)
    rms_norm_eps = property(lambda self: self.layernorm_epsilon)
    tie_word_embeddings = False

    def rope(self):
        """Rope dict for layers.rope_inv_freq over the R = D/2 rotary dims."""
        if self.rope_ratio_mode == "position" and self.rope_ratio != 1:
            return {"rope_type": "linear", "rope_theta": 10000.0, "factor": self.rope_ratio}
        return {"rope_type": "default", "rope_theta": 10000.0 * self.rope_ratio}


def interleaved_rope_tables(position_ids, inv_freq):
    """position_ids [B, S] -> cos, sin [B, S, 1, R/2] (angle pos·θ_i for pair i)."""
    freqs = position_ids.astype("float32").unsqueeze(-1) * paddle.to_tensor(inv_freq).reshape([1, 1, -1])
    return paddle.cos(freqs).unsqueeze(2), paddle.sin(freqs).unsqueeze(2)


def apply_interleaved_rope(x, cos, sin):
    """x [B, S, heads, D]; rotate pairs (x[2i], x[2i+1]) of the first R = 2·cos.shape[-1] dims:
    (x0, x1) -> (x0·cos - x1·sin, x1·cos + x0·sin); dims R..D-1 pass unchanged."""
    B, S, h, D = x.shape
    half = cos.shape[-1]
    rot, rest = x[..., :2 * half], x[..., 2 * half:]
    pairs = rot.reshape([B, S, h, half, 2])
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    out = paddle.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1).reshape([B, S, h, 2 * half])
    return paddle.concat([out, rest], axis=-1)


class InterleavedRope:
    """The runner's rope object for ChatGLM: cos/sin [B, S, 1, R/2] of one forward."""

    def __init__(self, cos, sin):
        self.cos, self.sin = cos, sin

    def apply_heads_first(self, x, scale=1.0):
        """x [B, S, heads, D] rotated (times `scale`), as [B, heads, S, D]."""
        out = apply_interleaved_rope(x, self.cos, self.sin)
        return (out if scale == 1.0 else out * scale).transpose([0, 2, 1, 3])


class SelfAttention(nn.Layer):
    def __init__(self, cfg: ChatGLM2Config, idx: int):
        super().__init__()
        N, G, D, H = (cfg.num_attention_heads, cfg.multi_query_group_num, cfg.kv_channels,
                      cfg.hidden_size)
        self.head_dim, self.group = D, N // G          # query heads per key/value head
        qkv_bias = None if (cfg.add_qkv_bias or cfg.add_bias_linear) else False
        self.query_key_value = nn.Linear(H, (N + 2 * G) * D, bias_attr=qkv_bias)
        self.dense = nn.Linear(N * D, H, bias_attr=None if cfg.add_bias_linear else False)
        self.dropout = cfg.attention_dropout
        self.layer_idx = idx

    def forward(self, x, ctx):
        B, S = x.shape[0], x.shape[1]
        qkv = self.query_key_value(x)
        q, k, v = paddle.split(qkv, self._parts(qkv.shape[-1]), axis=-1)
        q = ctx.rope.apply_heads_first(q.reshape([B, S, -1, self.head_dim]))   # [B, heads, S, D]
        k = ctx.rope.apply_heads_first(k.reshape([B, S, -1, self.head_dim]))
        v = v.reshape([B, S, -1, self.head_dim]).transpose([0, 2, 1, 3])
        if ctx.cache is not None:
            k, v = ctx.cache.update(self.layer_idx, k, v)
        out = attention(q, k, v, ctx.mask, self.dropout, self.training, flash=ctx.flash,
                        dropout_fn=ctx.dropout, recompute=ctx.recompute == "core_attn")
        return self.dense(out)


    def _parts(self, width):
        """[q, k, v] widths of the projection's output: the layer's `part_widths` when set (tensor
        parallel sets them to the rank's slices), else from the width: (g·G' + 2·G')·D for G'
        key/value heads."""
        parts = getattr(self.query_key_value, "part_widths", None)
        if parts is not None:
            return list(parts)
        kv = width // (self.head_dim * (self.group + 2))
        return [self.group * kv * self.head_dim, kv * self.head_dim, kv * self.head_dim]


class MLP(nn.Layer):
    """dense_4h_to_h(silu(a) * b) with [a | b] = dense_h_to_4h(x), weight [H, 2F]."""

    def __init__(self, cfg: ChatGLM2Config):
        super().__init__()
        b = None if cfg.add_bias_linear else False
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_hidden_size, bias_attr=b)
        self.dense_4h_to_h = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias_attr=b)

    def forward(self, x):
        a, b = paddle.chunk(self.dense_h_to_4h(x), 2, axis=-1)
        return self.dense_4h_to_h(swiglu(a, b))


class GLMBlock(nn.Layer):
    def __init__(self, cfg: ChatGLM2Config, idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)
        self.self_attention = SelfAttention(cfg, idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)
        self.mlp = MLP(cfg)
        self.hidden_dropout = cfg.hidden_dropout

    def forward(self, h, ctx):
        a = self.self_attention(self.input_layernorm(h), ctx)
        h = h + F.dropout(a, self.hidden_dropout, training=self.training)
        m = self.mlp(self.post_attention_layernorm(h))
        return h + F.dropout(m, self.hidden_dropout, training=self.training)


class Embedding(nn.Layer):
    def __init__(self, cfg: ChatGLM2Config):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)


class Encoder(nn.Layer):
    def __init__(self, cfg: ChatGLM2Config):
        super().__init__()
        self.layers = nn.LayerList([GLMBlock(cfg, i) for i in range(cfg.num_layers)])
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)


class ChatGLM2Model(nn.Layer):
    def __init__(self, cfg: ChatGLM2Config):
        super().__init__()
        self.embedding = Embedding(cfg)
        self.encoder = Encoder(cfg)
        self.output_layer = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size, bias_attr=False)


class ChatGLM2ForCausalLM(CausalLM):
    """ChatGLM2/3 parts for the shared runner (models/runner.py); logits are padded_vocab_size
    wide. Positions start at cache.length with a cache (learned prefixes included, as for every
    model here), else 0 (THUDM numbers positions 0..S-1 even under left padding)."""

    def __init__(self, cfg: ChatGLM2Config):
        super().__init__(cfg, SPEC)
        self.transformer = ChatGLM2Model(cfg)

    def get_input_embeddings(self):
        return self.transformer.embedding.word_embeddings

    def decoder_layers(self):
        return self.transformer.encoder.layers

    def final_norm(self):
        return self.transformer.encoder.final_layernorm

    def get_output_embeddings(self):
        return self.transformer.output_layer

    def rope_tables(self, position_ids):
        cfg = self.config
        inv = rope_inv_freq(cfg.kv_channels // 2, cfg.rope(), None, cfg.seq_length)
        return InterleavedRope(*interleaved_rope_tables(position_ids, inv))


def _prefix_layout(cfg):
    """Learned prefixes match the cache: one [G, P, D] key and value per block (THUDM's own
    P-tuning v2 prefixes have this shape too: multi_query_group_num heads of kv_channels)."""
    return cfg.num_layers, cfg.multi_query_group_num, cfg.kv_channels


# Tensor-parallel plan: query_key_value and dense_h_to_4h are "column" layers of fused parts
# (_tp_parts: q|k|v by heads, gate|up halves), each part split separately. With more ranks than
# key/value groups (multi_query_group_num is 2 for ChatGLM2/3-6B) the k and v heads are replicated.
_TP_PLAN = {"query_key_value": "column", "dense": "row", "dense_h_to_4h": "column",
            "dense_4h_to_h": "row", "word_embeddings": "vocab", "output_layer": "column"}


def _tp_parts(cfg):
    """(width, heads) of the output-column parts of each fused Linear, in order."""
    N, G, D = cfg.num_attention_heads, cfg.multi_query_group_num, cfg.kv_channels
    return {"query_key_value": [(N * D, N), (G * D, G), (G * D, G)],
            "dense_h_to_4h": [(cfg.ffn_hidden_size, None), (cfg.ffn_hidden_size, None)]}


def rope_ratio_fixup(src_dir, config, overrides):
    """ChatGLM's rope_ratio scales the rope base (ChatGLM3/GLM-4) or the positions (ChatGLM2-32K);
    paddletune's config.json records which as rope_ratio_mode. Taken from `overrides`, the config,
    or the checkpoint's modeling_chatglm.py, in that order."""
    if float(config.get("rope_ratio", 1) or 1) == 1:
        return {}
    mode = overrides.get("rope_ratio_mode") or config.get("rope_ratio_mode")
    code = os.path.join(src_dir, "modeling_chatglm.py")
    if not mode and os.path.exists(code):
        with open(code, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if "base = base * self.rope_ratio" in text:
            mode = "base"
        elif "/ self.rope_ratio" in text:
            mode = "position"
    if not mode:
        raise ValueError(f"{src_dir}/config.json has rope_ratio={config['rope_ratio']} and no "
                         "modeling_chatglm.py to tell its meaning; pass --rope_ratio_mode base "
                         "(ChatGLM3/GLM-4) or position (ChatGLM2-6B-32K)")
    return {"rope_ratio_mode": mode}


_TINY = {"model_type": "chatglm", "architectures": ["ChatGLMModel"], "num_layers": 2,
         "hidden_size": 64, "ffn_hidden_size": 160, "kv_channels": 16, "num_attention_heads": 4,
         "multi_query_attention": True, "multi_query_group_num": 2, "layernorm_epsilon": 1e-5,
         "add_qkv_bias": True, "add_bias_linear": False, "rmsnorm": True,
         "apply_residual_connection_post_layernorm": False, "post_layer_norm": True,
         "original_rope": True, "seq_length": 1024, "rope_ratio": 1, "hidden_dropout": 0.0,
         "attention_dropout": 0.0, "tie_word_embeddings": False}

SPEC = register(ModelSpec(
    model_type="chatglm", config_cls=ChatGLM2Config, model_cls=ChatGLM2ForCausalLM,
    architectures=("ChatGLMModel",),
    not_linear=("transformer.embedding.word_embeddings.weight",),
    lora_targets=(r".*\.query_key_value$", r".*\.dense$", r".*\.dense_h_to_4h$",
                  r".*\.dense_4h_to_h$"),
    tp_plan=dict(_TP_PLAN), prefix_layout=_prefix_layout,
    adapter_targets=(r".*\.self_attention\.dense$", r".*\.dense_4h_to_h$"), tiny_config=_TINY,
    default_chat_template="chatglm2", lm_head="transformer.output_layer", tp_parts=_tp_parts,
    tokenizer_classes={"ChatGLMTokenizer": "paddletune.models.chatglm_tokenizer:ChatGLMTokenizer"},
    conversion_fixups=rope_ratio_fixup, attention_module="self_attention"))
