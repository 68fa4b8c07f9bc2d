"""Issue 33: hostile model files (item 1), a user's stop (3), orphan workers (2), leftovers (4),
pre-training mixtures (6), lazy data checked up front (5), smaller items (7).

Hostile-file cases run the real CLI in subprocesses under a memory limit (RLIMIT_AS), so a case
cannot pass by having memory to spare; subprocess timeouts are hang guards, not speed claims."""
import json
import os
import resource
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "llm", "finetune_generation.py")
SFT = os.path.join(ROOT, "llm", "llama", "sft_argument.json")
QUICK = ["--do_eval", "false", "--evaluation_strategy", "no", "--save_strategy", "no",
         "--load_best_model_at_end", "false", "--disable_tqdm", "true", "--per_device_train_batch_size", "2",
         "--src_length", "64", "--max_length", "128", "--max_steps", "1"]
MEMORY_LIMIT = 2 << 30   # address space: `import paddle` + a tiny model's run fits in ~1.5 GB


def _limit():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def start_cli(model_dir, out_dir, *extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, SCRIPT, SFT, "--model_name_or_path", str(model_dir),
                             "--output_dir", str(out_dir)] + QUICK + list(extra),
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_limit)


def finish_cli(p, label, timeout):
    """(stdout, stderr) of a start_cli process; the test fails naming `label` if it still runs
    after `timeout` s (a hang guard, not a speed claim)."""
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        pytest.fail(f"{label}: still running after {timeout} s: {err[-2000:]}")


def tiny_model(dst):
    from paddletune.models import resolve_model_path

    shutil.copytree(resolve_model_path("paddletune/tiny-llama"), dst)
    return dst


def edit_json(path, **changes):
    d = json.load(open(path))
    d.update(changes)
    json.dump(d, open(path, "w"))


def _overlap(d):
    """model.safetensors whose header puts two tensors over the same bytes."""
    f = d / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    a, b = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]   # same shape and dtype: sizes agree
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def _huge(d):
    """A consistent 7B-sized checkpoint (sparse: ~no disk) with 64 layers: ~50 GiB of float32
    weights, beyond this host (the test is skipped on a host with more memory than that)."""
    H, I, V, L = 4096, 11008, 600, 64
    edit_json(d / "config.json", hidden_size=H, intermediate_size=I, num_hidden_layers=L,
              num_attention_heads=32, num_key_value_heads=32)
    shapes = {"model.embed_tokens.weight": [V, H], "lm_head.weight": [V, H], "model.norm.weight": [H]}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": [H], p + "post_attention_layernorm.weight": [H],
                       p + "mlp.gate_proj.weight": [I, H], p + "mlp.up_proj.weight": [I, H],
                       p + "mlp.down_proj.weight": [H, I]})
        shapes.update({p + f"self_attn.{x}_proj.weight": [H, H] for x in "qkvo"})
    header, at = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + size]}
        at += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(d / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + at)
    return at


def _template(src):
    def make(d):
        edit_json(d / "tokenizer_config.json", chat_template=src)
    return make


def _merges(d):
    tj = json.load(open(d / "tokenizer.json"))
    tj["model"]["merges"] = [["a", "b"]] * 300000
    json.dump(tj, open(d / "tokenizer.json", "w"))


