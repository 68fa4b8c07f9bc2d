"""The one parallel object the Trainer talks to: every axis of a run's layout behind one face.

    par, trainable = Parallel.for_trainer(model, topo, args, trainable, has_own_loss)
    par.after_setup(trainable, optimizer)     # fleet's optimizer wrapper (hybrid data parallel)
    par.begin_step(trainable); acc = par.backward(micro_batches, n_global, loss_fn, per_micro)
    norm = par.step(optimizer, named, update)  # update(grads) after the data-parallel reduction:
        grads = par.reduce_grads(named, grads); norm = par.grad_norm(named, grads); ...
    par.after_step(trainable); par.pieces(trainable, optimizer); par.export(...)

It composes this package's helpers: tensor parallel (tensor.py: DTensor slices, vocabulary-
parallel loss), pipeline stages (pipeline.py), expert parallel / MoE router statistics
(expert.py), sharding stages 1-3 (sharding.py) and the data-parallel gradient sum. An axis that
is off is None here, and with every axis off (one process) each method is the single-device
operation. The bodies are the Trainer's former per-axis branches, moved unchanged.

Who sums the data-parallel gradients, by layout:
- data parallel alone: paddle.DataParallel's reducer during backward (data.DataReducer);
- data parallel with tensor and / or pipeline parallel: fleet's HybridParallelOptimizer.step
  (data.FleetDataParallel, `hybrid` here); our sums over TP / PP replicas, norm and clipping
  run inside its step, after its reduction;
- sharding stage 1 (alone, x DP, x TP, x PP): fleet's HybridParallelOptimizer over its
  DygraphShardingOptimizer (data.FleetDataParallel with sharding): reduce to the owner, dp
  all-reduce of the owned, our update on the owned tensors, the owners' broadcasts; fleet's
  partition becomes the Sharding's owner map (checkpoints: each owner writes its tensors);
  under PP, copies held on several stages are summed over the stages before fleet's reduce;
  with split_param (no TP) its DygraphShardingOptimizerV2: our update on this rank's flat
  slices of the fused buffer, the state gathered to whole tensors at save (data.py);
- sharding stage 2 without TP / PP: paddle's group_sharded_parallel("os_g")
  (group_sharded.GroupShardedStage2 as `hybrid`): the trainer's forward goes through its layer
  wrapper (forward_model), its hooks reduce each gradient to the owner during backward, its
  step scales, all-reduces over dp, runs our update and broadcasts; its clear_grad zeroes;
- sharding stage 3 without TP / PP: paddle's group_sharded_parallel("p_g_os")
  (group_sharded.GroupShardedStage3 as `hybrid`): its hooks gather each layer's slices around
  its forward and backward and reduce the gradients; its step hands our update the slices;
  frozen slices released after each layer's backward; checkpoints gather whole tensors;
- sharding stage 3 under TP and TP x stage 2: ours (sharding.py); PP x stage 2 / 3 is refused
  (fleet has no pipeline path for them);
- Mixture-of-Experts on several data ranks (expert.py's groups: expert-data groups are not
  fleet's dp group) and a trainable set paddle's reducer cannot wait on: ours.
"""
import contextlib

import numpy as np
import paddle

from ..models.loss import hidden_loss_for


