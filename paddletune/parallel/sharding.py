"""Sharding (ZeRO-style) over the `sharding` axis: optimizer state, gradients, parameters.

The S sharding ranks of a group are data-parallel ranks (each reads its own share of every global
batch: the data loader splits a global batch over dp x sharding ranks) that also split the
training state. The trainable tensors (this rank's local shards under tensor / pipeline
parallelism) are partitioned into S owners, whole tensors in model order, balancing numel
(`partition`); sharding rank r owns part r:

    stage1  each rank keeps AdamW moments for its own tensors only. Without expert groups
            this is fleet's (alone, x DP, x TP, x PP): fleet.distributed_optimizer wraps the
            paddle AdamW in DygraphShardingOptimizer (V1) inside HybridParallelOptimizer, whose
            step reduces each gradient to its owner (sharding group), all-reduces the owned ones
            over dp, runs the trainer's update on the owner's tensors and broadcasts them (its
            partition: greedy by numel, largest first; parallel/data.py FleetDataParallel,
            `on_fleet`); with sharding_parallel_config split_param (no TP, no PP) fleet's
            DygraphShardingOptimizerV2: flat 1/S ranges of one fused buffer (`split`). Under PP each stage's sharding group partitions that stage's tensors,
            so the two copies of a tied embedding (first and last stage) or of a tensor every
            stage holds (a prefix) can have different owners: their copies are summed over the
            pipeline group before fleet's reduce (tied: fleet's shared comm at the end of
            forward_backward_pipeline; replicated: layout.Parallel.step), never after it
    stage2  gradients as well. Without TP / PP this is paddle's group_sharded_parallel("os_g")
            (group_sharded.py: reduced to the owner in buckets during backward, a non-owner
            drops each at once). Under TP / PP the code below runs it: after the step's
            backward the gradients are reduced to their
            owner only (dist.reduce over the sharding group, then an all-reduce over the pure
            data-parallel replicas of that owner), and every rank drops the gradients of the
            tensors it does not own right away (during backward a rank holds the whole
            gradient: gloo has no reduce_scatter, and reducing inside backward is not built)
    stage3  parameters as well. Without TP / PP this is paddle's group_sharded_parallel("p_g_os")
            (group_sharded.GroupShardedStage3: flat padded slices of every tensor above
            segment_size, frozen ones included, gathered per layer by its hooks; "stage3
            offload": its offload=True, on every build). Under TP (and with AMP O2) the code
            below runs it:
            between steps a rank holds only its own tensors' values (the
            others' storage is released). During a step the decoder blocks are gathered one at a
            time (`Layerwise`): a block's tensors are broadcast from their owners just before its
            forward and released right after it, gathered again when backward reaches the block
            and released when its backward is done; the tensors outside the blocks (embedding,
            final norm, head, a prefix) are gathered for the whole step. Peak during a step: the
            owned tensors + the non-block ones + one block. Evaluation and export gather the
            whole model. Frozen parameters (a PEFT backbone, quantized weights) are not sharded.
Example, 2 sharding ranks, tensors of numel [4, 4, 4, 4]: rank 0 owns the first two, keeps their
moments (16 numbers instead of 32), under stage2 holds their two gradients after the reduction,
under stage3 holds only their two values between steps.

The gradient norm for clipping is the global one: stage1 has every gradient on every rank; from
stage2 each owner's squared norm is summed over the sharding group (`square_norm`).

Stage 1 (with or without TP / PP) and (without TP / PP) stages 2 and 3 are paddle's (above); TP x
stage 2/3 are still this module's (paddle's group_sharded takes plain parameters; ours under TP are
DTensors: forced through it, TP2 x stage 2 trained on zero gradients and TP2 x stage 3 segfaulted at wrap); PP x stage 2 / 3 is refused (fleet has no pipeline path for
them). Why not paddle's dist.shard_optimizer: it shards paddle's optimizer accumulators through DTensor
placements on a sharding mesh axis; paddletune's AdamW keeps its state under full-model names for
layout-independent checkpoints and runs paddle's fused adamw_ kernel on local shards, and gloo has
no reduce_scatter (the engine needs a reshard shim for it). Communication here: dist.reduce,
dist.broadcast and all-reduce over paddle process groups (gloo on CPU, NCCL on GPU), in buckets
of at most BUCKET elements per collective (a lone tensor straight from / into its storage); the
only collectives inside autograd are stage 3's block gathers (forward hooks, PyLayer backward).

Checkpoints stay layout-independent: each owner writes its tensors (and their moments) under their
full names; the first pure data-parallel replica writes, so every tensor is written once.
"""
import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

