"""NEFTune and R-Drop: NEFTune changes nothing in eval mode and its noise has the stated scale;
R-Drop's loss equals cross-entropy without dropout and matches a numpy computation with it;
both still learn the copy task. Oracles: the base model, numpy, the copy task."""
import numpy as np
import paddle

from peft_util import tiny, ids, run
from conftest import copy_pairs, rel_err, token_accuracy, training_args
from paddletune import peft
from paddletune.args import ModelArgument
from paddletune.data.collate import pad_batch
from paddletune.models.loss import causal_lm_loss
from paddletune.peft import neftune, rdrop
from paddletune.trainer import Trainer


def margs(**kw):
    return ModelArgument(model_name_or_path="paddletune/tiny-llama", **kw)


# ------------------------------------------------------------------------------ NEFTune

def test_neftune_eval_identity_and_noise_scale():
    model = tiny()
    x = ids()
    base = run(model, x)
    hook = neftune.apply(model, 5.0)
    assert rel_err(run(model, x), base) == 0.0             # eval mode: no noise
    model.train()
    h = paddle.ones([4, 50, 64])
    noise = (hook(h) - h).numpy()
    scale = 5.0 / np.sqrt(50 * 64)
    assert np.abs(noise).max() <= scale * (1 + 1e-6)
    assert abs(noise.std() - scale / np.sqrt(3)) < 0.05 * scale   # U(-s, s) has std s/sqrt(3)
    model.eval()
    assert np.array_equal((hook(h) - h).numpy(), np.zeros_like(noise))


def test_neftune_trains_copy_task(tmp_path):
    model = tiny()
    data = copy_pairs()
    setup = peft.apply(model, margs(lora=True, neftune=True, neftune_noise_alpha=5.0))
    Trainer(model, training_args(tmp_path, max_steps=100), train_dataset=data,
            trainable=setup.trainable, export_fn=lambda d: None).train()
    assert token_accuracy(model, data) == 1.0


# ------------------------------------------------------------------------------ R-Drop

def _batch():
    b = pad_batch(copy_pairs(n=4), 0)
    return {"input_ids": paddle.to_tensor(b["input_ids"]), "labels": paddle.to_tensor(b["labels"])}


def _np_ce_sum(logits, targets):
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -logp[np.arange(len(targets)), targets].sum(), logp


def test_rdrop_equals_ce_without_dropout():
    model = tiny()
    setup = peft.apply(model, margs(lora=True, rdrop=True, rdrop_alpha=4.0))
    model.train()
    out = setup.loss_fn(model, _batch())
    ce, _ = _np_ce_sum(out.label_logits.numpy().astype(np.float64), out.label_targets.numpy())
    assert abs(float(out.loss_sum) - ce) / ce < 1e-5
    assert abs(float(out.loss) - ce / float(out.num_tokens)) / ce < 1e-5


def test_rdrop_loss_matches_numpy_with_dropout():
    model = tiny()
    peft.apply(model, margs(lora=True, lora_dropout=0.3))
    rng = np.random.default_rng(0)
    for n, p in model.named_parameters():
        if ".lora_B." in n:
            p.set_value((rng.standard_normal(p.shape) * 0.1).astype(np.float32))
    model.train()
    b = _batch()
    o1, o2 = (causal_lm_loss(model, b, keep_logits=True) for _ in range(2))   # as R-Drop's loss_fn
    got = rdrop.combine(o1, o2, alpha=2.0)
    t = o1.label_targets.numpy()
    ce1, lp1 = _np_ce_sum(o1.label_logits.numpy().astype(np.float64), t)
    ce2, lp2 = _np_ce_sum(o2.label_logits.numpy().astype(np.float64), t)
    kl12 = (np.exp(lp1) * (lp1 - lp2)).sum()
    kl21 = (np.exp(lp2) * (lp2 - lp1)).sum()
    assert kl12 > 1e-4                                      # dropout made the passes differ
    want = 0.5 * (ce1 + ce2) + 2.0 * 0.5 * (kl12 + kl21)
    assert abs(float(got.loss_sum) - want) / want < 1e-5


def test_rdrop_trains_copy_task(tmp_path):
    model = tiny()
    data = copy_pairs()
    setup = peft.apply(model, margs(lora=True, lora_dropout=0.1, rdrop=True))
    Trainer(model, training_args(tmp_path, max_steps=100), train_dataset=data,
            trainable=setup.trainable, export_fn=lambda d: None, loss_fn=setup.loss_fn).train()
    assert token_accuracy(model, data) == 1.0


