"""Text generation with a pre-allocated KV cache (prompt encoding and `pipeline("text-generation")`
live in text_generation.py).

    out = generate(model, [tok.encode("Hello"), tok.encode("Hi there")],
                   GenerationConfig(max_new_tokens=32), tokenizer=tok)
    out.sequences      # new token ids per prompt (through EOS / the stop string, if reached)
    pipe = paddletune.pipeline("text-generation", model=dir, max_new_tokens=32)
    pipe("Hello")      # [{"generated_text": "Hello ..."}]

How one call runs (B prompts, longest L tokens, P prefix tokens, N = max_new_tokens):
1. Prompts longer than `src_length` are cut from the LEFT (the end of a prompt matters most).
2. Prompts are LEFT-padded to L, so every row's next token sits in the last column.
   attention_mask [B, P+L+N] holds 1 for prefix, real prompt and generated positions, 0 for pads;
   position ids count real tokens only: pos = P + cumsum(mask) - 1 (as transformers does), so a
   padded row computes exactly what it would alone.
3. One forward over [B, L] fills the KVCache (buffers [B, kv_heads, P+L+N, head_dim] allocated
   once; each step writes its slice in place, nothing is concatenated).
4. Each step feeds the B chosen tokens [B, 1] at position last+1 and reuses the cache. Rows that
   finish (EOS or a stop string) are dropped from the batch (KVCache.select), so the step cost
   follows the rows still running. The only host round-trip per step is reading the B new ids.

Token choice per step (order as in transformers): repetition penalty (over prompt + generated
tokens: logit / p if positive else logit * p) -> greedy argmax, or for sampling:
logits / temperature -> keep top_k -> keep the smallest set of tokens whose probability mass
reaches top_p -> draw by inverse CDF with uniforms from a numpy Generator seeded with `seed`;
prompt i always uses the i-th row of draws, so the same seed and prompts give the same output
whatever the batch size, and the global paddle RNG is not touched.

Tensor parallel (a model loaded with a topology: `model.tensor_parallel` set): the logits are
this rank's vocabulary shard [B, V/t]; token choice runs on the shards (parallel/sampling.py,
same rules, same ids, no [B, V] gather), every rank gets the same ids and so takes the same
EOS / stop / row-dropping decisions; the KV cache holds the rank's key/value heads.
With return_logits each rank returns its shard.
"""
import time
from dataclasses import dataclass, field, fields
from typing import List, Optional

import numpy as np
import paddle

