"""The decode-step profile of generate_throughput.py --profile: ms per decode step of paddletune's
KV-cache greedy decode and of transformers' generate, and where our step's time goes.

Sections are timed with a stack of wall clocks: every sublayer's forward (pre/post hooks) and a
few functions of the decode path (wrapped while profiling) push on entry and pop on exit; a
section's *self* time is its wall time minus its timed children's, so the self times of one step
add up to the step. CPU ops run synchronously, so wall time is the ops' time plus the Python
around them. Per-step numbers are (run of N new tokens - run of 1) / (N - 1): the prompt
forward and the set-up are left out.
"""
import os
import time
from collections import defaultdict

import numpy as np


class Sections:
    """Self time per section name while active (see the module docstring)."""

    def __init__(self):
        self.self_s = defaultdict(float)
        self.stack = []            # [name, start, children's time]
        self.on = False

    def enter(self, name):
        if self.on:
            self.stack.append([name, time.perf_counter(), 0.0])

    def leave(self):
        if self.on and self.stack:
            name, t0, kids = self.stack.pop()
            wall = time.perf_counter() - t0
            self.self_s[name] += wall - kids
            if self.stack:
                self.stack[-1][2] += wall

    def wrap(self, owner, attr, name):
        """Time owner.attr (a function or method) as `name`; returns an undo callable."""
        orig = getattr(owner, attr)

        def timed(*args, **kw):
            self.enter(name)
            try:
                return orig(*args, **kw)
            finally:
                self.leave()

        setattr(owner, attr, timed)
        return lambda: setattr(owner, attr, orig)


def _section_name(name, layer):
    """'Linear q_proj' for model.layers.0.self_attn.q_proj: the class and its attribute."""
    return f"{type(layer).__name__} {name.split('.')[-1]}" if name else type(layer).__name__


def instrument(model, sec):
    """Hooks on every sublayer and wrappers on the decode path's functions; returns undo()."""
    from paddletune import generation
    from paddletune.models import cache, layers, llama, runner

    handles = []
    for name, layer in [("", model)] + list(model.named_sublayers()):
        label = "model forward (embedding hook, cache advance, glue)" if not name else _section_name(name, layer)
        handles.append(layer.register_forward_pre_hook(lambda m, i, n=label: sec.enter(n)))
        handles.append(layer.register_forward_post_hook(lambda m, i, o: sec.leave()))
    undo = [h.remove for h in handles]
    undo.append(sec.wrap(generation, "choose_tokens", "token choice (argmax)"))
    undo.append(sec.wrap(generation._LiveBatch, "advance", "next step's inputs (ids, positions)"))
    undo.append(sec.wrap(runner.CausalLM, "context", "context (rope tables, attention mask)"))
    undo.append(sec.wrap(cache.KVCache, "update", "KV cache write + read slice"))
    undo.append(sec.wrap(layers.RopeTables, "apply_heads_first", "rope on q, k"))
    undo.append(sec.wrap(llama, "attention", "attention core (q k^T, softmax, p v)"))
    return lambda: [u() for u in undo]


def _ours(model, prompts):
    from paddletune.generation import generate

    return lambda n: generate(model, prompts, max_new_tokens=n, eos_token_id=[]).sequences


def _theirs(hf, prompts):
    import torch

    x = torch.tensor(prompts)

    def run(n):
        with torch.no_grad():
            g = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)
        return g[:, x.shape[1]:].tolist()
    return run


def step_ms(run, n, repeats):
    """Best-of-`repeats` ms per decode step: (t(n) - t(1)) / (n - 1), runs alternating; also
    t(1) in ms (the prompt forward and the first token)."""
    run(2)
    t1, tn, ids = [], [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(1)
        t1.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ids = run(n)
        tn.append(time.perf_counter() - t0)
    return (min(tn) - min(t1)) / (n - 1) * 1e3, min(t1) * 1e3, ids


def _hf_model(path):
    try:
        import torch
        import transformers
    except ImportError:
        return None
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def profile(a, model, path):
    V, n = model.config.vocab_size, a.new_tokens
    hf = None if a.skip_transformers else _hf_model(path)
    load = os.getloadavg()[0]
    print(f"decode-step profile: prompt {a.prompt_length}, new tokens {n}, greedy, KV cache; "
          f"threads OMP={os.environ.get('OMP_NUM_THREADS')}; load average at start {load:.2f}")
    for B in a.batch_sizes:
        prompts = np.random.default_rng(0).integers(3, V, size=(B, a.prompt_length)).tolist()
        ours_ms, first, ids = step_ms(_ours(model, prompts), n, a.repeats)
        line = (f"\nbatch {B}: paddletune {ours_ms:.2f} ms/step ({B * 1e3 / ours_ms:.0f} new tok/s), "
                f"first token {first:.1f} ms")
        if hf is not None:
            hf_ms, hf_first, hf_ids = step_ms(_theirs(hf, prompts), n, a.repeats)
            line += (f"; transformers generate {hf_ms:.2f} ms/step ({B * 1e3 / hf_ms:.0f} new tok/s), "
                     f"first token {hf_first:.1f} ms; "
                     f"ratio {hf_ms / ours_ms:.2f}x; greedy ids {'equal' if hf_ids == ids else 'DIFFER'}")
        print(line)
        sec = Sections()
        undo = instrument(model, sec)
        try:
            runs = {}
            for k in (1, n):
                sec.self_s.clear()
                sec.on = True
                t0 = time.perf_counter()
                _ours(model, prompts)(k)
                sec.on = False
                runs[k] = (time.perf_counter() - t0, dict(sec.self_s))
        finally:
            undo()
        (t1, s1), (tn, sn) = runs[1], runs[n]
        per = {k: (sn.get(k, 0.0) - s1.get(k, 0.0)) / (n - 1) * 1e3 for k in sn}
        step = (tn - t1) / (n - 1) * 1e3
        per["generate loop (host read of the ids, bookkeeping)"] = step - sum(per.values())
        print(f"  sections of one decode step, self time (instrumented step {step:.2f} ms):")
        print(f"  {'section':58s} {'ms/step':>8s} {'share':>6s}")
        for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:a.top]:
            print(f"  {k:58s} {v:8.3f} {100 * v / step:5.1f}%")
