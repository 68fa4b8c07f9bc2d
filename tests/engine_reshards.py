"""Counts the reshards paddle's auto-parallel engine performs, from paddle's own log lines.

    import engine_reshards          # before the first DTensor op of the process
    with engine_reshards.record() as rec:
        step()
    rec.calls                       # e.g. {"SToR": 3, "PToR": 2}: all-gathers, all-reduces, ...

The engine's internal reshards never pass through Python, so a wrapper cannot see them; each one
logs "Call <Kind>Reshard" at glog level 3. Setting GLOG_v / GLOG_vmodule in the environment makes
paddle 3.3.1 crash at exit (measured: "double free or corruption", then a hang), so the levels are
set at run time with core.set_vlog_level, which only takes effect for log sites registered before
they first run: this module registers them at level 0 on import. Output is read by redirecting
file descriptor 2 (glog writes there directly) to a temp file for the duration of the block.
"""
import contextlib
import os
import re
import sys
import tempfile
from collections import Counter

from paddle.base import core

MODULES = ["s_to_r_reshard_function", "p_to_r_reshard_function", "r_to_s_reshard_function",
           "s_to_s_reshard_function", "r_to_p_reshard_function", "p_to_s_reshard_function",
           "s_to_p_reshard_function", "nd_mesh_reshard_function", "same_status_reshard_function",
           "x_to_r_shrink_reshard_function"]
core.set_vlog_level({m: 0 for m in MODULES})
CALL = re.compile(r"Call (\w+?)Reshard(?:Function)?\b")


class Record:
    calls = Counter()
    text = ""


@contextlib.contextmanager
def record(enabled=True):
    rec = Record()
    if not enabled:
        yield rec
        return
    sys.stderr.flush()
    saved = os.dup(2)
    tmp = tempfile.TemporaryFile(mode="w+b")
    os.dup2(tmp.fileno(), 2)
    core.set_vlog_level({m: 3 for m in MODULES})
    try:
        yield rec
    finally:
        core.set_vlog_level({m: 0 for m in MODULES})
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        tmp.seek(0)
        rec.text = tmp.read().decode(errors="replace")
        tmp.close()
        rec.calls = Counter(m.group(1) for m in CALL.finditer(rec.text))
        other = [l for l in rec.text.splitlines() if "Reshard" not in l and "reshard" not in l]
        if other:   # anything else written to stderr inside the block is passed through
            sys.stderr.write("\n".join(other)[-8000:] + "\n")
