"""1-step smoke runs of the benchmarks so they cannot rot (timings are never asserted)."""
import os

from conftest import ROOT, run_script


def test_train_throughput_smoke():
    r = run_script([os.path.join(ROOT, "benchmarks", "train_throughput.py"), "--smoke"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| paddletune runtime tuning |" in r.stdout and "tokens/s" in r.stdout


def test_tensor_parallel_benchmark_smoke():
    r = run_script([os.path.join(ROOT, "benchmarks", "tensor_parallel.py"), "--smoke"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| peak RSS growth while loading (MiB) |" in r.stdout and "vs Megatron analytic" in r.stdout


def test_pipeline_recompute_benchmark_smoke():
    r = run_script([os.path.join(ROOT, "benchmarks", "pipeline_recompute.py"), "--smoke", "--steps", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| core_attn |" in r.stdout and "1F1B bubble" in r.stdout


def test_recompute_ab_smoke():
    r = run_script([os.path.join(ROOT, "benchmarks", "recompute_ab.py"), "--smoke"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(f"| 32 | {m} |" in r.stdout for m in ("off", "on, rerun", "on, reuse")), r.stdout


def test_lora_fold_ab_smoke():
    r = run_script([os.path.join(ROOT, "benchmarks", "lora_fold_ab.py"), "--smoke"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(f"| 32x2 | {m} |" in r.stdout for m in ("off", "on")), r.stdout