HOSTILE = {
    # name: (change to the model directory, the file the error must name, words in the error)
    "config_dev_zero": (lambda d: (os.unlink(d / "config.json"), os.symlink("/dev/zero", d / "config.json")),
                        "config.json", "is a device, not a regular file"),
    "tokenizer_fifo": (lambda d: (os.unlink(d / "tokenizer.json"), os.mkfifo(d / "tokenizer.json")),
                       "tokenizer.json", "is a FIFO, not a regular file"),
    "tokenizer_config_dev_zero": (lambda d: (os.unlink(d / "tokenizer_config.json"),
                                             os.symlink("/dev/zero", d / "tokenizer_config.json")),
                                  "tokenizer_config.json", "not a regular file"),
    "layers_1e7": (lambda d: edit_json(d / "config.json", num_hidden_layers=10 ** 7),
                   "config.json", "'num_hidden_layers' is 10000000, above 1024"),
    "vocab_1e10": (lambda d: edit_json(d / "config.json", vocab_size=10 ** 10),
                   "config.json", "'vocab_size' is 10000000000, above 2147483647"),
    "nested_ranges": (_template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                "{% endfor %}{{ messages[0]['content'] }}"),
                      "tokenizer_config.json chat_template", "render budget"),
    "recursive_macro": (_template("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}"),
                        "tokenizer_config.json chat_template", "recurses without end"),
    "range_1e9": (_template("{% for i in range(10**9) %}{% endfor %}"),
                  "tokenizer_config.json chat_template", "Range too big"),
    "merges": (_merges, "tokenizer.json", "300000 BPE merges"),
    "overlap": (_overlap, "model.safetensors", "overlap in the safetensors header"),
    "huge": (_huge, "config.json", "GiB) per rank"),
}


def test_hostile_model_files_one_error_each(tmp_path):
    """Each hostile model directory: exit 2 and one error line naming the file, under a 2 GB
    address-space limit; all cases run at once (one `import paddle` each)."""
    from paddletune.models.memory import host_memory

    procs = {}
    for name, (damage, _, _) in HOSTILE.items():
        d = tiny_model(tmp_path / name)
        size = damage(d)
        if name == "huge" and host_memory() and size < host_memory():
            continue   # this host could hold it
        procs[name] = (d, start_cli(d, tmp_path / f"out-{name}"))
    for name, (d, p) in procs.items():
        out, err = finish_cli(p, name, 240)
        _, fname, words = HOSTILE[name]
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert p.returncode == 2 and len(lines) == 1, f"{name}: rc {p.returncode}\n{err[-3000:]}"
        assert str(d / fname) in lines[0] and words in lines[0], f"{name}: {lines[0]}"
        assert "Traceback" not in err, name


def test_weight_bytes_is_the_built_models_size():
    """The pure estimate against the lazily built models' parameter counts (oracle), and split
    by the layout: tp halves the matrices, pp halves the layers."""
    from paddletune.models import build_model, load_config, resolve_model_path
    from paddletune.models.memory import weight_bytes

    for name in ("paddletune/tiny-llama", "paddletune/tiny-mixtral"):
        _, cfg = load_config(resolve_model_path(name))
        exact = sum(int(np.prod(p.shape)) for p in build_model(cfg).parameters()) * 4
        est, _ = weight_bytes(cfg)
        assert abs(est - exact) <= 0.01 * exact, (name, est, exact)
    _, cfg = load_config(resolve_model_path("paddletune/tiny-llama"))
    full, parts = weight_bytes(cfg)
    tp2, _ = weight_bytes(cfg, tp=2)
    pp2, parts2 = weight_bytes(cfg, pp=2)
    assert parts2["num_hidden_layers"][1] == parts["num_hidden_layers"][1] / 2
    assert tp2 < 0.55 * full and pp2 < full
    nf4, _ = weight_bytes(cfg, algo="nf4")
    assert nf4 < full


# ------------------------------------------------------------------ 3 and 2: stops and orphans

TRAIN = ["--do_eval", "false", "--evaluation_strategy", "no", "--load_best_model_at_end", "false",
         "--disable_tqdm", "true", "--per_device_train_batch_size", "2", "--src_length", "64",
         "--max_length", "128", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2"]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _wait_for(path, proc, ready=None, timeout=240):
    """Until `path` exists (and ready(path) holds), the process ends or the time is up."""
    import time

    def done():
        return os.path.exists(path) and (ready is None or ready(path))

    deadline = time.time() + timeout
    while not done() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.3)
    return done()


def _start_launch(out, logs, steps, *extra):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return subprocess.Popen(
        [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--master",
         f"127.0.0.1:{port}", "--log_dir", str(logs), SCRIPT, SFT, "--output_dir", str(out),
         "--max_steps", str(steps)] + TRAIN + list(extra), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)


