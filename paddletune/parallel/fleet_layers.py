"""Tensor parallel through fleet's layer classes (issue 28 deliverable 4).

`parallelize(model, tp)` (tensor.install calls it, after load_sharded) puts in place of every
planned plain float module an instance of paddle's own Megatron layer, built from outside the
model from the ModelSpec plan (parallel/plan.py) with today's local widths:

    plan     module                       becomes (fleet.meta_parallel)            local weight
    column   nn.Linear  W [in, out]       ColumnParallelLinear(in, n_l * t,        [in, n_l]
                                            has_bias, gather_output=False)
    row      nn.Linear  W [in, out]       RowParallelLinear(in_l * t, out,         [in_l, out]
                                            has_bias, input_is_parallel=True)
    vocab    nn.Embedding  E [V, H]       VocabParallelEmbedding(V_l * t, H)       [V_l, H]

t = tensor-parallel degree; n_l / in_l / V_l the local width the plan gives this rank (the
DTensor's global shape is local x t): vocabulary padded to a multiple of t (the padded rows /
columns stay masked by parallel/vocab.py's cross-entropy), fused parts laid out [q_r | k_r | v_r]
(fleet's classes never look inside the local weight), key/value heads replicated when
kv_heads < t (out = local x t, as the DTensor), Bloom / Baichuan ALiBi offsets and ChatGLM2 part
widths set on the new layer as on the old. The new layer holds the SAME parameter objects (the
DTensor slices load_sharded read: no rank reads a full weight) under the same attribute, so
parameter names, checkpoints and exports do not change. Its __init__ would create a random
local weight (and a zero bias) in the mp RNG tracker's state: it runs under paddle.LazyGuard,
so those are never allocated, and are then replaced by ours (they keep fleet's is_distributed /
split_axis marks; hooks already on the old module move over).

Forward is fleet's (`type(layer).forward`), with one change for column layers: Megatron's f
(mp_ops._c_identity, identity forward / all-reduce backward) runs once per distinct input
(tensor.TensorParallel.enter: q/k/v share one, gate/up share one), as before, instead of once
per layer - so the instance's own identity is off (`is_mp = False`, which in
ColumnParallelLinear.forward only guards the identity and the output gather, both unused here;
the async-allreduce variants, whose backward all-reduces per layer, are turned off too). Row
and vocabulary layers run fleet's forward as it is (g = mp_ops._mp_allreduce after the local
matmul / the c_embedding lookup, which has a CPU kernel; the row bias added once after the sum); a wrapper only records the collective
in `tp.log` for the tests' counts. The layers run inside tensor.local_params, so fleet's
forward sees the local shards of the DTensor parameters.

Kept on tensor.py's patched forwards over the same mp_ops (install):
  - quantized linears (quant/: packed codes, `algo.matmul`): fleet's classes run F.linear on a
    float weight;
  - layers.NormHead (Baichuan2's head) and any other nn.Linear subclass: its `weight_transform`
    normalises the weight before the matmul, which fleet's forward would skip;
  - a float layer whose bias dtype differs from its weight's (F.linear takes one dtype; ours
    casts the bias);
  - modules whose weight was not loaded on this rank (another pipeline stage's), and every
    module when the run has no fleet HybridCommunicateGroup.
PEFT wraps fleet's layers as it wrapped nn.Linear (LoRA / adapters keep the layer as
`base_layer`; BitFit adds a bias that fleet's forward then uses), so no planned module stays
patched because of PEFT. (LoRA's in-memory merge() still takes only nn.Linear bases; under
TP adapters are merged from checkpoints, llm/merge_tp_and_pp_params.py, as before.)
"""
import types

import paddle
import paddle.nn as nn

FLOAT = ("float16", "bfloat16", "float32", "float64")
ENABLED = True   # False: every planned module keeps tensor.py's patched forward (tests compare)


def _dtype_name(t):
    return str(t.dtype).replace("paddle.", "")


def _classes():
    from paddle.distributed.fleet.meta_parallel import (ColumnParallelLinear, RowParallelLinear,
                                                        VocabParallelEmbedding)

    return {"column": ColumnParallelLinear, "row": RowParallelLinear, "vocab": VocabParallelEmbedding}


