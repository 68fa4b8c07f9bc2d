"""The training loop: one concrete Trainer, no subclass hooks.

Loss normalisation (exact across accumulation and data parallel): for one optimizer step, every
rank counts its target tokens, the counts are summed over ranks (N), and each micro-batch
back-propagates loss_sum / N. Summing gradients over ranks then gives the gradient of
(sum of all token losses in the global batch) / N, which is also the logged loss. So batch 4 x
accumulation 1, batch 1 x accumulation 4 and 2 ranks x batch 2 agree however lengths differ.
A loss over other units (preference pairs, paddletune/alignment) puts their number in each
micro-batch as "loss_count"; N counts those instead.

Per step: forward/backward of this rank's micro-batches -> gradients summed over data-parallel
ranks -> global-norm clipping -> AdamW -> (log, eval, checkpoint as configured).
The layout comes from an explicit parallel.Topology. Rank 0 writes logs and the final model;
checkpoints are written by every rank that holds a distinct slice (trainer/checkpoint.py).
"""
import json
import logging
import math
import os
import shutil
import time

import numpy as np
import paddle

from .. import outdir, parallel, runtime
from ..data.collate import BatchPlan, pad_batch
from ..runtime import amp_settings
from ..models import check_finite
from ..models.loss import lm_loss_for
from . import checkpoint as ckpt
from . import profiling, reporting, summary
from .optim import AdamW, lr_at

logger = logging.getLogger("paddletune")
# what a training / eval batch feeds the loss: right-padded rows need no attention mask (causal
# attention never looks right), so the mask is kept for counting real tokens only
LOSS_KEYS = ("input_ids", "labels", "position_ids", "segment_ids")


class MapStyleSource:
    """Training batches from an in-memory dataset through a BatchPlan (see data/collate.py)."""

    def __init__(self, dataset, plan, collate):
        self.dataset, self.plan, self.collate = dataset, plan, collate

    @property
    def steps_per_epoch(self):
        return self.plan.steps_per_epoch

    def iterate(self, epoch, start_step=0):
        for step, micro in self.plan.iterate(epoch, start_step):
            yield step, [self.collate([self.dataset[i] for i in idx]) for idx in micro]


