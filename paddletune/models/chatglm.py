"""ChatGLM-6B (v1) (THUDM `model_type: "chatglm"` with `position_encoding_2d`; registered here as
"chatglm6b", since ChatGLM2/3 share the model_type: ModelSpec.claims picks this file's configs).

Architecture (L = num_layers blocks, H hidden, N heads of D = H / N, alpha = sqrt(2L)):
    h = word_embeddings(ids)
    x = input_layernorm(h);  h = alpha · x + dense(attn(query_key_value(x)))
    y = post_attention_layernorm(h);  h = alpha · y + dense_4h_to_h(gelu(dense_h_to_4h(y)))
    logits = lm_head(final_layernorm(h))            LayerNorms with bias, tanh GeLU, untied head
- query_key_value's output is per head [q, k, v] (as Bloom's: [B, S, N, 3, D]), with bias.
- Layout of a row: prompt, [gMASK], sop, answer, eop. Context length c = the index of sop
  (config bos_token_id); m = the index of [gMASK] (or of [MASK] when there is no [gMASK]).
- Attention (prefix LM): query i sees key j when j < c (the whole prompt, both directions) or
  j <= i (causal over the answer).
- 2-D positions: p1 = j for j < c, m for j >= c; p2 = 0 for j < c, j - c + 1 for j >= c. Rotary
  embeddings of D/2 dims each (rotate-half, base 10000): the first half of every q/k head by p1,
  the second half by p2.
  Worked example: [a, b, [gMASK], sop, x, y] -> c = 3, m = 2, p1 = [0, 1, 2, 2, 2, 2],
  p2 = [0, 0, 0, 1, 2, 3]; key 2 ([gMASK]) is visible to query 0, key 4 (x) only from 4 on.
  Under left padding (attention_mask 0 in front) indices count real tokens only; padded keys
  stay blocked. With a KV cache the prompt's (c, m) are kept on the cache for the later tokens.
- Packed rows (segment_ids) are refused: every example would need its own context.
No independent oracle runs for this family in the tests (transformers has no ChatGLM-6B): they
check the worked example above by hand, shapes, and learning.
Module names equal THUDM's (transformer.layers.N.attention.query_key_value, ...).
Tokenizer: chatglm6b_tokenizer.py (ice_text.model; encode puts [gMASK] sop after the prompt, and
the SFT data puts them between prompt and answer: Tokenizer.specials_after_prompt).
Written as if for one device: tensor parallelism comes from ModelSpec.tp_plan and tp_parts.
"""
import copy
import math
from dataclasses import dataclass, field

import numpy as np
import paddle
import paddle.nn as nn

from .layers import RopeTables, activation, attention, rope_cos_sin, rope_inv_freq
from .runner import BlockContext, CausalLM
from .spec import ModelSpec, register, require_keys


def claims(d):
    """ChatGLM-6B's config.json (ChatGLM2/3 have padded_vocab_size, no 2-D positions)."""
    return "position_encoding_2d" in d or ("inner_hidden_size" in d and "padded_vocab_size" not in d)