STAGES = ("stage1", "stage2", "stage3")
BUCKET = 1 << 22   # elements per flat collective (16 MB in float32)
# stage 3 without TP / PP on paddle's group_sharded_parallel("p_g_os") (group_sharded.py);
# False: this module's layer-wise stage 3
PADDLE_STAGE3 = True


def stage_of(value):
    """The sharding stage (1, 2 or 3) of a `sharding` argument such as "stage2" or
    "stage1 offload" (several stages: the highest), 0 when empty."""
    words = (value or "").split()
    return max([int(w[-1]) for w in words if w in STAGES] or [0])


def partition(sizes, parts):
    """Owner index per entry of `sizes` (numel list, in model order): contiguous runs, as even as
    possible in numel. Example: [4, 4, 4, 4] over 2 -> [0, 0, 1, 1]."""
    total = float(sum(sizes)) or 1.0
    owners, acc = [], 0.0
    for n in sizes:
        owners.append(min(parts - 1, int((acc + n / 2.0) * parts / total)))
        acc += n
    return owners


def numel(t):
    return int(np.prod(t.shape)) if t is not None else 0


def resident_numel(tensors):
    """Elements of the tensors that hold storage now (a released stage-3 parameter holds none)."""
    return sum(numel(t) for t in tensors if t is not None and t._is_initialized())


def _refill(p, value):
    """Give released parameter `p` the storage of `value` (its local shard's values). A tensor-
    parallel DTensor takes it as a DTensor with its own mesh and placements: clearing or filling
    its _local_value() would only touch a temporary wrapper."""
    if p.is_dist():
        from paddle.distributed.auto_parallel.api import dtensor_from_local

        value = dtensor_from_local(value, p.process_mesh, p.placements)
    value._share_buffer_to(p)


