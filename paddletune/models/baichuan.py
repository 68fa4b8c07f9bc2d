"""Baichuan / Baichuan2 (`model_type: "baichuan"`, BaichuanForCausalLM, the published HF layout
of baichuan-inc's remote code): 7B with rotary positions, 13B with ALiBi.

Architecture (Llama's, with three differences; L blocks, H hidden, N heads of D = H / N):
    h = embed_tokens(ids)
    h = h + o_proj(attn(W_pack(input_layernorm(h))))      W_pack = [q | k | v] fused, no bias
    h = h + down_proj(silu(gate_proj(x)) * up_proj(x)),  x = post_attention_layernorm(h)
    logits = lm_head(norm(h))
- Positions: `position_embedding` "rope" (7B: rotate-half RoPE, base 10000, as Llama) or "alibi"
  (13B: score(i, j) += slope_n · j, layers.alibi_slopes; Baichuan's _get_interleave gives the
  same slopes). Checkpoints do not say which; config.json's `position_embedding` does when
  present (written on export), else a config with max_position_embeddings is the 7B (rope) and
  one without it the 13B (alibi).
- NormHead (Baichuan2): logits = h · (W_v / |W_v|) for every vocabulary row v of the HF weight
  [V, H]: the rows are normalised in every forward (Baichuan2 trains through the normalisation;
  its eval mode normalises the stored weight once, the same values). `norm_head` in config.json,
  default true for Baichuan2's 125696-token vocabulary; Baichuan (1) has a plain head.
- No q/k/v bias, no tied head. Baichuan2's z_loss_weight (a training-loss term) is not applied.
Module names equal the published ones (model.layers.N.self_attn.W_pack, ...); hf.py transposes
Linear weights. Written as if for one device: tensor parallelism comes from ModelSpec.tp_plan and
tp_parts (W_pack cut part by part by whole heads; the ALiBi slopes follow the rank's heads through
`head_offset`, which parallel/ sets on the layer).
"""
import copy
import math
from dataclasses import dataclass, field

import paddle
import paddle.nn as nn

from .layers import HeadSlopes, NormHead, RMSNorm, RopeTables, attention, rope_cos_sin, rope_inv_freq, swiglu
from .runner import CausalLM
from .spec import ModelSpec, register, require_keys

BAICHUAN2_VOCAB = 125696


