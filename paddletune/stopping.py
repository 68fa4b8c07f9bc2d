"""A user's stop is a stop; a launcher's death ends its workers.

    stopping.install()                 # cli.entry, after `import paddle` (see below)
    stopping.progress(step, output_dir)  # the trainer, every step
    stopping.mark_failed(rank)         # cli.entry, when a launched rank fails
    stopping.job_dir(output_dir)       # args.build: where this job's failure marker goes

Single process: SIGINT (Ctrl-C) prints one line ("stopped by the user at step N; newest
checkpoint ...; rerun the same command to resume") and exits 130; SIGTERM the same with 143.
Nothing half-written is picked up later (checkpoints and exports are renamed into place), so
leaving at once is safe; the output_dir lock is released first.

Under paddle.distributed.launch (PADDLE_TRAINERS_NUM > 1; PADDLE_TRAINER_ID is the rank): the
launcher answers a user's SIGINT / SIGTERM by sending SIGTERM to every worker (and SIGKILL after
30 s; its own exit status is paddle's). A rank that fails leaves a marker first (mark_failed), so
on SIGTERM a rank can tell the two apart: "another rank of this job failed" when a marker of this
job exists, exiting with the failed rank's code (2 for bad input), else "stopped by the launcher
at step N ...; rerun the same command to resume", exit 143. Why the failed rank's code: the
launcher exits with the code of the first rank, in rank order, that ended non-zero, so a refused
resume on pipeline stage 1 made the job exit 143 (rank 0's SIGTERM; 241 = -15 before these
handlers) instead of 2. The marker is output_dir/.paddletune-failed-<job key> (the key: a hash of the
job's endpoint list, the same on every rank and node; output_dir is locked by the job, and on
several nodes shared, see outdir.check_shared), so nothing is left in /tmp. A marker older than
the local launcher's start belongs to an earlier job: it is ignored, and removed by the next
run's rank 0 when it takes the output_dir lock (sweep_markers). A rank that fails before the
arguments are parsed (no output_dir known) leaves no marker: every rank fails the same way then. The launcher starts workers in their own session (os.setsid), so a SIGKILL of the
launcher (or of its process group) never reaches them: a daemon thread compares getppid() with
the launcher's PID recorded at start, and PR_SET_PDEATHSIG sends SIGTERM when the launcher dies
(checked again after setting it: it may already be gone); a signal is also handled from a thread
woken through signal.set_wakeup_fd, so a rank blocked in C++ (a backward all-reducing with a rank
that already left) leaves too. Either way the rank prints one line,
releases the lock and leaves with os._exit(143). A single process (e.g. under nohup) is never
watched: its parent may end by design.

Why after `import paddle`: paddle installs C-level handlers for SIGTERM, SIGSEGV and others
(signal.getsignal reports SIG_DFL for them); ours must be the last installed to be the one run.
Python runs a handler only between bytecodes; the watcher thread runs while the main thread waits
in a collective that releases the GIL (gloo's do).
"""
import ctypes
import glob
import hashlib
import os
import re
import signal
import sys
import threading
import time

STATE = {"step": None, "output_dir": None, "job_dir": None}
_LAUNCHER = {"pid": None, "started": None}
_MARK = ".paddletune-failed-{}"   # + the job key: one marker file per launched job
PR_SET_PDEATHSIG = 1


def _world():
    try:
        return int(os.environ.get("PADDLE_TRAINERS_NUM", "1")), int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    except ValueError:
        return 1, 0


def progress(step=None, output_dir=None):
    """Record where training is (the stop line reports it)."""
    if step is not None:
        STATE["step"] = step
    if output_dir is not None:
        STATE["output_dir"] = output_dir


def newest_checkpoint(output_dir):
    """output_dir/checkpoint-N with the largest N holding trainer_state.json, or None."""
    best = None
    for d in glob.glob(os.path.join(glob.escape(output_dir), "checkpoint-*")):
        m = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(d))
        if m and os.path.isfile(os.path.join(d, "trainer_state.json")) and (best is None or int(m[1]) > best[0]):
            best = (int(m[1]), d)
    return best[1] if best else None


def where():
    """' at step N; newest checkpoint X; rerun the same command to resume' while training ('' for
    a script that does not train: a predictor, a merge)."""
    step, out = STATE["step"], STATE["output_dir"]
    if out is None:
        return ""
    ck = newest_checkpoint(out)
    at = f"at step {step}" if step is not None else "before the first training step"
    return (f" {at}; newest checkpoint {ck}" if ck else f" {at}; no checkpoint saved yet") + \
        "; rerun the same command to resume"


def job_dir(output_dir):
    """Record the job's output_dir (the failure marker's place) as soon as it is known."""
    STATE["job_dir"] = os.path.abspath(output_dir) if output_dir else None


def _job_key():
    ends = os.environ.get("PADDLE_TRAINER_ENDPOINTS") or os.environ.get("PADDLE_MASTER") or \
        str(_LAUNCHER["pid"] or os.getppid())
    return hashlib.sha1(ends.encode()).hexdigest()[:12]


def _marker():
    d = STATE["job_dir"] or STATE["output_dir"]
    return os.path.join(d, _MARK.format(_job_key())) if d else None


