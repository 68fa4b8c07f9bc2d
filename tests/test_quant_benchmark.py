"""Smoke run of benchmarks/quant_memory.py (1 step, tiny model): it runs and prints its table;
the numbers themselves are not asserted (timing belongs to benchmarks, not tests) except the
byte columns, which are deterministic: nf4 holds < 0.15x the float32 backbone."""
import os

from conftest import ROOT, run_script


def test_quant_memory_benchmark_smoke():
    proc = run_script([os.path.join(ROOT, "benchmarks", "quant_memory.py"), "--hidden", "64",
                       "--layers", "2", "--intermediate", "128", "--vocab", "600", "--seq", "16",
                       "--batch", "2", "--steps", "1", "--algos", "none,nf4"])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("| ") and "MiB" not in line}
    assert set(rows) == {"float32 (plain LoRA)", "nf4"}
    assert float(rows["nf4"][0]) < 0.15 * float(rows["float32 (plain LoRA)"][0])
    assert "command: python benchmarks/quant_memory.py" in proc.stdout
