"""AdamW on paddle.optimizer.AdamW with state named like the model, and learning-rate schedules.

paddle's optimizer does the update (fleet's HybridParallelOptimizer, PipelineParallel.train_batch,
paddle.amp.decorate and GradScaler need a paddle.optimizer.Optimizer); this wrapper adds what the
trainer needs around it. As torch.optim.AdamW (paddle's fused adamw_ kernel folds the corrections:
p -= lr sqrt(1-b2^t)/(1-b1^t) m / (sqrt(v) + eps sqrt(1-b2^t)), the same update):
    p <- p * (1 - lr * wd)                                  (decay params only)
    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
- LoRA+ learning-rate scales are per-tensor: param.optimize_attr["learning_rate"] (what paddle's
  parameter groups would set) times the optimizer's lr. One flat parameter list, no groups:
  fleet's stage-1 sharding optimizer (DygraphShardingOptimizer) refuses parameter groups.
- Sharding stage 1 on fleet (parallel/data.py FleetDataParallel): the paddle AdamW is built over
  every trainable tensor, fleet's sharding optimizer partitions them, and keep_state(names) then
  creates the moments of this rank's tensors only (`held`); state_dict / load_state_dict /
  exp_avg cover `held`.
- Sharding stage 1 with split_param (fleet's DygraphShardingOptimizerV2): use_slices gives the
  paddle AdamW V2's flat slice parameters (same paddle names, the same optimize_attr) for this
  rank's range of the fused buffer: moments live on the slices, step() updates them,
  load_state_dict cuts a whole tensor's state to the slice; state_dict returns the slices
  (parallel/layout.py gathers them to whole tensors for a checkpoint).
- The no-decay rule (`no_decay`) goes through apply_decay_param_fun (called with param.name).
- The learning rate of each step comes from the trainer (`lr_at`): set_lr fills paddle's lr
  tensor in place (no host sync).
- Gradients arrive explicitly (after the data-parallel reduction and clipping, a DTensor's
  local slice): each group's (parameter, gradient) pairs go to the same _apply_optimize call
  paddle's step() makes with the .grad it reads.
- Data parallel with tensor / pipeline parallel: `opt` is also wrapped by
  fleet.distributed_optimizer (parallel/data.py FleetDataParallel); the trainer then calls
  fleet's HybridParallelOptimizer.step(), which reduces the gradients over the data-parallel
  group and calls opt.step(), replaced by the trainer's update (which ends in step() here).
- One map from paddle's names (param.name: the key of its moment1_0 / moment2_0 /
  beta1_pow_acc_0 / beta2_pow_acc_0 accumulators) to full-model names keeps the checkpoint format:
  "<name>.exp_avg", "<name>.exp_avg_sq" and the step count; paddle's beta-power accumulators
  are set to b^t from the step count before each step (so a resume needs nothing else).
- multi_precision (AMP O2, trainer/amp.py): paddle's AdamW keeps a float32 master copy of each
  16-bit parameter (created with the accumulators, so the parameters must already be 16-bit:
  decorate runs first) and updates it, then writes the 16-bit parameter from it; checkpoints
  carry the masters as "<name>.master" (a resume must not restart them from the rounded weights).
- offload (sharding's "stage2 / stage3 offload" on a GPU where this repository's sharding runs
  them: TP, experts, AMP O2 under stage 3; parallel/sharding.py): paddle.optimizer.AdamW has no host-memory
  option for its moments, so paddle's optimizer here runs on float32 host copies of the
  parameters (a float16 / bfloat16 parameter's copy is its float32 master): per step the gradient
  goes to the host, the host copy is updated, and the parameter copied back. Written for GPUs,
  where it is untested; a CPU build has one memory, and the trainer does not turn it on there.
"""
import math

import numpy as np
import paddle


def no_decay(name, param):
    """Norm weights, biases and other 1-D tensors get no weight decay."""
    return len(param.shape) < 2 or name.endswith(".bias") or "norm" in name


