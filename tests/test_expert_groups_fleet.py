"""Expert-parallel groups: ours (topology.py "ep" / "ep_data", parallel/expert.py) against fleet's
EPHybridCommunicateGroup probed at run time (issue 28, deliverable 6), on 4 launched ranks for
the layouts test_moe_ep.py trains: ep 2 < dp 4 and ep 4 = dp 4 (its 2-rank ep 2 = dp 2 has the
ep = dp form). Oracle: topology.py's docstring rule, worked by hand below.

What the probe recorded (paddle 3.3.1), and why the groups stay ours (expert.py docstring):
fleet refuses the layout as our degrees state it (data-parallel degree 4 with expert > 1): its
constructor asserts dp_degree == 1 "in MoE" (rank 0), and fails even earlier on other ranks (its
context grid is built from the sharding axis only) or when moe_sharding > 1 (dense_sharding =
sharding // moe_sharding = 0). Laid out as fleet wants it - data 1, sharding 4,
moe_sharding 4 / ep, expert ep - its expert groups equal our "ep" and its moe_sharding groups our
"ep_data", but the dense data-parallel ranks are then fleet's *sharding* axis and its data group
is each rank alone. A change in either fact fails here: re-probe and reconsider.
"""
import pytest

from conftest import launch_cases


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_probe")
    return launch_cases([("ep2", "ep_probe_cases:ep_groups_case", {"ep": 2}),
                         ("ep4", "ep_probe_cases:ep_groups_case", {"ep": 4})], tmp, nproc=4)


def _hand(r, ep):
    """topology.py docstring: 4 data ranks, expert groups of ep consecutive ranks, expert-data
    groups of the ranks with the same index in their expert group."""
    first = r - r % ep
    return list(range(first, first + ep)), list(range(r % ep, 4, ep))


@pytest.mark.parametrize("layout,ep", [("ep2", 2), ("ep4", 4)])
def test_fleets_expert_groups_equal_ours_only_with_data_as_sharding(probe, layout, ep):
    for r, res in enumerate(probe[layout]):
        ep_ranks, ep_data = _hand(r, ep)
        assert res["rank"] == r and res["world"] == 4
        assert res["ours"] == {"ep": ep_ranks, "ep_data": ep_data, "data": [0, 1, 2, 3],
                               "dp": [0, 1, 2, 3]}
        fleet = res["as_fleet"]
        assert "error" not in fleet, fleet
        assert fleet["expert"] == ep_ranks and fleet["moe_sharding"] == ep_data
        # ... but the dense data-parallel ranks are fleet's sharding group, its data group is alone
        assert fleet["sharding"] == [0, 1, 2, 3] and fleet["data"] == [r] and fleet["model"] == [r]


@pytest.mark.parametrize("layout,ep", [("ep2", 2), ("ep4", 4)])
def test_fleet_refuses_expert_parallel_over_data_parallel_ranks(probe, layout, ep):
    for r, res in enumerate(probe[layout]):
        err = res["as_ours"].get("error")
        assert err, f"fleet now builds ep {ep} over dp 4 ({res['as_ours']}): re-probe, maybe use it"
        if ep == 4:    # moe_sharding 1: the dp assertion (rank 0) or the context grid (others)
            assert err.startswith("AssertionError")
            if r == 0:
                assert "dp_degree 4 must be 1 in MoE" in err, err
        else:          # moe_sharding 2: dense_sharding = 1 // 2 = 0, an empty grid
            assert err.startswith("IndexError"), err
