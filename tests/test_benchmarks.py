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
    """p = 4 launched ranks, m = 8, v = 1 and 2 on fleet's engine. Checked from outside: the
    engine class fleet picked, every stage runs v x m forwards and backwards per step (its
    chunks of every micro-batch), and the replay of the recorded schedules at equal costs
    equals the analytic bubble (p-1)/(v m+p-1) on every stage (the replay's dependency model is
    the schedule fleet ran). Measured idle is printed, never asserted."""
    r = run_script([os.path.join(ROOT, "benchmarks", "pipeline_recompute.py"), "--smoke", "--steps", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| core_attn |" in r.stdout and "bubble (p-1)/(v m+p-1)" in r.stdout
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in r.stdout.splitlines()
            if line.startswith("| 1 | Pipeline") or line.startswith("| 2 | Pipeline")]
    p, m = 4, 8
    assert len(rows) == 2 * p, r.stdout
    for v_, engine, stage, bubble, equal, _replay, _idle, _stretch, _cpu, fb, _ms in rows:
        v = int(v_)
        assert engine == ("PipelineParallel" if v == 1 else "PipelineParallelWithInterleave"), engine
        assert abs(float(bubble) - (p - 1) / (v * m + p - 1)) < 1e-3 and abs(float(equal) - float(bubble)) < 1e-3
        assert fb == f"{v * m}, {v * m}", (stage, fb)
    assert sorted(int(row[2]) for row in rows) == sorted(list(range(p)) * 2)


def test_recompute_ab_smoke():
    r = run_script([os.path.join(ROOT, "benchmarks", "recompute_ab.py"), "--smoke"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(f"| 32 | {m} |" in r.stdout for m in ("off", "on, rerun", "on, reuse")), r.stdout


def test_pipeline_recompute_bad_input():
    """Settings paddle's interleaved schedule refuses: one error line naming the flag, exit 2,
    before any run (no table printed)."""
    script = os.path.join(ROOT, "benchmarks", "pipeline_recompute.py")
    for flags, named in ((["--pp-layers", "6"], "--pp-layers 6"), (["--pp", "2"], "--virtual 2 with --pp 2"),
                         (["--micro", "2"], "--micro 2")):
        r = run_script([script] + flags)
        assert r.returncode == 2, (flags, r.stderr[-2000:])
        assert [l for l in r.stderr.splitlines() if l.startswith("error:")] == \
            [l for l in r.stderr.splitlines() if named in l], r.stderr
        assert "|" not in r.stdout


def test_pipeline_replay_hand_worked():
    """The replay on a hand-worked 1F1B (p = 2, m = 2): stage 0 runs F0 F1 B0 B1, stage 1 F0 B0
    F1 B1. Costs F 1, B 2: s0 F0 [0,1], F1 [1,2]; s1 F0 [1,2], B0 [2,4], F1 [4,5], B1 [5,7];
    s0 B0 [4,6], B1 [7,9]: makespan 9, each stage busy 6. Uneven costs (stage 1 twice as slow):
    s0 F0 [0,1] F1 [1,2]; s1 F0 [1,3] B0 [3,7] F1 [7,9] B1 [9,13]; s0 B0 [7,9] B1 [13,15]."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ppr", os.path.join(ROOT, "benchmarks", "pipeline_recompute.py"))
    ppr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ppr)
    s0 = [("F", 0, 1.0), ("F", 0, 1.0), ("B", 0, 2.0), ("B", 0, 2.0)]
    s1 = [("F", 0, 2.0), ("B", 0, 4.0), ("F", 0, 2.0), ("B", 0, 4.0)]
    assert ppr.replay([s0, s1], 2, 1, cost=lambda k: 1.0 if k == "F" else 2.0) == (9.0, [6.0, 6.0])
    assert ppr.replay([s0, s1], 2, 1) == (15.0, [6.0, 12.0])
