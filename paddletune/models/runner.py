"""The one causal-LM forward pass, shared by every model family.

A family's model class subclasses `CausalLM` and defines only its parts (as HF names them):

    get_input_embeddings()   the token embedding (nn.Embedding, weight [V, H])
    decoder_layers()         nn.LayerList of blocks; each is called as block(h, ctx)
    final_norm()             the norm after the last block
    get_output_embeddings()  the LM head (nn.Linear, weight [H, V]), or None when it is tied to
                             the input embedding (logits = h @ E^T)
    rope_tables(positions)   the family's rotary tables for positions [B, S]: an object with
                             `apply_heads_first(x [B, S, heads, D], scale) -> [B, heads, S, D]`
                             (default layers.NoRotary: families without rotary positions)
    finish_embedding(h, ctx) optional: what follows the token lookup before the first block
                             (learned absolute positions from ctx.positions, an embedding norm);
                             default: nothing

Everything else lives here, once: positions, the attention structure (causal / padding mask or
packed rows), the KV cache and the learned prefix (`cache_hook`), embedding noise
(`embedding_hook`), activation recomputation and the flash-attention switch. Blocks receive one
fixed structure, `BlockContext` (rope tables, mask, cache, flash switch), next to the hidden
states h [B, S, H]; a pipeline stage can rebuild the context from the batch and pass only h.

The forward returns logits [B, S, V] (or, with return_hidden=True, the final-norm hidden states
and no logits). The training loss is not part of the model: `models.loss` computes it from the
hidden states, so a vocabulary-parallel loss can replace it without touching a model file.
"""
from dataclasses import dataclass
from typing import Optional

import paddle
import paddle.nn as nn

from .cache import PrefixCache
from .layers import NoRotary, attention_bias
from .owned import as_forward


@dataclass
class CausalLMOutput:
    """`logits` [B, S, V], or `hidden_states` [B, S, H] (after the final norm) with
    return_hidden=True."""
    logits: Optional[paddle.Tensor] = None
    hidden_states: Optional[paddle.Tensor] = None
    # Mixture-of-Experts models: the router logits [B*S, E] of each sparse block, in order (the
    # load-balancing loss in models/loss.py reads them); None for dense models
    router_logits: Optional[list] = None


@dataclass
class BlockContext:
    """What every block's attention needs besides the hidden states, built once per forward.

    rope:  the family's rotary tables for this forward's positions
    mask:  bool [B or 1, 1, S, T] (True = blocked; T = past + S), a layers.PackedRows (zero
           padding), or None (one new token with a cache: nothing to block)
    cache: KVCache (generation), PrefixCache (prefix tuning) or None
    flash: whether packed rows may use the GPU varlen flash-attention kernel
    dropout: f(probs [B, K, g*S, T], p, training) for attention dropout, or None (F.dropout);
           tensor parallelism passes one that draws the one-process mask over all heads
    recompute: None, or "full_attn" / "core_attn" while training with that recompute granularity:
           the part of the block whose activations are recomputed in backward ("full" recomputes
           whole blocks from the runner)
    positions: position ids [B, S] of this forward's tokens (learned position embeddings)
    router_logits: a list the MoE blocks append their router logits [B*S, E] to (models/moe.py)"""
    rope: object
    mask: object = None
    cache: object = None
    flash: bool = False
    dropout: object = None
    recompute: object = None
    positions: object = None
    router_logits: object = None


