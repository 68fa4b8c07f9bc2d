"""Data parallel alone (dp > 1, every other degree 1) on paddle's reducer: fleet.distributed_model
-> paddle.DataParallel, whose C++ EagerReducer all-reduces gradients in buckets (fleet's
`fuse_grad_size_in_MB`, last bucket `last_comm_group_size_MB`) during backward, as each bucket's
gradients become ready, so the reduction overlaps the rest of the backward pass.

    dp = DataReducer.for_model(model, topo, trainable)     # None where it does not apply
    acc = dp.run(micro_batches, per_micro)                 # the trainer's forward + backward
    dp.backward(loss)                                      # inside per_micro, instead of loss.backward()

Accumulation: every micro-batch but the last of a step back-propagates without the reducer
(DataParallel.no_sync: gradients accumulate locally); the last one is prepared as
DataParallel.forward does (`_reducer.prepare_for_backward(outputs)`, here with the loss itself,
so that with find_unused_parameters the traversal covers the head too) and its backward reduces
the accumulated gradients. Each rank runs exactly one reduced backward per step, whatever its
number of micro-batches (a rank with none back-propagates a zero loss over its parameters).

Paddle averages, paddletune sums. The trainer back-propagates loss_sum_local / N_global (N: the
global batch's target tokens), so the gradient one process would compute is the SUM over ranks
of the local gradients g_r. The reducer returns mean_r = (1/dp) sum_r. So `backward` applies the
factor dp to the local loss: it back-propagates dp * loss_sum_local / N_global, the reducer's
mean of dp * g_r is sum_r g_r, the one-process gradient. Nothing else is scaled (the logged loss
is the trainer's unscaled sum).

find_unused_parameters is on for Mixture-of-Experts models (an expert no token was routed to in
a step has no gradient; the reducer then treats it as ready instead of waiting for it) and off
otherwise (it costs a graph traversal per step). Measured (paddle 3.3.1, gloo, tests/test_fleet.py
dead-expert case): a run with it off also matched one process, so that test pins the setting but
cannot show it is needed on this build. Not used here: expert parallel (each rank holds
other experts: their groups are expert.py's) and sharding (sharding.py; issue 30 moves it to
fleet's sharding optimizers).

Sharding stage 1 (alone, x DP, x TP, x PP) goes through the same object:
fleet.distributed_optimizer then builds DygraphShardingOptimizer (V1) inside
HybridParallelOptimizer. Its step reduces every gradient to its owner over the sharding group
(scaled 1/S, SUM), all-reduces the owner's over dp (1/dp), calls _apply_optimize with this
rank's pairs (here: the trainer's update, on the owned tensors only) and broadcasts each tensor
from its owner. The loss factor is dp x S. Every rank holds every gradient until the step ends
(V1 reduces in place, its broadcast skips tensors without one). Under PP each stage's sharding
group partitions that stage's tensors (copies held on several stages are summed over the
pipeline group first: layout.Parallel.step, pipeline.py's shared layer).

With `sharding_parallel_config: split_param` (PaddleNLP's spelling; no TP) stage 1 is fleet's
DygraphShardingOptimizerV2 instead: every parameter lives in one fused buffer (padded per tensor
to 256 bytes x S), the buffer is cut into S equal contiguous ranges and rank r updates range r.
Its step reduce-scatters the gradient buffer (gloo: cpu_compat shim 7), all-reduces the owned
range over dp, calls _apply_optimize with this rank's flat slices (here: the trainer's update on
those slices: norm over the sharding group, clipping, AdamW with each tensor's decay and lr
scale, which V2's slice parameters carry by name and optimize_attr) and all-gathers the updated
buffer. A tensor may be cut between two ranks, so each rank's AdamW state is 1/S of the padded
buffer, not whole tensors; checkpoints still hold whole tensors (`gather_state` at save, the
AdamW slices at load). Paddle's clear_grad would cut every .grad off the buffer after the first
step (paddle_fixes.py 1.): its in-place replacement runs.

Data parallel with tensor and / or pipeline parallel (FleetDataParallel below): no reducer
during backward (fleet's TensorParallel / PipelineParallel model wrappers have none either: their
data-parallel sum is the optimizer's); the trainer's optimizer goes through
fleet.distributed_optimizer -> HybridParallelOptimizer, whose step() all-reduces the gradients
over fleet's data-parallel group (fused_allreduce_gradients: buckets, each multiplied by 1/dp
and summed) before it calls the inner optimizer's step().
"""
import contextlib
import logging

import paddle

