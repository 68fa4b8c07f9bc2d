"""The causal-LM training loss, outside the model: shifted cross-entropy at labelled positions.

    out = causal_lm_loss(model, batch)          # batch: input_ids, labels [B, S], ... (tensors)
    out.loss_sum / out.num_tokens               # summed token CE over the targets / their count

The model returns final-norm hidden states h [B, S, H]; position t predicts labels[t+1]
(-100 = no loss). Only the n labelled rows of h are projected to the vocabulary:
    labels [-100, -100, 7, 9] -> rows 1, 2 of h; targets [7, 9].
Training with a plain linear head (nn.Linear without bias, or a tied embedding) runs the head and
the loss chunk by chunk (linear_ce.LinearCrossEntropy: no [n, V] logits kept); otherwise (eval,
`keep_logits`, a wrapped head such as LoRA on lm_head) the label logits [n, V] are formed and
returned for metrics (accuracy) and R-Drop's KL term.

A parallel layout swaps this function for its own (the Trainer's `loss_fn`): nothing here or in
a model file assumes where the vocabulary lives, and a sharded head weight is refused rather than
treated as the whole vocabulary.
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from .layers import wide
from .linear_ce import LinearCrossEntropy
from .owned import as_forward

MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "segment_ids")


@dataclass
class LossOutput:
    loss_sum: paddle.Tensor                      # summed token cross-entropy (float32 scalar)
    num_tokens: paddle.Tensor                    # n, the number of target tokens (float32)
    label_logits: Optional[paddle.Tensor] = None   # [n, V] float32, when formed
    label_targets: Optional[paddle.Tensor] = None  # [n] int64
    # [n] predicted ids when the logits are vocabulary shards (tensor parallel); else from logits
    label_argmax: Optional[paddle.Tensor] = None
    # the tensor-parallel group whose vocabulary shards label_logits are (None: the whole vocabulary)
    vocab_parallel: Optional[object] = None
    # extra metrics of a loss that is not token cross-entropy (preference training): {name: (sum,
    # count)} float32 scalar tensors; the Trainer reports sum / count over the logging interval or
    # the eval set (the loss function's `metric_names` lists the names)
    metrics: Optional[dict] = None

    def predictions(self):
        return self.label_argmax if self.label_argmax is not None else self.label_logits.argmax(-1)

    @property
    def loss(self):
        return self.loss_sum / paddle.clip(self.num_tokens, min=1.0)


def head_layer(model):
    """(layer, transposed) when logits = h @ layer.weight (an LM head [H, V]) or h @ weight^T (a
    tied embedding [V, H]) with a plain bias-free head; None for a head that must run as a module
    (LoRA on lm_head, a bias). Nothing is read from the weight here (models/owned.py)."""
    head = model.get_output_embeddings()
    if head is None:
        return model.get_input_embeddings(), True
    transform = getattr(head, "weight_transform", None)
    plain = type(head) is nn.Linear or getattr(head, "plain_linear", False)   # (fleet's column layer)
    if (plain or transform is not None) and head.bias is None:
        return head, False
    return None


def head_matrix(layer, transposed, view=None):
    """The head's matrix: `layer`'s weight (view(weight) when given), through the head's
    `weight_transform` (layers.NormHead) if it has one."""
    w = view(layer.weight) if view is not None else layer.weight
    transform = None if transposed else getattr(layer, "weight_transform", None)
    return transform(w) if transform is not None else w


def linear_head(model, view=None):
    """(W, transposed) when logits = h @ W (W [H, V]) or h @ W^T (a tied embedding [V, H]) with a
    plain bias-free head; None for a head that must run as a module (LoRA on lm_head, a bias).
    A head with a `weight_transform` (layers.NormHead) gives the transformed weight. `view(p)`,
    when given, is applied to the parameter first (tensor parallelism: its local shard)."""
    found = head_layer(model)
    if found is None:
        return None
    return head_matrix(*found, view=view), found[1]


def target_index(labels):
    """The positions select_targets keeps, computed on the host from the collator's labels
    (numpy [B, S]): flat indices into labels[:, 1:] where the label is not -100, int64 [n].
    Example: [[1, 5, -100, 7]] -> [0, 2]. On a GPU, paddle.nonzero of a device tensor makes the
    host wait for the device (the count sizes the result); the Trainer passes this instead."""
    lab = np.asarray(labels)
    return np.flatnonzero(lab[:, 1:].reshape(-1) != -100).astype(np.int64)


def select_targets(hidden, labels, index=None):
    """(h_sel [n, H], targets [n]): hidden rows whose next label is not -100 (shifted by one).
    index: target_index(labels) as a tensor, when the caller has it (no device nonzero)."""
    H = hidden.shape[-1]
    h = hidden[:, :-1].reshape([-1, H])
    tgt = labels[:, 1:].reshape([-1])
    idx = index if index is not None else paddle.nonzero(tgt != -100).reshape([-1])
    return paddle.gather(h, idx), paddle.gather(tgt, idx)


def hidden_loss(model, hidden, labels, keep_logits=False, index=None):
    """LossOutput of final-norm `hidden` [B, S, H] against `labels` [B, S] (see module doc);
    index: as select_targets'."""
    h_sel, t_sel = select_targets(hidden, labels, index)
    n = paddle.to_tensor(t_sel.shape[0], dtype="float32")
    found = None if (keep_logits or not model.training) else head_layer(model)
    if found is not None and getattr(found[0].weight, "is_dist", lambda: False)():
        raise ValueError("the LM head is sharded: use the parallel layout's loss "
                         "(paddletune.parallel), not the single-device one")
    if found is not None and paddle.is_grad_enabled() and t_sel.shape[0] > 0:
        layer, transposed = found
        # the head's weight is read inside its layer's call (owned.py: sharding stage 3 gathers it)
        loss_sum = as_forward(layer, lambda h, t: LinearCrossEntropy.apply(h, head_matrix(layer, transposed), t,
                                                                           transposed), h_sel, t_sel)
        return LossOutput(loss_sum, n, None, t_sel)
    logits = model.logits(h_sel)
    logits = logits.astype(wide(logits.dtype))   # float32 for 16-bit models, float64 stays
    loss_sum = F.cross_entropy(logits, t_sel.unsqueeze(-1), reduction="sum")
    return LossOutput(loss_sum, n, logits, t_sel)


