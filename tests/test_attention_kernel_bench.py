"""1-step smoke run of benchmarks/long_context.py so it cannot rot (timings are never asserted)."""
import os

from conftest import ROOT, run_script


def test_long_context_benchmark_smoke():
    r = run_script([os.path.join(ROOT, "benchmarks", "long_context.py"), "--smoke", "--peers", "paddletune",
                    "--recompute", "on"])
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "| lora | 64 | on |" in out and "| lora | 128 | on |" in out and "| full | 64 | off |" in out
    assert "failed:" not in out and "skipped:" not in out
    assert "% of ceiling |" in out and "| 128 |" in out