logger = logging.getLogger("paddletune")

FUSE_GRAD_SIZE_MB = None   # None: fleet's default (32 MB); tests set a small one for several buckets


class DataReducer:
    def __init__(self, wrapped, degree):
        self.wrapped, self.degree = wrapped, degree
        self._sync = True

    @classmethod
    def for_model(cls, model, topo, trainable):
        """The DataParallel wrapper when this run is data parallel alone, else None."""
        d = topo.degrees
        if not (d["dp"] > 1 and d["tp"] == d["pp"] == d["sharding"] == 1 and topo.ep_degree == 1
                and topo.hcg is not None and trainable):
            return None
        needing = {id(p) for p in model.parameters() if not p.stop_gradient}
        if needing != {id(p) for p in trainable.values()}:
            # the reducer waits for every parameter that is not stop_gradient
            logger.warning("data parallel: the trainable set differs from the parameters that need "
                           "gradients; gradients are summed after backward instead of by paddle's "
                           "reducer")
            return None
        from paddle.distributed import fleet

        strategy = fleet.fleet._user_defined_strategy
        strategy.find_unused_parameters = bool(getattr(model.config, "moe", None))
        if FUSE_GRAD_SIZE_MB is not None:
            strategy.fuse_grad_size_in_MB = int(FUSE_GRAD_SIZE_MB)
        wrapped = fleet.distributed_model(model)
        assert isinstance(wrapped, paddle.DataParallel), type(wrapped)
        logger.info(f"data parallel: paddle.DataParallel over {d['dp']} ranks, gradients reduced "
                    f"in {len(wrapped.group_indices)} bucket(s) during backward"
                    + (", find_unused_parameters (MoE)" if strategy.find_unused_parameters else ""))
        return cls(wrapped, d["dp"])

    @property
    def find_unused_parameters(self):
        return self.wrapped.find_unused_parameters

    def run(self, micro_batches, per_micro):
        """per_micro(batches) -> summed loss_sum, called once per micro-batch; the last one with
        the reducer on (see the module docstring)."""
        if not micro_batches:   # nothing to read this step: zero gradients, reduced like the others
            self._sync = True
            params = [p for p in self.wrapped._layers.parameters() if not p.stop_gradient]
            self.backward(paddle.add_n([(p * 0).sum() for p in params]))
            return paddle.zeros([], "float32")
        acc = None
        for i, b in enumerate(micro_batches):
            self._sync = i == len(micro_batches) - 1
            part = per_micro([b])
            acc = part if acc is None else acc + part
        self._sync = True
        return acc

    def backward(self, loss):
        """loss.backward() with the factor dp (module docstring); reduced on the step's last
        micro-batch only."""
        loss = loss * float(self.degree)
        if not self._sync:
            with self.wrapped.no_sync():
                loss.backward()
            return
        self.wrapped._reducer.prepare_for_backward([loss])
        loss.backward()


