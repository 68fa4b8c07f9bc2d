"""DPO and KTO losses (paddletune/alignment/loss.py) against TRL on torch CPU (test-only oracle,
trl 1.x): on the same tiny checkpoints (a policy and a reference saved by transformers) and the
same batch, the loss, the chosen / rejected rewards (and margins, accuracies, KL) and the
gradient of every trained tensor equal TRL's to 1e-5.

- TRL's DPOTrainer._compute_loss: sigmoid, hinge, ipo, nca_pair, sppo_hard, sigmoid + the SFT term
  (TRL's loss_type ["sigmoid", "sft"]), and LoRA with the reference = the adapters disabled;
  padded and packed batches (zero padding) both.
- TRL's loss functions on torch log-probabilities where its DPOTrainer lacks the type:
  cDPO label smoothing and SimPO (experimental CPOTrainer.cpo_loss), ORPO (ORPOTrainer.
  odds_ratio_loss + the chosen NLL); PaddleNLP's dpop and kto_pair from its documented
  formulas, written in torch here.
- TRL's KTOTrainer._compute_loss with the same KL completions.
"""
import types

import numpy as np
import pytest

from conftest import hf_checkpoint, rel_err

PAIRS = [([1, 5, 6, 7], [8, 9, 2], [10, 2]),
         ([1, 11], [12, 13, 14, 15, 2], [16, 17, 2]),
         ([1, 18, 19], [20, 2], [21, 22, 23, 24, 2])]
KTO = [([1, 5, 6, 7], [8, 9, 2], 1), ([1, 11], [12, 13, 14, 2], 0), ([1, 18, 19], [20, 21, 2], 1),
       ([1, 25], [26, 2], 0)]