class Sharding:
    """This rank's place in its sharding group, which trainable tensors it owns, and the
    collectives of the stage. `named`: [(name, parameter)] of the trainable tensors, in the same
    order on every rank of the group; `local(p)` is a parameter's local shard (a DTensor's
    _local_value() under tensor parallel), which is what is partitioned and sent."""

    def __init__(self, topo, stage, named, local=lambda p: p, fleet=False):
        self.topo, self.stage, self.fleet = topo, stage, fleet
        self.degree, self.rank = topo.sharding_degree, topo.sharding_rank
        self.ranks = topo.ranks("sharding")
        self.group = None if len(self.ranks) == topo.world_size else topo.groups["sharding"]
        names = [n for n, _ in named]
        self.local = local
        self.shapes = {n: list(local(p).shape) for n, p in named}
        self.dtypes = {n: p.dtype for n, p in named}
        ours = dict(zip(names, partition([int(np.prod(self.shapes[n])) for n in names], self.degree)))
        # fleet (stage 1): every tensor counts as this rank's until adopt() takes fleet's partition;
        # paddle's stage 3: every rank updates its slice of every tensor (no owner)
        self.owner = {} if fleet else ours
        self.writer_of = ours   # paddle's stage 3: who writes a tensor to a checkpoint
        self.owned = [n for n in names if self.owns(n)]
        self.released = False
        self.layerwise = None   # stage 3: Layerwise over the decoder blocks (install_layerwise)
        self.offload = False    # "offload" on a GPU where ours runs: the owners' AdamW state in host memory
        self.paddle_offload = False   # "stage3 offload" on paddle's stage 3: group_sharded's offload
        self.stats = {}   # what a rank holds, measured (tests assert the split)
        self.split = False   # stage 1 as fleet's DygraphShardingOptimizerV2 (split_param, data.py)

    def owns(self, name):
        return self.owner.get(name, self.rank) == self.rank

    def writes(self, name):
        """Whether this rank writes `name` to a checkpoint: its owner, or under paddle's stage 3
        (every rank holds a slice of it) our partition's owner of the gathered tensor."""
        if self.stage >= 3 and self.fleet:
            return self.writer_of[name] == self.rank
        return self.owns(name)

    def adopt(self, owner):
        """fleet's partition ({name: sharding rank}, data.FleetDataParallel.owners) replaces ours."""
        self.owner = dict(owner)
        self.owned = [n for n in self.shapes if self.owns(n)]

    @property
    def owned_grads_only(self):
        """After the reduction a rank has the summed gradients of its own tensors only (stage 2+;
        fleet's stage 1: its reduce sums each gradient into its owner, the others' stay partial)."""
        return self.stage >= 2 or self.fleet

    def _dp(self):
        """(group, size) of the pure data-parallel replicas (same sharding index)."""
        n = self.topo.dp_degree
        if n <= 1:
            return None, 1
        return (None if n == self.topo.world_size else self.topo.groups["dp"]), n

    def _by_owner(self, names):
        return [(o, [n for n in names if self.owner[n] == o]) for o in range(self.degree)]

    def _buckets(self, names):
        """(owner, names) runs of one owner's tensors of at most BUCKET elements each (a bigger
        tensor alone): one collective per bucket, and the transient flat copy stays small."""
        out = []
        for owner, group in self._by_owner(names):
            cur, size = [], 0
            for n in group:
                k = int(np.prod(self.shapes[n]))
                if cur and size + k > BUCKET:
                    out.append((owner, cur))
                    cur, size = [], 0
                cur.append(n)
                size += k
            if cur:
                out.append((owner, cur))
        return out

    def reduce_grads(self, names, grads):
        """Stage 2+: gradients summed into their owner (dist.reduce over the sharding group,
        then an all-reduce over the data-parallel replicas; per bucket, a lone tensor in place);
        the returned list holds the owner's summed gradients (in the tensors passed in) and None
        for every tensor this rank does not own."""
        out = dict.fromkeys(names)
        where = dict(zip(names, grads))
        dp, size = self._dp()
        for owner, group_names in self._buckets(names):
            ts = [where[n] for n in group_names]
            flat = ts[0] if len(ts) == 1 else paddle.concat([g.reshape([-1]).astype("float32") for g in ts])
            dist.reduce(flat, dst=self.ranks[owner], group=self.group)
            if owner != self.rank:
                continue
            if size > 1:
                dist.all_reduce(flat, group=dp)
            if len(ts) == 1:
                out[group_names[0]] = flat
                continue
            for n, g, part in zip(group_names, ts, paddle.split(flat, [numel(g) for g in ts])):
                g.set_value(part.reshape(g.shape).astype(g.dtype))   # the sum, in the gradient itself
                out[n] = g
        return [out[n] for n in names]

    def broadcast_params(self, params):
        """Every owner sends its tensors' values to its sharding group (per bucket; a lone
        tensor straight from / into its storage). params: {name: parameter}; a released one
        gets new storage (stage 3)."""
        with paddle.no_grad():
            for owner, names in self._buckets(list(params)):
                src = self.ranks[owner]
                if len(names) == 1:
                    p = params[names[0]]
                    if owner == self.rank or p._is_initialized():
                        dist.broadcast(self.local(p), src=src, group=self.group)
                    else:
                        buf = paddle.empty(self.shapes[names[0]], self.dtypes[names[0]])
                        dist.broadcast(buf, src=src, group=self.group)
                        _refill(p, buf)
                    continue
                sizes = [int(np.prod(self.shapes[n])) for n in names]
                if owner == self.rank:
                    flat = paddle.concat([self.local(params[n]).reshape([-1]).astype("float32")
                                          for n in names])
                else:
                    flat = paddle.empty([sum(sizes)], "float32")
                dist.broadcast(flat, src=src, group=self.group)
                if owner == self.rank:
                    continue
                for n, part in zip(names, paddle.split(flat, sizes)):
                    value = part.reshape(self.shapes[n]).astype(self.dtypes[n])
                    p = params[n]
                    if p._is_initialized():
                        self.local(p).set_value(value)
                    else:   # released (stage 3): the received tensor's storage becomes its own
                        _refill(p, value)

    def gather(self, params):
        """Stage 3: the whole model, filled from the owners (evaluation, export, the end of
        training); no-op when held."""
        if self.stage >= 3 and self.released:
            self.broadcast_params(params)
            self.released = False

    def begin_step(self, params):
        """Stage 3 at the start of a step: the tensors outside the decoder blocks (the blocks
        come one at a time, `Layerwise`), or the whole model without blocks to hook."""
        if self.stage < 3 or not self.released:
            return
        if self.layerwise is None:
            return self.gather(params)
        self.broadcast_params({n: params[n] for n in self.layerwise.rest})
        self.released = False
        self.layerwise.start()

    def install_layerwise(self, model, params):
        """Stage 3: hook the model's decoder blocks (model.decoder_layers()) so each is gathered
        only while its forward or backward runs."""
        blocks = model.decoder_layers() if hasattr(model, "decoder_layers") else None
        if self.stage >= 3 and blocks is not None and not self.fleet:   # (paddle's: its own hooks)
            self.layerwise = Layerwise(self, blocks, params)

    def release(self, params):
        """Stage 3 (ours): drop the storage of every tensor this rank does not own."""
        if self.stage < 3 or self.fleet:   # (paddle's stage 3 holds slices: group_sharded.py)
            return
        for n, p in params.items():
            if not self.owns(n) and p._is_initialized():
                p._clear_data()
        self.released = True
        if self.layerwise is not None:
            self.layerwise.stop()

    def resident(self, params):
        """Elements of this rank's local shards that hold storage now (stage 3 between steps:
        the owned ones only; paddle's stage 3: each tensor's slice)."""
        if self.stage >= 3 and self.fleet:
            from .group_sharded import held_numel

            return sum(held_numel(p) for p in params.values())
        return sum(int(np.prod(self.shapes[n])) for n, p in params.items() if p._is_initialized())

    def after_step(self, params):
        """After the owners' update: stages 1-2 send the new values to the group, stage 3
        releases what this rank does not own (the owners send them at the next gather)."""
        if self.stage >= 3:
            self.release(params)
        elif not self.fleet:   # (fleet's sharding optimizer broadcast them in its step)
            self.broadcast_params(params)

    def square_norm(self, sq):
        """Stage 2+: the owners' squared-norm parts summed over the sharding group."""
        if self.degree > 1:
            from .group_sharded import on_comm_device

            comm = on_comm_device(sq)   # (paddle's stage 3 offload on a GPU: a host tensor)
            dist.all_reduce(comm, group=self.group)
            sq = comm if comm is sq else comm.cpu()
        return sq


