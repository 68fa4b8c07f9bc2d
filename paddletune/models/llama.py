"""Llama-family decoder: Llama 1/2/3, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), Mistral-style (no
sliding window), and the Mixture-of-Experts members Mixtral and Qwen2-MoE (models/moe.py: `moe`
settings from config.json; sparse blocks where moe.is_sparse_layer says, dense LlamaMLP elsewhere).

One file, differences are config flags: `qkv_bias` (Qwen2), `qk_norm` (Qwen3: every query and key
head is RMS-normalised over its head_dim by q_norm / k_norm [D] before the rotation),
`attention_bias` (bias on q,k,v,o),
`mlp_bias`, `tie_word_embeddings`, explicit `head_dim`, rope scaling (default, linear,
dynamic NTK, llama3), GQA/MQA through `num_key_value_heads`.

Module names equal the Hugging Face ones (model.layers.N.self_attn.q_proj, ...), so the HF key map
is the identity; hf.py only transposes Linear weights ([in, out] here, [out, in] in HF).
Written as if for one device: tensor parallelism comes from ModelSpec.tp_plan (parallel/).
"""
import copy
import math
from dataclasses import dataclass, field
from typing import Optional

import paddle.nn as nn
import paddle.nn.functional as F

from .layers import RMSNorm, RopeTables, attention, rope_cos_sin, rope_inv_freq, swiglu
from .moe import SparseMoeBlock, is_sparse_layer, moe_settings
from .runner import CausalLM
from .spec import ModelSpec, register