TOL = 1e-5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A reference and a policy (two random tiny Llamas with wide logits: log-ratios of a few
    nats), both as paths and as torch models."""
    d = tmp_path_factory.mktemp("dpo_oracle")
    ref_path, ref_t = hf_checkpoint(d / "ref", seed=0, initializer_range=0.2)
    pol_path, pol_t = hf_checkpoint(d / "policy", seed=1, initializer_range=0.2)
    return types.SimpleNamespace(dir=d, ref_path=ref_path, pol_path=pol_path, ref_t=ref_t, pol_t=pol_t)


def dataset(kind):
    from paddletune.alignment.data import PreferenceDataset

    a = lambda x: np.asarray(x, np.int64)  # noqa: E731
    if kind == "dpo":
        ex = [{"prompt": a(p), "chosen": a(c), "rejected": a(r), "id": i} for i, (p, c, r) in enumerate(PAIRS)]
    else:   # KL completion of example i: example (-i mod n)'s, as data.py pairs them
        ex = [{"prompt": a(p), "completion": a(c), "label": y, "id": i} for i, (p, c, y) in enumerate(KTO)]
        for i, e in enumerate(ex):
            e["kl"] = ex[(-i) % len(ex)]["completion"]
    return PreferenceDataset(kind, ex, [])


def our_batch(kind, packed=False):
    from paddletune.alignment.data import PackedPairSource, padded_collate

    ds = dataset(kind)
    if not packed:
        return padded_collate(ds, 0)(list(ds.examples))
    src = PackedPairSource(ds, 30, micro_batch=8, accumulation=1)   # several pairs per row
    assert len(src.packs) < len(ds)
    return src.collate(list(range(len(src.packs))))


def run_ours(loss_fn, model, batch):
    """(loss, metrics {name: mean}, {param name: grad in HF layout}) of one micro-batch."""
    import paddle
    from paddletune.models import hf

    model.train()
    out = loss_fn(model, {k: paddle.to_tensor(v) for k, v in batch.items()})
    loss = out.loss_sum / out.num_tokens
    loss.backward()
    metrics = {k: float(s) / float(c) for k, (s, c) in out.metrics.items() if float(c) > 0}
    grads = {n: hf.to_hf_layout(model.spec, n, p.grad.numpy()) for n, p in model.named_parameters()
             if p.grad is not None}
    model.clear_gradients()
    return float(loss), metrics, grads


def compare_grads(ours, torch_model, rename=lambda n: n):
    named = dict(torch_model.named_parameters())
    assert ours
    for n, g in ours.items():
        t = named[rename(n)].grad
        assert t is not None, n
        assert rel_err(g, t.detach().numpy()) <= TOL, (n, rel_err(g, t.detach().numpy()))


def dpo_cfg(**kw):
    from paddletune.alignment.args import DPOConfig

    return DPOConfig(**kw)


@pytest.fixture(scope="module")
def trl_env(ckpt):
    import transformers
    from datasets import Dataset

    tok = transformers.AutoTokenizer.from_pretrained(ckpt.ref_path)
    return types.SimpleNamespace(tok=tok, ds=Dataset.from_list([{"prompt": "a b", "chosen": " c", "rejected": " d"}] * 2),
                                 kto_ds=Dataset.from_list([{"prompt": "a", "completion": " b", "label": True},
                                                           {"prompt": "c", "completion": " d", "label": False}]))


def trl_dpo(ckpt, env, model, ref, peft_config=None, **cfg):
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(ckpt.dir / "trl"), report_to="none", use_cpu=True, bf16=False,
                     per_device_train_batch_size=2, **cfg)
    return DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=env.ds, processing_class=env.tok,
                      peft_config=peft_config)


def trl_batch():
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    return DataCollatorForPreference(pad_token_id=0)(
        [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in PAIRS])


def trl_metrics(tr):
    return {k: v[-1] for k, v in tr._metrics["train"].items()}


def check_metrics(ours, theirs, names=("rewards/chosen", "rewards/rejected", "rewards/margins",
                                       "rewards/accuracies", "logps/chosen", "logps/rejected")):
    for k in names:
        assert abs(ours[k] - theirs[k]) <= TOL * max(1.0, abs(theirs[k])), (k, ours[k], theirs[k])


CASES = {"sigmoid": ({"loss_type": ["sigmoid"], "beta": 0.1}, {"loss_type": "sigmoid", "beta": 0.1}),
         "hinge": ({"loss_type": ["hinge"], "beta": 0.5}, {"loss_type": "hinge", "beta": 0.5}),
         "ipo": ({"loss_type": ["ipo"], "beta": 0.1}, {"loss_type": "ipo", "beta": 0.1}),
         "nca_pair": ({"loss_type": ["nca_pair"], "beta": 0.2}, {"loss_type": "nca_pair", "beta": 0.2}),
         "sppo_hard": ({"loss_type": ["sppo_hard"], "beta": 0.3}, {"loss_type": "sppo_hard", "beta": 0.3}),
         "sigmoid+sft": ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5], "beta": 0.1},
                         {"loss_type": "sigmoid", "beta": 0.1, "sft_loss_ratio": 0.5})}


@pytest.mark.parametrize("case", list(CASES))
def test_dpo_losses_equal_trl_dpotrainer(ckpt, trl_env, case):
    """Loss, rewards, margins, accuracies, log-probabilities and every gradient equal TRL's
    DPOTrainer on the same batch; the packed batch (three pairs in fewer rows) gives the same."""
    import copy

    from paddletune.alignment.loss import DPOLoss, FrozenReference
    from paddletune.loading import load_model

    theirs_cfg, ours_cfg = CASES[case]
    policy = copy.deepcopy(ckpt.pol_t)
    tr = trl_dpo(ckpt, trl_env, policy, copy.deepcopy(ckpt.ref_t), **theirs_cfg)
    tr.model.train()
    loss_t = tr._compute_loss(tr.model, trl_batch(), False)
    loss_t.backward()
    loss_fn = DPOLoss(dpo_cfg(**ours_cfg), FrozenReference(load_model(ckpt.ref_path)))
    model = load_model(ckpt.pol_path)
    for packed in (False, True):
        loss, metrics, grads = run_ours(loss_fn, model, our_batch("dpo", packed))
        assert abs(loss - loss_t.item()) <= TOL * max(1.0, abs(loss_t.item())), (packed, loss, loss_t.item())
        check_metrics(metrics, trl_metrics(tr))
        compare_grads(grads, tr.model)


def test_dpo_lora_reference_is_the_adapter_free_base_as_in_trl(ckpt, trl_env):
    """LoRA: the reference is the same model with its adapters off (no second copy). TRL's
    DPOTrainer with a PEFT adapter (B set nonzero) vs ours loading that adapter: loss, rewards
    and the LoRA gradients agree."""
    import copy

    import peft as torch_peft

    from paddletune import peft
    from paddletune.alignment.loss import AdapterOffReference, DPOLoss
    from paddletune.args import ModelArgument
    from paddletune.loading import load_model

    import torch

    lcfg = torch_peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    tr = trl_dpo(ckpt, trl_env, copy.deepcopy(ckpt.ref_t), None, loss_type=["sigmoid"], beta=0.5, peft_config=lcfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.3)
    tr.model.save_pretrained(str(ckpt.dir / "adapter"))
    tr.model.train()
    loss_t = tr._compute_loss(tr.model, trl_batch(), False)
    loss_t.backward()

    model = load_model(ckpt.ref_path)
    setup = peft.apply(model, ModelArgument(model_name_or_path=ckpt.ref_path, lora=True,
                                            lora_path=str(ckpt.dir / "adapter")))
    loss, metrics, grads = run_ours(DPOLoss(dpo_cfg(loss_type="sigmoid", beta=0.5), AdapterOffReference()),
                                    model, our_batch("dpo"))
    assert set(grads) == set(setup.trainable)
    assert abs(loss - loss_t.item()) <= TOL
    check_metrics(metrics, trl_metrics(tr))
    assert abs(metrics["rewards/chosen"]) > 1e-2   # the adapter moved the policy off its reference
    rename = lambda n: "base_model.model." + n.replace(".weight", ".default.weight")  # noqa: E731
    compare_grads(grads, tr.model, rename)


def torch_logps(model, batch):
    """(summed, per-token mean) completion log-probabilities [2P] of TRL's preference batch."""
    import torch

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    m = batch["completion_mask"][:, 1:].float()
    s = (lp * m).sum(1)
    return s, s / m.sum(1), m