class _GatherInBackward(PyLayer):
    """Identity on a block's output; in backward (before the block's own backward) it gathers
    the block's tensors again."""

    @staticmethod
    def forward(ctx, x, unit):
        ctx.unit = unit
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        ctx.unit.enter_backward()
        return dy


class _ReleaseAfterBackward(PyLayer):
    """Identity on a block's input; its backward runs once the block's backward is done (every
    gradient of the block's weights is computed by then): the block's tensors are released."""

    @staticmethod
    def forward(ctx, x, unit):
        ctx.unit = unit
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        ctx.unit.leave_backward()
        return dy


class _Unit:
    """One decoder block's trainable tensors under layer-wise stage 3. `pending` counts the
    backward passes through the block that have begun and not ended (two with R-Drop's two
    forward passes, whose backwards may interleave): the block is released when it drops to 0."""

    def __init__(self, owner, names):
        self.owner, self.names = owner, names
        self.held = False   # gathered now (the same on every rank of the group)
        self.pending = 0

    @property
    def in_backward(self):
        return self.pending > 0

    def gather(self):
        sh, lw = self.owner.shard, self.owner
        if not self.held:
            sh.broadcast_params({n: lw.params[n] for n in self.names})
            self.held = True
            lw.note_peak()

    def release(self):
        sh, lw = self.owner.shard, self.owner
        for n in self.names:
            p = lw.params[n]
            if not sh.owns(n) and p._is_initialized():
                p._clear_data()
        self.held = False

    def enter_backward(self):
        self.gather()
        self.pending += 1

    def leave_backward(self):
        self.pending -= 1
        if self.pending == 0:
            self.release()

    def reset(self):
        self.held, self.pending = False, 0


