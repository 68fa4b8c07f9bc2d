"""parallel.topology: degrees under PaddleNLP's rules, the rank grid, group membership (hand-worked)."""
from types import SimpleNamespace

import pytest

from paddletune.parallel import Topology, TopologyError, degrees_from_args
from paddletune.parallel.topology import coordinates, group_ranks


def targs(tp=-1, pp=-1, sd=-1, sharding=""):
    return SimpleNamespace(tensor_parallel_degree=tp, pipeline_parallel_degree=pp,
                           sharding_parallel_degree=sd, sharding=sharding)


def test_degrees_follow_paddlenlp_rules():
    assert degrees_from_args(targs(), 4) == {"dp": 4, "pp": 1, "sharding": 1, "tp": 1}
    assert degrees_from_args(targs(tp=2), 8) == {"dp": 4, "pp": 1, "sharding": 1, "tp": 2}
    assert degrees_from_args(targs(tp=2, pp=2), 8) == {"dp": 2, "pp": 2, "sharding": 1, "tp": 2}
    # sharding_parallel_degree -1 with sharding set: every rank left after tp x pp
    assert degrees_from_args(targs(tp=2, sharding="stage1"), 8) == {"dp": 1, "pp": 1, "sharding": 4, "tp": 2}
    assert degrees_from_args(targs(sd=2, sharding="stage2"), 8) == {"dp": 4, "pp": 1, "sharding": 2, "tp": 1}
    # a sharding degree without `sharding` set means no sharding (PaddleNLP ignores it too)
    assert degrees_from_args(targs(sd=2), 4)["sharding"] == 1
    assert degrees_from_args(targs(tp=1, pp=1), 1) == {"dp": 1, "pp": 1, "sharding": 1, "tp": 1}


def test_indivisible_world_names_both_numbers():
    with pytest.raises(TopologyError, match=r"world size 6 .* = 4"):
        degrees_from_args(targs(tp=2, pp=2), 6)
    with pytest.raises(TopologyError, match="world size 3"):
        degrees_from_args(targs(tp=2, sharding="stage1"), 3)


def test_rank_grid_and_groups_hand_worked():
    """8 ranks as dp 2 x pp 2 x tp 2 (tp innermost): rank 5 = dp 1, pp 0, tp 1."""
    d = {"dp": 2, "pp": 2, "sharding": 1, "tp": 2}
    assert coordinates(5, d) == {"dp": 1, "pp": 0, "sharding": 0, "tp": 1}
    assert group_ranks(5, d, "tp") == [4, 5]
    assert group_ranks(5, d, "dp") == [1, 5]
    assert group_ranks(5, d, "pp") == [5, 7]
    assert group_ranks(5, d, "data") == [1, 5]
    d = {"dp": 2, "pp": 1, "sharding": 2, "tp": 1}   # data ranks = dp x sharding
    assert group_ranks(3, d, "data") == [0, 1, 2, 3]
    t = Topology(world_size=4, rank=3, degrees=d, coords=coordinates(3, d))
    assert (t.data_degree, t.data_rank, t.sharding_rank, t.dp_rank) == (4, 3, 1, 1)


def test_single_process_collectives_are_identities():
    import paddle

    t = Topology()
    x = paddle.to_tensor([1.0, 2.0])
    assert t.all_reduce_sum(x) is x and t.all_reduce_scalars([3, 4]) == [3.0, 4.0]
    assert t.all_gather_json({"a": 1}) == [{"a": 1}] and t.all_reduce_grads([x])[0] is x


def test_layout_checks_name_both_numbers():
    from dataclasses import replace

    from paddletune.models import get_spec
    from paddletune.models.llama import LlamaConfig
    from paddletune.parallel.plan import check_layout

    spec = get_spec("llama")
    cfg = LlamaConfig.from_dict(dict(spec.tiny_config, num_attention_heads=8, num_key_value_heads=2,
                                     intermediate_size=96))
    check_layout(spec, cfg, 2)                              # 8 heads, 2 kv heads, 96: fine
    check_layout(spec, cfg, 4)                              # 2 kv heads on 4 ranks: replicated
    for c, degree, msg in ((cfg, 3, r"num_attention_heads \(8\) is not divisible by tensor_parallel_degree \(3\)"),
                           (replace(cfg, num_key_value_heads=4, num_attention_heads=12), 6,
                            r"num_key_value_heads \(4\) is smaller than tensor_parallel_degree \(6\) "
                            "and does not divide it")):
        with pytest.raises(ValueError, match=msg):
            check_layout(spec, c, degree)
    with pytest.raises(ValueError, match=r"intermediate_size \(90\) is not divisible"):
        check_layout(spec, replace(cfg, intermediate_size=90, num_key_value_heads=8), 4)
    with pytest.raises(ValueError, match="declares no tensor-parallel plan"):
        check_layout(replace(spec, tp_plan={}), cfg, 2)


@pytest.mark.parametrize("heads, kv, degree, want", [(4, 2, 2, 1), (8, 8, 4, 2), (4, 1, 2, 1),
                                                     (8, 2, 4, 1), (8, 1, 4, 1)])
def test_local_kv_heads_one_count_for_the_plan_and_the_cache(heads, kv, degree, want):
    """Hand-worked: K / TP key/value heads per rank, or 1 (replicated) when K < TP. The plan's
    k_proj slice and the KV cache under TP (KVCache.for_model) both hold that many."""
    from types import SimpleNamespace

    from paddletune.models import get_spec
    from paddletune.models.cache import KVCache
    from paddletune.models.llama import LlamaConfig
    from paddletune.parallel.plan import local_heads, param_split
    from paddletune.parallel.tensor import TensorParallel

    spec = get_spec("llama")
    cfg = LlamaConfig.from_dict(dict(spec.tiny_config, hidden_size=64, num_attention_heads=heads,
                                     num_key_value_heads=kv))
    D = 64 // heads
    assert local_heads(kv, degree) == want
    split = param_split(spec, cfg, "model.layers.0.self_attn.k_proj.weight", [64, kv * D])
    assert split.local_shape([64, kv * D], degree) == [64, want * D]
    tp = TensorParallel.__new__(TensorParallel)        # only the degree matters here
    tp.degree = degree
    model = SimpleNamespace(spec=spec, config=cfg, tensor_parallel=tp)
    cache = KVCache.for_model(model, batch_size=3, max_length=5)
    assert cache.keys[0].shape == [3, want, 5, D] and len(cache.keys) == cfg.num_hidden_layers
