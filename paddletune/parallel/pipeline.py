"""Pipeline parallelism on fleet's engine: the model as a `PipelineLayer`, run by `PipelineParallel`
(1F1B) or `PipelineParallelWithInterleave` (virtual_pp_degree > 1).

    pipe = Pipeline(model, topo)          # at load: which blocks this stage holds (owned / prune)
    pipe.finalize(trainable)              # after PEFT: others' parts dropped, fleet's engine built
    acc = pipe.train_step(micro_batches, loss_of, n_global)   # forward + backward, 1F1B
    metrics = pipe.eval_batch(batch, metrics_of)              # forward only (last stage: metrics)

The PipelineLayer's items (pipeline_items.py), in model order: PipeEmbedding (a tied one:
PipeSharedEmbedding, fleet's SharedLayerDesc), PipeDecoderBlock 0 .. L-1, PipeFinalNorm (then,
tied, the head's PipeSharedEmbedding);
the loss (PipeLoss) is the last stage's loss function. Segmentation: without virtual stages a
list of boundaries (stage_layers: as even as possible, the first stages take the extra blocks);
with v virtual stages paddle's own "layer:PipeDecoderBlock" rule (blocks divisible by pp x v,
asserted by paddle) and fleet.distributed_model picks the schedule (accumulation >= pp:
PipelineParallelWithInterleave from 2 pp on, its F-then-B form below; less is refused by paddle).
Items hold the stage's real modules (already loaded, PEFT-wrapped); other stages' items are
empty placeholders, so a rank builds and loads nothing it does not run.

What travels between stages (fleet's p2p, keyed tensors): the hidden states [B, S, H] and the
micro-batch's position_ids / attention_mask / segment_ids [B, S] (whichever the batch has): each
stage builds its own attention context from them (never a [B, 1, S, S] mask). fleet's meta
message carries the sender's dtype, so a float64 (or bf16) model sends and receives its own.
fleet's shape cache (pipeline_configs.p2p_cache_shape) fixes the shapes at the first micro-batch
and suits fixed-shape data only. It is off here, always (the shipped configs included): padded
SFT batches and packed rows change length per micro-batch, and evaluation batches differ from
training ones even where training rows are packed to max_length. fleet then runs its dynamic-
shape mode (pp_configs.enable_dynamic_shape): a meta message (shape, dtype, key; one host read)
before every activation and every gradient, so a gradient's buffer has its micro-batch's shape.

The step: `forward_backward_pipeline` (fleet's 1F1B / interleaved schedule, p2p and the micro-
batch loop; at its end fleet all-reduces a tied embedding's gradient over its shared group:
SharedLayerDesc), then the Trainer's own step (gradient sums over TP / replicated tensors,
global norm, clipping, divergence check, AdamW: layout.Parallel.step, through fleet's
HybridParallelOptimizer under data parallel). Not `train_batch`: its optimizer step would skip
the Trainer's clipping over the whole model's norm (summed over stages) and metrics. The loss:
the last stage back-propagates loss_sum x dp / N (N = target tokens of the global batch), as
one process does; fleet's division of each micro-batch loss by accumulate_steps is off
(pp_configs.delay_scale_loss, which moves it into fleet's optimizer step, not run here).
"""
import contextlib
import time

import paddle
import paddle.distributed as dist
import paddle.nn as nn

from .pipeline_items import (CTX_KEYS, Absent, PipeDecoderBlock, PipeEmbedding, PipeFinalNorm,
                             PipeLoss, PipeSharedEmbedding, _head_copy)


def stage_layers(num_layers, num_stages, stage, virtual=1):
    """The decoder blocks of `stage`: 5 blocks on 2 stages -> [0, 1, 2] and [3, 4]; with v virtual
    stages (blocks divisible by stages x v) chunks stage, stage + P, ... of L / (P v) blocks."""
    if virtual > 1:
        per = num_layers // (num_stages * virtual)
        return [i for c in range(stage, num_stages * virtual, num_stages) for i in range(c * per, (c + 1) * per)]
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