@dataclass
class ChatGLM6BConfig:
    vocab_size: int = 130528
    hidden_size: int = 4096
    num_layers: int = 28
    num_attention_heads: int = 32
    inner_hidden_size: int = 16384
    layernorm_epsilon: float = 1e-5
    max_sequence_length: int = 2048
    bos_token_id: int = 130004       # sop
    eos_token_id: int = 130005       # eop
    mask_token_id: int = 130000      # [MASK]
    gmask_token_id: int = 130001     # [gMASK]
    pad_token_id: int = 3
    initializer_range: float = 0.02
    model_type: str = "chatglm6b"
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d):
        require_keys(d, ("hidden_size", "num_layers", "num_attention_heads", "vocab_size"), "ChatGLM-6B")
        if not d.get("position_encoding_2d", True):
            raise ValueError("config.json: position_encoding_2d=false is not ChatGLM-6B's layout")
        if d.get("quantization_bit"):
            raise ValueError(f"config.json: quantization_bit={d['quantization_bit']} marks THUDM's "
                             "int4/int8 checkpoint; use the float checkpoint")
        H, N = d["hidden_size"], d["num_attention_heads"]
        if H % (2 * N) or (H // N) % 4:
            raise ValueError(f"config.json: hidden_size ({H}) / num_attention_heads ({N}) must be a "
                             "multiple of 4 (two rotary halves per head)")
        base = cls()
        return cls(
            vocab_size=d["vocab_size"], hidden_size=H, num_layers=d["num_layers"],
            num_attention_heads=N, inner_hidden_size=d.get("inner_hidden_size") or 4 * H,
            layernorm_epsilon=d.get("layernorm_epsilon", 1e-5),
            max_sequence_length=d.get("max_sequence_length", 2048),
            **{k: d.get(k, getattr(base, k)) for k in
               ("bos_token_id", "eos_token_id", "mask_token_id", "gmask_token_id", "pad_token_id")},
            initializer_range=d.get("initializer_range", 0.02), raw=copy.deepcopy(d))

    def to_dict(self):
        d = copy.deepcopy(self.raw)
        d.update(vocab_size=self.vocab_size, model_type="chatglm", position_encoding_2d=True)
        for k in ("bos_token_id", "eos_token_id", "mask_token_id", "gmask_token_id", "pad_token_id"):
            d[k] = getattr(self, k)
        return d

    num_hidden_layers = property(lambda self: self.num_layers)
    num_key_value_heads = property(lambda self: self.num_attention_heads)
    head_dim = property(lambda self: self.hidden_size // self.num_attention_heads)
    intermediate_size = property(lambda self: self.inner_hidden_size)
    max_position_embeddings = property(lambda self: self.max_sequence_length)
    tie_word_embeddings = False


def glm_layout(ids, cfg, attention_mask=None):
    """Per row (numpy ids [B, S]): context length c (index of sop) and mask position m, counted
    over real tokens (left padding skipped), and the number of left pads."""
    ids = np.asarray(ids)
    pads = (np.zeros(len(ids), np.int64) if attention_mask is None else
            np.argmax(np.asarray(attention_mask)[:, -ids.shape[1]:] != 0, axis=1))
    ctx, mask = [], []
    for row, p in zip(ids, pads):
        real = row[p:].tolist()
        if cfg.bos_token_id not in real:
            raise ValueError(f"ChatGLM-6B input without sop (id {cfg.bos_token_id}): every row needs "
                             "prompt, [gMASK], sop, answer (the tokenizer's layout)")
        ctx.append(real.index(cfg.bos_token_id))
        mark = cfg.gmask_token_id if cfg.gmask_token_id in real else cfg.mask_token_id
        mask.append(real.index(mark) if mark in real else ctx[-1] - 1)
    return np.asarray(ctx), np.asarray(mask), pads


def glm_positions(start, seq, ctx, mask, pads):
    """2-D positions (p1, p2) [B, seq] of row indices start .. start+seq-1 (module docstring)."""
    j = np.arange(start, start + seq)[None, :] - pads[:, None]          # index among real tokens
    after = j >= ctx[:, None]
    p1 = np.where(after, mask[:, None], np.maximum(j, 0))
    p2 = np.where(after, j - ctx[:, None] + 1, 0)
    return p1.astype(np.int64), p2.astype(np.int64)


def glm_mask(seq, past, ctx, pads, attention_mask=None):
    """Bool [B, 1, S, T] (True = blocked): causal, except keys of the context (row index < pads +
    c) are visible to every query; padded keys blocked."""
    T = past + seq
    q = np.arange(past, T)[:, None]
    k = np.arange(T)[None, :]
    causal = k > q                                                      # [S, T]
    context = k[None] < (pads + ctx)[:, None, None]                     # [B, 1, T]
    blocked = causal[None] & ~context
    if attention_mask is not None:
        blocked = blocked | (np.asarray(attention_mask)[:, None, -T:] == 0)
    return paddle.to_tensor(blocked[:, None])


class Rope2D:
    """ChatGLM-6B's rope object: the first half of every head rotated by p1, the second by p2."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def apply_heads_first(self, x, scale=1.0):
        half = x.shape[-1] // 2
        return paddle.concat([self.first.apply_heads_first(x[..., :half], scale),
                              self.second.apply_heads_first(x[..., half:], scale)], axis=-1)


class GLMAttention(nn.Layer):
    def __init__(self, cfg: ChatGLM6BConfig, idx: int):
        super().__init__()
        H = cfg.hidden_size
        self.head_dim, self.layer_idx = cfg.head_dim, idx
        self.query_key_value = nn.Linear(H, 3 * H)
        self.dense = nn.Linear(H, H)

    def forward(self, x, ctx):
        B, S, D = x.shape[0], x.shape[1], self.head_dim
        qkv = self.query_key_value(x).reshape([B, S, -1, 3, D])   # per head [q, k, v]
        q = ctx.rope.apply_heads_first(qkv[:, :, :, 0], 1.0 / math.sqrt(D))
        k = ctx.rope.apply_heads_first(qkv[:, :, :, 1])
        v = qkv[:, :, :, 2].transpose([0, 2, 1, 3])
        if ctx.cache is not None:
            k, v = ctx.cache.update(self.layer_idx, k, v)
        out = attention(q, k, v, ctx.mask, 0.0, self.training, scale=1.0, dropout_fn=ctx.dropout,
                        recompute=ctx.recompute == "core_attn")
        return self.dense(out)


class GLMMLP(nn.Layer):
    def __init__(self, cfg: ChatGLM6BConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, cfg.inner_hidden_size)
        self.dense_4h_to_h = nn.Linear(cfg.inner_hidden_size, cfg.hidden_size)
        self.act = activation("gelu_new")   # THUDM's gelu_impl is the tanh approximation

    def forward(self, x):
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GLMBlock(nn.Layer):
    def __init__(self, cfg: ChatGLM6BConfig, idx: int):
        super().__init__()
        eps = cfg.layernorm_epsilon
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, epsilon=eps)
        self.attention = GLMAttention(cfg, idx)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, epsilon=eps)
        self.mlp = GLMMLP(cfg)
        self.alpha = math.sqrt(2 * cfg.num_layers)

    def forward(self, h, ctx):
        x = self.input_layernorm(h)
        h = x * self.alpha + self.attention(x, ctx)
        y = self.post_attention_layernorm(h)
        return y * self.alpha + self.mlp(y)


class ChatGLM6BModel(nn.Layer):
    def __init__(self, cfg: ChatGLM6BConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.LayerList([GLMBlock(cfg, i) for i in range(cfg.num_layers)])
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, epsilon=cfg.layernorm_epsilon)


class ChatGLMForConditionalGeneration(CausalLM):
    """ChatGLM-6B parts for the shared runner; the context (2-D positions, prefix-LM mask) comes
    from the token ids (module docstring), so `context` is this family's own."""

    def __init__(self, cfg: ChatGLM6BConfig):
        super().__init__(cfg, SPEC)
        self.transformer = ChatGLM6BModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias_attr=False)

    def context(self, batch, seq, attention_mask=None, position_ids=None, cache=None,
                segment_ids=None, dtype="float32", input_ids=None):
        if segment_ids is not None:
            raise ValueError("ChatGLM-6B: packed rows (zero_padding) are not supported: each example "
                             "needs its own prompt context; pad instead")
        if cache is None and self.cache_hook is not None:
            cache, attention_mask = self.cache_hook(attention_mask)
        past = cache.length if cache is not None else 0
        am = attention_mask.numpy() if attention_mask is not None else None
        layout = getattr(cache, "glm_layout", None)
        if layout is None:   # this call holds the rows' prompts (keys before it: learned prefix)
            ids = input_ids.numpy()
            ctx, mask, pads = glm_layout(ids, self.config, am)
            layout = (ctx, mask, pads + past)   # pads: row index of the first real token
            if cache is not None and hasattr(cache, "keys"):   # a KVCache: kept for later tokens
                cache.glm_layout = layout
        ctx, mask, pads = layout
        p1, p2 = glm_positions(past, seq, ctx, mask, pads)
        blocked = glm_mask(seq, past, ctx, pads, am)
        inv = rope_inv_freq(self.config.head_dim // 2, {"rope_type": "default", "rope_theta": 10000.0})
        tables = [RopeTables(*rope_cos_sin(paddle.to_tensor(p), inv)) for p in (p1, p2)]
        return BlockContext(Rope2D(*tables), blocked, cache, False, self.heads_dropout,
                            paddle.to_tensor(p1))


def _prefix_layout(cfg):
    return cfg.num_layers, cfg.num_attention_heads, cfg.head_dim


def _tp_parts(cfg):
    """query_key_value is one part of N whole heads (each head's q, k, v side by side)."""
    return {"query_key_value": [(3 * cfg.hidden_size, cfg.num_attention_heads)]}


_TINY = {"model_type": "chatglm6b", "architectures": ["ChatGLMModel"], "vocab_size": 512,
         "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "inner_hidden_size": 128,
         "layernorm_epsilon": 1e-5, "max_sequence_length": 1024, "position_encoding_2d": True,
         "bos_token_id": 5, "eos_token_id": 6, "mask_token_id": 3, "gmask_token_id": 4,
         "pad_token_id": 0}

SPEC = register(ModelSpec(
    module_paths={"embeddings": "transformer.word_embeddings", "layers": "transformer.layers",
                  "norm": "transformer.final_layernorm", "head": "lm_head"},
    attention_module="attention",
    model_type="chatglm6b", config_cls=ChatGLM6BConfig, model_cls=ChatGLMForConditionalGeneration,
    architectures=("ChatGLMModel",), not_linear=("transformer.word_embeddings.weight",),
    lora_targets=(r".*\.query_key_value$", r".*\.dense$", r".*\.dense_h_to_4h$",
                  r".*\.dense_4h_to_h$"),
    tp_plan={"query_key_value": "column", "dense": "row", "dense_h_to_4h": "column",
             "dense_4h_to_h": "row", "word_embeddings": "vocab", "lm_head": "column"},
    prefix_layout=_prefix_layout,
    adapter_targets=(r".*\.attention\.dense$", r".*\.dense_4h_to_h$"),
    tiny_config=_TINY, default_chat_template="chatglm", tp_parts=_tp_parts,
    hf_model_type="chatglm", claims=claims,
    tokenizer_classes={"ChatGLMTokenizer": "paddletune.models.chatglm6b_tokenizer:ChatGLM6BTokenizer"}))
