"""Small file helpers: atomic writes, temp dirs published by rename, JSON.

Rule: nothing half-written is ever left where a loader or `resume_from_checkpoint` would pick it
up. Whole directories (checkpoint-N) are built under a temp name and renamed in one step; files
published into an existing directory (the final model in output_dir) are moved one by one with
the file a loader looks for first (config.json / adapter_config.json) removed first and moved last.
Files and directories written here get the modes the process umask gives (0644 / 0755 under the
usual 022), like files any other tool writes: mkstemp / mkdtemp alone would make them 0600 / 0700,
unreadable to the other users of a machine once renamed into place.
"""
import contextlib
import errno
import json
import os
import shutil
import socket
import stat
import tempfile

MARKER_FILES = ("config.json", "adapter_config.json")


def _read_umask():
    mask = os.umask(0o022)   # the only way to read it; put straight back (at import, one thread)
    os.umask(mask)
    return mask


UMASK = _read_umask()


def umask_mode(path, directory=False):
    """chmod `path` (made by mkstemp / mkdtemp: 0600 / 0700) to what open() / mkdir() give."""
    os.chmod(path, (0o777 if directory else 0o666) & ~UMASK)
    return path


def temp_file(directory, prefix=".tmp-", suffix=""):
    """(fd, path) of a new temp file in `directory` with the umask's mode (see above)."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
    os.fchmod(fd, 0o666 & ~UMASK)
    return fd, tmp


def inside(directory, name, source):
    """os.path.join(directory, name) for a file name read from `source` (an index or metadata
    file), refusing a name that leaves the directory (absolute, or with '..' climbing out): a
    hostile index must not make a loader open /etc/passwd. The check is on the name as written;
    symbolic links inside the directory (Hugging Face's cache links snapshots to blobs) are fine."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{source}: file name {name!r} is not a non-empty string")
    root = os.path.normpath(os.path.abspath(directory))
    full = os.path.normpath(os.path.join(root, name))
    if os.path.isabs(name) or os.path.commonpath([root, full]) != root:
        raise ValueError(f"{source} names the file {name!r}, which is outside {directory}; "
                         "refusing to read it (a checkpoint's files must be inside its directory)")
    return full


def write_json(path, obj, indent=2):
    """Write JSON atomically (temp file in the same directory, then os.replace)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = temp_file(d, suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=indent, ensure_ascii=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# Size caps for files read from a model or data directory (untrusted input: a downloaded
# checkpoint). The largest published files of each kind are well below them (tokenizer.json:
# ~35 MB for Gemma's 256k vocabulary; config.json / tokenizer_config.json: well under 1 MB).
JSON_CAP = 64 << 20          # JSON metadata: indexes, trainer state, configs
CONFIG_CAP = 4 << 20         # config.json, generation_config.json, adapter_config.json
TOKENIZER_CAP = 128 << 20    # tokenizer.json, vocabulary files
TEMPLATE_CAP = 1 << 20       # a chat template (.jinja / chat_template.json)


def open_regular(path, what="file"):
    """A blocking read-only descriptor of `path`, refusing anything but a regular file.

    Symbolic links are followed and the file they end at is checked (fstat of the opened file,
    so the check and the read are on the same file). A FIFO, a device (/dev/zero), a socket or a
    directory is refused: O_NONBLOCK keeps open() from waiting on a FIFO with no writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a file")
        real = os.path.realpath(path)
        via = f" (a link to {real})" if real != os.path.abspath(path) else ""
        raise ValueError(f"{path}{via} is {kind}, not a regular file: refusing to read it as "
                         f"the {what}; put the real file there")
    os.set_blocking(fd, True)
    return fd


def read_capped(path, cap=JSON_CAP, what="file"):
    """The bytes of `path`, refusing anything but a regular file (open_regular) of at most `cap`
    bytes. The size is checked by reading at most cap + 1 bytes, not by trusting stat (a file may
    grow while it is read, and /proc files report size 0)."""
    fd = open_regular(path, what)
    try:
        chunks, left = [], cap + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > cap:
        raise ValueError(f"{path}: the {what} is larger than {cap >> 20} MB, the most read for such a "
                         "file: it is damaged or not the file its name says; copy it again")
    return data


def read_text(path, cap=JSON_CAP, what="file"):
    """read_capped(...) decoded as UTF-8; a decoding error names the file and the byte."""
    data = read_capped(path, cap, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: the {what} is not UTF-8 text (byte {e.start}: "
                         f"{data[e.start:e.start + 1]!r})") from None


def read_json(path, what="file", cap=None):
    """JSON from `path` through read_capped (a regular file of at most `cap` bytes; default
    CONFIG_CAP for *config.json files, JSON_CAP for others)."""
    if cap is None:
        cap = CONFIG_CAP if os.path.basename(str(path)).endswith("config.json") else JSON_CAP
    text = read_text(path, cap, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{path}: not valid JSON (nested too deeply)") from None


def temp_dir_beside(path):
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    return umask_mode(tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(os.path.abspath(path))}-",
                                       dir=parent), directory=True)


@contextlib.contextmanager
def atomic_dir(path):
    """Build a new directory under a temp name; on success rename it to `path` (replacing an old
    one). On error the temp dir is removed and `path` is untouched."""
    tmp = temp_dir_beside(path)
    try:
        yield tmp
        _fsync_dir(tmp)
        if os.path.exists(path):
            old = tmp + ".old"
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def publish_into(out_dir, stale_patterns=()):
    """Write files into a temp dir, then move them into `out_dir` (which may hold other things,
    such as checkpoints and logs). Marker files are removed first and moved last, and files
    matching `stale_patterns` (fnmatch) from an earlier save are removed before the move."""
    import fnmatch

    os.makedirs(out_dir, exist_ok=True)
    tmp = umask_mode(tempfile.mkdtemp(prefix=f"{SAVE_PREFIX}{os.getpid()}-{socket.gethostname()}-",
                                      dir=out_dir), directory=True)
    try:
        yield tmp
        new = sorted(os.listdir(tmp))
        for m in MARKER_FILES:
            if os.path.exists(os.path.join(out_dir, m)):
                os.unlink(os.path.join(out_dir, m))
        for name in os.listdir(out_dir):
            full = os.path.join(out_dir, name)
            if os.path.isfile(full) and any(fnmatch.fnmatch(name, p) for p in stale_patterns):
                os.unlink(full)
        for name in sorted(new, key=lambda n: n in MARKER_FILES):
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
        os.rmdir(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC and not e.filename:
            raise OSError(errno.ENOSPC, "disk full while saving the model (nothing partial was "
                          "kept; free some space and run the same command again) in", out_dir) from None
        raise
    clean_dead_saves(out_dir)


SAVE_PREFIX = ".tmp-save-"   # + owner PID + "-" + host + "-" + mkdtemp's random part


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_dead_saves(out_dir, unowned=False):
    """Remove the temp dirs of publish_into in `out_dir` whose owner process (on this host) is
    dead: an export killed mid-write leaves one with a partial shard. `unowned` also removes those
    of older versions, which record no owner: only under the output_dir lock at start, when no
    save of this job can be running. Returns the removed paths."""
    removed = []
    try:
        names = os.listdir(out_dir)
    except OSError:
        return removed
    host = socket.gethostname()
    for name in names:
        if not name.startswith(SAVE_PREFIX):
            continue
        pid, _, rest = name[len(SAVE_PREFIX):].partition("-")
        legacy = not (pid.isdigit() and rest)
        owned = not legacy and rest.rpartition("-")[0] == host
        if (owned and not _alive(int(pid))) or (unowned and legacy):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
            removed.append(os.path.join(out_dir, name))
    return removed


def _fsync_dir(path):
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            with open(full, "rb") as f:
                os.fsync(f.fileno())