class Trainer:
    """The training loop, callable two ways.

    Public (paddletune.Trainer; trainer/inputs.py turns what you pass into the parts below):
        trainer = Trainer(args, model, tokenizer=None, train_dataset=None, eval_dataset=None)
        trainer.train(); trainer.evaluate(); trainer.predict(["prompt", ...])
      args: TrainingArguments, the tuple parse_args returns, or a JSON argument file; model: a paddle model (paddletune.load_model) or a model name / directory (loaded,
      PEFT from the arguments applied, as llm/finetune_generation.py does); datasets: rows
      ({"src", "tgt"} or {"messages"}), lists of token ids, or {"input_ids", "labels"} dicts.
      Checkpoints, resume (a rerun continues from output_dir's latest checkpoint) and launching
      (paddle.distributed.launch) behave as in the script.
    Parts (the script's order): Trainer(model, args, train_dataset, eval_dataset, tokenizer,
      export_fn=...). export_fn(out_dir) writes the final model (HF directory, or adapter files
      for PEFT); it defaults to models.save_pretrained. `trainable` ({name: param}) defaults to
      every parameter with stop_gradient False. `train_source` replaces the default
      MapStyleSource (packing, lazy data). `callbacks` are called as cb(trainer, step_info) after
      every optimizer step. `topology` is the parallel.Topology of this process (default:
      parallel.init(args)). `checkpoint_meta` (JSON-able) is written into every checkpoint as
      meta.json."""

    def __init__(self, *positional, **kwargs):
        if positional and isinstance(positional[0], paddle.nn.Layer):
            self._setup(*positional, **kwargs)   # the script's order: (model, args, ...)
        else:
            from .inputs import public_inputs

            self._setup(**public_inputs(*positional, **kwargs))

    def _setup(self, model, args, train_dataset=None, eval_dataset=None, tokenizer=None,
               export_fn=None, trainable=None, collate=None, train_source=None, callbacks=(),
               lr_scales=None, loss_fn=None, eval_fn=None, topology=None, checkpoint_meta=None,
               generation=None):
        self.model, self.args, self.tokenizer = model, args, tokenizer
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.topo = topology if topology is not None else parallel.init(args)
        outdir.check_shared(args.output_dir, self.topo)   # every rank sees rank 0's output_dir
        pad_id = tokenizer.pad_token_id if tokenizer is not None else 0
        self.collate = collate or (lambda ex: pad_batch(ex, pad_id))
        self.trainable = trainable if trainable is not None else {
            n: p for n, p in model.named_parameters() if not p.stop_gradient}
        if not self.trainable:
            raise ValueError("no trainable parameters")
        # tensor parallel: parameters are DTensors (parallel/tensor.py); PEFT's new ones are placed
        # now, the loss runs on vocabulary shards, the optimizer updates the local shards
        self.pp = getattr(model, "pipeline", None)   # this rank's pipeline stage, or None
        if self.pp is not None:   # drop the other stages' blocks (and the adapters PEFT put there)
            self.trainable = {n: self.trainable[n] for n in self.pp.finalize(self.trainable)}
        self.tp = getattr(model, "tensor_parallel", None)
        # Mixture-of-Experts on >1 data rank (parallel/expert.py): router statistics over the data
        # ranks; under expert parallel each rank holds its own experts
        if (getattr(model.config, "moe", None) and self.topo.data_degree > 1
                and getattr(model, "expert_parallel", None) is None):   # loaded without the topology
            from ..parallel.expert import install

            install(model, self.topo)
        self.ep = getattr(model, "expert_parallel", None)
        if self.ep is not None:   # the other ranks' experts dropped (and PEFT's adapters on them)
            from ..parallel.expert import finalize

            self.trainable = {n: self.trainable[n] for n in finalize(model, self.ep, self.trainable, args)}
        if self.pp is not None and loss_fn is not None:
            raise ValueError("this loss (R-Drop) runs two passes through the whole model, which has "
                             "no pipeline-parallel form here; set pipeline_parallel_degree to 1")
        if self.tp is not None:
            from ..parallel import tensor as tensor_parallel

            tensor_parallel.finalize(model, self.tp)
            params = dict(model.named_parameters())
            self.trainable = {n: params[n] for n in self.trainable}
        self.checkpoint_meta = checkpoint_meta
        self.export_fn = export_fn or self._default_export
        self.train_source = train_source
        self.callbacks = list(callbacks)
        self.loss_fn = loss_fn or lm_loss_for(model)   # f(model, batch) -> models.loss.LossOutput
        # a loss function may name extra batch keys it reads and the metrics its LossOutput carries
        self.batch_keys = LOSS_KEYS + tuple(getattr(self.loss_fn, "batch_keys", ()))
        self.metric_names = tuple(getattr(self.loss_fn, "metric_names", ()))
        self._metric_acc = None
        self.eval_fn = eval_fn      # optional f(trainer) -> extra metrics (generation eval)
        # sharding (parallel/sharding.py): each rank's optimizer holds only the tensors it owns
        from ..parallel.sharding import for_trainer

        self.shard = for_trainer(args, self.topo, list(self.trainable.items()), self._local, model)
        self.optimizer = AdamW(((n, self._local(p)) for n, p in self.trainable.items()
                                if self.shard is None or self.shard.owns(n)), lr_scales,
                               (args.adam_beta1, args.adam_beta2), args.adam_epsilon, args.weight_decay,
                               offload=self.shard is not None and self.shard.offload)
        if self.shard is not None:
            self.shard.release(self.trainable)   # stage 3: non-owned values dropped between steps
        self.amp = amp_settings(args.fp16, args.bf16, args.fp16_opt_level)
        self.state = {"global_step": 0, "epoch": 0, "step_in_epoch": 0, "log_history": [],
                      "best_metric": None, "best_step": None}
        self.main = self.topo.is_main
        runtime.reuse_freed_memory()   # training speed: no page faults for every new tensor
        self._last_norm, self._last_lr = None, 0.0
        self._weights_at = None     # the step whose weights the model holds (None: not trained here)
        self.generation = generation   # GenerationConfig of predict() (default: greedy, 64 tokens)
        self.reporter = None   # report_to's event files and the PNG (trainer/reporting.py), from train()
        self.model.recompute = bool(args.recompute)
        self.model.recompute_granularity = args.recompute_granularity

    # ---------------------------------------------------------------- setup
    def _local(self, t):
        """A DTensor's local shard (tensor parallel), else the tensor itself."""
        return t._local_value() if self.tp is not None and t is not None and t.is_dist() else t

    def _default_export(self, out_dir):
        from ..models import save_pretrained

        if self.tp is None:
            save_pretrained(self.model, out_dir, tokenizer=self.tokenizer)
            return
        from ..parallel import tensor as tensor_parallel

        state = tensor_parallel.gathered_state(self.model, self.tp)   # a collective per tensor
        if self.main:
            save_pretrained(self.model, out_dir, tokenizer=self.tokenizer, state=state)
        else:
            for _ in state:
                pass

    def _source(self):
        if self.train_source is not None:
            return self.train_source
        a = self.args
        plan = BatchPlan(len(self.train_dataset), a.per_device_train_batch_size,
                         a.gradient_accumulation_steps, self.topo.data_degree, self.topo.data_rank,
                         seed=a.data_seed if a.data_seed is not None else a.seed,
                         drop_last=a.dataloader_drop_last)
        self.train_source = MapStyleSource(self.train_dataset, plan, self.collate)
        return self.train_source

    def total_steps(self):
        a, spe = self.args, self._source().steps_per_epoch
        if a.max_steps and a.max_steps > 0:
            return a.max_steps
        if spe is None:
            raise ValueError("max_steps is required when the number of steps per epoch is unknown (lazy data)")
        return max(1, math.ceil(a.num_train_epochs * spe))

    # ---------------------------------------------------------------- one step
    def _forward(self, batch):
        """models.loss.LossOutput of one micro-batch (numpy arrays from the collator)."""
        inputs = {k: paddle.to_tensor(v) for k, v in batch.items() if k in self.batch_keys}
        enabled, dtype, level = self.amp
        with paddle.amp.auto_cast(enable=enabled, dtype=dtype, level=level):
            return self.loss_fn(self.model, inputs)

    def training_step(self, micro_batches, lr):
        """Forward/backward of this rank's micro-batches, DP gradient sum, clip, AdamW.
        Returns (loss: the global batch's mean token loss, a tensor; grad norm, a tensor; target
        tokens and real tokens of the global batch, floats). Host syncs per step: the token counts
        (summed over ranks before the first backward) and the gradient norm (for clipping)."""
        tgt_local = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches)
        n_local = sum(int(np.sum(b["loss_count"])) for b in micro_batches) if all(
            "loss_count" in b for b in micro_batches) else tgt_local
        real_local = sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].size
                         for b in micro_batches)
        k = len(micro_batches)
        n_global, real_global, tgt_global, k_sum, k_sq = self.topo.all_reduce_scalars(
            [n_local, real_local, tgt_local, k, k * k])
        if self.ep is not None and k_sum * k_sum != k_sq * self.topo.data_degree:
            # (sum k)^2 = D sum k^2 only when every rank has the same k: each micro-batch's forward
            # holds collectives over the data ranks, so every rank must run as many
            raise ValueError(f"this step gives the data-parallel ranks different numbers of micro-"
                             f"batches (this rank: {k}): a Mixture-of-Experts model on several data "
                             "ranks needs equal ones; use dataloader_drop_last or a dataset size that "
                             "is a multiple of the global batch")
        if self.shard is not None:   # stage 3: what is outside the blocks (these come one by one)
            self.shard.begin_step(self.trainable)
        loss_acc = self._backward(micro_batches, n_global)
        names = list(self.trainable)
        named = [(n, self.trainable[n]) for n in names]
        grads = [self._grad(self.trainable[n]) for n in names]
        if self.tp is not None:   # replicated key/value heads: their partial gradients summed
            from ..parallel.tensor import sum_replicated_grads

            grads = sum_replicated_grads(self.model, named, grads, self.tp)
        if self.pp is not None:   # a tied embedding's two copies; tensors every stage holds
            grads = self.pp.sum_replicated_grads(named, self.pp.sum_tied_grads(named, grads))
        if self.shard is not None and self.shard.stage >= 2:
            grads = self.shard.reduce_grads(names, grads)    # None where another rank owns it
        elif self.ep is not None:   # experts' gradients over the ranks holding the same experts
            grads = self.ep.reduce_grads(names, grads)
        else:
            grads = self.topo.all_reduce_grads(grads)
        if self.shard is not None:   # stage2+: others' gradients dropped (an owner's are summed in
            for n, g in zip(names, grads):   # place); stage1: the summed copies replace them
                if g is None or self.shard.stage < 2:
                    self.trainable[n].clear_gradient(False)
        norm = self._grad_norm(named, grads)
        max_norm = self.args.max_grad_norm
        if max_norm and max_norm > 0:
            factor = max_norm / (float(norm) + 1e-6)
            if factor < 1.0:
                with paddle.no_grad():
                    for g in grads:
                        if g is not None:
                            g.scale_(factor)
        if self.shard is not None:
            self._shard_stats(grads)
        self.optimizer.step({n: g for n, g in zip(names, grads) if g is not None}, lr)
        for p in self.trainable.values():
            p.clear_gradient(False)
        if self.shard is not None:   # owners' new values to the group (stage 3: released)
            self.shard.after_step(self.trainable)
        return loss_acc / max(n_global, 1.0), norm, tgt_global, real_global

    def _new_metrics(self):
        return {n: [paddle.zeros([], "float32"), paddle.zeros([], "float32")] for n in self.metric_names}

    def _add_metrics(self, metrics, acc=None):
        """Add a LossOutput's {name: (sum, count)} to `acc` (default: the logging interval's)."""
        if not self.metric_names or not metrics:
            return
        if acc is None:
            self._metric_acc = self._metric_acc or self._new_metrics()
            acc = self._metric_acc
        for n in self.metric_names:
            if n in metrics:
                s, c = metrics[n]
                acc[n][0] = acc[n][0] + s.detach().astype("float32")
                c = c.detach().astype("float32") if isinstance(c, paddle.Tensor) else float(c)
                acc[n][1] = acc[n][1] + c

    def _reduce_metrics(self, acc):
        """{name: sum / count} of `acc` over the data-parallel ranks (names whose count is 0 left
        out); one collective for all of them, on every rank."""
        if not self.metric_names:
            return {}
        acc = acc or self._new_metrics()
        t = self.topo.all_reduce_sum(paddle.stack([acc[n][i] for i in (0, 1) for n in self.metric_names]))
        v, k = t.numpy().astype(np.float64), len(self.metric_names)
        return {n: float(v[i] / v[k + i]) for i, n in enumerate(self.metric_names) if v[k + i] > 0}

    def _backward(self, micro_batches, n_global):
        """Forward + backward of this rank's micro-batches, each back-propagating loss_sum / N;
        returns the summed loss_sum (through the pipeline stages' 1F1B schedule under PP)."""
        if self.pp is not None:
            from ..models.loss import hidden_loss_for

            loss_of = hidden_loss_for(self.model)
            tensors = [{k: paddle.to_tensor(v) for k, v in b.items() if k in LOSS_KEYS} for b in micro_batches]
            acc = self.pp.train_step(tensors, lambda h, b: loss_of(self.model, h, b["labels"]), n_global)
            return self.pp.sum_over_stages(acc)
        loss_acc = paddle.zeros([], "float32")
        for b in micro_batches:
            out = self._forward(b)
            loss_sum = out.loss_sum
            self._add_metrics(out.metrics)
            # the output is dropped before backward: its label logits ([n, vocab], not needed by
            # the backward pass) would otherwise stay alive through it
            del out
            (loss_sum / max(n_global, 1.0)).backward()
            loss_acc = loss_acc + loss_sum.detach().astype("float32")
        return loss_acc

    def _grad_norm(self, named, grads):
        """The whole model's gradient norm: TP slices summed over their ranks (replicated heads
        and replicated tensors counted once), pipeline stages summed, a tied embedding once."""
        # square, not ** 2 (paddle's CPU pow kernel is ~100x slower); one host read of the norm
        # per step lets clipping scale in place with a python float (no temporaries)
        squares = [paddle.square(g.astype("float32")).sum() if g is not None else paddle.zeros([], "float32")
                   for g in grads]
        if self.pp is not None:
            squares = [s if self.pp.counts_once(n) else s * 0 for s, (n, _) in zip(squares, named)]
        if self.ep is not None:   # each rank's experts are different ones: their parts summed
            squares = self.ep.norm_squares([n for n, _ in named], squares)
        if self.tp is None:
            norm = paddle.sqrt(paddle.add_n(squares))
        else:
            from ..parallel.tensor import global_grad_norm, is_split, replica_square_excess

            held = [(x, g) for x, g in zip(named, grads) if g is not None]
            norm = global_grad_norm(squares, [is_split(p) for _, p in named], self.tp,
                                    replica_square_excess(self.model, [x for x, _ in held],
                                                          [g for _, g in held], self.tp))
        if self.pp is not None:
            norm = paddle.sqrt(self.pp.sum_over_stages(paddle.square(norm)))
        if self.shard is not None and self.shard.stage >= 2:   # each owner's part of the norm
            norm = paddle.sqrt(self.shard.square_norm(paddle.square(norm)))
        return norm

    def _shard_stats(self, grads):
        """What this rank holds under sharding, measured (tests assert the 1/S split): gradient
        elements after the reduction, optimizer-state elements."""
        from ..parallel.sharding import numel, resident_numel

        left = resident_numel(self._local(p.grad) for n, p in self.trainable.items()
                              if p.grad is not None and not self.shard.owns(n))   # others' gradients
        self.shard.stats.update(
            grad_numel=sum(numel(g) for g in grads if g is not None) if self.shard.stage >= 2
            else sum(numel(g) for g in grads), grad_numel_left=left,
            optimizer_numel=sum(numel(t) for d in (self.optimizer.exp_avg, self.optimizer.exp_avg_sq)
                                for t in d.values()))

    def _grad(self, p):
        if p.grad is None:
            return paddle.zeros(self._local(p).shape, p.dtype)
        g = self._local(p.grad)
        if not g._is_initialized():
            # a DTensor gradient left without memory (a Mixture-of-Experts expert no token chose
            # in this step under tensor parallel): zero, as an unused parameter's
            return paddle.zeros(self._local(p).shape, p.dtype)
        return g

    # ---------------------------------------------------------------- loop
    def train(self):
        """Train to max_steps / num_train_epochs (resuming first when resume_from_checkpoint is
        set). Rank 0 holds output_dir's lock meanwhile (the scripts take it before any work; a
        Trainer used from Python takes it here), so a second job there is refused."""
        if self.ep is not None and self.export_fn == self._default_export:
            from ..parallel.expert import check_full_export

            check_full_export(self.model, self.ep)   # every rank, before any step
        lock = None
        if self.main and not outdir.holds(self.args.output_dir):
            lock = outdir.claim(self.args.output_dir)
        try:
            return self._train()
        finally:
            profiling.detach(self)   # (done already unless training raised)
            if lock is not None:
                outdir.release(lock)

    def _train(self):
        a = self.args
        source = self._source()
        total = self.total_steps()
        warmup = a.warmup_steps if a.warmup_steps > 0 else math.ceil(a.warmup_ratio * total)
        if a.resume_from_checkpoint:
            self._log_resume(self._resume(a.resume_from_checkpoint), total, source.steps_per_epoch)
        self._log_start(total)
        self.reporter = reporting.Reporter.for_trainer(self)   # rank 0: report_to, the PNG at the end
        if self.main and a.save_strategy == "steps":   # will the checkpoints it keeps fit?
            ckpt.warn_space(a.output_dir, (total - self.state["global_step"]) // a.save_steps,
                            a.save_total_limit, sum(int(np.prod(p.shape)) for p in self.trainable.values()))
        self.model.train()
        bar = self._progress(total)
        st = self.state
        interval = {"loss": paddle.zeros([], "float32"), "steps": 0, "tokens": 0.0, "targets": 0.0,
                    "t0": time.time(), "norm": None}
        epoch, start = st["epoch"], st["step_in_epoch"]
        self._metric_acc = self._new_metrics()
        source = profiling.attach(self, source, total)   # as is unless a profiling key is on
        while st["global_step"] < total:
            for s, micro in source.iterate(epoch, start):
                lr = lr_at(st["global_step"], total, a.learning_rate, warmup, a.lr_scheduler_type, a.min_lr)
                loss, norm, ntgt, ntok = self.training_step(micro, lr)
                st["global_step"] += 1
                self._weights_at = st["global_step"]
                spe = source.steps_per_epoch
                done = spe is not None and s + 1 == spe
                st["epoch"], st["step_in_epoch"] = (epoch + 1, 0) if done else (epoch, s + 1)
                interval["loss"] = interval["loss"] + loss
                interval["steps"] += 1
                interval["tokens"] += ntok
                interval["targets"] += ntgt
                interval["norm"] = norm
                self._last_norm, self._last_lr = norm, lr
                info = {"step": st["global_step"], "lr": lr, "micro_batches": micro,
                        "epoch": epoch + (s + 1) / spe if spe else epoch}
                for cb in self.callbacks:
                    cb(self, info)
                if bar is not None:
                    bar.update(1)
                self._maybe_log_eval_save(info, interval, done, total)
                if st["global_step"] >= total:
                    break
            epoch, start = st["epoch"], st["step_in_epoch"]
        if bar is not None:
            bar.close()
        profiling.detach(self)
        if self.shard is not None:   # stage 3: the whole model again, for export and the caller
            self.shard.gather(self.trainable)
        self._finish()
        if self.reporter is not None:
            self.reporter.end_of_training()
        return self.state

    def _maybe_log_eval_save(self, info, interval, epoch_done, total):
        a, st = self.args, self.state
        step = st["global_step"]
        last = step >= total
        if step % a.logging_steps == 0 or last or (a.logging_first_step and step == 1):
            self._log_interval(info, interval)
        evaluate = self.eval_dataset is not None and a.do_eval and (
            (a.evaluation_strategy == "steps" and step % (a.eval_steps or a.logging_steps) == 0)
            or (a.evaluation_strategy == "epoch" and epoch_done))
        metrics = self.evaluate() if evaluate else None
        if metrics:
            self._track_best(metrics)
        save = (a.save_strategy == "steps" and step % a.save_steps == 0) or (
            a.save_strategy == "epoch" and epoch_done)
        if save:
            self.save_checkpoint()

    def _log_interval(self, info, interval):
        loss = float(self.topo.all_reduce_sum(interval["loss"].clone())) / max(interval["steps"], 1)
        dt = max(time.time() - interval["t0"], 1e-9)
        norm = float(interval["norm"])
        self._check_finite(loss, norm, info["lr"])
        rec = {"step": self.state["global_step"], "epoch": round(info["epoch"], 4), "loss": loss,
               "lr": info["lr"], "grad_norm": norm,
               "tokens_per_sec": round(interval["tokens"] / dt, 1),
               "target_tokens_per_sec": round(interval["targets"] / dt, 1)}
        rec.update(self._reduce_metrics(self._metric_acc))
        self._metric_acc = self._new_metrics()
        self._record(rec)
        interval.update(loss=paddle.zeros([], "float32"), steps=0, tokens=0.0, targets=0.0,
                        t0=time.time())

    def _record(self, rec):
        self.state["log_history"].append(rec)
        if not self.main:
            return
        logger.info(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()))
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, "train_log.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.reporter is not None:
            self.reporter.write(rec)

    def _progress(self, total):
        return summary.progress(total, self.state["global_step"], self.args.logging_steps,
                                show=self.main and not self.args.disable_tqdm)

    def _log_start(self, total):
        a = self.args
        n_train = sum(int(np.prod(p.shape)) for p in self.trainable.values())
        n_all = sum(int(np.prod(p.shape)) for p in self.model.parameters())
        if self.main:
            logger.info("***** Running training *****")
            if self.train_dataset is not None and hasattr(self.train_dataset, "__len__"):
                logger.info("  examples = %d", len(self.train_dataset))
            logger.info("  micro batch = %d, accumulation = %d, data-parallel ranks = %d, global batch = %d",
                        a.per_device_train_batch_size, a.gradient_accumulation_steps,
                        self.topo.data_degree, self.global_batch())
            logger.info("  layout = %s = %d process(es)", summary.layout_line(self.topo.degrees, self.topo.ep_degree),
                        self.topo.world_size)
            logger.info("  optimizer steps = %d (starting at %d)", total, self.state["global_step"])
            logger.info("trainable params: {:,} / {:,} ({:.2%})".format(n_train, n_all, n_train / max(n_all, 1)))

    # ---------------------------------------------------------------- eval
    def predict(self, prompts, **generation):
        """Answers (strings) of the model for `prompts`: a string, a list of strings or chat
        messages; generation keywords (max_new_tokens, decode_strategy, ...) override the
        GenerateArgument defaults. See trainer/inputs.py."""
        from .inputs import predict

        return predict(self, prompts, **generation)

    def _log_resume(self, path, total, steps_per_epoch):
        """One prominent line: what a (re)run continues from and what is left."""
        if not self.main:
            return
        st, a = self.state, self.args
        step = st["global_step"]
        where = f"step {step} of {total}"
        if steps_per_epoch:
            where += (f", epoch {st['epoch'] + st['step_in_epoch'] / steps_per_epoch:.2f} of "
                      f"{total / steps_per_epoch:.2f}")
        left = (f"{total - step} steps left to train" if step < total else
                "nothing left to train: the model is exported (and evaluated) again")
        logger.warning("RESUMING from %s (%s): %s; set overwrite_output_dir: true to train from the "
                       "start", path, where, left)

    def _logged_eval(self, step):
        """The metrics logged for an evaluation of the weights of `step`, or None."""
        if step is None:
            return None
        for rec in reversed(self.state["log_history"]):
            if rec.get("step") == step and any(k.startswith("eval_") for k in rec):
                return {k[5:]: v for k, v in rec.items() if k.startswith("eval_")}
        return None

    @paddle.no_grad()
    def evaluate(self):
        """Dev-set loss, ppl, token accuracy (argmax at labelled positions), summed over ranks.
        Weights already evaluated (the last step's, or the best checkpoint's after
        load_best_model_at_end) return their logged metrics: each evaluation is logged once."""
        logged = self._logged_eval(self._weights_at)
        if logged is not None:
            return logged
        a, ds = self.args, self.eval_dataset
        was_training = self.model.training
        self.model.eval()
        released = self.shard is not None and self.shard.released
        if released:   # stage 3 between steps: gathered for evaluation, released after
            self.shard.gather(self.trainable)
        bs, world, rank = a.per_device_eval_batch_size, self.topo.data_degree, self.topo.data_rank
        batches = [list(range(i, min(i + bs, len(ds)))) for i in range(0, len(ds), bs)]
        if a.max_evaluate_steps and a.max_evaluate_steps > 0:
            batches = batches[:a.max_evaluate_steps]
        loss_sum = paddle.zeros([], "float32")
        count = paddle.zeros([], "float32")
        correct = paddle.zeros([], "float32")
        extra = self._new_metrics()
        mine = batches[rank::world]
        if self.ep is not None and self.ep.degree > 1 and batches:   # the dispatch is collective:
            for _ in range(-(-len(batches) // world) - len(mine)):    # every rank runs as many
                self._eval_batch(self.collate([ds[i] for i in batches[0]]))   # forwards (unused)
        for idx in mine:
            out = self._eval_batch(self.collate([ds[i] for i in idx]))
            if out is None:   # a pipeline stage before the last
                continue
            loss_sum += out.loss_sum.astype("float32")
            count += out.num_tokens
            if out.label_targets is not None:   # token losses (not preference pairs)
                correct += (out.predictions() == out.label_targets).astype("float32").sum()
            self._add_metrics(out.metrics, extra)
        stats = paddle.stack([loss_sum, count, correct])
        if self.pp is not None:   # the last stage's sums, to every stage
            stats = self.pp.sum_over_stages(stats)
        total = self.topo.all_reduce_sum(stats)
        loss_sum, count, correct = (float(x) for x in total.numpy())
        loss = loss_sum / max(count, 1.0)
        if self.metric_names and not getattr(self.loss_fn, "token_loss", False):
            # a loss of its own: its metrics instead of ppl / token accuracy
            metrics = {"loss": loss, **self._reduce_metrics(extra)}
        else:
            metrics = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "accuracy": correct / max(count, 1.0),
                       **self._reduce_metrics(extra)}   # (a token loss's extra terms: MoE aux_loss)
        if self.eval_fn is not None:
            metrics.update(self.eval_fn(self))
        self._record({"step": self.state["global_step"], **{f"eval_{k}": v for k, v in metrics.items()}})
        if was_training:
            self.model.train()
        if released:
            self.shard.release(self.trainable)
        return metrics

    def _eval_batch(self, batch):
        if self.pp is None:
            return self._forward(batch)
        from ..models.loss import hidden_loss_for

        loss_of = hidden_loss_for(self.model)
        tensors = {k: paddle.to_tensor(v) for k, v in batch.items() if k in LOSS_KEYS}
        return self.pp.eval_batch(tensors, lambda h, b: loss_of(self.model, h, b["labels"]))

    def _track_best(self, metrics):
        name = self.args.metric_for_best_model
        if not name or name not in metrics:
            return
        value, best = metrics[name], self.state["best_metric"]
        better = best is None or (value > best if self.args.greater_is_better else value < best)
        if better:
            self.state["best_metric"], self.state["best_step"] = value, self.state["global_step"]

    # ---------------------------------------------------------------- checkpoints
    def checkpoint_path(self, step):
        return os.path.join(self.args.output_dir, f"checkpoint-{step}")

    def _check_finite(self, loss, norm, lr):
        """Stop on a non-finite loss or gradient norm instead of training on garbage (checked
        when the values are synced anyway: at logging and before a checkpoint is written)."""
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise FloatingPointError(
                f"training diverged at step {self.state['global_step']}: loss={loss}, grad_norm={norm} "
                f"(learning rate {lr:.3g}). Lower learning_rate, add warmup_steps, or set max_grad_norm; "
                "the last checkpoint (if any) is still valid")

    def global_batch(self):
        a = self.args
        return a.per_device_train_batch_size * a.gradient_accumulation_steps * self.topo.data_degree

    def _data_positions(self):
        """Each data-parallel rank's stream position, in data-rank order (tensor / pipeline peers
        of a replica read the same stream: one entry per replica)."""
        t = self.topo
        parts = t.all_gather_json({"data_rank": t.data_rank, "lead": t.tp_rank == 0 and t.pp_rank == 0,
                                   "state": self.train_source.state_dict()})
        return [p["state"] for p in sorted((p for p in parts if p["lead"]), key=lambda p: p["data_rank"])]

    def _pieces(self):
        """This rank's slices of the trainable tensors and their optimizer state, as checkpoint
        pieces (full-model names, global boxes). Under TP a replicated tensor is written by the
        first TP rank only; under PP each stage writes its own tensors (a tied embedding once)."""
        tensors, meta = self.optimizer.state_dict()
        mine = (lambda n: True) if self.shard is None else self.shard.owns   # sharding: owners write
        if self.tp is None:
            own = {n: p for n, p in self.trainable.items()
                   if (self.pp is None or self.pp.counts_once(n)) and mine(n)
                   and (self.ep is None or self.ep.writes(n))}
            opt = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] in own}
            return ckpt.whole(ckpt.arrays(own)), ckpt.whole(opt), meta
        from ..parallel.plan import param_split
        from ..parallel.tensor import box_pieces, is_split, real_shape

        model_pieces, optim_pieces = [], []
        for n, p in self.trainable.items():
            if ((not is_split(p) and self.tp.rank != 0) or (self.pp is not None and not self.pp.counts_once(n))
                    or not mine(n)):
                continue
            arrays = {n: self._local(p).numpy(), f"{n}.exp_avg": tensors[f"{n}.exp_avg"],
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

    def _read_local(self, reader, name, p, kind="model", key=None):
        """This rank's slice of `key` (default `name`) from any layout's checkpoint."""
        key = key or name
        if self.tp is None:
            return reader.read(key, kind)
        from ..parallel.tensor import box_pieces

        out = np.zeros(self._local(p).shape, np.float32)
        for start, shape, idx, _ in box_pieces(self.model, name, p, self.tp):
            out[idx] = reader.read(key, kind, start, shape)
        return out

    def save_checkpoint(self):
        step = self.state["global_step"]
        if self._last_norm is not None:
            self._check_finite(0.0, float(self._last_norm), self._last_lr)
        rngs = self.topo.all_gather_json({"rank": self.topo.rank, "coords": self.topo.coords,
                                          "state": ckpt.rng_state()})
        # streamed data (lazy) cannot be re-derived from the step: keep each rank's position
        data = self._data_positions() if hasattr(self.train_source, "state_dict") else None
        model_pieces, optim_pieces, meta = self._pieces()
        state = dict(self.state, optimizer=meta, rng=rngs, world_size=self.topo.world_size,
                     degrees=dict(self.topo.degrees), global_batch=self.global_batch(),
                     args=ckpt.jsonable_args(self.args))
        if data is not None:
            state["data_state"] = data
        if self.main:
            ckpt.clean_temp_dirs(self.args.output_dir)
        # data-parallel replicas hold the same slices: the first replica writes them (under sharding
        # each of its ranks writes the tensors it owns)
        path = ckpt.save_checkpoint(self.checkpoint_path(step), self.topo, model_pieces, optim_pieces,
                                    state, writer=self._writer(), meta=self.checkpoint_meta)
        if self.main and getattr(self.args, "unified_checkpoint", False):
            self._unified(path)
        if self.main:
            best = self.checkpoint_path(self.state["best_step"]) if self.state["best_step"] else None
            ckpt.rotate_checkpoints(self.args.output_dir, self.args.save_total_limit, keep=best)
            logger.info("checkpoint saved: %s", path)
        self.topo.barrier()

    def _writer(self):
        """Whether this rank writes checkpoint pieces: the first data-parallel replica (expert
        parallel: the first expert group, each rank its experts)."""
        return self.ep.writer if self.ep is not None else self.topo.dp_rank == 0

    def _export_through_checkpoint(self, out_dir):
        """Pipeline stages: no rank holds the whole model, so every rank writes its tensors in the
        checkpoint format into a temp dir beside the output, and rank 0 merges that into one HF
        model / HF-PEFT adapter (trainer/export.py, as llm/merge_tp_and_pp_params.py does)."""
        tmp = os.path.join(out_dir, ".export-pieces")
        model_pieces, _, _ = self._pieces()
        ckpt.save_checkpoint(tmp, self.topo, model_pieces, [], {"global_step": self.state["global_step"]},
                             writer=self.topo.dp_rank == 0, meta=self.checkpoint_meta)
        if self.main:
            from .export import merge_checkpoint

            merge_checkpoint(tmp, output=out_dir)
            shutil.rmtree(tmp, ignore_errors=True)
        self.topo.barrier()

    def _unified(self, path):
        """unified_checkpoint: the checkpoint, read back whole, also written into itself as one HF
        model / HF-PEFT adapter (trainer/export.py, as llm/merge_tp_and_pp_params.py does)."""
        if self.checkpoint_meta is None:
            runtime.warn_once("unified", "unified_checkpoint needs the run's checkpoint_meta (base model, "
                              "model arguments), which this Trainer was not given: skipped")
            return
        from .export import merge_checkpoint

        merge_checkpoint(path)

    def _resume(self, which):
        path = ckpt.resume_path(self.args.output_dir, which)
        reader = ckpt.CheckpointReader(path)
        state = reader.trainer_state()
        self._check_resume_layout(state, path)
        self._load_trainable(reader, path)
        names = [f"{n}.{s}" for n in self.trainable for s in ("exp_avg", "exp_avg_sq")]
        missing = [k for k in names if k not in reader.index["optimizer"]]
        if missing:
            raise ValueError(f"{path}: optimizer state lacks {missing[0]}: checkpoint from a different setup?")
        tensors = {f"{n}.{s}": self._read_local(reader, n, self.trainable[n], "optimizer", f"{n}.{s}")
                   for n in self.optimizer.params for s in ("exp_avg", "exp_avg_sq")}   # owned ones
        self.optimizer.load_state_dict(tensors, state.pop("optimizer"))
        reader.release()
        rngs = state.pop("rng")
        data = state.pop("data_state", None)
        if data is not None and hasattr(self._source(), "load_state_dict"):
            self._source().load_state_dict(data[self.topo.data_rank])
        degrees = state.pop("degrees", {"dp": state.get("world_size", 1), "pp": 1, "sharding": 1, "tp": 1})
        state.pop("world_size", None)
        state.pop("global_batch", None)
        if self.main:
            ckpt.report_changed_args(state.pop("args", None), self.args, path)
        state.pop("args", None)
        if degrees == self.topo.degrees:
            ckpt.restore_rng(rngs, self.topo.rank, path)
        else:
            logger.warning("resuming under another layout (%s, checkpoint: %s): dropout RNG streams "
                           "are not carried over, they continue from the seed",
                           self.topo.describe(), ", ".join(f"{k}={v}" for k, v in degrees.items()))
        self.state.update(state)
        self._weights_at = self.state["global_step"]
        if self.main:   # the log holds what the checkpoint saw: later steps' records are dropped
            self._rewrite_log(self.state["log_history"])
        return path

    def _rewrite_log(self, records):
        """train_log.jsonl := `records` (atomic: written beside, then renamed). After a resume the
        steps after the checkpoint are trained again, so their old records would be duplicates."""
        path = os.path.join(self.args.output_dir, "train_log.jsonl")
        if not os.path.exists(path):
            return
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(rec) + "\n" for rec in records)
        os.replace(tmp, path)

    def _check_resume_layout(self, state, path):
        """Another layout may resume a checkpoint as long as every step sees the same data: the
        global batch must be equal; streamed data needs the same number of data ranks."""
        saved = state.get("global_batch")
        if saved is not None and saved != self.global_batch():
            raise ValueError(
                f"{path} was written with a global batch of {saved} examples per step, this run has "
                f"{self.global_batch()} (per_device_train_batch_size x gradient_accumulation_steps x "
                f"{self.topo.data_degree} data-parallel ranks); resume needs the same global batch")
        data = state.get("data_state")
        if data is not None and len(data) != self.topo.data_degree:
            raise ValueError(f"{path} holds the stream positions of {len(data)} data-parallel ranks "
                             f"(lazy data); this run has {self.topo.data_degree}: resume streamed "
                             "data with the same number of data-parallel ranks")

    def _load_trainable(self, reader, path):
        """Read each trainable tensor's slice from the checkpoint (any layout wrote it)."""
        missing = [n for n in self.trainable if n not in reader.index["model"]]
        if missing:
            raise ValueError(f"{path}: checkpoint lacks trainable tensors {missing[:3]} "
                             "(was it written by a different model or PEFT method?)")
        for n, p in self.trainable.items():
            want = list(p.shape)
            if self.tp is not None:
                from ..parallel.tensor import real_shape
                from ..parallel.plan import param_split

                want = real_shape(self.model, p, param_split(self.model.spec, self.model.config, n, want))
            if reader.global_shape(n) != want:
                raise ValueError(f"{path}: {n} has shape {reader.global_shape(n)}, model has {want}")
            if self._local(p)._is_initialized():   # released under stage 3: its owner loads it
                self._local(p).set_value(check_finite(self._read_local(reader, n, p), n, where=path))

    def _finish(self):
        a, st = self.args, self.state
        if a.load_best_model_at_end and st["best_step"]:
            path = self.checkpoint_path(st["best_step"])
            if os.path.isdir(path):
                reader = ckpt.CheckpointReader(path)
                self._load_trainable(reader, path)
                reader.release()
                self._weights_at = st["best_step"]
                if self.main:
                    logger.info("loaded best model (%s = %.6g) from %s", a.metric_for_best_model,
                                st["best_metric"], path)
                    last = (self._logged_eval(st["global_step"]) or {}).get(a.metric_for_best_model)
                    for line in summary.export_lines(a.metric_for_best_model, st["best_step"], st["best_metric"],
                                                     st["global_step"], last, a.output_dir):
                        logger.info(line)
        if self.pp is not None and self.checkpoint_meta is not None:
            self._export_through_checkpoint(a.output_dir)
        elif self.pp is not None:   # no run description to merge with: the caller's export only
            runtime.warn_once("pp_export", "pipeline parallel without checkpoint_meta: the final model "
                              "is not merged (each stage holds part of it); export_fn runs on rank 0")
            if self.main:
                self.export_fn(a.output_dir)
        elif self.ep is not None and self.ep.degree > 1:   # every expert gathered to rank 0
            from ..parallel.expert import full_experts

            with full_experts(self.model, self.ep, build=self.main):
                if self.main:
                    self.export_fn(a.output_dir)
        elif self.tp is not None and self.export_fn == self._default_export:
            self.export_fn(a.output_dir)                 # every rank: the tensors are gathered
        elif self.tp is not None:                        # PEFT: the adapter's tensors gathered
            from ..parallel.tensor import full_params

            with full_params(self.model, self.tp, list(self.trainable)):
                if self.main:
                    self.export_fn(a.output_dir)
        elif self.main:
            self.export_fn(a.output_dir)
        if self.main:
            logger.info("model saved to %s", os.path.abspath(a.output_dir))
        self.topo.barrier()