class FleetDataParallel:
    """TP x DP / PP x DP / sharding stage 1: the gradient reduction of fleet's HybridParallelOptimizer.

        hdp = FleetDataParallel.for_layout(topo, tp, pp, shard, ep)   # None where it does not apply
        hdp.wrap(optimizer)                 # trainer/optim.AdamW: its paddle AdamW under fleet
        norm = hdp.step(optimizer, named, grads, update)   # update(reduced grads) -> grad norm

    Order: backward -> HybridParallelOptimizer.step() = fused_allreduce_gradients over the dp
    group -> the inner (paddle) optimizer's step(), which here is `update`: the trainer's own
    sums over TP / PP replicas, fp16 unscale, global norm, clipping and AdamW update. Why the
    inner step and not HybridParallelClipGrad: our norm knows replicated key/value heads, a tied
    embedding across stages and vocabulary padding (layout.Parallel.grad_norm), fleet's does not;
    and running it inside the step puts it after fleet's reduction (the norm of the summed
    gradient, as one process computes it) without calling fleet's private methods. The paddle
    AdamW gets no grad_clip, so fleet leaves its clipping alone.

    Paddle averages, paddletune sums: fused_allreduce_gradients multiplies each bucket by 1/dp
    (hybrid_parallel_util.py fused_allreduce_gradients -> scale 1/nranks of the dp group) before
    the SUM all-reduce. The local loss is therefore multiplied by dp before backward
    (layout.Parallel.backward_loss; under PP the last stage's loss_sum, layout.Parallel.backward),
    so fleet's (1/dp) sum_r (dp g_r) = sum_r g_r: one process's gradient of loss_sum / N_global.
    The logged loss is not scaled.

    What fleet reads: the optimizer's parameters' gradients (param._grad_ivar(), or .main_grad
    when a parameter has none). A trainable tensor whose gradient is not on the tensor the paddle
    optimizer holds (a DTensor's local shard under tensor parallel) or that got no gradient this
    step is given its gradient as .main_grad for the step (removed after): every dp rank passes
    the same tensors, so fleet's buckets match across ranks."""

    def __init__(self, hcg, degree, sharding=False, split=False):
        self.hcg, self.degree, self.sharding, self.split = hcg, degree, sharding, split
        self.slices = {}    # split_param: {full name: (slice parameter, lo, hi)} of this rank's range
        self.writers = {}   # split_param: {full name: sharding rank holding its first element}
        self.hybrid = None     # fleet's HybridParallelOptimizer, after wrap
        self._update = None    # the trainer's update of this step (called by the inner step)

    @classmethod
    def for_layout(cls, topo, tp, pp, shard, ep):
        if getattr(shard, "fleet", False):   # sharding stage 1 (x DP, x TP): module docstring
            return cls(topo.hcg, topo.dp_degree * topo.sharding_degree, sharding=True,
                       split=getattr(shard, "split", False))
        if (topo.hcg is None or topo.dp_degree <= 1 or (tp is None and pp is None)
                or shard is not None or ep is not None or topo.sharding_degree > 1):
            return None
        return cls(topo.hcg, topo.dp_degree)

    @property
    def chain(self):
        """Class names from fleet's wrapper to the paddle optimizer that updates (tests assert
        which engine runs), e.g. [HybridParallelOptimizer, DygraphShardingOptimizer, AdamW]."""
        out, opt = [], self.hybrid
        while opt is not None:
            out.append(type(opt).__name__)
            opt = opt.__dict__.get("_inner_opt")
        return out

    def owners(self, optimizer):
        """{full name: sharding rank} of fleet's stage-1 partition (its _param2rank, by paddle
        name; greedy by numel, largest first: the partition is paddle's, not ours). split_param:
        the rank whose range holds the tensor's first element (it writes the whole tensor)."""
        if self.split:
            return dict(self.writers)
        ranks = self.hybrid._inner_opt._param2rank
        return {n: ranks[t.name] for n, t in optimizer.targets.items()}

    def wrap(self, optimizer):
        """fleet.distributed_optimizer over optimizer.opt (a paddle.optimizer.AdamW); its step()
        becomes this object's hook (the update of the current step)."""
        from paddle.distributed import fleet

        inner = optimizer.opt
        configs = fleet.fleet._user_defined_strategy.hybrid_configs
        # fleet's mp sync_param (on by default) broadcasts, after each step, the parameters its
        # name filter takes for replicated ones from the first TP rank: ours are equal on every
        # TP rank by construction (the same summed gradient and update), and the filter needs
        # `is_distributed`, which a DTensor's local shard lacks; off
        configs["mp_configs"].sync_param = False
        if self.sharding:   # V1 (per-tensor reduce / broadcast) or, with split_param, V2
            sc = configs["sharding_configs"]
            sc.split_param = self.split
            sc.tensor_fusion = sc.comm_overlap = False
            if self.split:
                from .cpu_compat import install_split_param

                install_split_param()   # gloo: alignment and reduce_scatter (CPU builds only)
        self.hybrid = fleet.distributed_optimizer(inner)
        want_dp = self.hcg.get_data_parallel_world_size() > 1 if self.sharding else True
        if self.hybrid._dp_enable != want_dp or self.hybrid._sharding_enable != self.sharding:
            raise RuntimeError(f"fleet's HybridParallelOptimizer: dp_enable {self.hybrid._dp_enable}, "
                               f"sharding {self.hybrid._sharding_enable}, expected {want_dp}, "
                               f"{self.sharding}; paddle changed its rules?")
        if self.sharding:
            from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import dygraph_sharding_optimizer as dso

            want = dso.DygraphShardingOptimizerV2 if self.split else dso.DygraphShardingOptimizer
            sharded = self.hybrid._inner_opt
            if type(sharded) is not want:
                raise RuntimeError(f"fleet built {type(sharded).__name__}, expected {want.__name__}")
            # its step(): _apply_optimize(this rank's (param, grad) pairs), then the owners'
            # broadcasts; the trainer's update replaces the first (an instance attribute: the
            # wrapper's __getattr__ would reach the paddle AdamW's)
            sharded._apply_optimize = lambda *a, **k: self._inner_step()
            if self.split:
                from .paddle_fixes import fix_v2_clear_grad

                fix_v2_clear_grad(sharded)
                self._map_slices(optimizer, sharded)
        else:
            inner.step = self._inner_step
        logger.info(f"data parallel: fleet's {' -> '.join(self.chain)} reduces gradients over "
                    f"{self.degree} ranks in its step")

    def _views(self, optimizer):
        """(full name, buffer, its ShardingGradView, range size) of every tensor V2 fused."""
        S = self.hcg.get_sharding_parallel_world_size()
        for buf in self.hybrid._inner_opt._comm_buffer_list:
            for p in buf.params:
                yield optimizer.full_name[p.name], buf, buf._sharding_param_grad_view[p.name], buf.buffer_size // S

    def _map_slices(self, optimizer, sharded):
        """split_param: this rank's flat slices and the writer of each tensor. V2 gives its slice
        parameters storage and gradients only inside its first step (_assign_slice_grad); done
        here once instead (the same call V2 repeats in every step), so AdamW's moments exist on
        the slices before that step (a resume loads them) and fleet's dp all-reduce, which
        skips slice parameters without storage (filter_parameters), covers step 1 too."""
        sharded._assign_slice_grad()
        for n, buf, view, size in self._views(optimizer):
            self.writers[n] = view._index // size
            if view._param_begin < view._param_end:
                self.slices[n] = (sharded._slice_params[view._param.name],
                                  view._param_begin - view._index, view._param_end - view._index)

    def gather_state(self, tensors, optimizer, kinds=("exp_avg", "exp_avg_sq")):
        """split_param: {name.kind: whole array} of every fused tensor from this rank's {name.kind:
        flat slice} (optimizer.state_dict under V2): per buffer and kind, each rank's range is
        all-gathered over the sharding group (collective: every rank of the group calls it)."""
        import numpy as np
        import paddle.distributed as dist

        group = self.hcg.get_sharding_parallel_group()
        views = list(self._views(optimizer))
        out = {}
        for buf in self.hybrid._inner_opt._comm_buffer_list:
            mine = [(n, v, size) for n, b, v, size in views if b is buf]
            size = mine[0][2]
            start = size * group.rank
            for kind in kinds:
                part = np.zeros(size, np.float32)
                for n, v, _ in mine:
                    if n in self.slices and f"{n}.{kind}" in tensors:
                        part[v._param_begin - start:v._param_end - start] = np.asarray(tensors[f"{n}.{kind}"]).reshape(-1)
                got = []
                dist.all_gather(got, paddle.to_tensor(part), group=group)
                whole = np.concatenate([t.numpy() for t in got])
                for n, v, _ in mine:
                    shape = list(v._param.shape)
                    out[f"{n}.{kind}"] = whole[v._index:v._index + int(np.prod(shape))].reshape(shape)
        return out

    def clear_grad(self):
        """split_param: V2's clear_grad (paddle_fixes: zeroed in place, still in the buffer)."""
        self.hybrid.clear_grad()

    def _inner_step(self):
        self._update()

    def step(self, optimizer, named, grads, update):
        """fleet's step over the gradients `grads` of `named` (name, parameter); update(grads
        reduced over dp) runs inside it. Returns what update returns."""
        staged, out = [], {}
        for (n, _), g in zip(named, grads if not self.split else ()):
            t = optimizer.targets[n]
            if t._grad_ivar() is None:   # a DTensor's shard, or no gradient this step
                t.main_grad = g
                staged.append(t)
        stage = {id(t) for t in staged}

        def run():
            # (read again: fleet writes the reduced values into the gradient tensors it found;
            # split_param: this rank's slices of the reduce-scattered buffer, None elsewhere)
            if self.split:
                reduced = [self.slices[n][0]._grad_ivar() if n in self.slices else None for n, _ in named]
            else:
                reduced = [t.main_grad if id(t) in stage else t.grad
                           for t in (optimizer.targets[n] for n, _ in named)]
            out["result"] = update(reduced)

        self._update = run
        try:
            self.hybrid.step()
        finally:
            self._update = None
            for t in staged:
                del t.main_grad
        return out["result"]


@contextlib.contextmanager
def fuse_grad_size(mb):
    """Tests: buckets of `mb` MB for the DataParallel built within the block."""
    global FUSE_GRAD_SIZE_MB
    before, FUSE_GRAD_SIZE_MB = FUSE_GRAD_SIZE_MB, mb
    try:
        yield
    finally:
        FUSE_GRAD_SIZE_MB = before
