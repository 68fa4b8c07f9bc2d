"""Qwen (1) (`model_type: "qwen"`, QWenLMHeadModel, the published HF layout of Qwen/Qwen-7B's
remote code: Qwen-1.8B/7B/14B/72B and their Chat models).

Architecture (L blocks, H hidden, N heads of D = kv_channels, F = intermediate_size / 2):
    h = wte(ids)
    h = h + attn.c_proj(attn(rope(c_attn(ln_1(h)))))     c_attn = [q | k | v] fused, with bias
    h = h + mlp.c_proj(w1(x) * silu(w2(x))),  x = ln_2(h)  w1, w2: [F, H] (silu on w2)
    logits = lm_head(ln_f(h))                            RMSNorms, untied head
- Rotary: rotate-half RoPE over the whole head (rotary_pct 1), base rotary_emb_base. Qwen's
  `use_dynamic_ntk` and `use_logn_attn` change nothing while the keys fit in `seq_length`
  (8192 / 32768); longer sequences are refused here with the reason.
- config.json's intermediate_size is twice the MLP width (Qwen's convention): w1/w2 have F rows.
- Tokenizer: qwen.tiktoken through models/qwen_tokenizer.py (no tiktoken, no network).
Module names equal the published ones (transformer.h.N.attn.c_attn, ...); hf.py transposes Linear
weights. Written as if for one device: tensor parallelism comes from ModelSpec.tp_plan and
tp_parts (c_attn cut part by part, by whole heads).
"""
import copy
import math
from dataclasses import dataclass, field

import paddle
import paddle.nn as nn

from .layers import RMSNorm, RopeTables, attention, rope_cos_sin, rope_inv_freq, swiglu
from .runner import CausalLM
from .spec import ModelSpec, register, require_keys


@dataclass
class QWenConfig:
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    kv_channels: int = 128
    layer_norm_epsilon: float = 1e-6
    rotary_emb_base: float = 10000.0
    seq_length: int = 8192
    long_context: bool = True        # use_dynamic_ntk or use_logn_attn: refused past seq_length
    attn_dropout_prob: float = 0.0
    initializer_range: float = 0.02
    model_type: str = "qwen"
    bos_token_id: object = None
    eos_token_id: object = None
    pad_token_id: object = None
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d):
        require_keys(d, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "vocab_size"), "model_type qwen")
        if float(d.get("rotary_pct", 1.0)) != 1.0:
            raise ValueError(f"config.json: rotary_pct={d['rotary_pct']} (partial rotary) is not "
                             "built; Qwen's checkpoints use 1.0")
        if d.get("no_bias", True) is False:
            raise ValueError("config.json: no_bias=false (bias on every Linear) is not Qwen's layout")
        H, N = d["hidden_size"], d["num_attention_heads"]
        if d["intermediate_size"] % 2:
            raise ValueError(f"config.json: intermediate_size ({d['intermediate_size']}) must be even "
                             "(Qwen's MLP width is intermediate_size / 2)")
        return cls(
            vocab_size=d["vocab_size"], hidden_size=H, intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=N,
            kv_channels=d.get("kv_channels") or H // N,
            layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-6),
            rotary_emb_base=float(d.get("rotary_emb_base", 10000.0)),
            seq_length=d.get("seq_length") or d.get("max_position_embeddings", 8192),
            long_context=bool(d.get("use_dynamic_ntk", True) or d.get("use_logn_attn", True)),
            attn_dropout_prob=float(d.get("attn_dropout_prob", 0.0) or 0.0),
            initializer_range=d.get("initializer_range", 0.02), model_type="qwen",
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"), raw=copy.deepcopy(d))

    def to_dict(self):
        d = copy.deepcopy(self.raw)
        d.update(vocab_size=self.vocab_size, model_type="qwen")
        return d

    num_key_value_heads = property(lambda self: self.num_attention_heads)
    head_dim = property(lambda self: self.kv_channels)
    max_position_embeddings = property(lambda self: self.seq_length)
    rms_norm_eps = property(lambda self: self.layer_norm_epsilon)
    tie_word_embeddings = False