def lm_loss_for(model):
    """The causal-LM loss function for `model`: this module's, or the vocabulary-parallel one of a
    tensor-parallel model (its `tensor_parallel` supplies parallel/vocab.py's), both f(model, batch, keep_logits=False); a
    Mixture-of-Experts model's adds the router's load-balancing loss (moe_causal_lm_loss)."""
    if getattr(model.config, "moe", None):
        return moe_causal_lm_loss
    if getattr(model, "tensor_parallel", None) is not None:
        return model.tensor_parallel.causal_lm_loss
    return causal_lm_loss


def hidden_loss_for(model):
    """hidden_loss, or its vocabulary-parallel form for a tensor-parallel model: both
    f(model, hidden, labels, keep_logits=False) -> LossOutput (pipeline stages use it)."""
    if getattr(model, "tensor_parallel", None) is not None:
        return model.tensor_parallel.hidden_loss
    return hidden_loss


def causal_lm_loss(model, batch, keep_logits=False):
    """Run `model` on the model inputs of `batch` (a dict of tensors) and return the LossOutput
    against batch["labels"]."""
    inputs = {k: v for k, v in batch.items() if k in MODEL_KEYS}
    out = model(**inputs, return_hidden=True)
    loss = hidden_loss(model, out.hidden_states, batch["labels"], keep_logits, batch.get("target_index"))
    return with_router_loss(model, loss, out.router_logits, batch.get("attention_mask"))


def with_router_loss(model, loss, router_logits, token_mask=None):
    """`loss` (a LossOutput) with a Mixture-of-Experts model's load-balancing term, as
    transformers adds it when config.json says output_router_logits: the mean loss becomes
    CE + router_aux_loss_coef * aux, i.e. loss_sum += coef * aux * n (n its target tokens; over
    accumulated micro-batches the aux terms are token-weighted like the CE). aux (moe.py) is over
    the tokens with token_mask [B, S] = 1 (every token when None); metrics["aux_loss"] carries it.
    Unchanged for dense models."""
    moe = getattr(model.config, "moe", None)
    if not moe or not moe["output_router_logits"] or not router_logits:
        return loss
    from .moe import load_balancing_loss

    comm = getattr(model, "expert_parallel", None) if model.training else None
    if comm is None:
        aux = load_balancing_loss(router_logits, moe["num_experts"], moe["top_k"], token_mask)
        loss.loss_sum = loss.loss_sum + (moe["aux_coef"] * aux) * loss.num_tokens
    else:   # data parallel: aux over the global micro-batch (parallel/expert.py: global_aux)
        aux, term = comm.global_aux(router_logits, moe, token_mask, loss.num_tokens)
        loss.loss_sum = loss.loss_sum + moe["aux_coef"] * term
    loss.metrics = dict(loss.metrics or {}, aux_loss=(aux.detach(), paddle.ones([], "float32")))
    return loss


def moe_causal_lm_loss(model, batch, keep_logits=False):
    """causal_lm_loss of a Mixture-of-Experts model in the Trainer: the batch's attention_mask
    (which the Trainer passes for this loss: `batch_keys`) marks the real tokens of the
    load-balancing loss only; the model runs on the same inputs as every other family's (right
    padding, causal attention), so padded positions do not count in the router statistics.
    Under tensor parallel the token loss runs on this rank's vocabulary shard; the router runs
    whole on every rank on the replicated hidden state, so the aux loss is the same on each."""
    token_loss = hidden_loss_for(model)
    mask = batch.get("attention_mask")
    inputs = {k: v for k, v in batch.items() if k in MODEL_KEYS and k != "attention_mask"}
    out = model(**inputs, return_hidden=True)
    index = batch.get("target_index") if token_loss is hidden_loss else None   # (TP: its own)
    loss = (token_loss(model, out.hidden_states, batch["labels"], keep_logits) if index is None
            else token_loss(model, out.hidden_states, batch["labels"], keep_logits, index))
    return with_router_loss(model, loss, out.router_logits, mask)


moe_causal_lm_loss.batch_keys = ("attention_mask",)
moe_causal_lm_loss.metric_names = ("aux_loss",)
moe_causal_lm_loss.token_loss = True   # eval reports perplexity and accuracy too
