"""Preference losses as Trainer loss functions: response log-probabilities, DPO's losses, KTO.

Per sequence u (data.py's unit_ids): logp_u = sum of log p(token | tokens before) over its
labelled tokens, n_u their count. Only the labelled positions' final-norm hidden states go
through the LM head; under tensor parallelism each rank's vocabulary shard gives the per-token
log-probabilities (parallel/vocab.sharded_token_logprobs: no [n, V] logits gathered).

DPO, pair k: policy (c, r) and reference (c0, r0) log-probabilities of chosen and rejected (0
with reference_free), beta b, label_smoothing e:
    x = (c - r) - (c0 - r0)       per-token means instead of sums for ipo, or, simpo
    sigmoid    -(1 - e) log s(b x) - e log s(-b x)                    s = sigmoid (cDPO)
    hinge      max(0, 1 - b x)                     ipo     (x - 1 / (2 b))^2
    simpo      sigmoid's form on x - gamma / b     dpop    -log s(b (x - lambda max(0, c0 - c)))
    sppo_hard  (c - c0 - 1 / (2 b))^2 + (r - r0 + 1 / (2 b))^2
    nca_pair   -log s(b (c - c0)) - log s(-b (c - c0)) / 2 - log s(-b (r - r0)) / 2
    kto_pair   (1 - s(b (c - c0 - R)) + 1 - s(b (C - (r - r0)))) / 2, C = max(0, mean(c - c0)),
               R = max(0, mean(r - r0)) over the micro-batch (PaddleNLP's form)
    or         -log s((c - r) - (log(1 - exp c) - log(1 - exp r)))    (ORPO's odds ratio)
  loss = pref_loss_ratio x mean_k loss_k + sft_loss_ratio x (mean NLL of the chosen tokens)
  rewards: b (c - c0) and b (r - r0) from summed log-probabilities (TRL's definition), logged
  as rewards/chosen, rewards/rejected, rewards/margins (their difference), rewards/accuracies
  (the share of pairs whose chosen reward is higher), and logps/chosen, logps/rejected.
KTO, example k with completion (y, y0), label d (1 desirable), KL completion (z, z0):
    kl = max(0, mean(z - z0)) over the micro-batch (averaged over data-parallel ranks in
         training), no gradient
    loss_k = w_d (1 - s(b (y - y0 - kl)))   if desirable
             w_u (1 - s(b (kl - (y - y0)))) otherwise;        loss = mean_k loss_k
The reference: a frozen copy of the initial model (full fine-tuning), the policy itself with
its LoRA adapters off (no second copy), or none (reference_free). Numbers as TRL's DPOTrainer /
KTOTrainer compute them (tests/test_dpo.py).
"""
import paddle
import paddle.nn.functional as F

from ..models.loss import LossOutput, linear_head
from ..peft.lora import adapters_disabled
from .args import AVERAGED

MODEL_INPUTS = ("input_ids", "position_ids", "segment_ids")


def token_logprobs(model, h, targets):
    """log p(target) [n] of hidden rows h [n, H] (float32), on the local vocabulary shard under
    tensor parallelism."""
    tp = getattr(model, "tensor_parallel", None)
    if tp is None:
        z = model.logits(h).astype("float32")
        return paddle.take_along_axis(F.log_softmax(z, axis=-1), targets.unsqueeze(-1), axis=-1).squeeze(-1)
    from ..parallel.tensor import copy_to_tp
    from ..parallel.vocab import _local_logits, _local_view, sharded_token_logprobs

    head = linear_head(model)
    if head is None:
        raise ValueError("tensor parallelism needs a plain linear LM head (no LoRA / bias on it)")
    w, transposed = head
    z = _local_logits(copy_to_tp(h, tp), _local_view(w), transposed, tp, model.config.vocab_size)
    return sharded_token_logprobs(z, targets, tp)


def sequence_logps(model, batch, units):
    """(log-probability sums [units], token counts [units]) of the batch's sequences."""
    hidden = model(**{k: batch[k] for k in MODEL_INPUTS if k in batch}, return_hidden=True).hidden_states
    H = hidden.shape[-1]
    u = batch["unit_ids"][:, 1:].reshape([-1])   # position t predicts label t + 1
    idx = paddle.nonzero(u >= 0).reshape([-1])
    h = paddle.gather(hidden[:, :-1].reshape([-1, H]), idx)
    lp = token_logprobs(model, h, paddle.gather(batch["labels"][:, 1:].reshape([-1]), idx))
    onehot = F.one_hot(paddle.gather(u, idx), units).astype("float32")   # [n, units]
    return paddle.matmul(lp.unsqueeze(0), onehot).squeeze(0), onehot.sum(0)


class FrozenReference:
    """A frozen second model (full fine-tuning: PaddleNLP's and TRL's ref_model)."""

    def __init__(self, model):
        model.eval()
        self.model = model
        for p in model.parameters():
            p.stop_gradient = True

    def __call__(self, policy, batch, units):
        with paddle.no_grad():
            return sequence_logps(self.model, batch, units)[0]


class AdapterOffReference:
    """The policy with its LoRA adapters off: the base model, no second copy of the weights."""

    def __call__(self, policy, batch, units):
        was = policy.training
        policy.eval()
        try:
            with paddle.no_grad(), adapters_disabled(policy):
                return sequence_logps(policy, batch, units)[0]
        finally:
            if was:
                policy.train()


