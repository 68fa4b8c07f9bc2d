"""paddle's group_sharded stage 3 and frozen parameters (docs/notes/group_sharded_frozen.md), through
tools/probes/gs_held_probe.py on 2 launched ranks (the oracle: the one-process run at the same
global batch, trained beside it on each rank). Bytes are counted by benchmarks/sharding_memory.py's
held_by_kind, so these cases also check that the benchmark's --peft mode sees paddle's slices.

Hand-worked per rank (float32, S = 2, CPU alignment 4096 bytes = 1024 elements, each parameter
padded to a multiple of it and cut in 2): frozen l2, l3 weights 65536 -> 32768 each, biases
256 -> 1024 -> 512 each: 66560 of 131584 elements (266240 of 526336 bytes); trainable l1.weight
4096 -> 2048, l1.bias 256 -> 512, l4.weight 1024 -> 512, l4.bias 4 -> 512: 3584 of 5380 elements
(14336 of 21520 bytes); the 4096-byte buffer stays whole (paddle never shards buffers).
The release after each layer's backward is also run with l2, l3 under fleet's non-reentrant
recompute (as paddletune's runner calls it).
"""
import json
import os

import pytest

from conftest import ROOT, launch

PROBE = os.path.join(ROOT, "tools", "probes", "gs_held_probe.py")
FROZEN_SLICE, FROZEN_WHOLE = [266240, 526336], [526336, 526336]
TRAINABLE = [14336, 21520]
BUFFERS = [4096, 4096]


def _probe(tmp_path, mode, *extra):
    out = str(tmp_path / mode)
    logs = tmp_path / f"{mode}_log"
    r = launch([PROBE, "--release-frozen", mode, "--json", out, *extra], log_dir=str(logs), timeout=300)
    tail = "".join(open(logs / f).read()[-3000:] for f in sorted(os.listdir(logs)) if f.startswith("workerlog"))
    assert r.returncode == 0, tail
    ranks = [json.load(open(f"{out}.rank{i}")) for i in (0, 1)]
    for res in ranks:
        assert res["wrapper"] == "GroupShardedStage3"
        assert res["dloss"] < 1e-6 and res["dparam"] < 1e-6          # equal to one process
        assert res["after_wrap"] == {"trainable": TRAINABLE, "frozen": FROZEN_SLICE, "buffers": BUFFERS}
        assert all(k["trainable"] == TRAINABLE and k["buffers"] == BUFFERS for k in res["steps"] + res["backward_end"])
    return ranks


def test_stage3_as_shipped_keeps_frozen_whole_after_backward(tmp_path):
    for res in _probe(tmp_path, "none"):
        assert all(k["frozen"] == FROZEN_WHOLE for k in res["steps"] + res["backward_end"])


@pytest.mark.parametrize("recompute", [False, True])
def test_release_frozen_in_backward_keeps_the_slice(tmp_path, recompute):
    for res in _probe(tmp_path, "backward", *(["--recompute"] if recompute else [])):
        assert all(k["frozen"] == FROZEN_SLICE for k in res["steps"] + res["backward_end"])
        # within backward, just before each release: the layer just done whole + the other's slice
        # ((65536 + 256) * 4 + (32768 + 512) * 4 = 396288 bytes), and the full buffer stage 3
        # prefetched for the next layer back (l2: 66560 * 4 = 266240; l1: (4096 + 1024) * 4 = 20480)
        # (under recompute 8192 more: l4's full buffer, (1024 + 1024) * 4, still in the task flow)
        extra = 8192 if recompute else 0
        assert res["in_backward"] == [[396288, 266240 + extra], [396288, 20480 + extra]] * 3


def test_release_frozen_after_step_only_leaves_backward_whole(tmp_path):
    for res in _probe(tmp_path, "step"):
        assert all(k["frozen"] == FROZEN_SLICE for k in res["steps"])
        assert all(k["frozen"] == FROZEN_WHOLE for k in res["backward_end"])
