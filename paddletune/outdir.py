"""The output directory of a run: writable, one job at a time, room for each save.

    claim(output_dir)          # rank 0, before any work: test write + the job's lock
    check_space(dir, need, what)   # before a save: refuse with the bytes needed and free
    release_all()              # the script's entry does this on every exit

One job per output_dir: two runs writing there would resume each other's checkpoints, overwrite
each other's model and delete each other's temp checkpoints. Rank 0 of a job (the only rank
that calls `claim`; its other ranks never lock, so they cannot refuse each other) holds an
exclusive flock on output_dir/.paddletune.lock for the whole run; the file names the holder (PID,
host, start time, command) for the message a second job gets. The kernel drops the flock when
the holder dies however it dies (SIGKILL included), so the file of a dead job is a stale lock
that the next run takes over (and says so). The file is removed on release; a directory that
`claim` created is removed again when it is still empty (a refused run leaves nothing behind).
"""
import errno
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time

logger = logging.getLogger("paddletune")

LOCK_NAME = ".paddletune.lock"
_HELD = []   # OutputLock objects of this process, released by release_all


class OutputDirError(ValueError):
    """output_dir cannot be used: names the directory and the fix."""


class NoSpaceError(OSError):
    """ENOSPC with the path, the bytes needed and the bytes free in the message."""

    def __init__(self, message):
        super().__init__(errno.ENOSPC, message)

    def __str__(self):
        return self.strerror


def _existing_ancestor(path):
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def check_writable(path, key="output_dir"):
    """A test write where `path` is (or where it would be created): a file, a directory that is
    read-only or not ours, or a read-only file system fail here, before any work, instead of at
    the first log line after training. Nothing is left behind."""
    p = os.path.abspath(path)
    if os.path.exists(p) and not os.path.isdir(p):
        raise OutputDirError(f"{key}={path!r} is a file, not a directory; give a new directory "
                             "(or the directory of an earlier run to resume it)")
    _test_write(p, f"{key}={path!r}")


def _test_write(p, what):
    probe = _existing_ancestor(p)
    if not os.path.isdir(probe):
        raise OutputDirError(f"{what} cannot be created: {probe} is a file")
    try:
        fd, name = tempfile.mkstemp(prefix=".paddletune-write-test-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        where = "" if probe == p else f" (it would be created in {probe})"
        raise OutputDirError(f"{what} is not writable{where}: {e.strerror}; choose a place you "
                             "can write to, or fix its permissions") from None


def check_writable_file(path, key):
    """A file `path` can be (re)written: an existing one must be writable, and its directory (or
    where that would be created) must take a new file (written beside it, then renamed)."""
    p = os.path.abspath(path)
    if os.path.exists(p) and not os.access(p, os.W_OK):
        raise OutputDirError(f"{key}={path!r} exists and is not writable; choose another file")
    _test_write(os.path.dirname(p), f"{key}={path!r}")


def free_bytes(path):
    """Free bytes on the file system that holds (or would hold) `path`."""
    return shutil.disk_usage(_existing_ancestor(path)).free


def human(n):
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def check_space(path, need, what):
    """Refuse to start writing `need` bytes of `what` under `path` when the disk has less free."""
    free = free_bytes(path)
    if need > free:
        raise NoSpaceError(f"not enough disk space for {what} in {os.path.abspath(path)}: it needs "
                           f"{human(need)} ({need} bytes), {human(free)} ({free} bytes) are free; "
                           "free some space, or lower save_total_limit / save less often")
    return free


def space_error(e, path, need):
    """An ENOSPC raised while writing, as a NoSpaceError naming `path`, the need and the free
    space; any other OSError is returned as it is."""
    if getattr(e, "errno", None) != errno.ENOSPC:
        return e
    return NoSpaceError(f"disk full while writing {path}: it needs {human(need)} ({need} bytes), "
                        f"{human(free_bytes(path))} are free; nothing partial was kept. Free some "
                        "space and resume from the last checkpoint")


class OutputLock:
    """flock on output_dir/.paddletune.lock for this process (see the module docstring)."""

    def __init__(self, output_dir):
        self.dir = os.path.abspath(output_dir)
        self.path = os.path.join(self.dir, LOCK_NAME)
        self.fd = None
        self.created = None   # the top-most directory made for the lock, removed if left empty

    def acquire(self):
        import fcntl

        if not os.path.isdir(self.dir):
            top = self.dir
            while not os.path.exists(os.path.dirname(top)):
                top = os.path.dirname(top)
            os.makedirs(self.dir)
            self.created = top
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    logger.warning("%s: the file system has no file locks (%s): this output_dir "
                                   "is not protected from a second job", self.dir, e.strerror)
                    break
                holder = _read_info(fd)
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    self._cleanup()
                    raise OutputDirError(self._busy(holder)) from None
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:   # not a file its holder unlinked while we waited: ours
                break
            os.close(fd)
        else:
            raise OutputDirError(f"{self.path}: could not take the lock (it keeps being replaced)")
        stale = _read_info(fd)
        if stale:
            logger.warning("%s: taking over the lock of a job that has ended (PID %s on host %s, "
                           "started %s)", self.dir, stale.get("pid"), stale.get("host"),
                           stale.get("started"))
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "ranks": int(os.environ.get("PADDLE_TRAINERS_NUM", "1")),
                "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self.fd = fd
        return self

    def _busy(self, holder):
        h = holder or {}
        who = f"PID {h.get('pid', '?')} on host {h.get('host', '?')}"
        more = f", started {h['started']}" if h.get("started") else ""
        if h.get("ranks", 1) > 1:
            more += f", {h['ranks']} ranks"
        cmd = f": {h['command']}" if h.get("command") else ""
        return (f"output_dir {self.dir} is in use by another job ({who}{more}){cmd}. Two runs in "
                "one output_dir would resume and overwrite each other's checkpoints and model: "
                "wait for that job to end, or give this run another output_dir")

    def release(self):
        if self.fd is None:
            return
        try:
            os.unlink(self.path)   # before the close: a waiting job retries on a fresh file
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None
        self._cleanup()

    def _cleanup(self):
        top, self.created = self.created, None
        if top is None:
            return
        d = self.dir
        while True:   # remove the directories made for the lock, innermost first, while empty
            try:
                os.rmdir(d)
            except OSError:
                return
            if d == top:
                return
            d = os.path.dirname(d)


def _read_info(fd):
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw.decode()) if raw.strip() else None
    except (OSError, ValueError):
        return {}


