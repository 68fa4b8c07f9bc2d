"""Batched KV-cache decoding for the server: requests that arrive within a short window are
decoded together; rows leave the batch when they finish (EOS, a stop string, their own
max_tokens, or a cancelled client).

    engine = BatchEngine(model, tok, eos_ids, pad_id, max_batch_size=8, window_s=0.02)
    engine.start()
    req = engine.submit(prompt_ids, GenerationConfig(max_new_tokens=32), on_event)
    # on_event(token_id, finish_reason_or_None) is called from the engine thread per new token;
    # on_event(None, "error:<message>") if the batch failed. req.cancel() drops the row.

How a batch runs (B requests, longest prompt L, N = the largest max_new_tokens among them):
the prompts are left-padded and masked exactly as `generation.generate` does (same `_prepare`,
same `_LiveBatch`: position ids count real tokens only, so a padded row computes what it would
alone), one forward fills the cache [B, kv_heads, L+N, head_dim], then one step per token feeds
the B chosen ids [B, 1]. Token choice is per request (its own temperature / top_k / top_p);
rows with the same settings share one `choose_tokens` call. Sampling row i draws its uniforms
from numpy's default_rng(seed) as generate() does for a single prompt, so a seeded request gives
what `predictor.py --seed S` gives for that prompt alone.

Requests that arrive while a batch runs wait for the next one: joining a running batch would
need per-row cache lengths (models/cache.py has one length for all rows).
"""
import itertools
import logging
import queue
import threading
import time

import numpy as np
import paddle

from ..generation import GenerationConfig, _LiveBatch, _prefix_of, _prepare, _stop_hit, choose_tokens

logger = logging.getLogger("paddletune")


class Request:
    """One generation request: prompt ids, its GenerationConfig, and a callback for its tokens."""

    _ids = itertools.count(1)

    def __init__(self, prompt, cfg, on_event):
        self.id = next(self._ids)
        self.prompt, self.cfg, self.on_event = list(prompt), cfg, on_event
        self.tokens, self.finish_reason = [], None
        self.cancelled = threading.Event()

    def cancel(self):
        self.cancelled.set()


def sampling_key(cfg):
    """Rows whose token choice can run in one call share this key."""
    if cfg.decode_strategy == "greedy_search":
        return ("greedy",)
    return ("sampling", cfg.temperature, cfg.top_k, cfg.top_p)


class BatchEngine:
    def __init__(self, model, tokenizer, eos_ids, pad_id, max_batch_size=8, window_s=0.02):
        self.model, self.tok = model, tokenizer
        self.eos, self.pad = set(eos_ids), pad_id
        self.max_batch_size, self.window_s = max_batch_size, window_s
        self.queue = queue.Queue()
        self.stats = {"requests": 0, "batches": 0, "cancelled": 0, "tokens": 0, "running": 0,
                      "max_batch": 0}
        self._thread = None
        self.device = paddle.get_device()   # the engine thread runs where the model was loaded

    def start(self):
        self._thread = threading.Thread(target=self._loop, name="paddletune-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, prompt, cfg, on_event):
        req = Request(prompt, cfg, on_event)
        self.stats["requests"] += 1
        self.queue.put(req)
        return req

    def _gather(self):
        """Block for one request, then take whatever else arrives within the window."""
        batch = [self.queue.get()]
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_batch_size:
            left = deadline - time.monotonic()
            try:
                batch.append(self.queue.get(timeout=left) if left > 0 else self.queue.get_nowait())
            except queue.Empty:
                break
        return [r for r in batch if not self._drop_cancelled(r)]

    def _drop_cancelled(self, r):
        if r.cancelled.is_set():
            self.stats["cancelled"] += 1
            return True
        return False

    def _loop(self):
        paddle.set_device(self.device)
        while True:
            batch = self._gather()
            if not batch:
                continue
            self.stats["running"] = len(batch)
            self.stats["batches"] += 1
            self.stats["max_batch"] = max(self.stats["max_batch"], len(batch))
            try:
                self.run_batch(batch)
            except Exception as e:   # the server keeps serving; these requests get an error
                logger.exception("generation failed for a batch of %d", len(batch))
                for r in batch:
                    if r.finish_reason is None:
                        r.finish_reason = "error"
                        r.on_event(None, f"error:{type(e).__name__}: {e}")
            finally:
                self.stats["running"] = 0

    @paddle.no_grad()
    def run_batch(self, reqs):
        """Decode `reqs` together until every row has finished (see the module docstring)."""
        model = self.model
        prefix = _prefix_of(model, None)
        P = prefix[0][0].shape[1] if prefix else 0
        N = max(r.cfg.max_new_tokens for r in reqs)
        ids, mask, pos, _ = _prepare([r.prompt for r in reqs], GenerationConfig(max_new_tokens=N), P,
                                     self.pad)
        # uniforms [B, N]: row i as generate() draws them for that prompt alone with its seed
        uniforms = np.ones((len(reqs), N))
        for i, r in enumerate(reqs):
            if r.cfg.decode_strategy == "sampling":
                seed = r.cfg.seed if r.cfg.seed is not None else np.random.randint(2**31)
                n = r.cfg.max_new_tokens
                uniforms[i, :n] = 1.0 - np.random.default_rng(seed).random((1, n))[0]
        live = _LiveBatch(model, ids, mask, pos, P, N, prefix, True, None)
        stop_windows = [8 + 4 * max((len(s) for s in r.cfg.stop), default=0) for r in reqs]
        for step in range(N):
            logits = live.logits(step)
            tok = self._choose(logits, [reqs[r] for r in live.rows], uniforms[live.rows, step])
            tok_np = tok.numpy()
            done = []
            for j, r in enumerate(live.rows):
                req = reqs[r]
                t = int(tok_np[j])
                req.tokens.append(t)
                reason = None
                if t in self.eos:
                    reason = "eos"
                elif req.cfg.stop and _stop_hit(self.tok, req.tokens, req.cfg.stop, stop_windows[r]):
                    reason = "stop"
                elif len(req.tokens) >= req.cfg.max_new_tokens:
                    reason = "length"
                self.stats["tokens"] += 1
                if reason is None and req.cancelled.is_set():
                    reason = "cancelled"
                    self.stats["cancelled"] += 1
                req.finish_reason = reason
                req.on_event(t, reason)
                if reason is not None:
                    done.append(j)
            live.advance(tok)
            if done:
                keep = [j for j in range(len(live.rows)) if j not in done]
                if not keep:
                    break
                live.keep(keep)
                self.stats["running"] = len(keep)

    def _choose(self, logits, rows, u):
        """Next ids [live] for logits [live, V]: one choose_tokens call per group of rows with
        the same sampling settings (greedy rows: one argmax)."""
        groups = {}
        for j, req in enumerate(rows):
            groups.setdefault(sampling_key(req.cfg), []).append(j)
        def uniforms(idx):   # greedy rows draw nothing (no tensor to build each step)
            if rows[idx[0]].cfg.decode_strategy != "sampling":
                return None
            return paddle.to_tensor(u[idx].reshape([-1, 1]), dtype="float32")

        if len(groups) == 1:
            return choose_tokens(logits, rows[0].cfg, None, uniforms(list(range(len(rows)))))
        out = paddle.zeros([len(rows)], dtype="int64")
        for idx in groups.values():
            index = paddle.to_tensor(idx, dtype="int64")
            chosen = choose_tokens(paddle.gather(logits, index), rows[idx[0]].cfg, None, uniforms(idx))
            out = paddle.scatter(out, index, chosen.astype("int64"))
        return out
