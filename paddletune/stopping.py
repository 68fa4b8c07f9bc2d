"""A user's stop is a stop; a launcher's death ends its workers.

    stopping.install()                 # cli.entry, after `import paddle` (see below)
    stopping.progress(step, output_dir)  # the trainer, every step
    stopping.mark_failed(rank)         # cli.entry, when a launched rank fails

Single process: SIGINT (Ctrl-C) prints one line ("stopped by the user at step N; newest
checkpoint ...; rerun the same command to resume") and exits 130; SIGTERM the same with 143.
Nothing half-written is picked up later (checkpoints and exports are renamed into place), so
leaving at once is safe; the output_dir lock is released first.

Under paddle.distributed.launch (PADDLE_TRAINERS_NUM > 1; PADDLE_TRAINER_ID is the rank): the
launcher answers a user's SIGINT / SIGTERM by sending SIGTERM to every worker (and SIGKILL after
30 s; its own exit status is paddle's). A rank that fails leaves a marker first (mark_failed), so
on SIGTERM a rank can tell the two apart: "another rank of this job failed" when a marker of this
job exists, else "stopped by the launcher at step N ...; rerun the same command to resume"; exit
143 either way. The launcher starts workers in their own session (os.setsid), so a SIGKILL of the
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
import os
import re
import signal
import sys
import tempfile
import threading
import time

STATE = {"step": None, "output_dir": None}
_LAUNCHER = {"pid": None}
_MARK = ".paddletune-failed-{}"   # + the launcher's PID: one marker file per launched job
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


def _marker():
    return os.path.join(tempfile.gettempdir(), _MARK.format(_LAUNCHER["pid"] or os.getppid()))


def mark_failed(rank):
    """Leave the marker of this job's failure (read by the other ranks' SIGTERM handler)."""
    if _world()[0] <= 1:
        return
    try:
        with open(_marker(), "a") as f:
            f.write(f"{rank}\n")
    except OSError:
        pass


def _failed_rank():
    try:
        with open(_marker()) as f:
            return f.readline().strip() or "?"
    except OSError:
        return None


_LEAVING = threading.Lock()


def _leave(line, code):
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
    if _world()[0] > 1:
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
    if failed is not None:
        _leave(f"error: rank {rank} of {world} stopped by the launcher: another rank of this job "
               f"failed (rank {failed}: its error is above, or in its workerlog)", code)
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


def _sweep(launcher):
    """Remove this job's stale marker (a launcher PID reused) and those of ended launchers."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), _MARK.format("*"))):
        pid = path.rsplit("-", 1)[-1]
        try:
            if not pid.isdigit() or not os.path.exists(f"/proc/{pid}") or (
                    int(pid) == launcher and os.stat(path).st_mtime < os.stat(f"/proc/{pid}").st_ctime):
                os.unlink(path)
        except OSError:
            pass


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
        _sweep(launcher)
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
