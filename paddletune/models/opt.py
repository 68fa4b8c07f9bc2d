"""OPT (HF `model_type: "opt"`, OPTForCausalLM; facebook/opt-125m ... 66b).

Architecture (L blocks, H = hidden_size, N heads of D = H / N, E = word_embed_proj_dim):
    x = embed_tokens(ids)                        [.., E]
    h = project_in(x) + embed_positions(pos + 2)  project_in only when E != H; the position table
                                                  has max_position_embeddings + 2 rows (offset 2)
    block, pre-LN (do_layer_norm_before, every size but 350m):
        h = h + out_proj(attn(q_proj, k_proj, v_proj of self_attn_layer_norm(h)))
        h = h + fc2(relu(fc1(final_layer_norm(h))))           (the block's own final_layer_norm)
    block, post-LN (350m): the same sums with each norm applied after its residual add
    y = project_out(decoder.final_layer_norm(h))  the norm only pre-LN, project_out only if E != H
    logits = y @ embed_tokens^T                   tied head (an lm_head.weight if untied)
Queries are scaled by D^-1/2; every Linear has a bias (enable_bias). `dropout` is applied to each
branch before its residual add, `attention_dropout` to the probabilities; layerdrop is not applied
(training runs every layer).

Positions: ids count from 0 (past tokens included); generation passes positions that count real
tokens only under left padding, which is what OPT's cumsum(attention_mask) - 1 gives.
Module names equal HF's (model.decoder.layers.N.self_attn.q_proj, ...); hf.py transposes Linears.
Written as if for one device: tensor parallelism comes from ModelSpec.tp_plan.
"""
import copy
from dataclasses import dataclass, field

import paddle.nn as nn

from .layers import activation, attention, check_positions, dropout
from .runner import CausalLM
from .spec import ModelSpec, register, require_keys

OFFSET = 2   # OPT's position table starts at row 2 (rows 0, 1 were fairseq's padding positions)


@dataclass
class OPTConfig:
    vocab_size: int = 50272
    hidden_size: int = 768
    num_hidden_layers: int = 12
    ffn_dim: int = 3072
    num_attention_heads: int = 12
    max_position_embeddings: int = 2048
    word_embed_proj_dim: int = 768
    do_layer_norm_before: bool = True
    has_final_norm: bool = True      # decoder.final_layer_norm exists (pre-LN, not removed)
    layer_norm_affine: bool = True   # layer_norm_elementwise_affine
    enable_bias: bool = True
    activation_function: str = "relu"
    dropout: float = 0.1
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    model_type: str = "opt"
    bos_token_id: object = None
    eos_token_id: object = None
    pad_token_id: object = None
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d):
        require_keys(d, ("hidden_size", "num_hidden_layers", "num_attention_heads", "ffn_dim", "vocab_size"),
                     "model_type opt")
        H, N = d["hidden_size"], d["num_attention_heads"]
        if H % N:
            raise ValueError(f"config.json: hidden_size ({H}) must be a multiple of "
                             f"num_attention_heads ({N})")
        before = bool(d.get("do_layer_norm_before", True))
        cfg = cls(
            vocab_size=d["vocab_size"], hidden_size=H, num_hidden_layers=d["num_hidden_layers"],
            ffn_dim=d["ffn_dim"], num_attention_heads=N,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            word_embed_proj_dim=d.get("word_embed_proj_dim") or H, do_layer_norm_before=before,
            has_final_norm=before and not d.get("_remove_final_layer_norm", False),
            layer_norm_affine=bool(d.get("layer_norm_elementwise_affine", True)),
            enable_bias=bool(d.get("enable_bias", True)),
            activation_function=d.get("activation_function", "relu"),
            dropout=float(d.get("dropout", 0.1)), attention_dropout=float(d.get("attention_dropout", 0.0)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            initializer_range=d.get("init_std", 0.02), model_type="opt",
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"), raw=copy.deepcopy(d))
        activation(cfg.activation_function)
        return cfg

    def to_dict(self):
        d = copy.deepcopy(self.raw)
        d["vocab_size"] = self.vocab_size
        d["model_type"] = "opt"
        return d

    num_key_value_heads = property(lambda self: self.num_attention_heads)
    head_dim = property(lambda self: self.hidden_size // self.num_attention_heads)
    intermediate_size = property(lambda self: self.ffn_dim)


def _norm(cfg):
    affine = None if cfg.layer_norm_affine else False
    return nn.LayerNorm(cfg.hidden_size, weight_attr=affine, bias_attr=affine)


class OPTAttention(nn.Layer):
    def __init__(self, cfg: OPTConfig, idx: int):
        super().__init__()
        H, b = cfg.hidden_size, None if cfg.enable_bias else False
        self.head_dim, self.layer_idx = cfg.head_dim, idx
        self.q_proj = nn.Linear(H, H, bias_attr=b)
        self.k_proj = nn.Linear(H, H, bias_attr=b)
        self.v_proj = nn.Linear(H, H, bias_attr=b)
        self.out_proj = nn.Linear(H, H, bias_attr=b)
        self.dropout = cfg.attention_dropout

    def forward(self, x, ctx):
        B, S, D = x.shape[0], x.shape[1], self.head_dim
        q = ctx.rope.apply_heads_first(self.q_proj(x).reshape([B, S, -1, D]), D ** -0.5)
        k = ctx.rope.apply_heads_first(self.k_proj(x).reshape([B, S, -1, D]))
        v = self.v_proj(x).reshape([B, S, -1, D]).transpose([0, 2, 1, 3])
        if ctx.cache is not None:
            k, v = ctx.cache.update(self.layer_idx, k, v)
        out = attention(q, k, v, ctx.mask, self.dropout, self.training, scale=1.0, flash=ctx.flash,
                        dropout_fn=ctx.dropout,
                        recompute=ctx.recompute == "core_attn")
        return self.out_proj(out)


class OPTDecoderLayer(nn.Layer):
    def __init__(self, cfg: OPTConfig, idx: int):
        super().__init__()
        b = None if cfg.enable_bias else False
        self.self_attn = OPTAttention(cfg, idx)
        self.self_attn_layer_norm = _norm(cfg)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_dim, bias_attr=b)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.hidden_size, bias_attr=b)
        self.final_layer_norm = _norm(cfg)
        self.act, self.before, self.p = activation(cfg.activation_function), cfg.do_layer_norm_before, cfg.dropout

    def forward(self, h, ctx):
        a = self.self_attn(self.self_attn_layer_norm(h) if self.before else h, ctx)
        h = h + dropout(a, self.p, self.training)
        if not self.before:
            h = self.self_attn_layer_norm(h)
        m = self.fc2(self.act(self.fc1(self.final_layer_norm(h) if self.before else h)))
        h = h + dropout(m, self.p, self.training)
        return h if self.before else self.final_layer_norm(h)


class OPTDecoder(nn.Layer):
    def __init__(self, cfg: OPTConfig):
        super().__init__()
        H, E = cfg.hidden_size, cfg.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(cfg.vocab_size, E)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + OFFSET, H)
        if E != H:
            self.project_in = nn.Linear(E, H, bias_attr=False)
            self.project_out = nn.Linear(H, E, bias_attr=False)
        if cfg.has_final_norm:
            self.final_layer_norm = _norm(cfg)
        self.layers = nn.LayerList([OPTDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])