class AdamW:
    """named_params: (full name, tensor to update: a parameter or a DTensor's local shard);
    lr_scales: {name: learning-rate multiplier}. Attributes the trainer reads: params,
    held (the names whose state is on this rank), exp_avg / exp_avg_sq ({name: moment tensor} of
    `held`), t (steps taken). defer_state: no moments until keep_state (fleet's sharding)."""

    def __init__(self, named_params, lr_scales=None, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, offload=False, multi_precision=False, defer_state=False):
        self.params = dict(named_params)
        self.b1, self.b2 = betas
        self.offload = offload
        self.lr_scales = lr_scales or {}
        # the tensors paddle's optimizer updates: the parameters, or their host copies (offload)
        self.targets = {n: self._host_copy(n, p) if offload else p for n, p in self.params.items()}
        self.master = {n: self.targets[n] for n, p in self.params.items()
                       if offload and p.dtype != paddle.float32}
        self.full_name = {t.name: n for n, t in self.targets.items()}   # paddle name -> model name
        if len(self.full_name) != len(self.targets):
            raise ValueError("two optimizer tensors share a paddle name: their state would mix")
        self.decay = {}   # paddle name -> whether weight decay applies
        for n, t in self.targets.items():
            self._adopt(n, t)
        self.opt = paddle.optimizer.AdamW(
            learning_rate=0.0, beta1=self.b1, beta2=self.b2, epsilon=eps, weight_decay=weight_decay,
            parameters=list(self.targets.values()), apply_decay_param_fun=lambda pname: self.decay[pname],
            multi_precision=bool(multi_precision) and not offload)   # (offload keeps its own masters)
        self.held = []
        self.slices = {}          # split_param: {name: (lo, hi)} of the flat tensor this rank updates
        self.update_targets = {}  # split_param: {name: V2's slice parameter}
        if not defer_state:
            self.keep_state(list(self.params))
        self.t = 0
        self._synced = not offload   # offload: host copies refreshed at the first step (resume)

    def _adopt(self, n, t):
        """t becomes the tensor paddle's optimizer updates for `n`: a plain tensor (a DTensor's
        local shard, a host copy, a stage-3 slice) made to look like a trainable parameter
        (paddle's optimizer skips stop_gradient ones; the lr scale in optimize_attr)."""
        self.decay[t.name] = not no_decay(n, self.params[n])
        t.stop_gradient = False
        if not hasattr(t, "trainable"):   # read by fleet's gradient reduction (data.py)
            t.trainable = True
        if getattr(t, "optimize_attr", None) is None:
            t.optimize_attr = {}
        t.optimize_attr["learning_rate"] = float(self.lr_scales.get(n, 1.0))

    def retarget(self, tensors):
        """{name: tensor}: the tensors paddle's optimizer updates for those names from now on
        (sharding stage 3 on paddle: this rank's flat slices, a new tensor object each step under
        the same paddle name, so the moments keyed by that name carry over)."""
        for n, t in tensors.items():
            old = self.targets[n]
            if old is t:
                continue
            self.full_name.pop(old.name, None)
            self.targets[n] = t
            self.full_name[t.name] = n
            self._adopt(n, t)

    def keep_state(self, names):
        """The tensors whose moments live on this rank (all, or a sharding rank's own): created
        now (checkpoint load, state accounting)."""
        self.held = [n for n in self.params if n in set(names)]
        block = paddle.static.default_main_program().global_block()
        self.opt._create_accumulators(block, [self.targets[n] for n in self.held])

    def use_slices(self, slices):
        """fleet's DygraphShardingOptimizerV2: slices = {name: (slice parameter, lo, hi)}, this
        rank's part [lo, hi) of each flattened (padded) tensor; its moments are created now."""
        self.slices = {n: (lo, hi) for n, (_, lo, hi) in slices.items()}
        self.update_targets = {n: t for n, (t, _, _) in slices.items()}
        self.held = [n for n in self.params if n in slices]
        block = paddle.static.default_main_program().global_block()
        self.opt._create_accumulators(block, [self.update_targets[n] for n in self.held])

    def _fit(self, n, array):
        """A whole tensor's state as this rank holds it: the flat slice [lo, hi) under split_param
        (zeros past the tensor's end: V2's padding), else as is."""
        array = np.asarray(array, np.float32)
        if n not in self.slices:
            return array
        lo, hi = self.slices[n]
        flat, out = array.reshape(-1), np.zeros(hi - lo, np.float32)
        k = max(0, min(hi, flat.size) - lo)
        out[:k] = flat[lo:lo + k]
        return out

    def _host_copy(self, n, p):
        t = p.cpu().astype("float32")
        t.name = f"offload.{n}"
        return t

    def _key(self, t):
        """The accumulators' key of tensor t: its name, or its float32 master's (paddle keys a
        16-bit parameter's moments and beta powers by the master under multi_precision)."""
        master = self.opt._master_weights.get(t.name) if self.opt._multi_precision else None
        return master.name if master is not None else t.name

    def _acc(self, kind, n):
        return self.opt._accumulators[kind][self._key(self.targets[n])]

    @property
    def exp_avg(self):
        return {n: self._acc(self.opt._moment1_acc_str, n) for n in self.held}

    @property
    def exp_avg_sq(self):
        return {n: self._acc(self.opt._moment2_acc_str, n) for n in self.held}

    @paddle.no_grad()
    def step(self, grads, lr):
        """grads: {name: tensor}; parameters without a gradient are left untouched."""
        self.t += 1
        if not self._synced:   # the parameters as they are now (a resume loaded them)
            for n, p in self.params.items():
                self.targets[n].set_value(p.cpu().astype("float32"))
            self._synced = True
        self.opt.set_lr(float(lr))
        # b^t from python (as the old AdamW and torch): the kernel's running float32 product
        # drifts by an ulp, which 1 - b2^t (~1e-3) turns into ~1e-5 relative on the update
        pows = ((self.opt._beta1_pow_acc_str, self.b1 ** self.t), (self.opt._beta2_pow_acc_str, self.b2 ** self.t))
        pairs = []
        for n in self.held:
            g = grads.get(n)
            if g is not None:
                t = self.update_targets.get(n, self.targets[n])
                pairs.append((t, g.cpu().astype("float32") if self.offload else g))
                for kind, value in pows:
                    self.opt._accumulators[kind][self._key(t)].fill_(value)
        if pairs:
            self.opt._apply_optimize(None, None, pairs)
        if self.offload:
            for n, p in self.params.items():
                if n in grads:
                    p.set_value(self.targets[n].astype(p.dtype))

    def masters(self):
        """{name: float32 master tensor} of the 16-bit parameters under multi_precision."""
        found = getattr(self.opt, "_master_weights", {}) or {}
        return {n: found[self.targets[n].name] for n in self.held if self.targets[n].name in found}

    def state_dict(self):
        """{name.exp_avg / name.exp_avg_sq (/ name.master): np.ndarray}, plus the step count."""
        tensors = {}
        for n in self.held:
            tensors[f"{n}.exp_avg"] = self._acc(self.opt._moment1_acc_str, n).numpy()
            tensors[f"{n}.exp_avg_sq"] = self._acc(self.opt._moment2_acc_str, n).numpy()
        for n, m in self.masters().items():
            tensors[f"{n}.master"] = m.numpy()
        return tensors, {"step": self.t}

    def load_state_dict(self, tensors, meta):
        self.t = int(meta["step"])
        for n in self.held:
            for key, kind in ((f"{n}.exp_avg", self.opt._moment1_acc_str),
                              (f"{n}.exp_avg_sq", self.opt._moment2_acc_str)):
                if key not in tensors:
                    raise ValueError(f"optimizer state lacks {key}: checkpoint from a different setup?")
                self._acc(kind, n).set_value(self._fit(n, tensors[key]))
        for n, m in self.masters().items():   # (a checkpoint of a float32 run: masters as created)
            if f"{n}.master" in tensors:
                m.set_value(self._fit(n, tensors[f"{n}.master"]))


def lr_at(step, total, base_lr, warmup=0, kind="linear", min_lr=0.0):
    """Learning rate for optimizer step `step` (0-based) of `total`: linear warmup from 0 over
    `warmup` steps, then linear / cosine decay to min_lr, or constant."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    if kind in ("constant", "constant_with_warmup"):
        return base_lr
    progress = (step - warmup) / max(1, total - warmup)
    progress = min(max(progress, 0.0), 1.0)
    if kind == "cosine":
        return min_lr + (base_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    return min_lr + (base_lr - min_lr) * (1 - progress)

