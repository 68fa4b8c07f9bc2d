"""paddle's group_sharded_parallel (sharding stage 2 "os_g" and stage 3 "p_g_os") on gloo through
parallel/cpu_compat.py's shim 4: 2 launched ranks, 3 AdamW steps, against one process at the same
global batch (tests/group_sharded_cases.py). Stage 3 shards a frozen float backbone too: at S=2
each rank holds about half of it between steps (each parameter's slice padded to paddle's
alignment), and with paddle's default segment_size (2**20) nothing of this small model is sharded,
which is why the trainer must choose segment_size by a rule. Engine level; the trainer's stage 2 / 3
on it: tests/test_sharding.py."""
import pytest

from conftest import launch_cases

CASES = {"os_g": {"level": "os_g"}, "p_g_os": {"level": "p_g_os"},
         "p_g_os_default_segment": {"level": "p_g_os", "segment_size": 2 ** 20}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch_cases([(n, "group_sharded_cases:group_sharded_case", kw) for n, kw in CASES.items()],
                        tmp_path_factory.mktemp("group_sharded"), nproc=2)


@pytest.mark.parametrize("name", list(CASES))
def test_group_sharded_equals_one_process_on_gloo(runs, name):
    import numpy as np

    for r in runs[name]:
        assert r["installed"] is True   # the CPU shim ran (a CUDA build needs none)
        np.testing.assert_allclose(r["losses"], r["ref_losses"], rtol=1e-6)
        assert r["max_param_diff"] <= 1e-6, r["max_param_diff"]
        assert (r["wrapper"], r["optimizer"]) == {
            "os_g": ("GroupShardedStage2", "GroupShardedOptimizerStage2"),
            "p_g_os": ("GroupShardedStage3", "AdamW")}[CASES[name]["level"]]


def test_stage3_shards_the_frozen_backbone_between_steps(runs):
    """p_g_os, segment_size 0: each rank holds its slice of every frozen parameter (numel / S,
    padded up to paddle's alignment unit), about half of the backbone; stage 2 and stage 3 with
    the default segment_size hold it whole."""
    for r in runs["p_g_os"]:
        S, unit = r["world"], r["align_bytes"] // 4   # float32 elements per alignment unit
        total = sum(r["frozen_numel"].values())
        for step in r["frozen_held"]:
            for name, numel in r["frozen_numel"].items():
                assert numel / S <= step[name] <= numel / S + unit, (name, step[name], numel)
            assert sum(step.values()) <= total / S + len(step) * unit / S
            assert sum(step.values()) <= 0.6 * total, (step, total)
    for name in ("os_g", "p_g_os_default_segment"):
        for r in runs[name]:
            assert all(step == r["frozen_numel"] for step in r["frozen_held"]), name
