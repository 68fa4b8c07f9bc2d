"""Issue 17 under paddle.distributed.launch: one job per output_dir (item 1) and an error on one
rank ending every rank promptly (item 13). Two launches (~7 s each before any work)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

from conftest import ROOT, launch, load_script, run_script, write_jsonl

SCRIPT = os.path.join(ROOT, "llm", "finetune_generation.py")
SFT = os.path.join(ROOT, "llm", "llama", "sft_argument.json")
QUICK = ["--do_eval", "false", "--evaluation_strategy", "no", "--save_strategy", "no",
         "--load_best_model_at_end", "false", "--disable_tqdm", "true", "--per_device_train_batch_size", "2",
         "--src_length", "64", "--max_length", "128"]


def _rows(n):
    return [json.loads(l) for l in open(os.path.join(ROOT, "paddletune", "assets", "sample-sft", "train.json"))][:n]


def _port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_second_job_on_an_output_dir_is_refused(tmp_path):
    """Job A (2 launched ranks: its ranks share the lock of rank 0) trains; job B on the same
    output_dir is refused before any work, naming A's PID and host; A's files are untouched."""
    out, logs = tmp_path / "out", tmp_path / "logA"
    write_jsonl(tmp_path / "data" / "train.json", _rows(40))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    job_a = subprocess.Popen(
        [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--master",
         f"127.0.0.1:{_port()}", "--log_dir", str(logs), SCRIPT, SFT, "--output_dir", str(out),
         "--dataset_name_or_path", str(tmp_path / "data"), "--max_steps", "100000", "--logging_steps", "1"] + QUICK,
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        lock = out / ".paddletune.lock"
        deadline = time.time() + 180
        while not (out / "train_log.jsonl").exists() and time.time() < deadline and job_a.poll() is None:
            time.sleep(0.5)
        assert (out / "train_log.jsonl").exists(), open(logs / "workerlog.0").read()[-3000:]
        holder = json.loads(lock.read_text())
        assert holder["ranks"] == 2 and holder["host"] == socket.gethostname()
        b = run_script([SCRIPT, SFT, "--output_dir", str(out), "--max_steps", "2",
                        "--dataset_name_or_path", str(tmp_path / "data")] + QUICK)
        assert b.returncode == 2, b.stderr[-2000:]
        line = [l for l in b.stderr.splitlines() if l.startswith("error:")]
        assert len(line) == 1 and f"is in use by another job (PID {holder['pid']} on host {holder['host']}" in line[0]
        assert "loaded " not in b.stdout and "Traceback" not in b.stderr
        assert job_a.poll() is None                       # A goes on
        assert "in use" not in open(logs / "workerlog.1").read()   # A's ranks share one lock
    finally:
        os.killpg(job_a.pid, signal.SIGTERM)              # stop A as a user would (Ctrl-C)
        job_a.wait(timeout=60)
    from paddletune.outdir import OutputLock

    OutputLock(str(out)).acquire().release()              # A's lock went with A (or is stale)
    assert not lock.exists()
    assert not os.path.exists(out / "config.json")        # B wrote nothing


def test_stale_lock_of_a_dead_job_is_taken_over(tmp_path, capsys, caplog):
    ft = load_script("llm/finetune_generation.py")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".paddletune.lock").write_text(json.dumps({"pid": 2 ** 22 + 7, "host": socket.gethostname(),
                                                      "started": "yesterday"}))
    caplog.set_level("WARNING", "paddletune")
    code = ft.main([SFT, "--output_dir", str(out), "--dataset_name_or_path", str(tmp_path / "nope")] + QUICK)
    said = capsys.readouterr().out + caplog.text
    assert code == 2 and f"taking over the lock of a job that has ended (PID {2 ** 22 + 7}" in said
    assert os.listdir(out) == []


def test_bad_line_on_one_rank_ends_every_rank(tmp_path):
    """lazy_check: false: rank 0's background pass finds a bad line in rank 1's half of the
    streamed data (rank 1's stream, 500 lines a read, would meet it at its step ~500 of 200) while rank 1 waits in a
    collective: both end promptly, rank 0's error shown by the launcher; rank 1 says another rank
    failed, naming rank 0, from the failure marker rank 0 left in output_dir (issue 33: not in
    /tmp, where nothing new is left)."""
    import glob
    import tempfile

    lines = [json.dumps(r) for r in _rows(3000)]
    lines[2989] = '{"src": "cut off", "tgt": '          # in rank 1's half of the bytes
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.json").write_text("\n".join(lines) + "\n")
    in_tmp = set(os.listdir(tempfile.gettempdir()))
    t0 = time.time()
    r = launch([SCRIPT, SFT, "--output_dir", str(tmp_path / "out"), "--dataset_name_or_path",
                str(tmp_path / "data"), "--lazy", "true", "--lazy_check", "false", "--max_steps", "200"] + QUICK,
               nproc=2, log_dir=tmp_path / "log", timeout=300)
    wall = time.time() - t0
    logs = [open(tmp_path / "log" / f"workerlog.{k}").read() for k in (0, 1)]
    assert r.returncode != 0
    assert wall < 60, wall                                # (a blocked rank would wait for minutes)
    bad = f"error: {tmp_path}/data/train.json:2990: not valid JSON (Expecting value at column 1) (found by the background"
    assert bad in logs[0] and bad in r.stdout + r.stderr, logs[0][-2000:]  # the launcher shows it
    assert "(rank 0 of 2)" in [x for x in logs[0].splitlines() if x.startswith("error:")][0]
    assert "code 2" in r.stdout + r.stderr
    said = [x for x in logs[1].splitlines() if x.startswith("error:")]
    assert len(said) == 1, logs[1][-2000:]
    assert ("another rank of this job failed (rank 0:" in said[0]) or ("lost the connection" in said[0]), said
    assert "stopped by the launcher (SIGTERM) at step" not in logs[1]   # not a user's stop
    assert "Traceback" not in logs[0] + logs[1]
    marks = glob.glob(str(tmp_path / "out" / ".paddletune-failed-*"))
    assert len(marks) == 1 and open(marks[0]).read() == "0 2\n", marks
    assert not [n for n in set(os.listdir(tempfile.gettempdir())) - in_tmp if "paddletune" in n]
    assert not os.path.exists(tmp_path / "out" / "config.json")
