"""Smoke run of benchmarks/generate_throughput.py (tiny sizes; timing is never asserted)."""
from conftest import run_script


def test_generate_throughput_smoke():
    r = run_script(["benchmarks/generate_throughput.py", "--hidden_size", "64", "--num_hidden_layers", "1",
                    "--vocab_size", "300", "--new_tokens", "6", "--prompt_length", "5",
                    "--batch_size", "2", "--repeats", "1"], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert any(l.startswith("paddletune, KV cache") for l in lines)
    rows = [l for l in lines if l.startswith(("paddletune, no cache", "transformers"))]
    assert len(rows) == 2 and all(l.rstrip().endswith("equal") for l in rows), r.stdout
    assert any(l.startswith("command: python benchmarks/generate_throughput.py") for l in lines)