def stage_parts(model, stage, num_stages, virtual=1):
    """[(module, kept?, what)] of the stage-divided parts of the model: every decoder block, the
    embedding (first stage, and the last when it is tied to the head), the final norm and head
    (last stage). Everything else (a prefix encoder) is on every stage."""
    keep = set(stage_layers(len(model.decoder_layers()), num_stages, stage, virtual))
    first, last = stage == 0, stage == num_stages - 1
    tied = model.get_output_embeddings() is None
    parts = [(layer, i in keep, f"decoder block {i}") for i, layer in enumerate(model.decoder_layers())]
    parts += [(model.get_input_embeddings(), first or (last and tied), "the embedding"),
              (model.final_norm(), last, "the final norm")]
    if not tied:
        parts.append((model.get_output_embeddings(), last, "the LM head"))
    return parts


def owned(model, stage, num_stages, virtual=1):
    """predicate(parameter name): whether this stage loads and trains the tensor."""
    absent = set()
    for module, kept, _ in stage_parts(model, stage, num_stages, virtual):
        if not kept and isinstance(module, nn.Layer):
            absent |= {id(p) for p in module.parameters()}
            absent |= {id(m) for m in module.sublayers(include_self=True)}
    names = {n for n, p in model.named_parameters() if id(p) in absent}
    quantized = {m.weight_name for m in model.sublayers() if id(m) in absent and getattr(m, "weight_name", None)}
    return lambda name: name not in names and name not in quantized


def prune_to_stage(model, stage, num_stages, virtual=1):
    """Replace what this stage does not hold by Absent modules (their parameters were never
    loaded: loading.load_model reads only the stage's). Done after PEFT wrapped the layers, so
    adapters are drawn as in one process and then dropped with the blocks they belong to. Names of
    what stays are unchanged (full-model names in checkpoints and exports)."""
    from ..peft.common import replace_module

    names = {id(m): n for n, m in model.named_sublayers()}
    layers = model.decoder_layers()
    for module, kept, what in stage_parts(model, stage, num_stages, virtual):
        if kept or not isinstance(module, nn.Layer):
            continue
        if what.startswith("decoder block"):
            layers[int(what.rsplit(" ", 1)[1])] = Absent(what)
        else:
            replace_module(model, names[id(module)], Absent(what))


_ACTIVE = []   # the Pipeline whose trace fleet's micro-step hooks write (registered once)


def _hook(kind):
    def hook(input_tensor=None, output_tensor=None, step_id=None, **_):
        pipe = _ACTIVE[0] if _ACTIVE else None
        if pipe is not None and kind == "B_end" and pipe.shared is not None:
            pipe.shared.share_grad()   # (a DTensor's gradient for fleet's shared all-reduce)
        if pipe is None or pipe.trace is None:
            return
        now = time.perf_counter()
        if kind == "F":
            if isinstance(input_tensor, dict) and "hidden" in input_tensor:   # received
                pipe.trace.append(("recv", pipe.prev, list(input_tensor["hidden"].shape)))
            pipe.trace.append(("F" if step_id is not None else "EF", step_id, now))
        elif kind == "F_end":
            pipe.trace.append(("F_end" if step_id is not None else "EF_end", step_id, now))
            if isinstance(output_tensor, dict):                               # sent on
                pipe.trace.append(("send", pipe.next, list(output_tensor["hidden"].shape)))
        else:
            pipe.trace.append((kind, step_id, now))
    return hook


def _install_trace_hooks():
    """fleet's micro-step callbacks (global in paddle) write the active Pipeline's trace:
    ("F" | "B", micro-batch, time) at each forward / backward fleet's schedule starts, their
    ends, ("recv" | "send", peer, hidden shape) where a stage's input came / output goes over p2p."""
    if _hook in _ACTIVE_HOOKS:
        return
    from paddle.distributed.fleet.meta_parallel.pipeline_parallel import (
        PipelineParallelMicroStepLocations as L, register_global_pipeline_parallel_hook)

    for loc, kind in ((L.FORWARD_BEGIN, "F"), (L.FORWARD_END, "F_end"), (L.BACKWARD_BEGIN, "B"),
                      (L.BACKWARD_END, "B_end")):
        register_global_pipeline_parallel_hook(loc, _hook(kind))
    _ACTIVE_HOOKS.append(_hook)