def normalize_rope(d):
    """Rope settings from config.json in either transformers 5.x form (`rope_parameters`) or 4.x
    form (`rope_theta` + `rope_scaling` with "type" or "rope_type") -> one dict."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        rope = dict(params)
    else:
        rope = dict(d.get("rope_scaling") or {})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", "default")
    if rope["rope_type"] == "su":
        rope["rope_type"] = "longrope"
    return rope


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    qkv_bias: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    model_type: str = "llama"
    bos_token_id: object = None
    eos_token_id: object = None
    pad_token_id: object = None
    raw: dict = field(default_factory=dict)   # config.json as read; written back on save
    moe: Optional[dict] = None   # MoE settings (moe.moe_settings); None = dense

    @classmethod
    def from_dict(cls, d):
        mt = d.get("model_type", "llama")
        if d.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window is true; sliding-window attention is "
                             "not built (set it to false to attend over the whole sequence)")
        if mt == "mixtral" and d.get("sliding_window"):
            raise ValueError(f"config.json: sliding_window={d['sliding_window']}: transformers' Mixtral "
                             "then attends within that window only, which is not built here; set "
                             "it to null (Mixtral-8x7B / 8x22B have null) to attend over the whole "
                             "sequence")
        heads = d["num_attention_heads"]
        attn_bias = bool(d.get("attention_bias", False))
        cfg = cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope=normalize_rope(d),
            qkv_bias=attn_bias or mt == "qwen2" or (mt == "qwen2_moe" and d.get("qkv_bias", True)),
            qk_norm=mt == "qwen3", attention_bias=attn_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            hidden_act=d.get("hidden_act", "silu"),
            attention_dropout=float(d.get("attention_dropout", 0.0) or 0.0),
            initializer_range=d.get("initializer_range", 0.02), model_type=mt,
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"), raw=copy.deepcopy(d),
            moe=moe_settings(d, _MOE_NAMES[mt]) if mt in _MOE_NAMES else None)
        cfg.validate()
        return cfg

    def validate(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.rope["rope_type"] not in ("default", "linear", "dynamic", "llama3"):
            raise ValueError(f"rope_type '{self.rope['rope_type']}' is not supported "
                             "(default, linear, dynamic, llama3)")

    def to_dict(self):
        d = copy.deepcopy(self.raw)
        d["vocab_size"] = self.vocab_size
        d.setdefault("model_type", self.model_type)
        return d


class LlamaAttention(nn.Layer):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        H, N, K, D = cfg.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        qkv_bias = None if cfg.qkv_bias else False
        self.q_proj = nn.Linear(H, N * D, bias_attr=qkv_bias)
        self.k_proj = nn.Linear(H, K * D, bias_attr=qkv_bias)
        self.v_proj = nn.Linear(H, K * D, bias_attr=qkv_bias)
        self.o_proj = nn.Linear(N * D, H, bias_attr=None if cfg.attention_bias else False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.dropout = cfg.attention_dropout
        self.layer_idx = 0

    def forward(self, x, ctx):
        B, S = x.shape[0], x.shape[1]
        # heads are read from the projection width so a tensor-parallel slice works unchanged
        q = self.q_proj(x).reshape([B, S, -1, self.head_dim])
        k = self.k_proj(x).reshape([B, S, -1, self.head_dim])
        v = self.v_proj(x).reshape([B, S, -1, self.head_dim])
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # [B, heads, S, D]; q carries the score scale
        q = ctx.rope.apply_heads_first(q, 1.0 / math.sqrt(self.head_dim))
        k = ctx.rope.apply_heads_first(k)
        v = v.transpose([0, 2, 1, 3])
        if ctx.cache is not None:
            k, v = ctx.cache.update(self.layer_idx, k, v)
        out = attention(q, k, v, ctx.mask, self.dropout, self.training, scale=1.0,
                        flash=ctx.flash, dropout_fn=ctx.dropout, recompute=ctx.recompute == "core_attn")
        return self.o_proj(out)


class LlamaMLP(nn.Layer):
    def __init__(self, cfg: LlamaConfig, intermediate_size=None):
        super().__init__()
        b = None if cfg.mlp_bias else False
        H, I = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias_attr=b)
        self.up_proj = nn.Linear(H, I, bias_attr=b)
        self.down_proj = nn.Linear(I, H, bias_attr=b)
        self.act = getattr(F, cfg.hidden_act)

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(swiglu(gate, up) if self.act is F.silu else self.act(gate) * up)


class LlamaDecoderLayer(nn.Layer):
    def __init__(self, cfg: LlamaConfig, idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.self_attn.layer_idx = idx
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sparse = is_sparse_layer(cfg.moe, idx)
        # the MLP's attribute name is the checkpoint's (Mixtral: block_sparse_moe)
        self.ffn = cfg.moe["block"] if self.sparse else "mlp"
        if self.sparse:
            shared = LlamaMLP(cfg, cfg.moe["shared_size"]) if cfg.moe["shared_size"] else None
            setattr(self, self.ffn, SparseMoeBlock(cfg, shared))
        else:
            self.mlp = LlamaMLP(cfg)

    def forward(self, h, ctx):
        h = h + self.self_attn(self.input_layernorm(h), ctx)
        x = self.post_attention_layernorm(h)
        return h + (getattr(self, self.ffn)(x, ctx) if self.sparse else self.mlp(x))


class LlamaModel(nn.Layer):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.LayerList([LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """Llama-family parts for the shared runner (models/runner.py: forward, cache, prefix, ...)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg, SPECS[cfg.model_type])
        self.model = LlamaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias_attr=False)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def decoder_layers(self):
        return self.model.layers

    def final_norm(self):
        return self.model.norm

    def get_output_embeddings(self):
        return None if self.config.tie_word_embeddings else self.lm_head

    def rope_tables(self, position_ids):
        cfg = self.config
        seq_len = int(position_ids.max()) + 1 if cfg.rope["rope_type"] == "dynamic" else None
        inv = rope_inv_freq(cfg.head_dim, cfg.rope, seq_len, cfg.max_position_embeddings)
        return RopeTables(*rope_cos_sin(position_ids, inv))


def _prefix_layout(cfg):
    return cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim


_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# q_norm / k_norm (Qwen3) are [D] weights shared by every head: "partial", their gradient from a
# rank's own heads is summed over the ranks
_TP_PLAN = {"q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row",
            "gate_proj": "column", "up_proj": "column", "down_proj": "row",
            "embed_tokens": "vocab", "lm_head": "column", "q_norm": "partial", "k_norm": "partial"}


def _tp_parts(cfg):
    """(width, heads) of the attention projections: TP splits them by whole heads (and replicates
    key/value heads when they are fewer than the ranks)."""
    N, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return {"q_proj": [(N * D, N)], "k_proj": [(K * D, K)], "v_proj": [(K * D, K)]}