class CausalLM(nn.Layer):
    """forward(input_ids [B, S], attention_mask [B, past+S] (1 = real), position_ids [B, S],
    cache (KVCache / PrefixCache), segment_ids [B, S] (packed rows), return_hidden) ->
    CausalLMOutput. Without a cache, positions start at 0; with one, at cache.length."""

    def __init__(self, config, spec):
        super().__init__()
        self.config, self.spec = config, spec
        self.recompute = False          # recompute activations in backward (training)
        self.recompute_granularity = "full"   # full (whole blocks), full_attn, core_attn
        self.flash_attention = False    # packed rows: GPU varlen flash attention (UNTESTED here)
        self.heads_dropout = None       # attention dropout function (parallel/ sets one under TP)
        self.embedding_hook = None      # f(embeddings) -> embeddings, e.g. NEFTune noise
        # f(attention_mask or None) -> (cache, attention_mask [B, P+S] or None), used when no cache
        # is given: prefix tuning supplies its learned prefixes this way (peft/prefix.py)
        self.cache_hook = None

    # ------------------------------------------------------------------ the parts a family defines
    # (by default from ModelSpec.module_paths)
    def _part(self, key):
        paths = self.spec.module_paths
        if not paths or key not in paths:
            raise NotImplementedError(f"{type(self).__name__} names no '{key}' (ModelSpec.module_paths)")
        out = self
        for name in paths[key].split("."):
            out = getattr(out, name)
        return out

    def get_input_embeddings(self):
        return self._part("embeddings")

    def decoder_layers(self):
        return self._part("layers")

    def final_norm(self):
        return self._part("norm")

    def get_output_embeddings(self):
        """The LM head, or None when it is the input embedding (tied)."""
        return None if getattr(self.config, "tie_word_embeddings", False) else self._part("head")

    def rope_tables(self, position_ids):
        return NoRotary()

    def finish_embedding(self, h, ctx):
        """h [B, S, H] token embeddings (after embedding_hook) -> the first block's input."""
        return h

    # ------------------------------------------------------------------ the runner
    def logits(self, h):
        """h [..., H] -> logits [..., V]."""
        head = self.get_output_embeddings()
        if head is None:   # tied: read inside the embedding's call (owned.py: sharding stage 3)
            emb = self.get_input_embeddings()
            return as_forward(emb, lambda x: paddle.matmul(x, emb.weight, transpose_y=True), h)
        return head(h)

    def context(self, batch, seq, attention_mask=None, position_ids=None, cache=None,
                segment_ids=None, dtype="float32", input_ids=None):
        """BlockContext: positions, rope tables and the attention structure. The prefix hook (if
        any) supplies the cache and extends the mask when none is given. `input_ids` is for
        families whose positions and mask depend on the tokens (ChatGLM-6B's [gMASK] / sop)."""
        if cache is None and self.cache_hook is not None:
            cache, attention_mask = self.cache_hook(attention_mask)
        past = cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = paddle.arange(past, past + seq, dtype="int64").unsqueeze(0).expand([batch, seq])
        mask = attention_bias(batch, seq, past, attention_mask, segment_ids, dtype=dtype)
        return BlockContext(self.rope_tables(position_ids), mask, cache, self.flash_attention,
                            self.heads_dropout, positions=position_ids)

    def embed(self, input_ids):
        h = self.get_input_embeddings()(input_ids)
        return self.embedding_hook(h) if self.embedding_hook is not None else h

    def run_layers(self, h, ctx, layers=None):
        """Apply `layers` (default: every decoder block) in order. With recompute on (training),
        granularity "full" recomputes whole blocks here; "full_attn" each block's attention
        module (ModelSpec.attention_module) and "core_attn" softmax(q k^T) v only, from inside."""
        # recompute only where the block input carries a gradient (a frozen embedding's output
        # does not: recomputing that block would save nothing and paddle warns about it); a
        # PrefixCache holds no state between calls, so recomputing is safe with it, a KVCache
        # (generation) is written in place and is not
        on = self.recompute and self.training and (ctx.cache is None or isinstance(ctx.cache, PrefixCache))
        mode = self.recompute_granularity if on else None
        ctx.recompute = mode if mode in ("full_attn", "core_attn") else None
        if mode == "full_attn":
            self._wrap_attention_modules()
        for layer in (self.decoder_layers() if layers is None else layers):
            if mode == "full" and not h.stop_gradient:
                from paddle.distributed.fleet.utils import recompute

                h = recompute(_reusing_attention(layer), h, ctx, use_reentrant=False)
            else:
                h = layer(h, ctx)
        return h

    def _wrap_attention_modules(self):
        """Once: every block's attention module recomputes itself when ctx.recompute is full_attn."""
        name = self.spec.attention_module
        if name is None:
            raise ValueError(f"recompute_granularity full_attn: model type {self.config.model_type!r} "
                             "names no attention module (ModelSpec.attention_module)")
        for block in self.decoder_layers():
            attn = getattr(block, name, None)
            if attn is None or getattr(attn, "_pt_recompute", False):
                continue
            attn.forward = _recompute_when_asked(attn.forward)
            attn._pt_recompute = True

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None,
                segment_ids=None, return_hidden=False):
        B, S = input_ids.shape
        h = self.embed(input_ids)
        ctx = self.context(B, S, attention_mask, position_ids, cache, segment_ids, h.dtype, input_ids)
        ctx.router_logits = []
        h = self.run_layers(self.finish_embedding(h, ctx), ctx)
        if ctx.cache is not None:
            ctx.cache.advance(S)
        h = self.final_norm()(h)
        router = ctx.router_logits or None
        if return_hidden:
            return CausalLMOutput(hidden_states=h, router_logits=router)
        return CausalLMOutput(logits=self.logits(h), router_logits=router)


def _recompute_when_asked(forward):
    """forward(x, ctx) recomputed in backward when ctx.recompute == "full_attn" and x needs grad."""
    def wrapped(x, ctx):
        if ctx.recompute == "full_attn" and not x.stop_gradient:
            from paddle.distributed.fleet.utils import recompute

            return recompute(_reusing_attention(forward), x, ctx, use_reentrant=False)
        return forward(x, ctx)
    return wrapped


def _reusing_attention(fn):
    """fn for one recompute call: its CPU attention kernel calls keep (out, lse) in the forward
    and reuse them when paddle's recompute runs fn again in backward (kernels.ReuseOutputs)."""
    from ..kernels.attention import ReuseOutputs

    slot = ReuseOutputs()

    def run(*args):
        with slot:
            return fn(*args)
    return run
