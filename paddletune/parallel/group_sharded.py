"""Sharding stages 2 and 3 on paddle's group_sharded_parallel (level "os_g" / "p_g_os"), layouts
without TP / PP. Stage 3: GroupShardedStage3 below (same face as GroupShardedStage2).

    gs = GroupShardedStage2.for_layout(model, topo, shard)   # None where it does not apply
    gs.wrap(optimizer)          # after the trainer's AdamW: paddle's wrappers around its paddle AdamW
    forward through gs.model    # GroupShardedStage2: its pre-forward rebuilds the gradient buckets
    norm = gs.step(optimizer, named, grads, update)

What paddle does (paddle 3.3.1 group_sharded_stage2.py / group_sharded_optimizer_stage2.py):
GroupShardedOptimizerStage2 partitions the trainable tensors over the S ranks (greedy, in list
order), fuses each rank's into one parameter buffer per dtype, and narrows the paddle AdamW to
the owned ones. GroupShardedStage2 hooks every trainable parameter: when its gradient is
complete in backward it is reduced to its owner (in buckets of buffer_max_size bytes), and a
non-owner drops it at once, so during backward a rank keeps its own gradients only. At step():
the owner's gradients are scaled by 1/S (and 1/dp with a dp group, then all-reduced over dp),
the paddle AdamW's step runs, and each owner broadcasts its fused parameter buffer.

Here the paddle AdamW's step() is the trainer's update (sums, unscale, norm over the owners'
squares, clipping, AdamW on the owned tensors with named state); the loss factor is S x dp.
On CPU builds parallel/cpu_compat.py's shim 4 lets paddle take the CPU device."""
import logging

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

logger = logging.getLogger("paddletune")

BUFFER_MAX_SIZE = 2 ** 23   # paddle's default bucket (bytes) for the gradient reduction


class GroupShardedStage2:
    sharding = True

    def __init__(self, model, topo):
        self.raw, self.topo = model, topo
        self.degree = topo.sharding_degree * topo.dp_degree
        self.model = model      # GroupShardedStage2 after wrap
        self.opt = None         # GroupShardedOptimizerStage2 after wrap
        self._update = None

    @classmethod
    def for_layout(cls, model, topo, shard):
        if shard is None or not shard.fleet or shard.stage != 2:
            return None
        return cls(model, topo)

    @property
    def chain(self):
        return [type(self.model).__name__, type(self.opt).__name__, type(self.opt._optim).__name__]

    def wrap(self, optimizer):
        from paddle.distributed.sharding import group_sharded_parallel

        from .cpu_compat import install_group_sharded

        install_group_sharded()   # (CPU builds only)
        # the world group when sharding spans it: for None paddle creates a new group at every
        # wrap, one more gloo group per Trainer in a process (a flaky connect on a loaded machine)
        group = self.topo.groups.get("sharding") or dist.get_group(0)
        dp = self.topo.groups.get("dp") if self.topo.dp_degree > 1 else None
        self.model, self.opt, _ = group_sharded_parallel(self.raw, optimizer.opt, level="os_g", group=group,
                                                         dp_group=dp, buffer_max_size=BUFFER_MAX_SIZE)
        optimizer.opt.step = self._inner_step
        logger.info(f"sharding stage 2: paddle's {' -> '.join(self.chain)} over {self.topo.sharding_degree} "
                    f"ranks" + (f" x dp {self.topo.dp_degree}" if dp is not None else ""))

    def owners(self, optimizer):
        ranks = self.opt.param2rank
        return {n: ranks[t.name] for n, t in optimizer.targets.items()}

    def _inner_step(self):
        self._update()

    def step(self, optimizer, named, grads, update):
        """paddle's step (scale, dp all-reduce, update(the owners' gradients), broadcasts)."""
        out = {}

        def run():
            out["result"] = update([optimizer.targets[n].grad for n, _ in named])

        self._update = run
        try:
            self.opt.step()
        finally:
            self._update = None
        return out["result"]


# ------------------------------------------------------------------------------------ stage 3

SEGMENT_SIZE = None   # None: segment_size() below; a number overrides the rule (tests: 0)


