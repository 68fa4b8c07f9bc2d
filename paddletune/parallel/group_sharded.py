"""Sharding stage 2 on paddle's group_sharded_parallel(level="os_g"), layouts without TP / PP.

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
        group = self.topo.groups.get("sharding")   # None: the whole world
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
