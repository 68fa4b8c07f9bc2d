"""R-Drop: two forward passes with independent dropout, CE plus a symmetric KL between them.

On the n target positions with logits z1, z2 [n, V] (p = softmax(z)) and token CE sums c1, c2:
    loss_sum = (c1 + c2) / 2 + alpha * sum_t (KL(p1_t || p2_t) + KL(p2_t || p1_t)) / 2
    KL(p || q) + KL(q || p) = sum_v (p_v - q_v) * (log p_v - log q_v)
The trainer divides loss_sum by the target count, so with dropout 0 (both passes equal) the loss
is exactly the cross-entropy. In eval mode only one pass is run.
"""
import paddle.nn.functional as F

from ..models.loss import LossOutput, lm_loss_for


def symmetric_kl(logits1, logits2, tp=None):
    """[n, V], [n, V] -> [n]: KL(p1||p2) + KL(p2||p1) per row (float32). With `tp` the logits are
    vocabulary shards [n, V/t] and the sums run over every rank's shard (parallel/vocab.py)."""
    if tp is not None:   # the model's tensor_parallel (parallel.tensor.TensorParallel)
        return tp.symmetric_kl(logits1, logits2)
    lp1 = F.log_softmax(logits1.astype("float32"), axis=-1)
    lp2 = F.log_softmax(logits2.astype("float32"), axis=-1)
    return ((lp1.exp() - lp2.exp()) * (lp1 - lp2)).sum(-1)


def combine(out1, out2, alpha):
    """LossOutput of the R-Drop objective from two passes (see the module docstring)."""
    kl = symmetric_kl(out1.label_logits, out2.label_logits, out1.vocab_parallel).sum()
    loss_sum = 0.5 * (out1.loss_sum + out2.loss_sum) + alpha * 0.5 * kl
    return LossOutput(loss_sum, out1.num_tokens, out1.label_logits, out1.label_targets,
                      out1.label_argmax, out1.vocab_parallel)


def make_loss_fn(alpha):
    assert alpha >= 0, f"rdrop_alpha must be >= 0, got {alpha} (args.py checks it for users)"

    def loss_fn(model, batch):
        lm_loss = lm_loss_for(model)
        out1 = lm_loss(model, batch, keep_logits=True)   # the KL term needs label logits
        if not model.training:
            return out1
        return combine(out1, lm_loss(model, batch, keep_logits=True), alpha)

    return loss_fn


def has_dropout(model):
    """Whether two training passes can differ (attention dropout or LoRA dropout > 0)."""
    if getattr(model.config, "attention_dropout", 0) > 0:
        return True
    from .lora import LoRALinear

    return any(m.dropout > 0 for _, m in model.named_sublayers() if isinstance(m, LoRALinear))