def segment_size(degree, element_bytes):
    """The rule for paddle's `segment_size` (stage 3 slices a tensor of MORE than this many
    elements; smaller ones stay whole on every rank, their gradients all-reduced): S alignment
    units, i.e. a tensor is sliced when each rank's slice is more than one alignment unit
    (paddle pads every slice to it: 256 bytes on GPU, 4096 on CPU, group_sharded_stage3.py
    `alignment`). A tensor left whole then costs each rank at most (S - 1) / S of S units more
    than its 1/S share, the same order as the padding of a sliced one; paddle's default (2**20
    elements) would leave LoRA's A / B matrices of a 70B model (8 x 8192) whole, optimizer state
    included, on every rank. Llama-2-7B, S = 8, float32 on GPU: 512 elements (norm weights of
    4096 are sliced too); the tiny test models (hidden 64) set SEGMENT_SIZE = 0 instead."""
    if SEGMENT_SIZE is not None:
        return SEGMENT_SIZE
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage3 import alignment

    unit = alignment["gpu" if paddle.is_compiled_with_cuda() else "cpu"]
    return degree * max(1, unit // element_bytes)


def held_numel(p):
    """Elements of parameter p this rank holds now: its stage-3 slice and / or its storage."""
    fw = getattr(p, "fw_storage", None)
    return (int(p._numel()) if p._is_initialized() else 0) + (int(fw._numel()) if fw is not None else 0)


class _AfterBackward(PyLayer):
    """Identity on a layer's input whose backward calls fn: it runs once the layer's backward is
    done (the input's gradient is formed after every use of the layer's weights)."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        ctx.fn()
        return dy


def release_frozen(stage3, layer_ids=None):
    """Put the frozen parameters that paddle's stage 3 left whole back to this rank's slice.

    What paddle does (3.3.1 group_sharded_stage3.py, any device): backward gathers every sliced
    parameter of a layer again (ForwardPostHooks.backward -> _wait_layer / _allgather_buffer:
    status "all", use_count + 1), but the only release in backward is in the gradient hooks,
    which exist for trainable parameters only (_register_backward_hooks -> _get_allreduce_fn).
    A frozen one keeps status "all" and use_count 1; the next forward's release (_release_param)
    never brings the count to 0, so from the first backward on every rank holds the whole frozen
    backbone (LoRA of a 70B model: the backbone whole on each rank). Here, for each frozen
    parameter of the given layers (all: None) with status "all": this rank's slice of the
    gathered buffer (or of the parameter, zero-padded) becomes its fw_storage, its storage is
    cleared, status "part", use_count 0: what _release_param does for a trainable one.
    (docs/notes/group_sharded_frozen.md, tools/probes/gs_held_probe.py)"""
    flow = stage3._task_flow
    for lid, params in stage3._trainable_params.items():
        if layer_ids is not None and lid not in layer_ids:
            continue
        for p in params:
            if p.trainable or getattr(p, "status", None) != "all":
                continue
            start, end = stage3._param2buffer[p.name][stage3._rank]
            full = flow.full_param.pop(p.name, None)
            if full is None:
                buf = paddle.zeros([stage3._param2buffer_size[p.name]], p.dtype)
                buf[:p._numel()] = p.detach().reshape([-1])
            else:
                buf = full[0]
            p.fw_storage = buf._slice(start, end).detach().clone()
            if stage3._offload:   # where paddle's _release_param keeps an offloaded slice
                p.fw_storage = p.fw_storage.cpu()
            p._clear_data()
            p.status, p.use_count = "part", 0


def release_frozen_in_backward(stage3, layer):
    """Each frozen layer's slices released as soon as its backward is done (a PyLayer on its
    input), so backward holds the layers it is in, as forward does. A layer whose input needs no
    gradient (the embedding: token ids) is released after the step (GroupShardedStage3.step)."""
    def hook(_, inputs):
        x = inputs[0] if inputs else None
        if isinstance(x, paddle.Tensor) and not x.stop_gradient and paddle.is_grad_enabled():
            return (_AfterBackward.apply(x, lambda: release_frozen(stage3, {id(layer)})),) + tuple(inputs[1:])
        return None
    layer.register_forward_pre_hook(hook)


def on_comm_device(t):
    """t, or on a CUDA build a device copy of a host tensor (offload's slices): NCCL moves device
    memory only."""
    if paddle.is_compiled_with_cuda() and t.place.is_cpu_place():
        return t._copy_to(paddle.CUDAPlace(dist.ParallelEnv().dev_id), True)
    return t


class _Both:
    """A resume target that is two tensors (a slice and its host master): assign() writes both."""

    def __init__(self, *tensors):
        self.tensors = tensors
        self.dtype = tensors[0].dtype

    def set_value(self, value):
        for t in self.tensors:
            t.set_value(value if t.dtype == self.dtype else value.astype(t.dtype))


class GroupShardedStage3:
    """Sharding stage 3 on paddle's group_sharded_parallel(level="p_g_os"), layouts without TP /
    PP (see parallel/sharding.py for the stage and docs/notes/group_sharded_frozen.md).

    What paddle does: every parameter of more than segment_size elements, frozen ones included,
    is padded to its alignment, cut in S equal flat slices and cleared; a rank keeps its slice
    (`fw_storage`). A layer's forward pre-hook all-gathers the layer's own parameters, the
    post-hook releases them; backward gathers them again, and each trainable parameter's
    gradient hook all-reduces its full gradient (x 1/S, then over dp x 1/dp) and keeps this
    rank's slice (`bw_storage`). At step() the slices become the paddle AdamW's parameters
    (a fresh "slice@<name>" tensor per step, its gradient the slice), smaller tensors stay whole
    with all-reduced gradients. Here the paddle AdamW's step is the trainer's update (as stage
    2): sums, unscale, the norm over the slices (all-reduced; a whole tensor counted once),
    clipping and AdamW on the slices, moments named by the model's names (the optimizer's
    targets are re-pointed at the slices, `_retarget`). Models read weights inside their layer's
    call (models/owned.py); the prefix encoder is left whole (exclude_layer). Frozen parameters
    are released after each layer's backward and after each step (release_frozen: paddle keeps
    them whole otherwise). Checkpoints: each tensor's slices all-gathered, whole tensors under
    full names written by the owner of our partition (pieces); a resume reads this rank's slice
    (read_local). QLoRA's quantized codes / scales are buffers: paddle never slices them (every
    rank holds them whole).

    offload ("stage3 offload"): paddle keeps each slice in host memory and copies it to the device
    for the gathers; a trainable slice gets a float32 host master (`master_weight`), the gradient
    slices go to the host, and paddle's step runs the optimizer under device_guard("cpu") on
    tensors sharing the masters' memory: the trainer's update (as above) then updates the masters,
    and its AdamW moments are created on the host (wrap). A resume writes the slice and its master
    (load_target). On a CPU build host = device (cpu_compat shim 8 lets paddle's copies run)."""
    sharding = True
    own_grads = True   # the step takes the slices' gradients itself (Parallel.step)

    def __init__(self, model, topo, offload=False):
        self.raw, self.topo = model, topo
        self.offload = offload  # paddle's offload: slices, float32 masters and moments on the host
        self.degree = topo.sharding_degree * topo.dp_degree
        self.model = model      # GroupShardedStage3 after wrap
        self.opt = None         # the paddle AdamW (paddle redefines its step / clear_grad)
        self._update = None
        self.sliced = {}        # model name -> parameter paddle slices (trainable or frozen)
        self.whole = set()      # trainable names paddle keeps whole (all-reduced gradients)

    @classmethod
    def for_layout(cls, model, topo, shard):
        if shard is None or not shard.fleet or shard.stage != 3:
            return None
        return cls(model, topo, offload=shard.paddle_offload)

    @property
    def chain(self):
        return [type(self.model).__name__, type(self.opt).__name__]

    def wrap(self, optimizer):
        from paddle.distributed.sharding import group_sharded_parallel

        from .cpu_compat import install_group_sharded

        install_group_sharded()   # (CPU builds only)
        # the world group when sharding spans it (paddle's stage 3 would create a new group for
        # None at every wrap: one more gloo group per Trainer in a process)
        group = self.topo.groups.get("sharding") or dist.get_group(0)
        dp = self.topo.groups.get("dp") if self.topo.dp_degree > 1 else None
        optimizer.opt.step = self._inner_step   # paddle's step wraps the step it finds at wrap time
        first = next(iter(optimizer.params.values()))
        size = segment_size(self.topo.sharding_degree, first.element_size())
        prefix = getattr(self.raw, "prefix_encoder", None)
        self.model, self.opt, _ = group_sharded_parallel(
            self.raw, optimizer.opt, level="p_g_os", group=group, dp_group=dp, segment_size=size,
            offload=self.offload,
            exclude_layer=[id(prefix)] if prefix is not None else None)
        by_id = {id(p): n for n, p in self.raw.named_parameters()}
        for lid, params in self.model._trainable_params.items():
            for p in params:
                self.sliced[by_id[id(p)]] = p
        self.whole = {n for n in optimizer.params if n not in self.sliced}
        for layer in [self.raw] + list(self.raw.sublayers()):
            params = self.model._trainable_params.get(id(layer), [])
            if any(not p.trainable for p in params):
                release_frozen_in_backward(self.model, layer)
        self._retarget(optimizer)
        if self.offload:   # the moments on the host, beside the slices (paddle's own offload creates
            # its optimizer's accumulators inside its step, under this device_guard)
            from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_utils import device_guard

            with device_guard():
                optimizer.keep_state(list(optimizer.params))
        logger.info(f"sharding stage 3: paddle's {' -> '.join(self.chain)} over {self.topo.sharding_degree} "
                    f"ranks" + (f" x dp {self.topo.dp_degree}" if dp is not None else "")
                    + f", segment_size {size}: {len(self.sliced)} tensors sliced"
                    + (", offload (slices, masters and optimizer state in host memory)" if self.offload else ""))

    def owners(self, optimizer):
        """Every rank updates its slice of every tensor: no owner map for the update."""
        return {}

    def _retarget(self, optimizer):
        optimizer.retarget({n: self.sliced[n].fw_storage for n in optimizer.params if n in self.sliced})

    def _inner_step(self):
        self._update()

    def step(self, optimizer, named, grads, update):
        """paddle's step (this rank's gradient slices and the whole tensors' all-reduced
        gradients -> update), then the frozen slices released."""
        out = {}

        def run():
            self._retarget(optimizer)   # paddle made fresh slice tensors for this step
            out["result"] = update([optimizer.targets[n].grad for n, _ in named])

        self._update = run
        try:
            self.opt.step()
        finally:
            self._update = None
        release_frozen(self.model)
        return out["result"]

    def counts_once(self, name):
        """Whether this rank's gradient of `name` counts in the global norm: a slice always; a
        whole tensor (the same on every rank of the group) on the group's first rank only."""
        return name not in self.whole or self.topo.sharding_rank == 0

    # ---------------------------------------------------------------- values
    def _flat_range(self, p):
        start, end = self.model._param2buffer[p.name][self.model._rank]
        return start, end, self.model._param2buffer_size[p.name]

    def full_array(self, name, p, slice_value=None):
        """The whole tensor of `name` as a numpy array (a collective for a sliced one: every rank
        of the group calls it): the parameter's value, or, given slice_value (this rank's slice
        of a state tensor shaped like it: a moment), that tensor's whole value."""
        if name not in self.sliced:
            return (slice_value if slice_value is not None else p).numpy()
        if slice_value is None:
            if p._is_initialized():    # gathered (the end of training, get_all_parameters)
                return p.numpy()
            slice_value = p.fw_storage
        parts = []
        dist.all_gather(parts, on_comm_device(slice_value.reshape([-1])), group=self.model._group)
        flat = paddle.concat(parts)[:int(np.prod(p.shape))]
        return flat.reshape(p.shape).numpy()

    def local_slice(self, name, p, array):
        """This rank's slice (flat, padded) of whole `array` for a sliced tensor; else array."""
        if name not in self.sliced:
            return array
        start, end, size = self._flat_range(p)
        flat = np.zeros([size], np.float32)
        a = np.asarray(array, np.float32).reshape(-1)
        flat[:a.size] = a
        return flat[start:end]

    def load_target(self, name, p):
        """The tensor a resume writes `name`'s value into: its slice, or the parameter. Under
        offload also paddle's float32 host master of it (the tensor the update writes and the
        slice is reset to after each backward: created at wrap time, it would bring back the
        initial values)."""
        if name in self.sliced and p._is_initialized():   # gathered (whole): no slice to write
            return p
        target = p.fw_storage if name in self.sliced else p
        master = getattr(p, "master_weight", None) if self.offload else None
        return target if master is None else _Both(target, master)

    def gather_all(self):
        """The whole model on every rank (the end of training: export, evaluation, the caller)."""
        self.model.get_all_parameters(with_freeze_param=True)
        # (prefetched buffers and their all-gather tasks left from the last pass: nothing uses
        # them now that every parameter is whole)
        self.model._task_flow.full_param.clear()
        self.model._task_flow.full_grad.clear()