class Layerwise:
    """Stage 3 block by block, through forward pre/post hooks on each decoder block (active only
    inside a training step; evaluation and export see the whole model):
        pre-hook   gather the block; its input goes through _ReleaseAfterBackward
        post-hook  release the block; its output goes through _GatherInBackward
    A block whose backward is running (recompute re-runs its forward then) is left alone. A block
    whose input carries no gradient (the first one over a frozen embedding, PEFT) would give no
    signal at the end of its backward: its input gets a zero added from a leaf that requires a
    gradient (`anchor`), so the signal comes, at the cost of that block's input gradient. Every
    rank of a sharding group runs the same blocks in the same order, so the broadcasts match."""

    def __init__(self, shard, blocks, params):
        self.shard, self.params = shard, params
        by_id = {id(p): n for n, p in params.items()}
        self.units, inside = [], set()
        for block in blocks:
            names = [by_id[id(p)] for p in block.parameters() if id(p) in by_id]
            if not names:
                continue
            unit = _Unit(self, names)
            inside.update(names)
            block.register_forward_pre_hook(self._pre(unit))
            block.register_forward_post_hook(self._post(unit))
            self.units.append(unit)
        self.rest = [n for n in params if n not in inside]
        self.active = False
        self.anchors = {}   # dtype -> zero scalar leaf that requires a gradient

    def start(self):
        for u in self.units:
            u.reset()
        self.active = True
        self.note_peak()

    def stop(self):
        for u in self.units:
            u.reset()
        self.active = False
        for a in self.anchors.values():
            a.clear_gradient(False)

    def _anchored(self, x):
        """x + 0 through a leaf that requires a gradient, so x's backward runs."""
        key = str(x.dtype)
        if key not in self.anchors:
            a = paddle.zeros([1], x.dtype)
            a.stop_gradient = False
            self.anchors[key] = a
        return x + self.anchors[key]

    def note_peak(self):
        now = self.shard.resident(self.params)
        self.shard.stats["peak_resident"] = max(self.shard.stats.get("peak_resident", 0), now)

    def _pre(self, unit):
        def hook(layer, inputs):
            if not self.active or unit.in_backward:
                return None
            unit.gather()
            x = inputs[0]
            if not (isinstance(x, paddle.Tensor) and paddle.is_grad_enabled()):
                return None
            if x.stop_gradient and not x.is_dist():
                x = self._anchored(x)
            if x.stop_gradient:
                return None   # no signal at the end of its backward: held to the end of the step
            return (_ReleaseAfterBackward.apply(x, unit),) + tuple(inputs[1:])
        return hook

    def _post(self, unit):
        def hook(layer, inputs, out):
            if not self.active or unit.in_backward:
                return None
            if not (isinstance(out, paddle.Tensor) and not out.stop_gradient and paddle.is_grad_enabled()):
                return None   # no backward through it: kept until the step ends
            unit.release()
            return _GatherInBackward.apply(out, unit)
        return hook


# "offload" (PaddleNLP: sharding "stageN offload"), by stage and build (docs/parallel.md's table):
#   stage 3 where paddle's stage 3 runs (no TP / PP / experts, not AMP O2): group_sharded_parallel(
#     offload=True) on every build (on a CPU build host and device memory are one: warned);
#   stage 1 / stage 2 where paddle's engine runs them: a CUDA build refuses it before any work
#     (OFFLOAD_STAGE1 / OFFLOAD_STAGE2), a CPU build warns and runs without;
#   stages 2 / 3 where this module runs them (TP, experts, AMP O2 under stage 3): on a CUDA build
#     the trainer's AdamW keeps its state in host memory (trainer/optim.py offload); CPU: warned.
OFFLOAD_STAGE1 = ("sharding 'stage1 offload': paddle's stage-1 sharding optimizer (fleet's "
                  "DygraphShardingOptimizer) has no offload, and DygraphShardingOptimizerV2's "
                  "offload_opt_buffer_size only marks slices (is_offload_opt) for an optimizer that moves "
                  "its own state, which paddle's AdamW under the trainer's update does not; "
                  "drop 'offload' (the moments are already 1/S per rank) or use 'stage3 offload'")
OFFLOAD_STAGE2 = ("sharding 'stage2 offload': paddle's stage-2 offload (GroupShardedOptimizerStage2) "
                  "runs only for float16 parameters (AMP O2) without a data-parallel group and steps "
                  "paddle's own optimizer on one fused host buffer, which the trainer's update cannot "
                  "run on; use 'stage3 offload' (paddle's offload of parameters, gradients and "
                  "optimizer state) or drop 'offload'")
OFFLOAD_CPU = ("sharding offload keeps training state in host memory on a GPU; on this CPU build host "
               "and device memory are the same, so it saves nothing")


def offload_refusal(stage, degrees, ep=1):
    """The one-line refusal of 'offload' with `stage` on this layout on a CUDA build (None: it
    runs): stage 1 anywhere on fleet, stage 2 where paddle's group_sharded runs it (no TP / PP,
    no expert groups). A CPU build never refuses (warned in for_trainer)."""
    if stage == 0 or degrees["sharding"] <= 1 or ep > 1 or not paddle.is_compiled_with_cuda():
        return None
    if stage == 1:
        return OFFLOAD_STAGE1
    if stage == 2 and degrees["tp"] == 1 and degrees.get("pp", 1) == 1:
        return OFFLOAD_STAGE2
    return None