from .models.cache import KVCache, PrefixCache


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128          # tokens generated per prompt at most
    decode_strategy: str = "greedy_search"   # greedy_search | sampling
    temperature: float = 1.0           # sampling: logits / temperature
    top_k: int = 0                     # sampling: keep the k most likely tokens (0 = all)
    top_p: float = 1.0                 # sampling: nucleus mass
    repetition_penalty: float = 1.0    # > 1 discourages tokens already in prompt or output
    eos_token_id: Optional[List[int]] = None   # stop after any of these ids
    pad_token_id: Optional[int] = None
    stop: List[str] = field(default_factory=list)   # stop strings (need a tokenizer)
    seed: Optional[int] = None         # sampling seed; None draws one from numpy's global RNG
    src_length: Optional[int] = None   # cut prompts to this many tokens from the left

    def validate(self):
        def bad(key, msg):
            raise ValueError(f"generation: '{key}' {msg}")

        if self.max_new_tokens is None or self.max_new_tokens <= 0:
            bad("max_new_tokens", f"must be a positive number of tokens, got {self.max_new_tokens}")
        if self.decode_strategy not in ("greedy_search", "sampling"):
            bad("decode_strategy", f"must be greedy_search or sampling, got {self.decode_strategy!r}")
        if not self.temperature > 0:
            bad("temperature", f"must be > 0, got {self.temperature} (use greedy_search for argmax)")
        if self.top_k < 0:
            bad("top_k", f"must be >= 0 (0 = no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", f"must be > 0 (1 = off), got {self.repetition_penalty}")
        if self.src_length is not None and self.src_length <= 0:
            bad("src_length", f"must be positive, got {self.src_length}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", f"must be a list of non-empty strings, got {self.stop!r}")
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        return self

    @classmethod
    def from_kwargs(cls, base=None, **kw):
        """A copy of `base` with keys of `kw` replaced; unknown keys are an error."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise TypeError(f"unknown generation argument(s) {unknown}; valid: {sorted(names)}")
        vals = {f.name: getattr(base, f.name) for f in fields(cls)} if base else {}
        vals.update(kw)
        return cls(**vals).validate()


@dataclass
class GenerateOutput:
    sequences: List[List[int]]     # new ids per prompt, EOS / stop-completing token included
    finish_reasons: List[str]      # "eos" | "stop" | "length"
    prompt_lengths: List[int]      # tokens of each prompt after the src_length cut
    seconds: float = 0.0           # wall time of the forward passes and token choice
    logits: Optional[List[np.ndarray]] = None   # with return_logits: per prompt [steps, V]
    texts: Optional[List[str]] = None           # with a tokenizer: decoded, cut at a stop string

    @property
    def num_new_tokens(self):
        return sum(len(s) for s in self.sequences)

    @property
    def tokens_per_second(self):
        return self.num_new_tokens / max(self.seconds, 1e-9)


# ------------------------------------------------------------------------------ token choice

def penalize_repetition(logits, seen, penalty):
    """logits [B, V]; seen [B, V] (1 where the token occurred). Occurred tokens get
    logit / penalty when positive, logit * penalty otherwise (transformers' rule)."""
    scaled = paddle.where(logits > 0, logits / penalty, logits * penalty)
    return paddle.where(seen > 0, scaled, logits)


def filter_top_k_top_p(logits, top_k=0, top_p=1.0):
    """Set logits outside the top_k largest and outside the nucleus to -inf. [B, V] -> [B, V].

    Nucleus: with probabilities sorted descending p(1) >= p(2) >= ..., token (i) is dropped when
    the mass before it, p(1) + ... + p(i-1), already reaches top_p; the most likely token is
    always kept; equal logits are ordered lowest index first (a stable sort: the tensor-parallel
    nucleus, parallel/sampling.py, follows the same order). Example: p = [.5, .3, .2],
    top_p = .8 -> keeps the first two."""
    V = logits.shape[-1]
    neg = paddle.full_like(logits, -float("inf"))
    if 0 < top_k < V:
        kth = paddle.topk(logits, top_k, axis=-1)[0][:, -1:]
        logits = paddle.where(logits < kth, neg, logits)
    if top_p < 1.0:
        order = paddle.argsort(logits, axis=-1, descending=True, stable=True)
        sorted_logits = paddle.take_along_axis(logits, order, axis=-1)
        # masses summed in float64 from softmax's float32 numerators: float32 running sums drift
        # by ~1e-6 over a vocabulary, enough to move the boundary token now and then, and the
        # tensor-parallel nucleus (sums in another order) would then differ from this one
        w = paddle.exp(sorted_logits - sorted_logits[:, :1]).astype("float64")
        cum = paddle.cumsum(w, axis=-1)
        drop_sorted = (cum - w >= top_p * cum[:, -1:]).astype("int32")
        drop = paddle.put_along_axis(paddle.zeros_like(drop_sorted), order, drop_sorted, axis=-1)
        logits = paddle.where(drop > 0, neg, logits)
    return logits


def sample_from(probs, u):
    """Inverse-CDF draw: probs [B, V] (rows need not sum to 1), u [B, 1] uniform in (0, 1].
    Returns ids [B]: the first index whose cumulative mass reaches u * total. Zero-probability
    tokens are never chosen. Sums run in float64 (see filter_top_k_top_p)."""
    cdf = paddle.cumsum(probs.astype("float64"), axis=-1)
    target = u.astype("float64") * cdf[:, -1:]
    idx = (cdf < target).astype("int64").sum(-1)
    return paddle.clip(idx, max=probs.shape[-1] - 1)


def choose_tokens(logits, cfg, seen=None, u=None, tp=None, vocab_size=None):
    """logits [B, V] float32 -> next ids [B] int64, following `cfg` (see module docstring).
    Under tensor parallelism (`tp`, the model's TensorParallel) logits and seen are this rank's
    vocabulary shard [B, V/t] of a `vocab_size` vocabulary and every rank returns the same ids."""
    if tp is not None:
        from .parallel import sampling

        return sampling.choose_tokens(logits, cfg, seen, u, tp, vocab_size, penalize_repetition)
    if cfg.repetition_penalty != 1.0 and seen is not None:
        logits = penalize_repetition(logits, seen, cfg.repetition_penalty)
    if cfg.decode_strategy == "greedy_search":
        return paddle.argmax(logits, axis=-1)
    logits = filter_top_k_top_p(logits / cfg.temperature, cfg.top_k, cfg.top_p)
    # softmax's numerators: the draw normalises by the total itself
    return sample_from(paddle.exp(logits - logits.max(axis=-1, keepdim=True)), u)


# ------------------------------------------------------------------------------ the loop

def _model_dtype(model):
    for p in model.parameters():
        if p.dtype in (paddle.float16, paddle.bfloat16, paddle.float32, paddle.float64):
            return p.dtype
    return paddle.float32


def _prefix_of(model, prefix):
    """(keys, values) per layer [kv_heads, P, head_dim], from the argument or from the prefix
    encoder that prefix tuning attached to the model (peft/prefix.py)."""
    if prefix is not None:
        return prefix
    enc = getattr(model, "prefix_encoder", None)
    return enc.prefix_kv() if enc is not None else None


def _prepare(prompts, cfg, P, pad_id):
    """Cut, left-pad and mask the prompts. Returns numpy ids [B, L], mask [B, P+L+N], positions
    [B, L], lengths [B]."""
    cut = [list(p)[-cfg.src_length:] if cfg.src_length else list(p) for p in prompts]
    for i, p in enumerate(cut):
        if not p:
            raise ValueError(f"prompt {i} is empty; give at least one token (e.g. BOS)")
    lengths = np.array([len(p) for p in cut])
    B, L, N = len(cut), int(lengths.max()), cfg.max_new_tokens
    ids = np.full((B, L), pad_id, np.int64)
    mask = np.ones((B, P + L + N), np.int64)
    for i, p in enumerate(cut):
        ids[i, L - len(p):] = p
        mask[i, P:P + L - len(p)] = 0
    prompt_mask = mask[:, P:P + L]
    pos = P + np.maximum(np.cumsum(prompt_mask, axis=1) - 1, 0)
    return ids, mask, pos, lengths


def _stop_hit(tokenizer, row_ids, stops, window):
    text = tokenizer.decode(row_ids[-window:], skip_special_tokens=False)
    return any(s in text for s in stops)


class _LiveBatch:
    """Device state of the rows still generating. `rows` maps live rows to prompt indices."""

    def __init__(self, model, ids, mask, pos, P, N, prefix, use_cache, seen):
        self.model, self.P, self.prefix, self.use_cache = model, P, prefix, use_cache
        self.tp = getattr(model, "tensor_parallel", None)
        B, L = ids.shape
        self.rows = np.arange(B)
        self.need_mask = bool((mask == 0).any())
        self.mask = paddle.to_tensor(mask)
        self.ids = paddle.to_tensor(ids)           # next forward's input: prompt, then [B, 1]
        self.pos = paddle.to_tensor(pos)
        self.prompt_pos = self.pos                 # uncached path: full positions each step
        self.seq = self.ids                        # uncached path: whole sequence so far
        self.seen = seen
        self.past = P
        self.cache = None
        if use_cache:
            self.cache = KVCache.for_model(model, B, P + L + N, dtype=_model_dtype(model))
            if prefix:
                self.cache.fill_prefix(*prefix)

    def logits(self, step):
        """Last-position logits [live, V] (float32) of this step's forward."""
        if self.use_cache:
            ids, pos, cache = self.ids, self.pos, self.cache
            T = self.past + ids.shape[1]
        else:   # recompute everything; a prefix enters through a PrefixCache (never grows)
            ids, cache = self.seq, PrefixCache(*self.prefix) if self.prefix else None
            gen = self.prompt_pos[:, -1:] + paddle.arange(1, step + 1, dtype="int64").unsqueeze(0)
            pos = paddle.concat([self.prompt_pos, gen], axis=1) if step else self.prompt_pos
            T = self.P + ids.shape[1]
        mask = self.mask[:, :T] if self.need_mask else None
        if not hasattr(self.model, "logits"):
            out = self.model(ids, attention_mask=mask, position_ids=pos, cache=cache)
            return out.logits[:, -1].astype("float32")
        # the head on the last position only: the prompt forward would otherwise multiply all
        # [B, L, H] hidden states by the [H, V] head (B*L*H*V MACs) to keep one row of them
        h = self.model(ids, attention_mask=mask, position_ids=pos, cache=cache, return_hidden=True).hidden_states
        return self.model.logits(h[:, -1:])[:, -1].astype("float32")

    def advance(self, tok):
        """Append the chosen ids tok [live] to every row."""
        self.past += self.ids.shape[1]
        self.ids = tok.reshape([-1, 1])
        self.pos = self.pos[:, -1:] + 1
        if self.seen is not None and self.tp is not None:
            from .parallel import sampling

            self.seen = sampling.mark_seen(self.seen, self.ids, self.tp)
        elif self.seen is not None:
            self.seen = paddle.put_along_axis(self.seen, self.ids, 1.0, axis=-1)
        if not self.use_cache:
            self.seq = paddle.concat([self.seq, self.ids], axis=1)

    def keep(self, keep):
        """Drop finished rows: keep live rows `keep` (list of indices)."""
        self.rows = self.rows[keep]
        idx = paddle.to_tensor(keep, dtype="int64")
        for name in ("ids", "pos", "mask", "seen", "seq", "prompt_pos"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, paddle.gather(t, idx))
        if self.cache is not None:
            self.cache.select(keep)


def _fresh_seed(tp):
    """A random sampling seed; under tensor parallelism every rank takes the largest of the
    ranks' draws, so all ranks draw the same uniforms (and choose the same tokens)."""
    seed = np.random.randint(2**31)
    if tp is None:
        return seed
    return int(tp.all_reduce(paddle.to_tensor([seed], dtype="int64"), "max").numpy()[0])


def _seen_mask(ids, lengths, vocab, tp):
    """The repetition penalty's mask of the prompts' tokens: float32 [B, V] (under tensor
    parallelism this rank's shard [B, V/t]) from left-padded ids [B, L]."""
    rows = [ids[i, ids.shape[1] - n:] for i, n in enumerate(lengths)]
    if tp is not None:
        from .parallel import sampling

        return sampling.local_seen(rows, tp, -(-vocab // tp.degree))
    seen = np.zeros((len(rows), vocab), np.float32)
    for i, r in enumerate(rows):
        seen[i, r] = 1.0
    return paddle.to_tensor(seen)


def _special_ids(cfg, model, tokenizer):
    """(eos ids list, pad id): from cfg, else the tokenizer, else the model config."""
    eos = cfg.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id if tokenizer is not None else model.config.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = cfg.pad_token_id
    if pad is None:
        cands = (tokenizer.pad_token_id if tokenizer else None, model.config.pad_token_id,
                 eos[0] if eos else None)
        pad = next((x for x in cands if x is not None), 0)
    return eos, pad


@paddle.no_grad()
def generate(model, prompts, config=None, tokenizer=None, prefix=None, use_cache=True,
             return_logits=False, **kwargs):
    """Generate for a batch of prompts (lists of token ids). See the module docstring.

    `config` (GenerationConfig) with `kwargs` overriding its fields. eos/pad default to the
    tokenizer's, or the model config's. `prefix` = (keys, values), per layer
    [kv_heads, P, head_dim], starts every row from learned prefixes (prefix tuning); a model
    with a prefix-tuning encoder supplies its own. `use_cache=False` recomputes the whole
    sequence every step (the reference the cached path is tested against)."""
    cfg = GenerationConfig.from_kwargs(config, **kwargs)
    if not prompts or isinstance(prompts[0], (int, np.integer)):
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if cfg.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer to decode the output")
    eos, pad = _special_ids(cfg, model, tokenizer)
    eos_set = set(eos)
    prefix = _prefix_of(model, prefix)
    P = prefix[0][0].shape[1] if prefix else 0
    ids, mask, pos, lengths = _prepare(prompts, cfg, P, pad)
    B, N = ids.shape[0], cfg.max_new_tokens
    tp = getattr(model, "tensor_parallel", None)
    uniforms = None
    if cfg.decode_strategy == "sampling":
        rng = np.random.default_rng(cfg.seed if cfg.seed is not None else _fresh_seed(tp))
        uniforms = 1.0 - rng.random((B, N)).T
    V = model.config.vocab_size
    seen = _seen_mask(ids, lengths, V, tp) if cfg.repetition_penalty != 1.0 else None

    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    live = _LiveBatch(model, ids, mask, pos, P, N, prefix, use_cache, seen)
    out, logits_out = [[] for _ in range(B)], [[] for _ in range(B)]
    reasons = ["length"] * B
    stop_window = 8 + 4 * max((len(s) for s in cfg.stop), default=0)
    for step in range(N):
        logits = live.logits(step)
        u = None if uniforms is None else paddle.to_tensor(uniforms[step, live.rows].reshape([-1, 1]),
                                                           dtype="float32")
        tok = choose_tokens(logits, cfg, live.seen, u, tp, V)
        tok_np = tok.numpy()                     # the one host round-trip per step
        lg = logits.numpy() if return_logits else None
        done = []
        for j, r in enumerate(live.rows):
            out[r].append(int(tok_np[j]))
            if return_logits:
                logits_out[r].append(lg[j])
            if out[r][-1] in eos_set:
                reasons[r] = "eos"
            elif cfg.stop and _stop_hit(tokenizer, out[r], cfg.stop, stop_window):
                reasons[r] = "stop"
            else:
                continue
            done.append(j)
        live.advance(tok)
        if done:
            keep = [j for j in range(len(live.rows)) if j not in done]
            if not keep:
                break
            live.keep(keep)
    seconds = time.perf_counter() - t0
    if was_training:
        model.train()
    res = GenerateOutput(out, reasons, lengths.tolist(), seconds,
                         [np.stack(x) for x in logits_out] if return_logits else None)
    if tokenizer is not None:
        res.texts = [decode_output(tokenizer, s, cfg.stop, eos) for s in out]
    return res


def decode_output(tokenizer, ids, stops=(), eos=()):
    """Text of generated ids: EOS dropped, special tokens skipped, cut before a stop string."""
    ids = [i for i in ids if i not in set(eos)]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stops if s in text]
    return text[:min(cuts)] if cuts else text


# ------------------------------------------------------------------------------ loading, pipeline

def checkpoint_defaults(path, tokenizer):
    """eos/pad GenerationConfig fields a checkpoint implies: eos ids = generation_config.json's
    eos_token_id (an id or a list: Llama-3 / Qwen2 list end-of-turn ids there) + the
    tokenizer's eos + the chat template's end-of-turn token; pad = the tokenizer's pad."""
    import os

    from .io import read_json

    gen = os.path.join(path, "generation_config.json") if path else ""
    eos = read_json(gen).get("eos_token_id") if gen and os.path.isfile(gen) else None
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    from .data.chat_template import stop_token_ids

    try:
        ends = stop_token_ids(tokenizer)   # the template's end-of-turn id (if any) + EOS
    except Exception:   # a template that cannot render a plain user/assistant pair
        ends = [tokenizer.eos_token_id]
    for i in ends:
        if i is not None and i not in eos:
            eos.append(i)
    return {"eos_token_id": eos, "pad_token_id": tokenizer.pad_token_id}
