"""Generation throughput: paddletune with the KV cache, without it (full recomputation every
step), and transformers' generate on the same checkpoint. Greedy, fixed length (EOS ignored).

    python benchmarks/generate_throughput.py                      # tiny Llama built on the fly
    python benchmarks/generate_throughput.py --model_name_or_path DIR --batch_size 4 --new_tokens 256

Prints a table (new tokens per second, best of --repeats) and whether the ids agree.
transformers/torch are optional (only for the comparison row).

    python benchmarks/generate_throughput.py --profile --batch_sizes 1 8 --new_tokens 64

--profile: the decode-step profile instead. For each batch size: ms per decode step of ours
(greedy, KV cache) and of transformers' generate (same prompts, new tokens, threads), then the
sections of our step by inclusive time (layer forward hooks: CPU ops run synchronously, so a
hook's wall time is the section's time; the token choice and the one host read are timed by
wrapping them). Ms per step = (time of an N-token run - time of a 1-token run) / (N - 1), so the
prompt forward is left out of the per-step numbers.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import paddletune  # noqa: E402  (sets CPU threads before paddle is imported)

import numpy as np  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", default=None, help="HF checkpoint dir; default: a random tiny Llama")
    p.add_argument("--hidden_size", type=int, default=256, help="tiny model: hidden size")
    p.add_argument("--num_hidden_layers", type=int, default=4, help="tiny model: decoder layers")
    p.add_argument("--vocab_size", type=int, default=32000, help="tiny model: vocabulary")
    p.add_argument("--batch_size", type=int, default=1, help="prompts per batch")
    p.add_argument("--prompt_length", type=int, default=32, help="prompt tokens per row")
    p.add_argument("--new_tokens", type=int, default=256, help="tokens generated per row")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per row (best is kept)")
    p.add_argument("--skip_uncached", action="store_true", help="skip the recomputation row")
    p.add_argument("--skip_transformers", action="store_true", help="skip the transformers row")
    p.add_argument("--profile", action="store_true", help="decode-step profile (see above)")
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8], help="--profile: batch sizes")
    p.add_argument("--top", type=int, default=12, help="--profile: sections listed")
    return p.parse_args()


def tiny_checkpoint(a, out):
    from paddletune.models import build_model, save_pretrained

    cfg = {"model_type": "llama", "vocab_size": a.vocab_size, "hidden_size": a.hidden_size,
           "intermediate_size": a.hidden_size * 11 // 4, "num_hidden_layers": a.num_hidden_layers,
           "num_attention_heads": max(1, a.hidden_size // 64), "num_key_value_heads": max(1, a.hidden_size // 128),
           "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2}
    save_pretrained(build_model(cfg, seed=0), out, dtype="float32")
    return out


def best_time(fn, repeats):
    fn(warmup=True)
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn(warmup=False)
        times.append(time.perf_counter() - t0)
    return min(times), result


def main():
    a = parse()
    from paddletune.generation import generate
    from paddletune.loading import load_model

    tmp = None
    path = a.model_name_or_path
    if path is None:
        tmp = tempfile.mkdtemp(prefix="gen-bench-")
        path = tiny_checkpoint(a, tmp)
    model = load_model(path)
    if a.profile:
        from decode_profile import profile

        profile(a, model, path)
        print("command: python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]))
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    V = model.config.vocab_size
    prompts = np.random.default_rng(0).integers(3, V, size=(a.batch_size, a.prompt_length)).tolist()
    n_new = a.batch_size * a.new_tokens
    rows = []

    def ours(use_cache):
        def run(warmup):
            n = 4 if warmup else a.new_tokens
            return generate(model, prompts, max_new_tokens=n, eos_token_id=[], use_cache=use_cache).sequences
        return run

    t_c, ids_c = best_time(ours(True), a.repeats)
    rows.append(("paddletune, KV cache", t_c, "reference"))
    if not a.skip_uncached:
        t_u, ids_u = best_time(ours(False), 1)
        rows.append(("paddletune, no cache (recompute)", t_u, "equal" if ids_u == ids_c else "DIFFER"))
    if not a.skip_transformers:
        try:
            import torch
            import transformers
        except ImportError:
            print("transformers/torch not installed: skipping that row")
        else:
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            x = torch.tensor(prompts)

            def run(warmup):
                n = 4 if warmup else a.new_tokens
                with torch.no_grad():
                    g = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                    min_new_tokens=n, do_sample=False, pad_token_id=0)
                return g[:, x.shape[1]:].tolist()

            t_h, ids_h = best_time(run, a.repeats)
            rows.append((f"transformers {transformers.__version__} generate (torch)", t_h,
                         "equal" if ids_h == ids_c else "DIFFER"))
    c = model.config
    print(f"\nmodel: {path if a.model_name_or_path else 'random tiny llama'} (hidden {c.hidden_size}, "
          f"{c.num_hidden_layers} layers, vocab {V}); batch {a.batch_size}, prompt {a.prompt_length}, "
          f"new tokens {a.new_tokens}; threads OMP={os.environ.get('OMP_NUM_THREADS')}")
    print(f"{'run':44s} {'seconds':>9s} {'new tok/s':>10s} {'vs cache':>9s}  greedy ids")
    for name, t, same in rows:
        print(f"{name:44s} {t:9.3f} {n_new / t:10.1f} {t_c / t:8.2f}x  {same}")
    print("command: python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]))
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