def _checkpoint_at_least(step):
    """ready(out): a checkpoint-N with N >= step is in out (whatever save_total_limit removed)."""
    def ready(out):
        return any(n.startswith("checkpoint-") and n.split("-", 1)[1].isdigit() and
                   int(n.split("-", 1)[1]) >= step for n in os.listdir(out))
    return ready


def _workers(launcher_pid):
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == launcher_pid:
                kids.append(int(d))
    return kids


def _gone(pids, timeout=60):
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and
                 open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
        if not alive:
            return []
        time.sleep(0.5)
    return alive


def _final_weights(out):
    from paddletune.models.hf import SafetensorsFile

    f = SafetensorsFile(str(out / "model.safetensors"))
    return {k: f.get(k) for k in f.keys()}


def test_launcher_killed_then_stopped_then_resumed_exactly(tmp_path):
    """A 2-rank job: SIGKILL of the launcher's process group ends both workers (within 60 s,
    each saying so with exit 143); the rerun stopped by a user's SIGINT to the launcher says
    "stopped by the launcher" on each rank (exit 143, no "another rank failed"); a third run
    finishes, and its model equals that of an uninterrupted run (resumed exactly)."""
    import signal

    # 40 steps: a tiny model trains ~10 steps a second on an idle machine, and save_total_limit 1
    # removes checkpoint-N once N + 2 is written, so the test waits for any checkpoint, not one
    # name (waiting for checkpoint-2 of a 12-step run failed in CI: the run had finished).
    out, steps = tmp_path / "out", 40
    job = _start_launch(out, tmp_path / "log1", steps)
    try:
        assert _wait_for(out, job, _checkpoint_at_least(2)), open(tmp_path / "log1" / "workerlog.0").read()[-3000:]
        workers = _workers(job.pid)
        assert len(workers) == 2, workers
        os.killpg(job.pid, signal.SIGKILL)      # the launcher and its group; workers have their own
        job.wait(timeout=30)
        assert _gone(workers) == [], "workers outlived their launcher by 60 s"
    finally:
        for p in _workers(job.pid):
            os.kill(p, signal.SIGKILL)
    for r in (0, 1):
        log = open(tmp_path / "log1" / f"workerlog.{r}").read()
        assert f"rank {r} of 2: the launcher (PID {job.pid}) is gone; stopping at step" in log, log[-2000:]
        assert "rerun the same command to resume (exit 143)" in log
        assert "Traceback" not in log
    from paddletune.stopping import newest_checkpoint

    resumed = int(newest_checkpoint(str(out)).rsplit("-", 1)[1])
    job = _start_launch(out, tmp_path / "log2", steps)
    try:
        assert _wait_for(out, job, _checkpoint_at_least(resumed + 2))
        os.kill(job.pid, signal.SIGINT)          # a user's Ctrl-C to the launcher
        job.wait(timeout=90)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    for r in (0, 1):
        log = open(tmp_path / "log2" / f"workerlog.{r}").read()
        line = [x for x in log.splitlines() if "stopped by the launcher" in x]
        assert len(line) == 1 and line[0].startswith(f"rank {r} of 2 stopped by the launcher (SIGTERM) at step "), log[-2000:]
        assert "newest checkpoint" in line[0] and line[0].endswith("rerun the same command to resume (exit 143)")
        assert "another rank" not in log and "Traceback" not in log
        assert f"RESUMING from {out}/checkpoint-{resumed} " in log or r == 1
    job = _start_launch(out, tmp_path / "log3", steps)
    assert job.wait(timeout=300) == 0, open(tmp_path / "log3" / "workerlog.0").read()[-3000:]
    ref = _start_launch(tmp_path / "ref", tmp_path / "logref", steps)
    assert ref.wait(timeout=300) == 0
    a, b = _final_weights(out), _final_weights(tmp_path / "ref")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_failure_markers_of_earlier_jobs_are_swept_at_claim(tmp_path, monkeypatch):
    """A launched rank's failure marker goes into the job's output_dir (not /tmp); taking the
    output_dir lock removes markers older than this process (an earlier job's), keeps newer ones;
    an old marker is not read as this job's failure. (The launched case: test_reliability_launch.)"""
    import time

    from paddletune import outdir, stopping

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "127.0.0.1:1,127.0.0.1:2")
    monkeypatch.setitem(stopping.STATE, "job_dir", None)
    stopping.mark_failed(1)                       # no output_dir known yet: nothing written
    stopping.job_dir(str(out))
    stopping.mark_failed(1)
    mine = [p for p in out.iterdir() if p.name.startswith(".paddletune-failed-")]
    assert len(mine) == 1 and mine[0].read_text() == "1 2\n"
    assert stopping._failed_rank() == ("1", 2)
    old = out / ".paddletune-failed-0123456789ab"
    old.write_text("0\n")
    os.utime(old, (time.time() - 10 ** 6,) * 2)
    os.utime(mine[0], (time.time() - 10 ** 6,) * 2)
    monkeypatch.setitem(stopping._LAUNCHER, "started", time.time() - 100)
    assert stopping._failed_rank() is None        # older than this job's launcher
    os.utime(mine[0])
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "1")   # claim as a single process: since its start
    lock = outdir.claim(str(out))
    outdir.release(lock)
    assert sorted(p.name for p in out.iterdir()) == [mine[0].name]


