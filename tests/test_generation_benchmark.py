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


def test_generate_throughput_profile_smoke():
    """--profile: per batch size, ours and transformers' ms per step with equal greedy ids, and
    the sections table (the head, the attention core and the token choice among them)."""
    r = run_script(["benchmarks/generate_throughput.py", "--profile", "--hidden_size", "64",
                    "--num_hidden_layers", "1", "--vocab_size", "300", "--new_tokens", "4",
                    "--prompt_length", "5", "--batch_sizes", "1", "3", "--repeats", "1", "--top", "50"],
                   timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    for b in (1, 3):
        assert f"batch {b}: paddletune" in out and "transformers generate" in out, out
    assert out.count("greedy ids equal") == 2, out
    tables = out.split("sections of one decode step")[1:]
    assert len(tables) == 2
    for t in tables:
        names = " ".join(l for l in t.splitlines()[2:] if l.startswith("  "))
        assert "Linear lm_head" in names and "attention core" in names and "token choice" in names, t