class Parallel:
    """This rank's layout for training. tp: tensor.TensorParallel; pp: pipeline.Pipeline (this
    rank's stage); ep: expert.ExpertParallel (MoE on > 1 data rank); shard: sharding.Sharding;
    each None when that axis is off. dp: data.DataReducer, paddle.DataParallel's reducer when
    the run is data parallel alone (its gradients are reduced during backward). hybrid:
    data.FleetDataParallel when data parallel runs with TP / PP (fleet's optimizer reduces)."""

    def __init__(self, model, topo, tp=None, pp=None, ep=None, shard=None, dp=None, hybrid=None):
        self.model, self.topo = model, topo
        self.tp, self.pp, self.ep, self.shard, self.dp = tp, pp, ep, shard, dp
        self.hybrid = hybrid

    @classmethod
    def for_trainer(cls, model, topo, args, trainable, own_loss=False):
        """(Parallel, trainable narrowed to what this rank trains). Drops other stages' / other
        ranks' experts' parameters (and the adapters PEFT put there), places PEFT's new
        parameters under tensor parallel, and builds the sharding of the optimizer state."""
        pp = getattr(model, "pipeline", None)   # this rank's pipeline stage, or None
        if pp is not None:   # drop the other stages' blocks (and the adapters PEFT put there)
            trainable = {n: trainable[n] for n in pp.finalize(trainable)}
        tp = getattr(model, "tensor_parallel", None)
        # Mixture-of-Experts on >1 data rank (expert.py): router statistics over the data ranks;
        # under expert parallel each rank holds its own experts
        if (getattr(model.config, "moe", None) and topo.data_degree > 1
                and getattr(model, "expert_parallel", None) is None):   # loaded without the topology
            from .expert import install

            install(model, topo)
        ep = getattr(model, "expert_parallel", None)
        if ep is not None:   # the other ranks' experts dropped (and PEFT's adapters on them)
            from .expert import finalize

            trainable = {n: trainable[n] for n in finalize(model, ep, trainable, args)}
        if pp is not None and own_loss:
            raise ValueError("this loss (R-Drop) runs two passes through the whole model, which has "
                             "no pipeline-parallel form here; set pipeline_parallel_degree to 1")
        if tp is not None:   # PEFT's new parameters placed; LoRA's collectives hooked
            from . import tensor as tensor_parallel

            tensor_parallel.finalize(model, tp)
            params = dict(model.named_parameters())
            trainable = {n: params[n] for n in trainable}
        par = cls(model, topo, tp, pp, ep)
        # sharding (sharding.py): each rank's optimizer holds only the tensors it owns
        from .sharding import for_trainer

        par.shard = for_trainer(args, topo, list(trainable.items()), par.local, model)
        if par.shard is None and tp is None and pp is None:   # data parallel alone: paddle's reducer
            from .data import DataReducer

            par.dp = DataReducer.for_model(model, topo, trainable)
        from .data import FleetDataParallel
        from .group_sharded import GroupShardedStage2, GroupShardedStage3

        par.hybrid = (GroupShardedStage2.for_layout(model, topo, par.shard)
                      or GroupShardedStage3.for_layout(model, topo, par.shard)
                      or FleetDataParallel.for_layout(topo, tp, pp, par.shard, ep))
        return par, trainable

    # ---------------------------------------------------------------- tensors
    def local(self, t):
        """A DTensor's local shard (tensor parallel), else the tensor itself."""
        return t._local_value() if self.tp is not None and t is not None and t.is_dist() else t

    def grad(self, p):
        """p's gradient as this rank holds it (zeros when it has none)."""
        if p.grad is None:
            return paddle.zeros(self.local(p).shape, p.dtype)
        g = self.local(p.grad)
        if not g._is_initialized():
            # a DTensor gradient left without memory (a Mixture-of-Experts expert no token chose
            # in this step under tensor parallel): zero, as an unused parameter's
            return paddle.zeros(self.local(p).shape, p.dtype)
        return g

    def optimizer_params(self, trainable):
        """(name, local tensor) pairs this rank's optimizer updates (sharding: the owned ones)."""
        return ((n, self.local(p)) for n, p in trainable.items() if self.owns(n))

    def owns(self, name):
        return self.shard is None or self.shard.owns(name)

    @property
    def forward_model(self):
        """What the trainer's forward calls: paddle's sharding wrapper when there is one."""
        wrapper = getattr(self.hybrid, "model", None)
        return self.model if wrapper is None else wrapper

    @property
    def defers_state(self):
        """The optimizer's moments wait for fleet's stage-1 partition (after_setup)."""
        return self.shard is not None and self.shard.fleet

    @property
    def offload(self):
        return self.shard is not None and self.shard.offload

    # ---------------------------------------------------------------- one step
    def after_setup(self, trainable, optimizer=None):
        if self.hybrid is not None and optimizer is not None:   # fleet's step reduces over dp
            self.hybrid.wrap(optimizer)
            if self.hybrid.sharding:   # stage 1 on fleet: its partition; moments of ours only
                self.shard.adopt(self.hybrid.owners(optimizer))
                if getattr(self.hybrid, "split", False):   # V2: moments on this rank's flat slices
                    optimizer.use_slices(self.hybrid.slices)
                else:
                    optimizer.keep_state(self.shard.owned)
        if self.shard is not None:
            self.shard.release(trainable)   # stage 3: non-owned values dropped between steps

    def check_micro_batches(self, k, k_sum, k_sq):
        if self.ep is not None and k_sum * k_sum != k_sq * self.topo.data_degree:
            # (sum k)^2 = D sum k^2 only when every rank has the same k: each micro-batch's forward
            # holds collectives over the data ranks, so every rank must run as many
            raise ValueError(f"this step gives the data-parallel ranks different numbers of micro-"
                             f"batches (this rank: {k}): a Mixture-of-Experts model on several data "
                             "ranks needs equal ones; use dataloader_drop_last or a dataset size that "
                             "is a multiple of the global batch")

    def begin_step(self, trainable):
        if self.shard is not None:   # stage 3: what is outside the blocks (these come one by one)
            self.shard.begin_step(trainable)

    def backward(self, micro_batches, n_global, keys, per_micro):
        """The summed loss_sum of this rank's micro-batches: through the pipeline stages' 1F1B
        schedule under PP, else per_micro(micro_batches) (the Trainer's forward + backward)."""
        if self.pp is None:
            return per_micro(micro_batches) if self.dp is None else self.dp.run(micro_batches, per_micro)
        loss_of = hidden_loss_for(self.model)
        tensors = [{k: paddle.to_tensor(v) for k, v in b.items() if k in keys} for b in micro_batches]
        # fleet's dp mean (data.FleetDataParallel): the last stage back-propagates loss_sum x dp;
        # the logged sum is loss_sum itself
        acc = self.pp.train_step(tensors, lambda h, b: loss_of(self.model, h, b["labels"]), n_global,
                                 scale=float(self._hybrid_factor()))
        return self.pp.sum_over_stages(acc)

    def _hybrid_factor(self):
        return 1 if self.hybrid is None else self.hybrid.degree

    def backward_loss(self, loss):
        """loss.backward(); under paddle.DataParallel with its reducer and scale, under fleet's
        hybrid optimizer with its scale dp (data.py)."""
        if self.hybrid is not None:
            (loss * float(self.hybrid.degree)).backward()
        elif self.dp is None:
            loss.backward()
        else:
            self.dp.backward(loss)

    def reduce_grads(self, trainable, named, grads):
        """Gradients summed where ranks hold parts of one: replicated TP heads, a tied embedding
        across stages, the data-parallel (or expert / sharding) group. Under sharding stage >= 2
        a rank keeps only the gradients it owns (None elsewhere)."""
        names = [n for n, _ in named]
        if self.tp is not None:   # replicated key/value heads: their partial gradients summed
            from .tensor import sum_replicated_grads

            grads = sum_replicated_grads(self.model, named, grads, self.tp)
        if self.pp is not None and self.hybrid is None:   # tensors every stage holds (with fleet's
            # optimizer: before its step, `step`); a tied embedding's two copies were summed by
            # fleet's shared comm at the end of forward_backward_pipeline (pipeline.py)
            grads = self.pp.sum_replicated_grads(named, grads)
        if self.shard is not None and self.shard.split:
            pass   # V2: this rank's reduced slices already (None where it holds none)
        elif self.shard is not None and self.shard.fleet:   # fleet summed the owners' (data.py)
            grads = [g if self.shard.owns(n) else None for n, g in zip(names, grads)]
        elif self.shard is not None and self.shard.stage >= 2:
            grads = self.shard.reduce_grads(names, grads)    # None where another rank owns it
        elif self.dp is not None or self.hybrid is not None:
            pass   # paddle's reducer summed them during backward / fleet's optimizer (data.py)
        elif self.ep is not None:   # experts' gradients over the ranks holding the same experts
            grads = self.ep.reduce_grads(names, grads)
        else:
            grads = self.topo.all_reduce_grads(grads)
        if self.shard is not None and not self.shard.fleet:   # (fleet's step broadcasts the
            # owners' values for the tensors with a gradient: theirs stay until the step ends)
            # stage2+: others' gradients dropped (an owner's are summed in place); stage1: the
            # summed copies replace them
            for n, g in zip(names, grads):
                if g is None or self.shard.stage < 2:
                    trainable[n].clear_gradient(False)
        return grads

    def step(self, optimizer, named, update):
        """update(grads of `named`, data-parallel summed) -> its result: directly, or inside
        fleet's HybridParallelOptimizer.step after its reduction (data.FleetDataParallel)."""
        if getattr(self.hybrid, "own_grads", False):   # paddle's stage 3: its gradient slices
            return self.hybrid.step(optimizer, named, None, update)
        grads = [self.grad(p) for _, p in named]
        if self.hybrid is None:
            return update(grads)
        if self.pp is not None:
            # a tensor every stage holds (a prefix): its copies summed over the stages (in place,
            # in the gradients fleet reads) BEFORE fleet's reduction. Under sharding each stage's
            # group partitions its own tensors, so the copies' owners can differ: a sum over the
            # stages after the reduce would add an owner's total to a non-owner's partial
            grads = self.pp.sum_replicated_grads(named, grads)
        return self.hybrid.step(optimizer, named, grads, update)

    def clear_grads(self, trainable):
        """After a step: gradients released, or paddle's stage-2 clear_grad (it zeroes the owned
        gradients in its buffer; releasing them would cut them off it)."""
        if getattr(self.hybrid, "opt", None) is not None:
            self.hybrid.opt.clear_grad()
            return
        if getattr(self.hybrid, "split", False):   # V2: zeroed in its fused buffer (data.py)
            self.hybrid.clear_grad()
            return
        for p in trainable.values():
            p.clear_gradient(False)

    def grad_norm(self, named, grads):
        """The whole model's gradient norm: TP slices summed over their ranks (replicated heads
        and replicated tensors counted once), pipeline stages summed, a tied embedding once."""
        # square, not ** 2 (paddle's CPU pow kernel is ~100x slower); one host read of the norm
        # per step lets clipping scale in place with a python float (no temporaries)
        squares = [paddle.square(g.astype("float32")).sum() if g is not None else paddle.zeros([], "float32")
                   for g in grads]
        if self.pp is not None:
            squares = [s if self.pp.counts_once(n) else s * 0 for s, (n, _) in zip(squares, named)]
        if hasattr(self.hybrid, "counts_once"):   # paddle's stage 3: a whole tensor counted once
            squares = [s if self.hybrid.counts_once(n) else s * 0 for s, (n, _) in zip(squares, named)]
        if self.ep is not None:   # each rank's experts are different ones: their parts summed
            squares = self.ep.norm_squares([n for n, _ in named], squares)
        if self.tp is None:
            norm = paddle.sqrt(paddle.add_n(squares))
        else:
            from .tensor import global_grad_norm, is_split, replica_square_excess

            held = [(x, g) for x, g in zip(named, grads) if g is not None]
            norm = global_grad_norm(squares, [is_split(p) for _, p in named], self.tp,
                                    replica_square_excess(self.model, [x for x, _ in held],
                                                          [g for _, g in held], self.tp))
        if self.pp is not None:
            norm = paddle.sqrt(self.pp.sum_over_stages(paddle.square(norm)))
        if self.shard is not None and self.shard.owned_grads_only:   # each owner's part
            norm = paddle.sqrt(self.shard.square_norm(paddle.square(norm)))
        return norm

    def before_update(self, trainable, grads, optimizer):
        """What this rank holds under sharding, measured (tests assert the 1/S split): gradient
        elements after the reduction, optimizer-state elements."""
        if self.shard is None:
            return
        from .sharding import numel, resident_numel

        left = resident_numel(self.local(p.grad) for n, p in trainable.items()
                              if p.grad is not None and not self.shard.owns(n))   # others' gradients
        if self.shard.fleet and self.shard.stage < 3:   # fleet's stage 1 holds every gradient through its step
            held = resident_numel(self.local(p.grad) for p in trainable.values() if p.grad is not None)
        elif self.shard.stage >= 2:
            held = sum(numel(g) for g in grads if g is not None)
        else:
            held = sum(numel(g) for g in grads)
        self.shard.stats.update(
            grad_numel=held, grad_numel_left=left,
            optimizer_numel=sum(numel(t) for d in (optimizer.exp_avg, optimizer.exp_avg_sq)
                                for t in d.values()))

    def after_step(self, trainable):
        if self.shard is not None:   # owners' new values to the group (stage 3: released)
            self.shard.after_step(trainable)

    def after_training(self, trainable):
        if self.shard is not None:   # stage 3: the whole model again, for export and the caller
            self.shard.gather(trainable)
        if hasattr(self.hybrid, "gather_all"):   # paddle's stage 3
            self.hybrid.gather_all()

    def whole_arrays(self, trainable):
        """{name: whole numpy array} of the trainable tensors without TP (a collective per
        sliced tensor under paddle's stage 3: every rank of the group calls it)."""
        if hasattr(self.hybrid, "full_array"):
            return {n: self.hybrid.full_array(n, p) for n, p in trainable.items()}
        return {n: p.numpy() for n, p in trainable.items()}

    # ---------------------------------------------------------------- evaluation
    @contextlib.contextmanager
    def whole_for_eval(self, trainable):
        released = self.shard is not None and self.shard.released
        if released:   # stage 3 between steps: gathered for evaluation, released after
            self.shard.gather(trainable)
        yield
        if released:
            self.shard.release(trainable)

    def eval_padding_batches(self, n_batches, n_mine):
        """How many unused forwards this rank runs so every rank runs as many (the expert
        dispatch is collective)."""
        if self.ep is not None and self.ep.degree > 1 and n_batches:
            return -(-n_batches // self.topo.data_degree) - n_mine
        return 0

    def eval_batch(self, batch, keys, forward):
        if self.pp is None:
            return forward(batch)
        loss_of = hidden_loss_for(self.model)
        tensors = {k: paddle.to_tensor(v) for k, v in batch.items() if k in keys}
        return self.pp.eval_batch(tensors, lambda h, b: loss_of(self.model, h, b["labels"]))

    def sum_over_stages(self, stats):
        """The last stage's sums, to every stage (as they are without PP)."""
        return stats if self.pp is None else self.pp.sum_over_stages(stats)

    # ---------------------------------------------------------------- checkpoints
    def writer(self):
        """Whether this rank writes checkpoint pieces: the first data-parallel replica (expert
        parallel: the first expert group, each rank its experts)."""
        return self.ep.writer if self.ep is not None else self.topo.dp_rank == 0

    def pieces(self, trainable, optimizer, ckpt):
        """This rank's slices of the trainable tensors and their optimizer state, as checkpoint
        pieces (full-model names, global boxes). Under TP a replicated tensor is written by the
        first TP rank only; under PP each stage writes its own tensors (a tied embedding once)."""
        tensors, meta = optimizer.state_dict()
        if getattr(self.hybrid, "split", False):   # V2's flat slices -> whole tensors (collective)
            kinds = ("exp_avg", "exp_avg_sq") + (("master",) if optimizer.masters() else ())
            tensors = self.hybrid.gather_state(tensors, optimizer, kinds)
        if hasattr(self.hybrid, "full_array"):   # paddle's stage 3: slices gathered (collectives)
            model, optim = {}, {}
            for n, p in trainable.items():
                value = self.hybrid.full_array(n, p)
                moments = {f"{n}.{k}": self.hybrid.full_array(n, p, paddle.to_tensor(tensors[f"{n}.{k}"]))
                           for k in ("exp_avg", "exp_avg_sq")}
                if self.shard.writes(n):
                    model[n] = np.asarray(value, np.float32)
                    optim.update(moments)
            return ckpt.whole(model), ckpt.whole(optim), meta
        if self.tp is None:
            own = {n: p for n, p in trainable.items()
                   if (self.pp is None or self.pp.counts_once(n)) and self.owns(n)
                   and (self.ep is None or self.ep.writes(n))}
            opt = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] in own}
            return ckpt.whole(ckpt.arrays(own)), ckpt.whole(opt), meta
        from .plan import param_split
        from .tensor import box_pieces, is_split, real_shape

        model_pieces, optim_pieces = [], []
        for n, p in trainable.items():
            if ((not is_split(p) and self.tp.rank != 0) or (self.pp is not None and not self.pp.counts_once(n))
                    or not self.owns(n)):
                continue
            arrays = {n: self.local(p).numpy(), f"{n}.exp_avg": tensors[f"{n}.exp_avg"],
                      f"{n}.exp_avg_sq": tensors[f"{n}.exp_avg_sq"]}
            whole = real_shape(self.model, p, param_split(self.model.spec, self.model.config, n, list(p.shape)))
            boxes = box_pieces(self.model, n, p, self.tp)
            for key, arr in arrays.items():
                out = model_pieces if key == n else optim_pieces
                for i, (start, _, idx, shared) in enumerate(boxes):
                    if self.tp.rank % shared:   # a replicated head: its first rank writes it
                        continue
                    out.append(ckpt.Piece(key, np.ascontiguousarray(arr[idx]), whole, start,
                                          key if len(boxes) == 1 else f"{key}@{i}"))
        return model_pieces, optim_pieces, meta

    def read_local(self, reader, name, p, kind="model", key=None):
        """This rank's slice of `key` (default `name`) from any layout's checkpoint."""
        key = key or name
        if hasattr(self.hybrid, "local_slice"):   # paddle's stage 3: this rank's flat slice
            return self.hybrid.local_slice(name, p, reader.read(key, kind))
        if self.tp is None:
            return reader.read(key, kind)
        from .tensor import box_pieces

        out = np.zeros(self.local(p).shape, np.float32)
        for start, shape, idx, _ in box_pieces(self.model, name, p, self.tp):
            out[idx] = reader.read(key, kind, start, shape)
        return out

    def load_target(self, name, p):
        """The tensor a resume writes `name`'s value into; None when this rank holds none of it
        (our stage 3 between steps: the owner loads it)."""
        if hasattr(self.hybrid, "load_target"):
            return self.hybrid.load_target(name, p)
        return self.local(p) if self.local(p)._is_initialized() else None

    def global_shape(self, name, p):
        """The shape a checkpoint holds for parameter `p` (the whole tensor's)."""
        want = list(p.shape)
        if self.tp is None:
            return want
        from .plan import param_split
        from .tensor import real_shape

        return real_shape(self.model, p, param_split(self.model.spec, self.model.config, name, want))

    # ---------------------------------------------------------------- export
    def check_export(self, default_export):
        if self.ep is not None and default_export:
            from .expert import check_full_export

            check_full_export(self.model, self.ep)   # every rank, before any step

    def save_whole(self, out_dir, tokenizer, main):
        """The default export: models.save_pretrained of the whole model (under TP the slices
        gathered, a collective per tensor, on every rank; rank 0 writes)."""
        from ..models import save_pretrained

        if self.tp is None:
            save_pretrained(self.model, out_dir, tokenizer=tokenizer)
            return
        from . import tensor as tensor_parallel

        state = tensor_parallel.gathered_state(self.model, self.tp)   # a collective per tensor
        if main:
            save_pretrained(self.model, out_dir, tokenizer=tokenizer, state=state)
        else:
            for _ in state:
                pass

    def export(self, out_dir, export_fn, default_export, trainable, main, through_checkpoint):
        """Write the final model: export_fn(out_dir) on the rank(s) that can. Pipeline stages
        hold parts only: through_checkpoint(out_dir) merges them (None: no run description to
        merge with, export_fn on rank 0 of what it holds)."""
        if self.pp is not None and through_checkpoint is not None:
            through_checkpoint(out_dir)
        elif self.pp is not None:   # no run description to merge with: the caller's export only
            from ..runtime import warn_once

            warn_once("pp_export", "pipeline parallel without checkpoint_meta: the final model "
                      "is not merged (each stage holds part of it); export_fn runs on rank 0")
            if main:
                export_fn(out_dir)
        elif self.ep is not None and self.ep.degree > 1:   # every expert gathered to rank 0
            from .expert import full_experts

            with full_experts(self.model, self.ep, build=main):
                if main:
                    export_fn(out_dir)
        elif self.tp is not None and default_export:
            export_fn(out_dir)                 # every rank: the tensors are gathered
        elif self.tp is not None:              # PEFT: the adapter's tensors gathered
            from .tensor import full_params

            with full_params(self.model, self.tp, list(trainable)):
                if main:
                    export_fn(out_dir)
        elif main:
            export_fn(out_dir)