class OPTModel(nn.Layer):
    def __init__(self, cfg: OPTConfig):
        super().__init__()
        self.decoder = OPTDecoder(cfg)


class OPTForCausalLM(CausalLM):
    """OPT parts for the shared runner (models/runner.py): no rotary tables; positions enter
    through embed_positions (offset 2) in finish_embedding."""

    def __init__(self, cfg: OPTConfig):
        super().__init__(cfg, SPEC)
        self.model = OPTModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.word_embed_proj_dim, cfg.vocab_size, bias_attr=False)

    def get_input_embeddings(self):
        return self.model.decoder.embed_tokens

    def decoder_layers(self):
        return self.model.decoder.layers

    def final_norm(self):
        return self._final

    def _final(self, h):
        """decoder.final_layer_norm (pre-LN checkpoints), then project_out (when E != H)."""
        dec = self.model.decoder
        if self.config.has_final_norm:
            h = dec.final_layer_norm(h)
        return dec.project_out(h) if hasattr(dec, "project_out") else h

    def get_output_embeddings(self):
        return None if self.config.tie_word_embeddings else self.lm_head

    def finish_embedding(self, h, ctx):
        dec = self.model.decoder
        check_positions(ctx.positions, self.config.max_position_embeddings, "max_position_embeddings")
        if hasattr(dec, "project_in"):
            h = dec.project_in(h)
        return h + dec.embed_positions(ctx.positions + OFFSET).astype(h.dtype)


def _prefix_layout(cfg):
    return cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim


def _tp_parts(cfg):
    N, H = cfg.num_attention_heads, cfg.hidden_size
    return {"q_proj": [(H, N)], "k_proj": [(H, N)], "v_proj": [(H, N)]}


_TINY = {"model_type": "opt", "architectures": ["OPTForCausalLM"], "vocab_size": 512,
         "hidden_size": 64, "num_hidden_layers": 2, "ffn_dim": 128, "num_attention_heads": 4,
         "max_position_embeddings": 512, "word_embed_proj_dim": 64, "do_layer_norm_before": True,
         "activation_function": "relu", "dropout": 0.0, "attention_dropout": 0.0,
         "enable_bias": True, "tie_word_embeddings": True}

SPEC = register(ModelSpec(
    learned_positions=True,
    attention_module="self_attn",
    model_type="opt", config_cls=OPTConfig, model_cls=OPTForCausalLM,
    architectures=("OPTForCausalLM",),
    not_linear=("model.decoder.embed_tokens.weight", "model.decoder.embed_positions.weight"),
    lora_targets=tuple(rf".*\.{n}$" for n in ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")),
    tp_plan={"q_proj": "column", "k_proj": "column", "v_proj": "column", "out_proj": "row",
             "fc1": "column", "fc2": "row", "embed_tokens": "vocab", "lm_head": "column"},
    prefix_layout=_prefix_layout, adapter_targets=(r".*\.out_proj$", r".*\.fc2$"),
    tiny_config=_TINY, default_chat_template="plain", tp_parts=_tp_parts, base_prefix="model."))