def expressible(m, kind):
    """Whether fleet's class for `kind` computes what `m` computes (see the module docstring)."""
    w = getattr(m, "weight", None)
    if w is None or not w.is_dist() or _dtype_name(w) not in FLOAT:
        return False
    if kind == "vocab":
        return type(m) is nn.Embedding
    b = getattr(m, "bias", None)
    return type(m) is nn.Linear and (b is None or (b.is_dist() and b.dtype == w.dtype))


def build(m, kind, tp):
    """Fleet's layer for planned module `m`, holding m's parameters (global shapes = local x t)."""
    cls = _classes()[kind]
    w = m.weight
    shape = [int(s) for s in w.shape]   # DTensor: the global shape, local x t along the split
    with paddle.LazyGuard():   # __init__'s random weight / zero bias: never allocated
        if kind == "column":
            new = cls(shape[0], shape[1], has_bias=m.bias is not None, gather_output=False,
                      mp_group=tp.mp_group)
        elif kind == "row":
            new = cls(shape[0], shape[1], has_bias=m.bias is not None, input_is_parallel=True,
                      mp_group=tp.mp_group)
        else:
            new = cls(shape[0], shape[1], mp_group=tp.mp_group)
    new._parameters["weight"] = w
    if kind != "vocab":
        new._parameters["bias"] = m.bias
    # the marks fleet's __init__ gives its own parameters (its HybridParallelClipGrad and
    # broadcast_mp_parameters read them): a split tensor is distributed, along split_axis
    for leaf, axis in {"column": (("weight", 1), ("bias", 0)), "row": (("weight", 0),),
                       "vocab": (("weight", 0),)}[kind]:
        p = new._parameters.get(leaf)
        if p is not None:
            p.is_distributed, p.split_axis = True, axis
        # LoRA / adapters / BitFit size themselves by these (the DTensor's global shape, as
        # peft.common.linear_dims read them off nn.Linear's weight)
        new.in_features, new.out_features = shape
    new.training = m.training
    # hooks registered on the module before (same dicts: their remove handles keep working)
    new._forward_pre_hooks, new._forward_post_hooks = m._forward_pre_hooks, m._forward_post_hooks
    if kind != "vocab":   # x @ W (+ b): models/loss.linear_head's head, BitFit's bias target
        new.plain_linear = True
    for key, value in vars(m).items():   # attributes the model code set on the module
        if not key.startswith("_") and key not in vars(new):
            setattr(new, key, value)
    if kind == "column":
        # f once per distinct input (module docstring); no per-layer identity or async variant
        new.is_mp = False
        new.mp_async_allreduce = new.mp_skip_c_identity = False
        new.mp_fused_linear_param_grad_add = False
        new.forward = types.MethodType(_column_forward(tp), new)
    else:
        new.forward = types.MethodType(_reducing_forward(tp), new)
    return new


def _column_forward(tp):
    def forward(self, x):
        return type(self).forward(self, tp.enter(x))
    return forward


def _reducing_forward(tp):
    def forward(self, x):
        y = type(self).forward(self, x)   # ends in mp_ops._mp_allreduce over the mp group
        if tp.log is not None:
            tp.log.append(("all_reduce_sum", list(y.shape)))
        return y
    return forward


def parallelize(model, tp):
    """Replace every planned float Linear / Embedding of `model` by fleet's layer (module
    docstring); returns {module name: kind} of the replaced modules. Needs fleet.init (a
    HybridCommunicateGroup); without one nothing is replaced."""
    from .plan import module_kind

    if not ENABLED or getattr(tp.topo, "hcg", None) is None:
        return {}
    done = {}
    for name, m in list(model.named_sublayers()):
        kind = module_kind(model.spec, name)
        if kind not in ("column", "row", "vocab") or getattr(m, "_pt_tp", False):
            continue
        if not expressible(m, kind):
            continue
        new = build(m, kind, tp)
        new._pt_tp = kind
        parent_name, _, leaf = name.rpartition(".")
        parent = model
        for part in parent_name.split(".") if parent_name else []:
            parent = getattr(parent, part)
        setattr(parent, leaf, new)
        done[name] = kind
    return done