def claim(output_dir, key="output_dir"):
    """Test-write and lock `output_dir` for this process (rank 0 of the job) until release_all."""
    check_writable(output_dir, key)
    lock = OutputLock(output_dir).acquire()
    _HELD.append(lock)
    from .io import clean_dead_saves

    for path in clean_dead_saves(lock.dir, unowned=True):   # an export killed mid-write
        logger.info("removed %s, left by an interrupted save", path)
    from .stopping import sweep_markers

    sweep_markers(lock.dir)   # failure markers of earlier launched jobs
    return lock


def holds(output_dir):
    """Whether this process already holds the lock of `output_dir`."""
    d = os.path.abspath(output_dir)
    return any(lock.dir == d for lock in _HELD)


def release(lock):
    """Release one lock taken by claim."""
    if lock in _HELD:
        _HELD.remove(lock)
    lock.release()


def release_all():
    while _HELD:
        _HELD.pop().release()


SHARED_MARK = ".paddletune-shared-"


def check_shared(output_dir, topo):
    """Every rank of a launched job must see the output_dir rank 0 writes (one machine always
    does; several nodes need a shared file system there): rank 0 puts a marker file with a random
    name in it, every rank looks for that name, and all ranks learn the answer together. A rank
    that does not see it fails the whole job with one message naming the ranks and hosts, before
    any work. Collective: every rank calls it at the same point."""
    if topo.world_size <= 1:
        return
    import secrets

    d = os.path.abspath(output_dir)
    mark = None
    if topo.rank == 0:
        os.makedirs(d, exist_ok=True)
        mark = SHARED_MARK + secrets.token_hex(8)
        with open(os.path.join(d, mark), "w") as f:
            f.write(socket.gethostname() + "\n")
    mark = topo.all_gather_json(mark)[0]
    seen = os.path.exists(os.path.join(d, mark))
    views = topo.all_gather_json({"seen": seen, "host": socket.gethostname()})
    if topo.rank == 0:
        try:
            os.unlink(os.path.join(d, mark))
        except FileNotFoundError:
            pass
    blind = [f"rank {r} on {v['host']}" for r, v in enumerate(views) if not v["seen"]]
    if blind:
        raise OutputDirError(
            f"output_dir {d} is not shared: {', '.join(blind)} cannot see the directory rank 0 (on "
            f"{views[0]['host']}) writes. A job over several nodes needs output_dir on a file "
            "system every node mounts at the same path (NFS, a parallel file system)")
