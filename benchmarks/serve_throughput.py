"""Serving throughput: requests/s and new tokens/s of llm/server.py at 1, 4 and 16 concurrent
streaming-free clients (greedy chat completions), against sequential decoding with
llm/predictor.py (--batch_size 1, the same prompts, the same max new tokens).

    python benchmarks/serve_throughput.py                                   # built-in tiny Qwen2
    python benchmarks/serve_throughput.py --model_name_or_path OUT --max_tokens 128 --clients 1,4,16
    python benchmarks/serve_throughput.py --url http://127.0.0.1:8000 --model NAME   # a running server

Each row: R = max(--requests, 2 x clients) requests sent by `clients` threads, each thread taking
the next prompt until all are sent; wall time from the first send to the last answer.
New tokens are the servers' usage.completion_tokens (answers may end early at EOS; predictor.py
stops there too). The server decodes concurrent requests together (--max_batch_size 16 here).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
PROMPTS = ["def read_file(path):", "The os module provides", "import json\n", "class Parser:",
           "Return the", "The following functions are available in the", "Open the file", "x = [1, 2"]


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", default="paddletune/tiny-qwen2")
    p.add_argument("--clients", default="1,4,16", help="concurrency levels")
    p.add_argument("--requests", type=int, default=16, help="requests per level at least")
    p.add_argument("--max_tokens", type=int, default=64, help="new tokens per answer at most")
    p.add_argument("--url", default=None, help="a running server (default: start llm/server.py)")
    p.add_argument("--model", default=None, help="with --url: the served model name")
    p.add_argument("--api_key", default=None, help="with --url: its key")
    p.add_argument("--smoke", action="store_true", help="2 requests of 4 tokens at 1 and 2 clients")
    return p.parse_args()


def run_level(url, model, key, clients, n, max_tokens):
    import httpx

    todo, lock, tokens, errors = list(range(n)), threading.Lock(), [0], []
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def worker():
        with httpx.Client(timeout=600) as c:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop(0)
                body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
                r = c.post(url + "/v1/chat/completions", json=body, headers=headers)
                if r.status_code != 200:
                    errors.append(r.text)
                    return
                with lock:
                    tokens[0] += r.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"error: the server answered {errors[0][:300]}")
    return n / wall, tokens[0] / wall


def predictor_baseline(model, n, max_tokens):
    """(requests/s, tokens/s) of llm/predictor.py answering the same n prompts one at a time
    (wall time after loading, as the script prints it)."""
    with tempfile.TemporaryDirectory() as d:
        data = os.path.join(d, "p.json")
        with open(data, "w") as f:
            for i in range(n):
                f.write(json.dumps({"src": PROMPTS[i % len(PROMPTS)]}) + "\n")
        r = subprocess.run([sys.executable, os.path.join(ROOT, "llm", "predictor.py"), "--model_name_or_path",
                            model, "--data_file", data, "--output_file", os.path.join(d, "out.json"),
                            "--decode_strategy", "greedy_search", "--max_length", str(max_tokens),
                            "--batch_size", "1"], capture_output=True, text=True, cwd=ROOT)
    m = re.search(r"generated (\d+) tokens in [\d.]+ s: [\d.]+ tokens/s \(wall ([\d.]+) s\)", r.stdout)
    if r.returncode or not m:
        raise SystemExit(f"error: predictor.py failed: {r.stderr[-2000:]}")
    tokens, wall = int(m.group(1)), float(m.group(2))
    return n / wall, tokens / wall


def main():
    a = parse()
    levels = [1, 2] if a.smoke else [int(x) for x in a.clients.split(",")]
    n_min, max_tokens = (2, 4) if a.smoke else (a.requests, a.max_tokens)
    server, url, model = None, a.url, a.model or a.model_name_or_path
    if url is None:
        from serve_util import ServerProcess

        server = ServerProcess(["--model_name_or_path", a.model_name_or_path, "--max_batch_size",
                                str(max(levels)), "--batch_window_ms", "20"])
        url = server.url
    try:
        run_level(url, model, a.api_key, 1, 1, max_tokens)   # warm-up
        rows = [(c, *run_level(url, model, a.api_key, c, max(n_min, 2 * c), max_tokens)) for c in levels]
    finally:
        if server is not None:
            server.stop()
    base = predictor_baseline(a.model_name_or_path if a.url is None else model, max(n_min, 2 * max(levels)),
                              max_tokens)
    print(f"`{' '.join(['python benchmarks/serve_throughput.py'] + sys.argv[1:])}` "
          f"({model}, greedy, <= {max_tokens} new tokens per answer)\n")
    print("| clients | requests/s | new tokens/s | tokens/s vs sequential predictor.py |")
    print("|---|---|---|---|")
    print(f"| predictor.py, sequential (batch_size 1) | {base[0]:.2f} | {base[1]:.1f} | 1.00x |")
    for c, rps, tps in rows:
        print(f"| {c} | {rps:.2f} | {tps:.1f} | {tps / base[1]:.2f}x |")


if __name__ == "__main__":
    main()
