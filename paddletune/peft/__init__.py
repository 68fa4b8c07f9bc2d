"""Parameter-efficient fine-tuning: one entry point for the finetune script, one for inference.

    setup = peft.apply(model, model_args, tokenizer=tok)      # wraps, never rewrites
    Trainer(model, args, ..., trainable=setup.trainable, export_fn=setup.export_fn,
            loss_fn=setup.loss_fn, lr_scales=setup.lr_scales)
    peft.load_adapter(model, lora_path=..., prefix_path=...)  # predictor: saved adapter -> model
    peft.merge_lora(lora_path, out_dir)                        # base checkpoint + LoRA -> HF dir

Methods that choose what trains (at most one per run): lora (lora.py), prefix_tuning (prefix.py),
adapter (adapter.py), lowrank_adapter (lowrank_adapter.py), bitfit (bitfit.py). Training tricks
that combine with any of them or with full fine-tuning: rdrop (rdrop.py), neftune (neftune.py).
Without a selection method every parameter trains (trainable None) and the export is the full
model.
"""
import logging
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from . import adapter, bitfit, lora, lowrank_adapter, neftune, prefix, rdrop
from .common import OWN_CONFIG, match_modules
from .merge import merge_lora, merge_lora_state, merge_lora_tensor  # noqa: F401

logger = logging.getLogger("paddletune")

SELECTION = {"lora": lora, "prefix_tuning": prefix, "adapter": adapter,
             "lowrank_adapter": lowrank_adapter, "bitfit": bitfit}


@dataclass
class PeftSetup:
    """What the Trainer needs: None fields mean the Trainer's defaults (full fine-tuning)."""
    method: Optional[str] = None
    trainable: Optional[Dict] = None           # {name: parameter}
    export_fn: Optional[Callable] = None       # export_fn(out_dir) writes the adapter files
    loss_fn: Optional[Callable] = None         # R-Drop: f(model, batch) -> models.loss.LossOutput
    lr_scales: Optional[Dict] = None           # LoRA+: {lora_B name: lr multiplier}


def selected(model_args):
    """The selection method of `model_args`, or None. args.py refuses two in one argument file;
    the assert is for programmatic callers."""
    chosen = [k for k in SELECTION if getattr(model_args, k, False)]
    assert len(chosen) <= 1, f"{' and '.join(chosen)} cannot be combined in one run: choose one PEFT method"
    return chosen[0] if chosen else None


def apply(model, model_args, tokenizer=None):
    """Apply the PEFT method(s) of `model_args` to `model` in place; returns a PeftSetup."""
    method = selected(model_args)
    setup = PeftSetup(method=method)
    if method is not None:   # each method module: setup() -> (trainable, lr_scales, export_fn)
        setup.trainable, setup.lr_scales, setup.export_fn = SELECTION[method].setup(
            model, model_args, tokenizer)
    if getattr(model_args, "neftune", False):
        neftune.apply(model, model_args.neftune_noise_alpha)
        logger.info("NEFTune: noise alpha %g on input embeddings (training only)",
                    model_args.neftune_noise_alpha)
    if getattr(model_args, "rdrop", False):
        setup.loss_fn = rdrop.make_loss_fn(model_args.rdrop_alpha)
        if not rdrop.has_dropout(model):
            logger.warning("rdrop: the model has no dropout (attention_dropout and lora_dropout are 0), "
                           "so both passes agree and the loss equals plain cross-entropy")
    return setup


def validate(model_args, model_path):
    """Cheap checks of the PEFT settings against the model at `model_path` before any work: the
    model is built lazily (no weights), only names and shapes are inspected."""
    method = selected(model_args)
    if method is None:
        return
    from ..models import build_model, load_config

    _, cfg = load_config(model_path)
    model = build_model(cfg)
    if method == "lora":
        if model_args.lora_path:
            lora.read(model_args.lora_path, model)   # shapes checked before any tensor is read
        else:
            match_modules(model, model_args.lora_target_modules or list(model.spec.lora_targets),
                          "lora_target_modules")
    elif method == "prefix_tuning" and model_args.prefix_path:
        prefix.read(model, model_args.prefix_path)
    elif method in ("adapter", "lowrank_adapter"):
        adapter.targets(model)


def load_adapter(model, path=None, lora_path=None, prefix_path=None):
    """Attach saved PEFT weights for inference (frozen). `path` is detected by its files:
    adapter_config.json (HF-PEFT LORA or PREFIX_TUNING) or paddletune_adapter.json (ADAPTER,
    LOWRANK_ADAPTER, BITFIT). Returns the model."""
    for p, kind in ((lora_path, "LORA"), (prefix_path, "PREFIX_TUNING"), (path, None)):
        if not p:
            continue
        kind = kind or adapter_type(p)
        loader = {"LORA": lora.load, "PREFIX_TUNING": prefix.load, "ADAPTER": adapter.load,
                  "LOWRANK_ADAPTER": lowrank_adapter.load, "BITFIT": bitfit.load}.get(kind)
        if loader is None:
            raise ValueError(f"{p}: peft_type {kind!r} is not supported (LORA, PREFIX_TUNING, "
                             "ADAPTER, LOWRANK_ADAPTER, BITFIT)")
        loader(model, p)
    return model


def adapter_type(path):
    from ..io import read_json

    for name in ("adapter_config.json", OWN_CONFIG):
        f = os.path.join(path, name)
        if os.path.exists(f):
            return read_json(f, "adapter config").get("peft_type")
    raise FileNotFoundError(f"{path} holds no adapter_config.json or {OWN_CONFIG}")