_ACTIVE_HOOKS = []


@contextlib.contextmanager
def _no_startup_broadcast(layer):
    """fleet's PipelineParallel broadcasts every parameter over the dp / mp / sharding groups at
    construction (sync_params_buffers, which skips `no_sync` tensors). Every rank here loaded the
    same checkpoint (under TP its own slices, as DTensors fleet cannot tell are split: the mp
    broadcast would overwrite them with rank 0's), so the broadcast is skipped."""
    held = list(layer._obtain_parameters_buffers().values())
    before = [getattr(t, "no_sync", None) for t in held]
    for t in held:
        t.no_sync = True
    try:
        yield
    finally:
        for t, b in zip(held, before):
            t.no_sync = b if b is not None else False


class Pipeline:
    """This rank's stage: fleet's PipelineParallel over the model's PipelineLayer (built in
    finalize, after PEFT), the step and eval forward through it, and what the Trainer needs
    (stage-local gradient norm, replicated-tensor sums, logged-loss sum)."""

    def __init__(self, model, topo):
        self.model, self.topo = model, topo
        self.stage, self.num_stages = topo.pp_rank, topo.pp_degree
        self.virtual = int(topo.pipeline.get("virtual", 1))
        ranks = topo.ranks("pp")
        self.prev = ranks[self.stage - 1] if self.stage > 0 else None
        self.next = ranks[self.stage + 1] if self.stage < self.num_stages - 1 else None
        self.first, self.last = self.stage == 0, self.stage == self.num_stages - 1
        self.layer_ids = stage_layers(len(model.decoder_layers()), self.num_stages, self.stage, self.virtual)
        self.group = None if len(ranks) == topo.world_size else topo.groups["pp"]
        self.trace = None   # when a list: fleet's schedule as it ran (_install_trace_hooks)
        self.replicated = set()   # trainable names held whole on every stage (a prefix encoder)
        self.engine = None        # fleet's PipelineParallel (finalize)
        self.losses, self.loss_scale, self.loss_of = [], 1.0, None
        self._ctx = {}
        # a tied embedding: one copy on the first stage, one on the last, fleet's shared layer
        # (SharedLayerDesc) on both; fleet sums the copies' gradients over its shared group
        self.tied = model.get_output_embeddings() is None and self.num_stages > 1
        self.tied_name = None
        if self.tied and (self.first or self.last):
            w = model.get_input_embeddings().weight
            self.tied_name = next(n for n, p in model.named_parameters() if p is w)
        self.trainable = set()    # (finalize) the trainable names this stage holds
        self.shared = None        # (build_engine) this stage's PipeSharedEmbedding, if it holds one

    # ------------------------------------------------------------------ the engine
    def build_engine(self):
        """The PipelineLayer of this stage's modules and fleet.distributed_model over it (after
        prune_to_stage). fleet's settings (strategy.pipeline_configs / pp_configs) are set on
        the job's strategy first; gloo's in cpu_compat.pipeline_on_gloo."""
        from paddle.distributed import fleet
        from paddle.distributed.fleet.meta_parallel import PipelineLayer

        from .cpu_compat import pipeline_on_gloo

        cfg, m = self.topo.pipeline, self.model
        strategy = fleet.fleet._user_defined_strategy
        pipeline_on_gloo(strategy)
        strategy.hybrid_configs["pp_configs"].delay_scale_loss = True
        # variable lengths (module docstring): a meta message before every activation and gradient
        # (without dynamic shape a gradient's buffer takes the last *sent* activation's shape);
        # the interleaved schedule asserts the cache (fixed shapes: fixed_shape_batches)
        cache = self.virtual > 1
        strategy.hybrid_configs["pp_configs"].enable_dynamic_shape = not cache
        strategy.pipeline_configs = {"accumulate_steps": int(cfg.get("accumulate_steps", 1)),
                                     "micro_batch_size": int(cfg.get("micro_batch_size", 1)),
                                     "p2p_cache_shape": cache}
        L, mine = len(m.decoder_layers()), set(self.layer_ids)
        items = [self._shared_embedding("first") if self.tied else
                 PipeEmbedding(self, m.get_input_embeddings() if self.first else None)]
        items += [PipeDecoderBlock(self, i, m.decoder_layers()[i] if i in mine else None) for i in range(L)]
        head = m.get_output_embeddings()
        items.append(PipeFinalNorm(self, m.final_norm() if self.last else None, head if self.last else None))
        if self.tied:
            items.append(self._shared_embedding("last"))
        if self.virtual > 1:
            seg, kw = "layer:PipeDecoderBlock", {"num_virtual_pipeline_stages": self.virtual}
        else:
            seg = [0] + [1 + stage_layers(L, self.num_stages, s)[0] for s in range(1, self.num_stages)]
            seg, kw = seg + [len(items)], {}
        # fleet's shared comm creates its groups with paddle.distributed.new_group (cpu_compat 1)
        from .cpu_compat import fleet_groups

        with fleet_groups(self.topo.world_size):
            layer = PipelineLayer(items, topology=self.topo.hcg.topology(), loss_fn=PipeLoss(self),
                                  seg_method=seg, **kw)
        self.shared = layer.shared_layers["tied_embedding"] if "tied_embedding" in layer.shared_layers else None
        chunks = [c.get_run_function() for c in layer.get_model_chunks()] if self.virtual > 1 \
            else [layer.run_function]
        assert sorted(x.index for c in chunks for x in c if isinstance(x, PipeDecoderBlock)) == sorted(mine), \
            "fleet's segmentation differs from the blocks this stage loaded"
        for c in chunks:
            c[-1].ends_chunk = True
        _install_trace_hooks()
        with _no_startup_broadcast(layer):
            self.engine = fleet.distributed_model(layer)
        from .cpu_compat import route_p2p_over_pairs
        from .topology import group_ranks

        route_p2p_over_pairs(self.topo.hcg, lambda r: group_ranks(r, self.topo.degrees, "pp"),
                             self.topo.world_size)
        return self.engine

    def _shared_embedding(self, end):
        """The tied embedding's SharedLayerDesc for the first (embeds) or last (head) stage. fleet
        builds a PipeSharedEmbedding on each stage whose segment holds the item, joins the two
        stages' ranks of every pipeline in a shared group (paddle.distributed.new_group), at
        construction broadcasts the weight from the first stage (both loaded it: a no-op), and at
        the end of forward_backward_pipeline all-reduces the copies' gradients over that group
        (PipelineLayer.allreduce_shared_weight_gradients). A frozen tied embedding (LoRA) shares
        no attribute: nothing to sum, no gradient made for it."""
        from paddle.distributed.fleet.meta_parallel import SharedLayerDesc

        emb = self.model.get_input_embeddings()
        held = self.first if end == "first" else self.last
        attrs = ["weight"] if self.tied_name in self.trainable else []
        return SharedLayerDesc("tied_embedding", PipeSharedEmbedding, None if end == "first" else _head_copy,
                               attrs, pipe=self, module=emb if held else None)

    def local(self):
        """Under tensor parallelism the non-block parts run on their local shards too."""
        tp = getattr(self.model, "tensor_parallel", None)
        if tp is None:
            return contextlib.nullcontext()
        from .tensor import local_params

        return local_params(self.model, skip=list(self.model.decoder_layers()))

    def context(self, x, h):
        """The attention context of a micro-batch on this stage (positions, rope tables, mask,
        a prefix's cache), built once from its [B, S] tensors and reused by the stage's blocks."""
        refs = [x[k] for k in CTX_KEYS if k in x]
        key = tuple(id(t) for t in refs) + (tuple(h.shape),)
        hit = self._ctx.get(key) if refs else None
        if hit is None:
            with self.local():
                ctx = self.model.context(h.shape[0], h.shape[1], x.get("attention_mask"), x.get("position_ids"),
                                         None, x.get("segment_ids"), h.dtype)
            hit = (refs, ctx)   # the tensors kept alive with it: their ids stay unique
            if refs:
                self._ctx[key] = hit
        return hit[1]

    def _data(self, batches):
        """fleet's data argument: (inputs, labels), each {key: [tensor per micro-batch]}."""
        keys = ["input_ids"] + [k for k in CTX_KEYS if k in batches[0]]
        inputs = {k: [b[k] for b in batches] for k in keys}
        return inputs, {"labels": [b["labels"] for b in batches]}

    def _set_accumulation(self, m):
        e = self.engine
        if e._dynamic_shape:   # fleet appends a meta record per p2p op (re-sent every time without
            e._p2p_helper._dynamic_cnt = 0   # the cache): each step starts at the first again
        if e.accumulate_steps != m:   # a shorter last step: fleet's hook counts follow
            e.accumulate_steps = m
            e._init_user_forward_backward_hooks()

    # ------------------------------------------------------------------ a step
    def train_step(self, micro_batches, loss_of, n_global, scale=1.0):
        """Forward and backward of this replica's micro-batches by fleet's schedule. loss_of(
        hidden, {"labels"}) -> LossOutput on the last stage; each micro-batch back-propagates
        its loss_sum x scale / n_global. Returns the summed loss_sum of the micro-batches (the
        last stage's; 0 on the others)."""
        _ACTIVE[:] = [self]
        if self.virtual > 1:
            self._check_fixed(micro_batches)
        self._set_accumulation(len(micro_batches))
        self.losses, self.loss_of, self.loss_scale = [], loss_of, scale / max(n_global, 1.0)
        self._ctx = {}
        if self.trace is not None:
            self.trace.append(("step", len(micro_batches), time.perf_counter()))
        try:
            self.engine.forward_backward_pipeline(self._data(micro_batches), None)   # no scaler
        finally:
            if self.shared is not None:
                self.shared.release_grad()
        if self.trace is not None:
            self.trace.append(("step_end", len(micro_batches), time.perf_counter()))
        self._ctx = {}
        acc = paddle.zeros([], "float32")   # summed as the Trainer sums (float32, in order)
        for loss in self.losses:
            acc = acc + loss.astype("float32")
        self.losses = []
        return acc

    @paddle.no_grad()
    def eval_batch(self, batch, metrics_of):
        """Forward only (fleet's eval_batch); the last stage returns metrics_of(hidden, batch),
        the others None. The model's train / eval mode is kept. With the shape cache (virtual
        stages) the batch runs as the training step's micro-batches (fixed_shape_batches)."""
        _ACTIVE[:] = [self]
        training = self.model.training
        parts, rows = ([batch], None) if self.virtual == 1 else self.fixed_shape_batches(batch)
        self._set_accumulation(len(parts))
        self._ctx = {}
        out = self.engine.eval_batch(self._data(parts), compute_loss=False)
        self._ctx = {}
        self.model.train() if training else self.model.eval()
        if not self.last:
            return None
        h = out[0] if rows is None else paddle.concat(list(out))[:rows]
        with self.local():
            return metrics_of(h, batch)

    # ------------------------------------------------------------------ fixed shapes (virtual stages)
    def _check_fixed(self, micro_batches):
        """fleet's interleaved schedule keeps the first step's shapes (its p2p cache, asserted
        there): every step must have as many micro-batches of one shape."""
        shapes = {tuple(b["input_ids"].shape) for b in micro_batches}
        want = self.topo.pipeline.get("accumulate_steps", 1)
        first = getattr(self, "_fixed_shape", None) or next(iter(shapes))
        if len(shapes) != 1 or first not in shapes or len(micro_batches) != want:
            raise ValueError(
                f"virtual_pp_degree {self.virtual}: fleet's interleaved schedule needs every step to "
                f"have {want} micro-batches of one shape (its p2p shape cache); this step has "
                f"{len(micro_batches)} of shapes {sorted(shapes)}: use pad_to_max_length and a "
                "dataset size that is a multiple of the global batch (dataloader_drop_last)")
        self._fixed_shape = first

    def fixed_shape_batches(self, batch):
        """(micro-batches of the training step's shape, rows of `batch`): the rows split into
        accumulate_steps micro-batches of micro_batch_size rows, filled up with copies of the
        first row whose labels are all ignored (no targets: loss, counts and accuracy unchanged;
        finite activations). Batches of more rows than one step holds are refused."""
        import numpy as np

        from ..data.collate import IGNORE

        want = getattr(self, "_fixed_shape", None)
        mb, m = int(self.topo.pipeline.get("micro_batch_size", 1)), int(self.topo.pipeline.get("accumulate_steps", 1))
        rows = int(batch["input_ids"].shape[0])
        if want is not None and int(batch["input_ids"].shape[1]) != want[1] or rows > mb * m:
            raise ValueError(
                f"virtual_pp_degree {self.virtual}: an evaluation batch of shape "
                f"{list(batch['input_ids'].shape)} does not fit the training step's micro-batches "
                f"({m} x {[mb, want[1] if want else '?']}): use pad_to_max_length and "
                f"per_device_eval_batch_size <= {mb * m}")
        idx = np.concatenate([np.arange(rows), np.zeros(mb * m - rows, np.int64)])
        full = {k: paddle.gather(v, paddle.to_tensor(idx)) for k, v in batch.items()}
        if rows < mb * m:
            keep = paddle.to_tensor((np.arange(mb * m) < rows)[:, None])
            full["labels"] = paddle.where(keep, full["labels"], paddle.full_like(full["labels"], IGNORE))
        return [{k: v[i * mb:(i + 1) * mb] for k, v in full.items()} for i in range(m)], rows

    # ------------------------------------------------------------------ what the Trainer needs
    def sum_over_stages(self, t):
        """Sum a tensor over the pipeline stages (in place; the loss / counts of other stages are 0)."""
        if self.num_stages > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def finalize(self, trainable):
        """After PEFT: drop what other stages hold (prune_to_stage) and note the trainable tensors
        every stage holds whole (they get their gradients summed over the stages). Returns the
        names of `trainable` that stay on this stage. fleet's engine is built here."""
        prune_to_stage(self.model, self.stage, self.num_stages, self.virtual)
        held = dict(self.model.named_parameters())
        stage_ids = {id(p) for m, kept, _ in stage_parts(self.model, self.stage, self.num_stages, self.virtual)
                     if kept and isinstance(m, nn.Layer) for p in m.parameters()}
        self.replicated = {n for n in trainable if n in held and id(held[n]) not in stage_ids}
        self.trainable = {n for n in trainable if n in held}
        self.build_engine()
        return [n for n in trainable if n in held]

    def counts_once(self, name):
        """False for the copies norms and checkpoints must not count again: the last stage's
        tied embedding, and a replicated tensor on every stage but the first."""
        if name in self.replicated:
            return self.first
        return not (self.tied_name == name and self.last and not self.first)

    def sum_replicated_grads(self, named, grads):
        """A tensor every stage holds (a prefix: one slice per block) gets each stage's part of the
        gradient: summed over the stages, every copy takes the same update."""
        for i, (n, _) in enumerate(named):
            if n in self.replicated and self.num_stages > 1:
                dist.all_reduce(grads[i], group=self.group)
        return grads


def check_stages(config, num_stages, virtual=1):
    """Refuse, before loading, a pipeline with more stages than decoder blocks, and (virtual
    stages) a block count paddle's interleaved segmentation cannot divide."""
    if config.num_hidden_layers < num_stages:
        raise ValueError(f"pipeline_parallel_degree ({num_stages}) exceeds the model's "
                         f"num_hidden_layers ({config.num_hidden_layers}): every stage needs a block")
    if virtual > 1 and config.num_hidden_layers % (num_stages * virtual):
        raise ValueError(f"virtual_pp_degree {virtual}: the model's num_hidden_layers "
                         f"({config.num_hidden_layers}) must be divisible by pipeline_parallel_degree x "
                         f"virtual_pp_degree ({num_stages * virtual}; paddle's interleaved segmentation)")
