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
import json
import os
import shutil
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


def read_json(path, what="file"):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


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
    tmp = umask_mode(tempfile.mkdtemp(prefix=".tmp-save-", dir=out_dir), directory=True)
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_dir(path):
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            with open(full, "rb") as f:
                os.fsync(f.fileno())
