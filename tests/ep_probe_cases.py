"""Launched case of tests/test_expert_groups_fleet.py: fleet's EPHybridCommunicateGroup (paddle
3.3.1, fleet/base/topology.py) built at run time for the expert-parallel layouts our tests use,
next to our groups (parallel/expert.py, topology.py "ep" / "ep_data") for the same layout.

fleet would build it from fleet.init when hybrid_configs has ep_degree > 1 (fleet.py
_create_hcg); here it is constructed directly, with the class's own default axis order, after
parallel.init built ours, so both exist in one process. It replaces topology's global
_HYBRID_PARALLEL_GROUP while it lives: the previous one is put back.
"""
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import paddletune  # noqa: E402,F401

NAMES = ["pipe", "moe_sharding", "expert", "data", "sharding", "sep", "context", "model"]


def _build(dims):
    """fleet's EPHybridCommunicateGroup over `dims` ({name: degree}, others 1), its groups created
    through cpu_compat.fleet_groups as parallel.init creates fleet's; ({...} | {"error": ...})."""
    import paddle.distributed as dist
    from paddle.distributed.fleet.base import topology as fleet_topology

    from paddletune.parallel.cpu_compat import fleet_groups

    saved = fleet_topology._HYBRID_PARALLEL_GROUP
    try:
        with fleet_groups(dist.get_world_size()):
            hcg = fleet_topology.EPHybridCommunicateGroup(NAMES, [dims.get(n, 1) for n in NAMES])
    except Exception as err:   # recorded: the test states which layouts fleet refuses, and why
        return {"error": f"{type(err).__name__}: {err}"}
    finally:
        fleet_topology._HYBRID_PARALLEL_GROUP = saved
    return {"expert": list(hcg.get_expert_parallel_group().ranks),
            "moe_sharding": list(hcg.get_moe_sharding_parallel_group().ranks),
            "data": list(hcg.get_data_parallel_group().ranks),
            "sharding": list(hcg.get_sharding_parallel_group().ranks),
            "model": list(hcg.get_model_parallel_group().ranks)}


def ep_groups_case(ep):
    """Ours for dp = world, expert_parallel_degree `ep`; fleet's for the same experts laid out
    (a) as our degrees say (data = world, expert = ep) and (b) as fleet lays data ranks out
    under expert parallel (data 1, sharding = world, moe_sharding = world / ep, expert = ep)."""
    from paddletune import parallel

    args = types.SimpleNamespace(tensor_parallel_degree=1, pipeline_parallel_degree=1, sharding="",
                                 sharding_parallel_degree=-1, expert_parallel_degree=ep)
    topo = parallel.init(args)
    world = topo.world_size
    ours = {"ep": topo.ranks("ep"), "ep_data": topo.ranks("ep_data"), "data": topo.ranks("data"),
            "dp": topo.ranks("dp")}
    as_ours = _build({"data": world, "expert": ep, "moe_sharding": world // ep})
    as_fleet = _build({"sharding": world, "expert": ep, "moe_sharding": world // ep})
    return {"rank": topo.rank, "world": world, "ours": ours, "as_ours": as_ours, "as_fleet": as_fleet}