def test_refused_resume_under_pipeline_parallel_exits_2(tmp_path, capsys):
    """A checkpoint (written by one process) whose shards.json gives a layer-3 tensor a wrong
    shape, resumed by a 2-stage pipeline job: stage 1 (rank 1, layers 2-3) refuses it; rank 0,
    waiting for stage 1, is stopped by the launcher and says another rank failed. The job exits
    2, the code of bad input, not 143 (rank 0's SIGTERM; 241 before the handlers): the launcher
    reports the lowest rank's code, so rank 0 leaves with the failed rank's."""
    from conftest import load_script

    out, steps = tmp_path / "out", 4
    ft = load_script("llm/finetune_generation.py")
    assert ft.main([SFT, "--output_dir", str(out), "--max_steps", "2"] + TRAIN) == 0
    capsys.readouterr()
    shards = out / "checkpoint-2" / "shards.json"
    index = json.load(open(shards))
    index["model"]["model.layers.3.input_layernorm.weight"]["global_shape"] = [129]
    json.dump(index, open(shards, "w"))
    job = _start_launch(out, tmp_path / "log", steps, "--pipeline_parallel_degree", "2")
    assert job.wait(timeout=300) == 2
    logs = [open(tmp_path / "log" / f"workerlog.{r}").read() for r in (0, 1)]
    errors = [[x for x in log.splitlines() if x.startswith("error:")] for log in logs]
    assert errors[1] == [f"error: {out}/checkpoint-2: model.layers.3.input_layernorm.weight has shape [129], "
                         "model has [128] (rank 1 of 2)"], logs[1][-2000:]
    assert len(errors[0]) == 1 and (errors[0][0].endswith("another rank of this job failed (rank 1: its "
                                                          "error is above, or in its workerlog) (exit 2)")
                                    or "lost the connection" in errors[0][0]), logs[0][-2000:]
    assert "Traceback" not in logs[0] + logs[1]


def test_single_process_sigint_is_one_line_exit_130(tmp_path):
    """Ctrl-C in a single process: one line naming the step and newest checkpoint, exit 130, the
    output_dir lock released; no paddle internals printed."""
    import signal

    out = tmp_path / "out"
    # the output goes to files, as to a terminal that reads it: an unread pipe fills up (64 KiB of
    # per-step log lines) and blocks the run in its next print, before the checkpoint shows up
    with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
        p = subprocess.Popen([sys.executable, SCRIPT, SFT, "--output_dir", str(out), "--max_steps", "100000"]
                             + TRAIN, cwd=ROOT, env=_env(), stdout=so, stderr=se, text=True)
        try:
            # any checkpoint: save_total_limit 1 rotates checkpoint-2 away within milliseconds
            assert _wait_for(out, p, lambda d: any(n.startswith("checkpoint-") for n in os.listdir(d)))
            p.send_signal(signal.SIGINT)
            p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
    err = (tmp_path / "stderr").read_text()
    lines = [x for x in err.splitlines() if x.strip()]
    assert p.returncode == 130, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("stopped by the user (SIGINT) at step "), err[-2000:]
    assert f"newest checkpoint {out}/checkpoint-" in lines[0]
    assert lines[0].endswith("rerun the same command to resume (exit 130)")
    assert not (out / ".paddletune.lock").exists()