def dpo_losses(cfg, c, r, c0, r0, nc, nr):
    """Per-pair loss [P] of loss_type cfg.loss_type (module docstring); n* are token counts."""
    b, kind, e = cfg.beta, cfg.loss_type, cfg.label_smoothing
    ls = F.log_sigmoid
    if kind in AVERAGED:
        c, r, c0, r0 = c / nc, r / nr, c0 / nc, r0 / nr
    x = (c - r) - (c0 - r0)
    if kind == "sigmoid":
        return -(1 - e) * ls(b * x) - e * ls(-b * x)
    if kind == "hinge":
        return F.relu(1 - b * x)
    if kind == "ipo":
        return (x - 1 / (2 * b)) ** 2
    if kind == "simpo":
        x = x - cfg.simpo_gamma / b
        return -(1 - e) * ls(b * x) - e * ls(-b * x)
    if kind == "dpop":
        return -ls(b * (x - cfg.dpop_lambda * paddle.clip(c0 - c, min=0)))
    if kind == "sppo_hard":
        return (c - c0 - 0.5 / b) ** 2 + (r - r0 + 0.5 / b) ** 2
    if kind == "nca_pair":
        cr, rr = b * (c - c0), b * (r - r0)
        return -ls(cr) - 0.5 * ls(-cr) - 0.5 * ls(-rr)
    if kind == "kto_pair":
        ckl, rkl = paddle.clip((c - c0).mean(), min=0), paddle.clip((r - r0).mean(), min=0)
        return 0.5 * ((1 - F.sigmoid(b * (c - c0 - rkl))) + (1 - F.sigmoid(b * (ckl - (r - r0)))))
    if kind == "or":
        return -ls((c - r) - (log1mexp(c) - log1mexp(r)))
    raise ValueError(f"unknown loss_type {kind!r} (args.py lists the choices)")


def log1mexp(x):
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2."""
    near = x > -0.6931471805599453
    return paddle.where(near, paddle.log(-paddle.expm1(paddle.where(near, x, -paddle.ones_like(x)))),
                        paddle.log1p(-paddle.exp(paddle.where(near, -paddle.ones_like(x), x))))


def _mean_parts(values, weights=None):
    """(sum, count) of a metric; `weights` selects rows (KTO's labels)."""
    if weights is None:
        return values.sum(), float(values.shape[0])
    return (values * weights).sum(), weights.sum()


class DPOLoss:
    """loss_fn(model, batch) -> LossOutput of a DPO loss (module docstring); loss_sum sums over
    the micro-batch's pairs, num_tokens is their number."""
    batch_keys = ("unit_ids", "loss_count")
    metric_names = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                    "logps/chosen", "logps/rejected")

    def __init__(self, config, reference=None):
        self.cfg, self.reference = config, reference

    def __call__(self, model, batch):
        cfg, P = self.cfg, int(batch["loss_count"])
        lp, n = sequence_logps(model, batch, 2 * P)
        ref = self.reference(model, batch, 2 * P) if self.reference is not None else paddle.zeros_like(lp)
        c, r, c0, r0 = lp[:P], lp[P:], ref[:P], ref[P:]
        nc, nr = paddle.clip(n[:P], min=1.0), paddle.clip(n[P:], min=1.0)
        loss_sum = cfg.pref_loss_ratio * dpo_losses(cfg, c, r, c0, r0, nc, nr).sum()
        if cfg.sft_loss_ratio:   # per micro-batch token mean, weighted by its pairs
            loss_sum = loss_sum + cfg.sft_loss_ratio * P * (-c.sum() / nc.sum())
        cr, rr = cfg.beta * (c - c0).detach(), cfg.beta * (r - r0).detach()
        metrics = {"rewards/chosen": _mean_parts(cr), "rewards/rejected": _mean_parts(rr),
                   "rewards/margins": _mean_parts(cr - rr),
                   "rewards/accuracies": _mean_parts((cr > rr).astype("float32")),
                   "logps/chosen": _mean_parts(c.detach()), "logps/rejected": _mean_parts(r.detach())}
        return LossOutput(loss_sum, paddle.to_tensor(float(P)), metrics=metrics)


class KTOLoss:
    """loss_fn(model, batch) -> LossOutput of KTO (module docstring). `topology`: the KL estimate
    is averaged over its data-parallel ranks in training (every rank runs the same number of
    micro-batches then; in evaluation each rank's own estimate is used)."""
    batch_keys = ("unit_ids", "loss_count", "kto_labels")
    metric_names = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl")

    def __init__(self, config, reference, topology=None):
        self.cfg, self.reference, self.topo = config, reference, topology

    def __call__(self, model, batch):
        cfg, E = self.cfg, int(batch["loss_count"])
        lp, _ = sequence_logps(model, batch, 2 * E)
        ref = self.reference(model, batch, 2 * E)
        y, z, y0, z0 = lp[:E], lp[E:], ref[:E], ref[E:]
        kl = (z - z0).mean().detach().reshape([1])
        if model.training and self.topo is not None and self.topo.data_degree > 1:
            kl = self.topo.all_reduce_sum(kl) / self.topo.data_degree
        kl = paddle.clip(kl, min=0).reshape([])
        d = batch["kto_labels"].astype("float32")
        ratio = y - y0
        losses = (d * cfg.desirable_weight * (1 - F.sigmoid(cfg.beta * (ratio - kl)))
                  + (1 - d) * cfg.undesirable_weight * (1 - F.sigmoid(cfg.beta * (kl - ratio))))
        rewards = cfg.beta * ratio.detach()
        metrics = {"rewards/chosen": _mean_parts(rewards, d), "rewards/rejected": _mean_parts(rewards, 1 - d),
                   "logps/chosen": _mean_parts(y.detach(), d), "logps/rejected": _mean_parts(y.detach(), 1 - d),
                   "kl": (kl, 1.0)}
        return LossOutput(losses.sum(), paddle.to_tensor(float(E)), metrics=metrics)