class QWenAttention(nn.Layer):
    def __init__(self, cfg: QWenConfig, idx: int):
        super().__init__()
        H, ND = cfg.hidden_size, cfg.num_attention_heads * cfg.kv_channels
        self.head_dim, self.layer_idx = cfg.kv_channels, idx
        self.c_attn = nn.Linear(H, 3 * ND)
        self.c_proj = nn.Linear(ND, H, bias_attr=False)
        self.dropout = cfg.attn_dropout_prob

    def forward(self, x, ctx):
        B, S, D = x.shape[0], x.shape[1], self.head_dim
        q, k, v = paddle.chunk(self.c_attn(x), 3, axis=-1)   # a TP rank: its heads of each part
        q = ctx.rope.apply_heads_first(q.reshape([B, S, -1, D]), 1.0 / math.sqrt(D))
        k = ctx.rope.apply_heads_first(k.reshape([B, S, -1, D]))
        v = v.reshape([B, S, -1, D]).transpose([0, 2, 1, 3])
        if ctx.cache is not None:
            k, v = ctx.cache.update(self.layer_idx, k, v)
        out = attention(q, k, v, ctx.mask, self.dropout, self.training, scale=1.0, flash=ctx.flash,
                        dropout_fn=ctx.dropout,
                        recompute=ctx.recompute == "core_attn")
        return self.c_proj(out)


class QWenMLP(nn.Layer):
    def __init__(self, cfg: QWenConfig):
        super().__init__()
        H, F = cfg.hidden_size, cfg.intermediate_size // 2
        self.w1 = nn.Linear(H, F, bias_attr=False)
        self.w2 = nn.Linear(H, F, bias_attr=False)
        self.c_proj = nn.Linear(F, H, bias_attr=False)

    def forward(self, x):
        return self.c_proj(swiglu(self.w2(x), self.w1(x)))   # w1(x) * silu(w2(x))


class QWenBlock(nn.Layer):
    def __init__(self, cfg: QWenConfig, idx: int):
        super().__init__()
        self.ln_1 = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.attn = QWenAttention(cfg, idx)
        self.ln_2 = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mlp = QWenMLP(cfg)

    def forward(self, h, ctx):
        h = h + self.attn(self.ln_1(h), ctx)
        return h + self.mlp(self.ln_2(h))


class QWenModel(nn.Layer):
    def __init__(self, cfg: QWenConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.h = nn.LayerList([QWenBlock(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.ln_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class QWenLMHeadModel(CausalLM):
    """Qwen (1) parts for the shared runner (models/runner.py)."""

    def __init__(self, cfg: QWenConfig):
        super().__init__(cfg, SPEC)
        self.transformer = QWenModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias_attr=False)

    def rope_tables(self, position_ids):
        cfg = self.config
        top = int(position_ids.max()) + 1 if position_ids.shape[-1] else 0
        if cfg.long_context and top > cfg.seq_length:
            raise ValueError(f"{top} positions exceed Qwen's seq_length ({cfg.seq_length}), past "
                             "which its dynamic NTK / logn attention would rescale; these are not "
                             "built: shorten the sequence")
        inv = rope_inv_freq(cfg.kv_channels, {"rope_type": "default", "rope_theta": cfg.rotary_emb_base})
        return RopeTables(*rope_cos_sin(position_ids, inv))


def _prefix_layout(cfg):
    return cfg.num_hidden_layers, cfg.num_attention_heads, cfg.kv_channels


def _tp_parts(cfg):
    """c_attn's output is [q | k | v], N heads each: every part is cut by whole heads."""
    N, ND = cfg.num_attention_heads, cfg.num_attention_heads * cfg.kv_channels
    return {"c_attn": [(ND, N), (ND, N), (ND, N)]}


_TINY = {"model_type": "qwen", "architectures": ["QWenLMHeadModel"], "vocab_size": 512,
         "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "kv_channels": 16, "layer_norm_epsilon": 1e-6,
         "rotary_emb_base": 10000, "rotary_pct": 1.0, "seq_length": 1024,
         "max_position_embeddings": 1024, "use_dynamic_ntk": True, "use_logn_attn": True,
         "no_bias": True, "tie_word_embeddings": False}

SPEC = register(ModelSpec(
    module_paths={"embeddings": "transformer.wte", "layers": "transformer.h",
                  "norm": "transformer.ln_f", "head": "lm_head"},
    attention_module="attn",
    model_type="qwen", config_cls=QWenConfig, model_cls=QWenLMHeadModel,
    architectures=("QWenLMHeadModel",), not_linear=("transformer.wte.weight",),
    lora_targets=(r".*\.c_attn$", r".*\.c_proj$", r".*\.w1$", r".*\.w2$"),
    tp_plan={"c_attn": "column", "c_proj": "row", "w1": "column", "w2": "column",
             "wte": "vocab", "lm_head": "column"},
    prefix_layout=_prefix_layout, adapter_targets=(r".*\.attn\.c_proj$", r".*\.mlp\.c_proj$"),
    tiny_config=_TINY, default_chat_template="chatml", tp_parts=_tp_parts,
    tokenizer_classes={"QWenTokenizer": "paddletune.models.qwen_tokenizer:QWenTokenizer"}))