def on_fleet(stage, topo, model=None):
    """Whether this stage runs on paddle's sharding engine here, under fleet.init (more than one
    process), without a Mixture-of-Experts layout (expert.py's groups): stage 1 (fleet's
    DygraphShardingOptimizer inside HybridParallelOptimizer, data.py; under pipeline parallel
    too, the optimizer PipelineParallel works with), stages 2 and 3 without tensor or pipeline
    parallel (group_sharded_parallel "os_g" / "p_g_os", group_sharded.py: its hooks take the
    layer's own parameters, a DTensor's local shard is not one). Otherwise this module's code."""
    if not (topo.hcg is not None and topo.ep_degree == 1
            and getattr(model, "expert_parallel", None) is None):
        return False
    return stage == 1 or (stage in ((2, 3) if PADDLE_STAGE3 else (2,)) and topo.degrees["tp"] == 1
                          and topo.pp_degree == 1)


def check_offload(args, degrees, ep=1):
    """Before any work (parallel.init; the arguments' check says the same as an `error:` line):
    'offload' refused on a CUDA build where paddle's engine runs the stage and has no offload
    the trainer's update can run on (offload_refusal)."""
    words = (getattr(args, "sharding", "") or "").split()
    if "offload" in words:
        msg = offload_refusal(stage_of(" ".join(words)), degrees, ep)
        if msg:
            raise ValueError(msg)


SPLIT_PARAM_TP = ("sharding_parallel_config 'split_param' with tensor_parallel_degree > 1: fleet's "
                  "DygraphShardingOptimizerV2 moves each parameter into its fused buffer, which a "
                  "tensor-parallel slice (a DTensor's local value) cannot follow; stage 1 runs V1 "
                  "(DygraphShardingOptimizer, whole tensors per rank)")


SPLIT_PARAM_PP = ("sharding_parallel_config 'split_param' with pipeline_parallel_degree > 1: not wired "
                  "with fleet's pipeline here (untested); stage 1 runs V1 (DygraphShardingOptimizer)")


def wants_split_param(args, topo):
    """Stage 1 as fleet's DygraphShardingOptimizerV2: PaddleNLP's `sharding_parallel_config:
    split_param`, on layouts without tensor / pipeline parallel (warned once there: V1 runs)."""
    if "split_param" not in (getattr(args, "sharding_parallel_config", "") or "").split():
        return False
    if topo.degrees["tp"] > 1:
        from ..runtime import warn_once

        warn_once("split_param_tp", SPLIT_PARAM_TP)
        return False
    if topo.degrees.get("pp", 1) > 1:
        from ..runtime import warn_once

        warn_once("split_param_pp", SPLIT_PARAM_PP)
        return False
    return True


def for_trainer(args, topo, named, local=lambda p: p, model=None):
    """The Sharding of a run, or None when `sharding` is off or has one rank. Offload: see the
    table above OFFLOAD_STAGE1; on a CPU build warned once (one memory)."""
    stage = stage_of(getattr(args, "sharding", ""))
    offload = "offload" in (getattr(args, "sharding", "") or "").split()
    cuda = paddle.is_compiled_with_cuda()
    if offload and not cuda:
        from ..runtime import warn_once

        warn_once("sharding_offload", OFFLOAD_CPU)
    if stage == 0 or topo.sharding_degree <= 1:
        return None
    if stage >= 2 and topo.pp_degree > 1:
        from ..args import PP_STAGE23

        raise ValueError(PP_STAGE23.format(stage=stage))
    fleet = on_fleet(stage, topo, model)
    if fleet and stage == 3:   # AMP O2's float32 masters of the slices are not in our checkpoints yet
        from ..runtime import amp_settings

        fleet = amp_settings(getattr(args, "fp16", False), getattr(args, "bf16", False),
                             getattr(args, "fp16_opt_level", "O1"))[2] != "O2"
    if offload and fleet and stage < 3 and cuda:   # (check_offload refused it before any work)
        raise ValueError(offload_refusal(stage, topo.degrees))
    shard = Sharding(topo, stage, named, local, fleet=fleet)
    shard.split = fleet and stage == 1 and wants_split_param(args, topo)
    shard.paddle_offload = offload and fleet and stage == 3   # group_sharded_parallel(offload=True)
    shard.offload = offload and cuda and not fleet   # the trainer's AdamW state in host memory
    if model is not None:
        shard.install_layerwise(model, dict(named))
    return shard