def start_time(pid):
    """When process `pid` started (seconds since the epoch), from /proc; None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22: starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def mark_failed(rank, code=2):
    """Leave the marker of this job's failure ("rank code", read by the other ranks' SIGTERM
    handler) in the job's output_dir; nothing when there is none yet."""
    path = _marker()
    if _world()[0] <= 1 or path is None or not os.path.isdir(os.path.dirname(path)):
        return
    try:
        with open(path, "a") as f:
            f.write(f"{rank} {code}\n")
    except OSError:
        pass


def _failed_rank():
    """(rank, exit code) named by this job's marker, or None (no marker, or one older than the
    launcher)."""
    path = _marker()
    if path is None:
        return None
    try:
        started = _LAUNCHER["started"]
        if started is not None and os.stat(path).st_mtime < started - 1:   # btime: 1 s resolution
            return None
        with open(path) as f:
            words = f.readline().split()
    except OSError:
        return None
    code = int(words[1]) if len(words) > 1 and words[1].isdigit() and 0 < int(words[1]) < 256 else 2
    return (words[0] if words else "?"), code


def sweep_markers(output_dir):
    """Remove failure markers of earlier jobs from output_dir (rank 0, holding its lock): those
    written before this process's launcher (or this process) started. Returns the paths removed."""
    since = start_time(os.getppid() if _world()[0] > 1 else os.getpid())
    gone = []
    for path in glob.glob(os.path.join(glob.escape(output_dir), _MARK.format("*"))):
        try:
            if since is None or os.stat(path).st_mtime < since - 1:
                os.unlink(path)
                gone.append(path)
        except OSError:
            pass
    return gone


_LEAVING = threading.Lock()


def _leave(line, code, grace=True):
    from . import outdir

    if not _LEAVING.acquire(blocking=False):   # another thread is already leaving (one line)
        time.sleep(60)
        return

    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    print(f"{line} (exit {code})", file=sys.stderr, flush=True)
    try:
        outdir.release_all()
    except OSError:
        pass
    if _world()[0] > 1 and grace:
        # the launcher signals every rank at once: let each print its line before any leaves
        # (a rank's exit breaks a collective its peers are in); a peer whose C++ collective then
        # fails aborts quietly (SIGABRT default: no paddle crash report after its stop line)
        try:
            ctypes.CDLL(None).signal(signal.SIGABRT, 0)
        except (OSError, AttributeError):
            pass
        time.sleep(1.0)
    os._exit(code)


def _on_signal(signum, frame):
    world, rank = _world()
    name = signal.Signals(signum).name
    code = 130 if signum == signal.SIGINT else 143
    if world <= 1:
        _leave(f"stopped by the user ({name}){where()}", code)
    if _LAUNCHER["pid"] and os.getppid() != _LAUNCHER["pid"]:
        _launcher_gone()
    failed = _failed_rank()
    if failed is not None:   # the failed rank's code: the launcher reports the lowest rank's
        _leave(f"error: rank {rank} of {world} stopped by the launcher: another rank of this job "
               f"failed (rank {failed[0]}: its error is above, or in its workerlog)", failed[1],
               grace=False)   # no grace: after a failure the launcher kills what is left 3 s later
    _leave(f"rank {rank} of {world} stopped by the launcher ({name}){where()}", code)


def _signal_thread(fd):
    """Launched ranks: the number of a delivered SIGINT / SIGTERM arrives here at once
    (signal.set_wakeup_fd), so a rank whose main thread waits inside C++ still leaves with its
    line: a backward whose paddle.DataParallel reducer all-reduces with a rank that has already
    left would otherwise hold it until gloo's timeout aborts the process (a C++ exception in the
    reducer's hook), and Python runs its handler only between bytecodes. paddle's backward
    releases the GIL, so this thread runs meanwhile."""
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        for b in data:
            if b in (signal.SIGINT, signal.SIGTERM):
                _on_signal(b, None)


def _launcher_gone():
    world, rank = _world()
    _leave(f"rank {rank} of {world}: the launcher (PID {_LAUNCHER['pid']}) is gone; stopping"
           f"{where()}", 143)


def _watch(pid):
    while os.getppid() == pid:
        time.sleep(0.5)
    _launcher_gone()


def install():
    """Install the handlers (and, under the launcher, the watcher) once per process; returns the
    previous handlers (restored by restore)."""
    world, _ = _world()
    if "paddle" in sys.modules or world > 1:   # (a tool that never imports paddle is spared it)
        import paddle  # noqa: F401 - paddle's own C handlers must be in place before ours
    if threading.current_thread() is not threading.main_thread():
        return None
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in old:
        signal.signal(s, _on_signal)
    if world > 1 and _LAUNCHER["pid"] is None:
        _LAUNCHER["pid"] = launcher = os.getppid()
        _LAUNCHER["started"] = start_time(launcher)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        threading.Thread(target=_watch, args=(launcher,), name="launcher-watch", daemon=True).start()
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=_signal_thread, args=(r,), name="signal-wake", daemon=True).start()
    return old


def restore(old):
    """Put back the handlers install() replaced (in-process callers such as tests)."""
    for s, h in (old or {}).items():
        if h is not None:
            signal.signal(s, h)
