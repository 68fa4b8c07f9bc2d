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
import time

import numpy as np
import paddle

from .. import outdir, parallel, runtime, stopping
from ..data.collate import BatchPlan, pad_batch
from ..models.loss import causal_lm_loss, lm_loss_for, moe_causal_lm_loss, target_index
from ..parallel.layout import Parallel
from . import checkpoint as ckpt
from . import export, profiling, reporting, resume, summary
from .amp import Precision
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

    DEVICE_CLIP = None   # clipping without a host read (_clip): None = on a GPU only

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
        # the layout (parallel/layout.py): tensor / pipeline / expert / sharding / data parallel
        self.par, self.trainable = Parallel.for_trainer(model, self.topo, args, self.trainable,
                                                        own_loss=loss_fn is not None)
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
        # AMP (trainer/amp.py): O2 casts the weights before the optimizer is built, so paddle's
        # AdamW gives every 16-bit parameter a float32 master (multi_precision)
        self.precision = Precision(args, self.topo)
        self.precision.decorate(model)
        self.optimizer = AdamW(self.par.optimizer_params(self.trainable), lr_scales,
                               (args.adam_beta1, args.adam_beta2), args.adam_epsilon, args.weight_decay,
                               offload=self.par.offload,
                               **({"multi_precision": True} if self.precision.o2 else {}),
                               **({"defer_state": True} if self.par.defers_state else {}))
        # sharding stage 3: non-owned values dropped; hybrid data parallel: fleet's optimizer
        self.par.after_setup(self.trainable, self.optimizer)
        self.state = {"global_step": 0, "epoch": 0, "step_in_epoch": 0, "log_history": [],
                      "best_metric": None, "best_step": None}
        self.main = self.topo.is_main
        runtime.reuse_freed_memory()   # training speed: no page faults for every new tensor
        self._last_norm, self._last_lr = None, 0.0
        self.skipped = False        # the last step's update was skipped (fp16 overflow)
        self._weights_at = None     # the step whose weights the model holds (None: not trained here)
        self.generation = generation   # GenerationConfig of predict() (default: greedy, 64 tokens)
        self.reporter = None   # report_to's event files and the PNG (trainer/reporting.py), from train()
        self.model.recompute = bool(args.recompute)
        self.model.recompute_granularity = args.recompute_granularity

    # ---------------------------------------------------------------- setup
    def _local(self, t):
        """A DTensor's local shard (tensor parallel), else the tensor itself."""
        return self.par.local(t)

    def _default_export(self, out_dir):
        self.par.save_whole(out_dir, self.tokenizer, self.main)

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
        if self.loss_fn in (causal_lm_loss, moe_causal_lm_loss) and "labels" in batch:
            # the labelled positions from the host's labels (a device nonzero would be a sync)
            inputs["target_index"] = paddle.to_tensor(target_index(batch["labels"]))
        with self.precision.autocast():   # (sharding stage 2: through paddle's wrapper)
            return self.loss_fn(self.par.forward_model, inputs)

    def training_step(self, micro_batches, lr):
        """Forward/backward of this rank's micro-batches, DP gradient sum, clip, AdamW.
        Returns (loss: the global batch's mean token loss, a tensor; grad norm, a tensor; target
        tokens and real tokens of the global batch, floats); self.skipped: whether fp16 loss
        scaling skipped the update (gradients overflowed). Host syncs per step (counted by
        tests/test_host_sync.py): none on one process; the token counts summed over ranks before
        the first backward (data parallel: every micro-batch divides by the global count); fp16's
        found-inf (trainer/amp.py). On a GPU clipping scales on the device (_clip)."""
        tgt_local = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches)
        n_local = sum(int(np.sum(b["loss_count"])) for b in micro_batches) if all(
            "loss_count" in b for b in micro_batches) else tgt_local
        real_local = sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].size
                         for b in micro_batches)
        k = len(micro_batches)
        n_global, real_global, tgt_global, k_sum, k_sq = self.topo.all_reduce_scalars(
            [n_local, real_local, tgt_local, k, k * k])
        self.par.check_micro_batches(k, k_sum, k_sq)   # expert parallel: equal counts
        self.par.begin_step(self.trainable)
        loss_acc = self._backward(micro_batches, n_global)
        named = list(self.trainable.items())
        # the update runs after the data-parallel reduction (inside fleet's optimizer step under
        # TP / PP x DP: parallel/layout.py Parallel.step)
        norm = self.par.step(self.optimizer, named, lambda grads: self._update(named, grads, lr))
        self.par.clear_grads(self.trainable)
        if not self.skipped:
            self.par.after_step(self.trainable)   # sharding: owners' new values to the group
        return loss_acc / max(n_global, 1.0), norm, tgt_global, real_global

    def _update(self, named, grads, lr):
        """Sums over TP / PP replicas, fp16 unscale, global norm, clipping and AdamW on this
        rank's (data-parallel reduced) gradients; returns the norm."""
        grads = self.par.reduce_grads(self.trainable, named, grads)
        self.skipped = self.precision.unscale(grads)   # fp16: unscaled in place; overflowed?
        norm = self.par.grad_norm(named, grads)
        if not self.skipped:
            self._clip(grads, norm)
            self.par.before_update(self.trainable, grads, self.optimizer)
            self.optimizer.step({n: g for (n, _), g in zip(named, grads) if g is not None}, lr)
        return norm

    def _clip(self, grads, norm):
        """Global-norm clipping, g *= min(1, max_grad_norm / (norm + 1e-6)). On a GPU (or with
        DEVICE_CLIP true) the factor stays a device tensor and every gradient is multiplied
        (exactly by 1.0 when the norm is within the bound): reading the norm would make the host
        wait for the device every step. On CPU ops run synchronously, so reading the norm costs
        nothing there and spares a pass over every gradient when no clipping is needed."""
        max_norm = self.args.max_grad_norm
        if not (max_norm and max_norm > 0):
            return
        on_device = self.DEVICE_CLIP if self.DEVICE_CLIP is not None else runtime.device() == "gpu"
        if not on_device:
            factor = max_norm / (float(norm) + 1e-6)
            if factor < 1.0:
                with paddle.no_grad():
                    for g in grads:
                        if g is not None:
                            g.scale_(factor)
            return
        factor = paddle.minimum(max_norm / (norm.astype("float32") + 1e-6), paddle.ones([], "float32"))
        with paddle.no_grad():
            for g in grads:
                if g is not None:
                    g.multiply_(factor if g.dtype == paddle.float32 else factor.astype(g.dtype))

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
        returns the summed loss_sum (through the pipeline stages' 1F1B schedule under PP:
        Parallel.backward)."""
        def each(batches):
            loss_acc = paddle.zeros([], "float32")
            for b in batches:
                out = self._forward(b)
                loss_sum = out.loss_sum
                self._add_metrics(out.metrics)
                # the output is dropped before backward: its label logits ([n, vocab], not needed
                # by the backward pass) would otherwise stay alive through it
                del out
                self.par.backward_loss(self.precision.scale(loss_sum / max(n_global, 1.0)))
                loss_acc = loss_acc + loss_sum.detach().astype("float32")
            return loss_acc

        return self.par.backward(micro_batches, n_global, LOSS_KEYS, each)

    # ---------------------------------------------------------------- loop
    def train(self):
        """Train to max_steps / num_train_epochs (resuming first when resume_from_checkpoint is
        set). Rank 0 holds output_dir's lock meanwhile (the scripts take it before any work; a
        Trainer used from Python takes it here), so a second job there is refused."""
        self.par.check_export(self.export_fn == self._default_export)
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
            resume.log_resume(self, resume.resume(self, a.resume_from_checkpoint), total, source.steps_per_epoch)
        elif self.main and self.state["global_step"] == 0:   # a fresh start: drop the records of a
            resume.rewrite_log(a.output_dir, [])               # run killed before its first checkpoint
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
        stopping.progress(st["global_step"], a.output_dir)
        while st["global_step"] < total:
            for s, micro in source.iterate(epoch, start):
                # the schedule advances on updates only: a skipped (fp16 overflow) step does not
                # move it, as PaddleNLP's trainer steps its lr_scheduler only if optimizer_was_run
                ran = st["global_step"] - st.get("skipped_steps", 0)
                lr = lr_at(ran, total, a.learning_rate, warmup, a.lr_scheduler_type, a.min_lr)
                loss, norm, ntgt, ntok = self.training_step(micro, lr)
                st["global_step"] += 1
                if self.precision.scaler is not None:
                    self._after_scaled_step(interval)
                stopping.progress(st["global_step"], a.output_dir)   # for the stop line (SIGINT / SIGTERM)
                self._weights_at = st["global_step"]
                spe = source.steps_per_epoch
                done = spe is not None and s + 1 == spe
                st["epoch"], st["step_in_epoch"] = (epoch + 1, 0) if done else (epoch, s + 1)
                if not self.skipped:   # a skipped step's loss / norm may be inf: not a divergence
                    interval["loss"] = interval["loss"] + loss
                    interval["steps"] += 1
                    interval["norm"] = norm
                    self._last_norm, self._last_lr = norm, lr
                interval["tokens"] += ntok
                interval["targets"] += ntgt
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
        self.par.after_training(self.trainable)   # sharding stage 3: the whole model again
        self._finish()
        if self.reporter is not None:
            self.reporter.end_of_training()
        return self.state

    def _after_scaled_step(self, interval):
        """fp16: the scale updated; a skipped step counted (state["skipped_steps"], the interval's
        "skipped") and logged; the run stopped after amp_skip_limit skips in a row (amp.py)."""
        st = self.state
        self.precision.after_step(self.skipped, st["global_step"])
        if self.skipped:
            st["skipped_steps"] = st.get("skipped_steps", 0) + 1
            interval["skipped"] = interval.get("skipped", 0) + 1

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
        rec = {"step": self.state["global_step"], "epoch": round(info["epoch"], 4)}
        if interval["norm"] is not None:   # (None: every step of the interval was skipped)
            norm = float(interval["norm"])
            self._check_finite(loss, norm, info["lr"])
            rec.update(loss=loss, lr=info["lr"], grad_norm=norm)
        if self.precision.scaler is not None:
            rec.update(loss_scale=self.precision.scale_value(),
                       skipped_steps=interval.get("skipped", 0))
        rec.update(tokens_per_sec=round(interval["tokens"] / dt, 1),
                   target_tokens_per_sec=round(interval["targets"] / dt, 1))
        rec.update(self._reduce_metrics(self._metric_acc))
        self._metric_acc = self._new_metrics()
        self._record(rec)
        interval.update(loss=paddle.zeros([], "float32"), steps=0, tokens=0.0, targets=0.0,
                        t0=time.time(), norm=None, skipped=0)

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
        was_training = self.model.training
        self.model.eval()
        with self.par.whole_for_eval(self.trainable):   # sharding stage 3: gathered meanwhile
            metrics = self._evaluate()
        if was_training:
            self.model.train()
        return metrics

    def _evaluate(self):
        a, ds = self.args, self.eval_dataset
        bs, world, rank = a.per_device_eval_batch_size, self.topo.data_degree, self.topo.data_rank
        batches = [list(range(i, min(i + bs, len(ds)))) for i in range(0, len(ds), bs)]
        if a.max_evaluate_steps and a.max_evaluate_steps > 0:
            batches = batches[:a.max_evaluate_steps]
        loss_sum = paddle.zeros([], "float32")
        count = paddle.zeros([], "float32")
        correct = paddle.zeros([], "float32")
        extra = self._new_metrics()
        mine = batches[rank::world]
        for _ in range(self.par.eval_padding_batches(len(batches), len(mine))):   # expert parallel:
            self._eval_batch(self.collate([ds[i] for i in batches[0]]))   # as many forwards (unused)
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
        stats = self.par.sum_over_stages(stats)   # pipeline: the last stage's sums, to every stage
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
        return metrics

    def _eval_batch(self, batch):
        return self.par.eval_batch(batch, LOSS_KEYS, self._forward)

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

    def save_checkpoint(self):
        step = self.state["global_step"]
        if self._last_norm is not None:
            self._check_finite(0.0, float(self._last_norm), self._last_lr)
        rngs = self.topo.all_gather_json({"rank": self.topo.rank, "coords": self.topo.coords,
                                          "state": ckpt.rng_state()})
        # streamed data (lazy) cannot be re-derived from the step: keep each rank's position
        data = self._data_positions() if hasattr(self.train_source, "state_dict") else None
        model_pieces, optim_pieces, meta = self.par.pieces(self.trainable, self.optimizer, ckpt)
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
                                    state, writer=self.par.writer(), meta=self.checkpoint_meta)
        if self.main and getattr(self.args, "unified_checkpoint", False):
            export.unified_checkpoint(self, path)
        if self.main:
            best = self.checkpoint_path(self.state["best_step"]) if self.state["best_step"] else None
            ckpt.rotate_checkpoints(self.args.output_dir, self.args.save_total_limit, keep=best)
            logger.info("checkpoint saved: %s", path)
        self.topo.barrier()

    def _finish(self):
        a, st = self.args, self.state
        if a.load_best_model_at_end and st["best_step"]:
            path = self.checkpoint_path(st["best_step"])
            if os.path.isdir(path):
                reader = ckpt.CheckpointReader(path)
                resume.load_trainable(self, reader, path)
                reader.release()
                self._weights_at = st["best_step"]
                if self.main:
                    logger.info("loaded best model (%s = %.6g) from %s", a.metric_for_best_model,
                                st["best_metric"], path)
                    last = (self._logged_eval(st["global_step"]) or {}).get(a.metric_for_best_model)
                    for line in summary.export_lines(a.metric_for_best_model, st["best_step"], st["best_metric"],
                                                     st["global_step"], last, a.output_dir):
                        logger.info(line)
        through = ((lambda d: export.through_checkpoint(self, d)) if self.checkpoint_meta is not None
                   else None)   # pipeline stages hold parts: merged from checkpoint pieces
        self.par.export(a.output_dir, self.export_fn, self.export_fn == self._default_export,
                        self.trainable, self.main, through)
        if self.main:
            logger.info("model saved to %s", os.path.abspath(a.output_dir))
        self.topo.barrier()