SIGACTION_PROBE = r"""
import ctypes, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(256)          # struct sigaction; sa_handler is its first field
def handler(sig):
    assert libc.sigaction(sig, None, buf) == 0
    return ctypes.c_void_p.from_buffer(buf).value
signal.signal(signal.SIGUSR2, lambda *a: None)   # a handler installed by Python: its C address
python_handler = handler(signal.SIGUSR2)
import paddle
before = handler(signal.SIGTERM)                 # paddle's own C handler
from paddletune import stopping
stopping.install()
print(before not in (None, 0) and before != python_handler, handler(signal.SIGTERM) == python_handler,
      handler(signal.SIGINT) == python_handler)
"""


def test_handlers_are_ours_after_paddle_by_sigaction():
    """The real disposition (sigaction), not signal.getsignal: paddle's import leaves its own C
    handler on SIGTERM; after install() SIGTERM and SIGINT run Python's (ours)."""
    r = subprocess.run([sys.executable, "-c", SIGACTION_PROBE], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["True", "True", "True"], r.stdout + r.stderr[-2000:]


# ------------------------------------------------------------------ 4: leftovers

KILLED_EXPORT = r"""
import os, signal, sys
from paddletune.io import publish_into
with publish_into(sys.argv[1]) as tmp:
    with open(os.path.join(tmp, "model-00001-of-00002.safetensors"), "wb") as f:
        f.write(b"\0" * 100000)
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)     # killed mid-write, as a final export can be
"""


def test_leftovers_of_a_killed_export_and_log_of_a_killed_run(tmp_path, capsys):
    """A save killed mid-write leaves .tmp-save-<pid>-...; the next run (under the lock) removes
    it, keeps the temp dir of a live owner and anything else; a run restarted after being killed
    before its first checkpoint does not repeat its records in train_log.jsonl."""
    import socket

    from conftest import load_script
    from paddletune.io import clean_dead_saves

    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, "-c", KILLED_EXPORT, str(out)], env=_env(), timeout=60)
    assert r.returncode == -9
    dead = [n for n in os.listdir(out) if n.startswith(".tmp-save-")]
    assert len(dead) == 1 and os.listdir(out / dead[0]) == ["model-00001-of-00002.safetensors"]
    live = out / f".tmp-save-{os.getpid()}-{socket.gethostname()}-abcdefgh"   # this process: alive
    live.mkdir()
    (out / "notes.txt").write_text("mine")
    assert clean_dead_saves(str(out)) == [str(out / dead[0])]
    assert sorted(os.listdir(out)) == sorted([live.name, "notes.txt"])
    # a legacy temp dir (no owner recorded) goes only at the start of a run, under the lock
    (out / ".tmp-save-q1w2e3r4").mkdir()
    assert clean_dead_saves(str(out)) == [] and (out / ".tmp-save-q1w2e3r4").exists()
    # the run: killed before its first checkpoint (its log has steps 1, 2), then started again
    (out / "train_log.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2)))
    ft = load_script("llm/finetune_generation.py")
    code = ft.main([SFT, "--output_dir", str(out), "--max_steps", "3", "--save_strategy", "no"] + TRAIN[:-4])
    assert code == 0, capsys.readouterr().err[-2000:]
    steps = [json.loads(line).get("step") for line in open(out / "train_log.jsonl")]
    train_steps = [s for s in steps if s is not None]
    assert sorted(set(train_steps)) == train_steps and train_steps[:3] == [1, 2, 3], steps
    assert not (out / ".tmp-save-q1w2e3r4").exists() and live.exists()
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-save-") and n != live.name]


# ------------------------------------------------------------------ 6: pre-training mixtures

def test_mixture_weights_and_index_of_another_corpus(tmp_path):
    """NaN / zero / infinite blend weights are refused naming the corpus (a NaN weight used to drop
    its corpus silently: half the samples); an .idx of another corpus, or of another dtype, next
    to a .bin is refused naming both files; the untouched mixture uses both corpora."""
    from paddletune.data.pretrain import CorpusError, build_pretrain_datasets, write_corpus

    rng = np.random.default_rng(0)
    a, b, c = (str(tmp_path / n) for n in "abc")
    for prefix, n in ((a, 40), (b, 40), (c, 30)):
        write_corpus(prefix, [rng.integers(3, 500, 37) for _ in range(n)], vocab_size=500)
    train, _, _ = build_pretrain_datasets(f"1 {a} 1 {b}", "1,0,0", 32)
    single, _, _ = build_pretrain_datasets(a, "1,0,0", 32)
    assert len(train) == 2 * len(single)   # both corpora, equal weights (hand count: 40*37 // 32 each)
    assert len(single) == 40 * 37 // 32
    for w in ("nan", "0", "inf", "-1"):
        with pytest.raises(CorpusError, match=f"the weight '{w}' of {b} must be a finite number above 0"):
            build_pretrain_datasets(f"1 {a} {w} {b}", "1,0,0", 32)
    shutil.copy(c + ".idx", b + ".idx")                     # another corpus's index beside b.bin
    with pytest.raises(CorpusError, match=rf"{b}.bin: holds 1480 tokens, the index {b}.idx names 1110"):
        build_pretrain_datasets(f"1 {a} 1 {b}", "1,0,0", 32)
    write_corpus(b, [rng.integers(3, 500, 37) for _ in range(40)], dtype=np.int32)
    raw = bytearray(open(b + ".idx", "rb").read())
    raw[17] = 8                                              # the dtype code says uint16: 2x the tokens
    open(b + ".idx", "wb").write(bytes(raw))
    # read as uint16: 2960 tokens; the byte pointers now give starts 0, 74, ..., 39*74 and the
    # index names 39*74 + 37 = 2923 tokens
    with pytest.raises(CorpusError, match=rf"{b}.bin: holds 2960 tokens, the index {b}.idx names 2923"):
        build_pretrain_datasets(b, "1,0,0", 32)


# ------------------------------------------------------------------ 5: lazy data checked first

def test_bad_lazy_line_is_found_before_training(tmp_path, capsys):
    """A bad line deep in a streamed (lazy) file (beyond the 8 lines checked before) fails
    before the first step (default lazy_check: true), naming file and line; nothing is trained
    or written. (lazy_check: false, the line met while streaming on rank 1 of a launched job:
    test_reliability_launch.py.)"""
    from conftest import load_script

    rows = [json.loads(line) for line in open(os.path.join(ROOT, "paddletune", "assets", "sample-sft", "train.json"))][:200]
    lines = [json.dumps(r) for r in rows]
    lines[179] = '{"src": "cut off", "tgt": '
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.json").write_text("\n".join(lines) + "\n")
    ft = load_script("llm/finetune_generation.py")
    args = [SFT, "--dataset_name_or_path", str(tmp_path / "data"), "--lazy", "true", "--max_steps", "400",
            "--save_strategy", "no"] + TRAIN[:-4]
    code = ft.main(args + ["--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and line == [f"error: {tmp_path}/data/train.json:180: not valid JSON "
                                  "(Expecting value at column 1)"], err[-2000:]
    assert not (tmp_path / "out" / "train_log.jsonl").exists()
    assert "loaded " not in err   # before the model is loaded


def test_bad_lazy_line_found_by_the_background_pass(tmp_path, capsys):
    """lazy_check: false: training starts at once and the background pass over every line finds a
    bad line at line 2900 of 3000, which the stream itself (2 rows a step, file order, 500 lines
    a read) would meet only at step 1250: the run ends with one error line naming file and line, long before, with
    nothing exported."""
    from conftest import load_script

    lines = open(os.path.join(ROOT, "paddletune", "assets", "sample-sft", "train.json")).read().splitlines()
    lines[2899] = '{"src": "no target"}'
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.json").write_text("\n".join(lines) + "\n")
    ft = load_script("llm/finetune_generation.py")
    code = ft.main([SFT, "--dataset_name_or_path", str(tmp_path / "data"), "--lazy", "true", "--lazy_check",
                    "false", "--max_steps", "100000", "--output_dir", str(tmp_path / "out")] + TRAIN[:-4] +
                   ["--save_strategy", "no"])
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(line) == 1, err[-2000:]
    assert line[0].startswith(f"error: {tmp_path}/data/train.json:2900: ") and "tgt" in line[0], line
    step = int(line[0].split("found by the background check of the train data at training step ")[1].split(";")[0])
    assert step < 1250, line   # (the stream reads lines 2501-3000 at step 1250)
    assert not (tmp_path / "out" / "model.safetensors").exists()


# ------------------------------------------------------------------ 7: smaller items

def test_smaller_items(tmp_path, capsys, caplog, monkeypatch):
    """Non-UTF-8 input to preprocess_data names file and line; random bytes as a .bin are "not a
    PyTorch checkpoint", not a hostile object; a disk full during an export names the directory;
    eval_steps 0 is refused; DPO pairs with chosen == rejected are warned about."""
    import errno

    from conftest import load_script
    from paddletune.args import ArgumentError, parse_args

    src = tmp_path / "docs.jsonl"
    src.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')   # latin-1 on line 2
    pre = load_script("tools/preprocess_data.py")
    code = pre.main(["--model_name_or_path", "paddletune/tiny-llama", "--input_path", str(src),
                     "--output_prefix", str(tmp_path / "corpus")])
    err = capsys.readouterr().err
    assert code == 2 and f"error: {src}:2: not UTF-8 text (byte 13 of the line: b'\\xe9')" in err, err[-2000:]
    assert not list(tmp_path.glob("corpus*"))
    # random bytes where a pytorch_model.bin belongs
    conv = load_script("tools/convert_checkpoint.py")
    rnd = tmp_path / "pytorch_model.bin"
    rnd.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    with pytest.raises(conv.ConvertError, match="is not a PyTorch checkpoint: its bytes are not a pickle"):
        list(conv.torch_tensors([str(rnd)]))
    # ENOSPC while the final model is written
    from paddletune.models import build_model, hf, load_config, resolve_model_path, save_pretrained

    model = build_model(load_config(resolve_model_path("paddletune/tiny-llama"))[1], seed=0)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(hf, "write_weights", full)
    out = tmp_path / "export"
    with pytest.raises(OSError) as e:
        save_pretrained(model, str(out))
    from paddletune.cli import report

    assert report(e.value) == (2, f"error: disk full while saving the model (nothing partial was kept; "
                                  f"free some space and run the same command again) in: {out}")
    assert os.listdir(out) == []
    monkeypatch.undo()
    # eval_steps: 0
    with pytest.raises(ArgumentError, match="eval_steps"):
        parse_args([SFT, "--output_dir", str(tmp_path / "o"), "--evaluation_strategy", "steps", "--eval_steps", "0",
                    "--load_best_model_at_end", "false"])
    # DPO: chosen == rejected
    from paddletune.alignment.data import PairTokenizer, load_preference_split
    from paddletune.loading import load_tokenizer

    rows = [{"prompt": "q1", "chosen": "a b", "rejected": "a b"},
            {"prompt": "q2", "chosen": "yes", "rejected": "no"}]
    (tmp_path / "dpo").mkdir()
    (tmp_path / "dpo" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    caplog.set_level("WARNING", "paddletune")
    tok = load_tokenizer("paddletune/tiny-llama")
    ds = load_preference_split(str(tmp_path / "dpo" / "train.jsonl"), "train_dataset_path", "dpo",
                               PairTokenizer(tok, None, 64, 128))
    assert len(ds) == 2
    assert f"1 of 2 pairs have a chosen answer equal to the rejected one (they teach nothing), e.g. " \
           f"{tmp_path}/dpo/train.jsonl:1" in caplog.text


def test_fit_check_refuses_above_host_memory_and_warns_above_80_percent(monkeypatch, caplog):
    """check_fits against a stated host size: weights x local ranks above it are refused (file,
    key, value, bytes), above 80% warned, below that silent."""
    from paddletune.models import load_config, resolve_model_path
    from paddletune.models import memory

    path = resolve_model_path("paddletune/tiny-llama")
    _, cfg = load_config(path)
    need = 3568128                       # the module docstring's worked example
    monkeypatch.setenv("PADDLE_LOCAL_SIZE", "2")
    caplog.set_level("WARNING", "paddletune")
    monkeypatch.setattr(memory, "host_memory", lambda: 2 * need - 1)
    with pytest.raises(MemoryError, match=rf"{path}/config.json: the model's weights \(num_hidden_layers=4\) "
                                          r"take 3568128 bytes \(0.0 GiB\) per rank .* x 2 rank\(s\) on this host = 7136256 bytes"):
        memory.check_fits(path, cfg)
    monkeypatch.setattr(memory, "host_memory", lambda: int(2 * need / 0.9))
    assert memory.check_fits(path, cfg) == 2 * need and "above 80% of this host" in caplog.text
    caplog.clear()
    monkeypatch.setattr(memory, "host_memory", lambda: 4 * need)
    assert memory.check_fits(path, cfg) == 2 * need and caplog.text == ""


def test_training_memory_estimate_hand_worked(monkeypatch, tmp_path, capsys):
    """Training terms of the fit check against the module docstring's hand-worked tiny-llama
    numbers; the trainable counts against the built model's (full, and LoRA r 8 on every
    linear); the CLI refuses full fine-tuning that the stated host cannot hold, naming the
    numbers and the fixes, before the model is built."""
    from conftest import load_script
    from paddletune.models import build_model, load_config, resolve_model_path
    from paddletune.models import memory
    from paddletune.peft import lora

    path = resolve_model_path("paddletune/tiny-llama")
    _, cfg = load_config(path)
    model = build_model(cfg)
    assert memory.trainable_values(cfg, "full") == 892032 == sum(int(np.prod(p.shape)) for p in model.parameters())
    lora.inject(model, [n for n, _ in model.named_sublayers() if n.rsplit(".", 1)[-1] in
                        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")], 8, 16)
    real = sum(int(np.prod(p.shape)) for n, p in model.named_parameters() if ".lora_" in n)
    assert memory.trainable_values(cfg, "lora", 8) == 74752 == real
    assert memory.training_bytes(cfg, 892032, 2, 128) == {
        "gradients": 3568128, "optimizer": 7136256, "master": 0, "activations": 14991360}
    t = memory.training_bytes(cfg, 892032, 2, 128, sharding=2, stage=1, dtype="bfloat16", recompute=True)
    assert t == {"gradients": 3568128, "optimizer": 3568128, "master": 3568128, "activations": 4 * 256 * (4 * 128 + 1200)}
    monkeypatch.setenv("PADDLE_LOCAL_SIZE", "1")
    full = {"method": "full", "batch": 2, "seq": 128}
    monkeypatch.setattr(memory, "host_memory", lambda: 29263872 - 1)
    with pytest.raises(MemoryError, match=r"training adds gradients 3568128, optimizer 7136256, activations "
                                          r"14991360 bytes \(batch 2 x max_length 128, full\): 29263872 bytes"):
        memory.check_fits(path, cfg, training=full)
    assert memory.check_fits(path, cfg, training=dict(full, method="lora")) < 29263872 - 1
    assert memory.check_fits(path, cfg) == 3568128
    ft = load_script("llm/finetune_generation.py")
    code = ft.main([SFT, "--output_dir", str(tmp_path / "out"), "--max_steps", "1"] + TRAIN[:-4] + ["--save_strategy", "no"])
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(line) == 1 and f"{path}/config.json: the model's weights" in line[0], err[-2000:]
    assert "training adds gradients 3568128, optimizer 7136256, activations 14991360 bytes" in line[0]
    assert "a smaller per_device_train_batch_size or max_length, LoRA (lora: true)" in line[0]
    assert "loaded " not in err
