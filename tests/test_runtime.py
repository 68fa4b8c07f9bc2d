"""CPU runtime set-up before paddle is imported: threads = physical cores (divided among local
processes), MKL_DEBUG_CPU_TYPE=5 on AMD, user settings respected, the choice logged."""
import dataclasses
import json
import os
import subprocess

import pytest

from conftest import ROOT, launch, run_script

PROBE = ("import os, json, paddletune; "
         "print(json.dumps({k: os.environ.get(k) for k in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'MKL_DEBUG_CPU_TYPE')}))")
KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DEBUG_CPU_TYPE")


def lscpu_cores_and_vendor():
    """Independent reading of the machine: unique (socket, core) pairs from `lscpu -p`."""
    out = subprocess.run(["lscpu", "-p=CORE,SOCKET"], capture_output=True, text=True).stdout
    cores = {tuple(l.split(",")) for l in out.splitlines() if l and not l.startswith("#")}
    vendor = [l.split(":", 1)[1].strip() for l in subprocess.run(["lscpu"], capture_output=True, text=True)
              .stdout.splitlines() if l.startswith("Vendor ID")][0]
    return len(cores), vendor


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    env.update(extra)
    return env


def probe(env):
    r = run_script(["-c", PROBE], env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_defaults_follow_the_machine():
    cores, vendor = lscpu_cores_and_vendor()
    got = probe(clean_env())
    assert got["OMP_NUM_THREADS"] == got["MKL_NUM_THREADS"] == str(cores)
    assert got["MKL_DEBUG_CPU_TYPE"] == ("5" if vendor == "AuthenticAMD" else None)


def test_user_settings_win():
    got = probe(clean_env(OMP_NUM_THREADS="1", MKL_DEBUG_CPU_TYPE="0"))
    assert got["OMP_NUM_THREADS"] == "1" and got["MKL_DEBUG_CPU_TYPE"] == "0"


def test_threads_shared_among_launched_processes(tmp_path):
    cores, _ = lscpu_cores_and_vendor()
    script = tmp_path / "probe.py"
    script.write_text(PROBE.replace("; ", "\n"))
    r = launch([str(script)], nproc=2, env=clean_env(), log_dir=tmp_path / "log")
    assert r.returncode == 0
    for rank in (0, 1):
        line = [l for l in open(tmp_path / "log" / f"workerlog.{rank}") if l.startswith("{")][-1]
        assert json.loads(line)["OMP_NUM_THREADS"] == str(max(1, cores // 2))


def test_choice_is_logged_by_the_finetune_script(tmp_path):
    r = run_script([os.path.join(ROOT, "llm", "finetune_generation.py"), os.path.join(ROOT, "llm", "llama", "sft_argument.json"),
                    "--output_dir", str(tmp_path / "o"), "--max_steps", "1", "--do_eval", "false",
                    "--save_strategy", "no", "--evaluation_strategy", "no", "--load_best_model_at_end", "false"],
                   env=clean_env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert "CPU runtime: OMP_NUM_THREADS=" in r.stdout


STRIDE_PROBE = ("import paddletune, paddle; x = paddle.ones([2, 3]); "
                "print(paddle.get_flags(['FLAGS_use_stride_kernel'])['FLAGS_use_stride_kernel'], x.T.is_contiguous())")


def test_strided_views_off_unless_the_user_sets_the_flag():
    """CPU builds: paddletune turns paddle's strided views off (a transpose is then a contiguous
    copy, which paddle's CPU matmul reads fast); an explicit FLAGS_use_stride_kernel wins, and the
    environment is left untouched so child processes keep paddle's default."""
    env = {k: v for k, v in os.environ.items() if k != "FLAGS_use_stride_kernel"}
    r = run_script(["-c", STRIDE_PROBE + "; import os; print(os.environ.get('FLAGS_use_stride_kernel'))"], env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-3:] == ["False", "True", "None"]
    r = run_script(["-c", STRIDE_PROBE], env=dict(env, FLAGS_use_stride_kernel="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-2:] == ["True", "False"]


def test_choices_are_one_immutable_record():
    """configure_cpu_env decides once and returns a frozen record; paddletune.RUNTIME extends it
    with the strided-views choice, and log_runtime logs that record."""
    import paddletune
    from paddletune import runtime

    first = runtime.configure_cpu_env()
    assert runtime.configure_cpu_env() is first
    assert isinstance(paddletune.RUNTIME, runtime.RuntimeChoices)
    assert paddletune.RUNTIME.items[:len(first.items)] == first.items
    with pytest.raises(dataclasses.FrozenInstanceError):
        paddletune.RUNTIME.items = ()
    assert first.plus("x", 1).items[-1] == ("x", "1") and first.plus("x", 1) is not first