def _tiny(model_type, **kw):
    base = {"model_type": model_type, "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
            "bos_token_id": 1, "eos_token_id": 2}
    base.update(kw)
    return base


SPECS = {}
for _mt, _arch, _tiny_cfg, _tmpl in (
        ("llama", "LlamaForCausalLM", _tiny("llama"), "llama2"),
        ("qwen2", "Qwen2ForCausalLM", _tiny("qwen2", tie_word_embeddings=True), "chatml"),
        ("qwen3", "Qwen3ForCausalLM", _tiny("qwen3", tie_word_embeddings=True, head_dim=32), "chatml"),
        ("mistral", "MistralForCausalLM", _tiny("mistral", sliding_window=None), "llama2")):
    SPECS[_mt] = register(ModelSpec(
        model_type=_mt, config_cls=LlamaConfig, model_cls=LlamaForCausalLM, architectures=(_arch,),
        not_linear=("model.embed_tokens.weight",),
        lora_targets=tuple(rf".*\.{n}$" for n in _LINEARS), tp_plan=dict(_TP_PLAN),
        prefix_layout=_prefix_layout, adapter_targets=(r".*\.o_proj$", r".*\.down_proj$"),
        tiny_config=_tiny_cfg, default_chat_template=_tmpl, tp_parts=_tp_parts,
        attention_module="self_attn"))

# Mixture-of-Experts members (models/moe.py). Module names = the per-expert layout transformers 5
# writes (hf.py also reads its fused in-memory layout, ModelSpec.fused_experts). Tensor parallel:
# attention as Llama's; every expert's gate/up (Mixtral w1/w3, Qwen2-MoE gate_proj/up_proj, the
# shared expert's too) column, down (w2 / down_proj) row; the router `gate` [H, E] and
# `shared_expert_gate` [H, 1] are not in the plan: whole on every rank, fed the replicated hidden
# state, so every rank routes (and computes the aux loss) identically.
_MOE_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
              "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _moe_tp_plan(model_type):
    """Llama's plan plus the experts' names (Mixtral: w1 / w3 column, w2 row); Qwen2-MoE's
    experts, shared expert and dense layers use gate_proj / up_proj / down_proj as Llama's MLP."""
    plan = {k: v for k, v in _TP_PLAN.items() if k not in ("q_norm", "k_norm")}
    _, gate, up, down = _MOE_NAMES[model_type]
    plan.update({gate: "column", up: "column", down: "row"})
    return plan


for _mt, _arch, _tiny_cfg, _tmpl, _mlp in (
        ("mixtral", "MixtralForCausalLM",
         _tiny("mixtral", intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=None, router_aux_loss_coef=0.02, output_router_logits=True),
         "llama2", ("w1", "w2", "w3")),
        ("qwen2_moe", "Qwen2MoeForCausalLM",
         _tiny("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
               shared_expert_intermediate_size=128, norm_topk_prob=False, decoder_sparse_step=1,
               mlp_only_layers=[], qkv_bias=True, router_aux_loss_coef=0.001,
               output_router_logits=True, use_sliding_window=False),
         "chatml", ("gate_proj", "up_proj", "down_proj"))):
    SPECS[_mt] = register(ModelSpec(
        model_type=_mt, config_cls=LlamaConfig, model_cls=LlamaForCausalLM, architectures=(_arch,),
        not_linear=("model.embed_tokens.weight",),
        # attention and every expert (shared expert included); the router (`.*\.gate$`) can be
        # added through lora_target_modules
        lora_targets=tuple(rf".*\.{n}$" for n in _ATTN + _mlp), tp_plan=_moe_tp_plan(_mt),
        prefix_layout=_prefix_layout, adapter_targets=(r".*\.o_proj$",),
        tiny_config=_tiny_cfg, default_chat_template=_tmpl, attention_module="self_attn",
        tp_parts=_tp_parts,
        fused_experts=_MOE_NAMES[_mt], quant_keep=(r".*\.gate", r".*\.shared_expert_gate")))