def formula_loss(name, pol, ref, batch):
    """The oracle's loss: TRL's functions (CPO, ORPO) or PaddleNLP's documented formulas."""
    import torch
    import torch.nn.functional as F
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    s, avg, m = torch_logps(pol, batch)
    with torch.no_grad():
        s0, _, _ = torch_logps(ref, batch)
    P = len(PAIRS)
    c, r, c0, r0 = s[:P], s[P:], s0[:P], s0[P:]
    ns = lambda **kw: types.SimpleNamespace(alpha=0.0, accelerator=types.SimpleNamespace(device="cpu"), **kw)  # noqa: E731
    if name == "cdpo":      # DPO with label smoothing = CPO's sigmoid form on the log-ratios
        return CPOTrainer.cpo_loss(ns(loss_type="sigmoid", beta=0.2, label_smoothing=0.25), c - c0, r - r0)[0].mean()
    if name == "simpo":
        return CPOTrainer.cpo_loss(ns(loss_type="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.1),
                                   avg[:P], avg[P:])[0].mean()
    if name == "orpo":
        nll = -(s[:P].sum() / m[:P].sum())
        return nll - ORPOTrainer.odds_ratio_loss(ns(beta=0.1), avg[:P], avg[P:])[0].mean()
    x = (c - r) - (c0 - r0)
    if name == "dpop":      # PaddleNLP: -log s(b (x - lambda max(0, c0 - c)))
        return -F.logsigmoid(0.1 * (x - 5.0 * torch.clamp(c0 - c, min=0))).mean()
    if name == "kto_pair":  # PaddleNLP: chosen and rejected halves, KL from the other half
        ckl, rkl = (c - c0).mean().clamp(min=0), (r - r0).mean().clamp(min=0)
        return torch.cat([1 - torch.sigmoid(0.1 * (c - c0 - rkl)), 1 - torch.sigmoid(0.1 * (ckl - (r - r0)))]).mean()
    raise KeyError(name)


FORMULAS = {"cdpo": dict(loss_type="sigmoid", beta=0.2, label_smoothing=0.25),
            "simpo": dict(loss_type="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.1, reference_free=True),
            "orpo": dict(loss_type="or", reference_free=True, sft_loss_ratio=1.0, pref_loss_ratio=0.1),
            "dpop": dict(loss_type="dpop", beta=0.1, dpop_lambda=5.0),
            "kto_pair": dict(loss_type="kto_pair", beta=0.1)}


@pytest.mark.parametrize("name", list(FORMULAS))
def test_dpo_losses_outside_trl_dpotrainer_equal_their_formulas(ckpt, name):
    """cDPO (label smoothing), SimPO and ORPO equal TRL's own loss functions, dpop and kto_pair
    PaddleNLP's formulas (torch), on the same log-probabilities: loss and every gradient."""
    import copy

    from paddletune.alignment.loss import DPOLoss, FrozenReference
    from paddletune.loading import load_model

    cfg = dpo_cfg(**FORMULAS[name])
    pol = copy.deepcopy(ckpt.pol_t).train()
    loss_t = formula_loss(name, pol, ckpt.ref_t, trl_batch())
    loss_t.backward()
    ref = None if cfg.reference_free else FrozenReference(load_model(ckpt.ref_path))
    loss, _, grads = run_ours(DPOLoss(cfg, ref), load_model(ckpt.pol_path), our_batch("dpo"))
    assert abs(loss - loss_t.item()) <= TOL * max(1.0, abs(loss_t.item())), (loss, loss_t.item())
    compare_grads(grads, pol)


def test_kto_equals_trl_ktotrainer(ckpt, trl_env):
    """KTO (desirable / undesirable weights, the KL term from mismatched completions): loss, KL,
    rewards and every gradient equal TRL's KTOTrainer on the same batch, padded and packed."""
    import copy

    from trl import KTOConfig, KTOTrainer
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    from paddletune.alignment.args import KTOConfig as OurKTO
    from paddletune.alignment.loss import FrozenReference, KTOLoss
    from paddletune.loading import load_model

    args = KTOConfig(output_dir=str(ckpt.dir / "trl_kto"), report_to="none", use_cpu=True, bf16=False,
                     per_device_train_batch_size=2, beta=0.3, desirable_weight=1.5, undesirable_weight=0.7)
    tr = KTOTrainer(model=copy.deepcopy(ckpt.pol_t), ref_model=copy.deepcopy(ckpt.ref_t), args=args,
                    train_dataset=trl_env.kto_ds, processing_class=trl_env.tok)
    ds = dataset("kto")
    batch = DataCollatorForUnpairedPreference(pad_token_id=0)(
        [{"prompt_ids": e["prompt"].tolist(), "completion_ids": e["completion"].tolist(),
          "KL_completion_ids": e["kl"].tolist(), "label": bool(e["label"])} for e in ds.examples])
    tr.model.train()
    loss_t = tr._compute_loss(tr.model, batch, False)
    loss_t.backward()
    loss_fn = KTOLoss(OurKTO(beta=0.3, desirable_weight=1.5, undesirable_weight=0.7),
                      FrozenReference(load_model(ckpt.ref_path)))
    model = load_model(ckpt.pol_path)
    theirs = trl_metrics(tr)
    assert theirs["kl"] > 0   # the KL term is active
    for packed in (False, True):
        loss, metrics, grads = run_ours(loss_fn, model, our_batch("kto", packed))
        assert abs(loss - loss_t.item()) <= TOL, (packed, loss, loss_t.item())
        check_metrics(metrics, theirs, ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl"))
        compare_grads(grads, tr.model)