@dataclass
class BaichuanConfig:
    vocab_size: int = BAICHUAN2_VOCAB
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    position_embedding: str = "rope"   # "rope" (7B) or "alibi" (13B)
    norm_head: bool = True
    initializer_range: float = 0.02
    model_type: str = "baichuan"
    bos_token_id: object = None
    eos_token_id: object = None
    pad_token_id: object = None
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d):
        require_keys(d, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "vocab_size"), "model_type baichuan")
        H, N = d["hidden_size"], d["num_attention_heads"]
        if H % N:
            raise ValueError(f"config.json: hidden_size ({H}) must be a multiple of "
                             f"num_attention_heads ({N})")
        pos = d.get("position_embedding") or ("rope" if "max_position_embeddings" in d else "alibi")
        if pos.lower() not in ("rope", "alibi"):
            raise ValueError(f"config.json: position_embedding {pos!r} is not 'rope' or 'alibi'")
        if d.get("tie_word_embeddings"):
            raise ValueError("config.json: tie_word_embeddings is true; Baichuan's head is never tied")
        return cls(
            vocab_size=d["vocab_size"], hidden_size=H, intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=N,
            max_position_embeddings=d.get("max_position_embeddings") or d.get("model_max_length", 4096),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), position_embedding=pos.lower(),
            norm_head=bool(d.get("norm_head", d["vocab_size"] == BAICHUAN2_VOCAB)),
            initializer_range=d.get("initializer_range", 0.02), model_type="baichuan",
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"), raw=copy.deepcopy(d))

    def to_dict(self):
        d = copy.deepcopy(self.raw)
        d.update(vocab_size=self.vocab_size, model_type="baichuan",
                 position_embedding=self.position_embedding, norm_head=self.norm_head)
        return d

    num_key_value_heads = property(lambda self: self.num_attention_heads)
    head_dim = property(lambda self: self.hidden_size // self.num_attention_heads)
    tie_word_embeddings = False


class BaichuanAttention(nn.Layer):
    def __init__(self, cfg: BaichuanConfig, idx: int, slopes):
        super().__init__()
        H = cfg.hidden_size
        self.head_dim, self.layer_idx, self.slopes = cfg.head_dim, idx, slopes
        self.W_pack = nn.Linear(H, 3 * H, bias_attr=False)
        self.o_proj = nn.Linear(H, H, bias_attr=False)

    def forward(self, x, ctx):
        B, S, D = x.shape[0], x.shape[1], self.head_dim
        q, k, v = paddle.chunk(self.W_pack(x), 3, axis=-1)   # a TP rank: its heads of each part
        q = ctx.rope.apply_heads_first(q.reshape([B, S, -1, D]), 1.0 / math.sqrt(D))
        k = ctx.rope.apply_heads_first(k.reshape([B, S, -1, D]))
        v = v.reshape([B, S, -1, D]).transpose([0, 2, 1, 3])
        if ctx.cache is not None:
            k, v = ctx.cache.update(self.layer_idx, k, v)
        alibi = None
        if self.slopes is not None:
            alibi = self.slopes.get(getattr(self.W_pack, "head_offset", 0), q.shape[1])
        out = attention(q, k, v, ctx.mask, 0.0, self.training, scale=1.0, flash=ctx.flash,
                        dropout_fn=ctx.dropout, alibi=alibi,
                        recompute=ctx.recompute == "core_attn")
        return self.o_proj(out)


class BaichuanMLP(nn.Layer):
    def __init__(self, cfg: BaichuanConfig):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias_attr=False)
        self.up_proj = nn.Linear(H, I, bias_attr=False)
        self.down_proj = nn.Linear(I, H, bias_attr=False)

    def forward(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class BaichuanLayer(nn.Layer):
    def __init__(self, cfg: BaichuanConfig, idx: int, slopes):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = BaichuanAttention(cfg, idx, slopes)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = BaichuanMLP(cfg)

    def forward(self, h, ctx):
        h = h + self.self_attn(self.input_layernorm(h), ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class BaichuanModel(nn.Layer):
    def __init__(self, cfg: BaichuanConfig):
        super().__init__()
        slopes = HeadSlopes(cfg.num_attention_heads) if cfg.position_embedding == "alibi" else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.LayerList([BaichuanLayer(cfg, i, slopes) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class BaichuanForCausalLM(CausalLM):
    """Baichuan parts for the shared runner (models/runner.py)."""

    def __init__(self, cfg: BaichuanConfig):
        super().__init__(cfg, SPEC)
        self.model = BaichuanModel(cfg)
        head = NormHead if cfg.norm_head else nn.Linear
        self.lm_head = head(cfg.hidden_size, cfg.vocab_size, bias_attr=False)

    def rope_tables(self, position_ids):
        if self.config.position_embedding == "alibi":
            return super().rope_tables(position_ids)
        inv = rope_inv_freq(self.config.head_dim, {"rope_type": "default", "rope_theta": 10000.0})
        return RopeTables(*rope_cos_sin(position_ids, inv))


def _prefix_layout(cfg):
    return cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim


def _tp_parts(cfg):
    """W_pack's output is [q | k | v], N heads each: every part is cut by whole heads."""
    H, N = cfg.hidden_size, cfg.num_attention_heads
    return {"W_pack": [(H, N), (H, N), (H, N)]}


_TINY = {"model_type": "baichuan", "architectures": ["BaichuanForCausalLM"], "vocab_size": 512,
         "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 512, "model_max_length": 512,
         "rms_norm_eps": 1e-6, "position_embedding": "rope", "norm_head": True,
         "tie_word_embeddings": False, "hidden_act": "silu"}

SPEC = register(ModelSpec(
    module_paths={"embeddings": "model.embed_tokens", "layers": "model.layers",
                  "norm": "model.norm", "head": "lm_head"},
    attention_module="self_attn",
    model_type="baichuan", config_cls=BaichuanConfig, model_cls=BaichuanForCausalLM,
    architectures=("BaichuanForCausalLM",), not_linear=("model.embed_tokens.weight",),
    lora_targets=tuple(rf".*\.{n}$" for n in ("W_pack", "o_proj", "gate_proj", "up_proj", "down_proj")),
    tp_plan={"W_pack": "column", "o_proj": "row", "gate_proj": "column", "up_proj": "column",
             "down_proj": "row", "embed_tokens": "vocab", "lm_head": "column"},
    prefix_layout=_prefix_layout, adapter_targets=(r".*\.o_proj$", r".*\.down_proj$"),
    tiny_config=_TINY, default_chat_template="baichuan2", tp_parts=_tp_parts))
