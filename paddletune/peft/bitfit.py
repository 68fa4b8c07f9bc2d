"""BitFit: train only the biases of the decoder's linear layers, everything else frozen.

Targets are the decoder Linear layers (ModelSpec.lora_targets). A layer without a bias (Llama has
none) gets a zero-initialised one, so the model's output is unchanged at the start:
    y = x @ W + b      W [in, out] frozen, b [out] trained (new ones start at 0)
Trainable count = sum of the targets' output sizes. Saved in the own format (peft/common.py);
the config lists which biases were added, so loading re-creates them before setting values.
"""
import logging
from dataclasses import dataclass
from typing import Tuple

import paddle.nn as nn

from .common import (base_name_for_config, builtin_name, check_shapes, freeze, get_module, linear_dims,
                     match_modules, read_own, save_own)

logger = logging.getLogger("paddletune")
PEFT_TYPE = "BITFIT"


def add_bias(layer, name):
    """Give `layer` a zero bias [out] if it has none; returns True when one was added."""
    if getattr(layer, "bias", None) is not None:
        return False
    if not (isinstance(layer, nn.Linear) or getattr(layer, "plain_linear", False)):   # (fleet's)
        raise ValueError(f"BitFit cannot add a bias to {name} ({type(layer).__name__}); only paddle "
                         "nn.Linear layers can take a new bias")
    out = linear_dims(layer)[1]
    layer.bias = layer.create_parameter([out], is_bias=True,
                                        default_initializer=nn.initializer.Constant(0.0))
    return True


@dataclass(frozen=True)
class BitFitTargets:
    """What BitFit did to one model, as written to the saved config: the Linear layers whose
    biases train, and which of those biases it added (zero-initialised)."""
    target_modules: Tuple[str, ...]
    added_bias: Tuple[str, ...]

    def config(self):
        return {"target_modules": list(self.target_modules), "added_bias": list(self.added_bias)}


def _targets(model):
    return match_modules(model, list(model.spec.lora_targets),
                         f"ModelSpec({model.config.model_type}).lora_targets")


def apply(model, model_args):
    """Freeze the model, give every target a trainable bias. Returns (trainable, BitFitTargets)."""
    freeze(model)
    names = _targets(model)
    added = [n for n in names if add_bias(get_module(model, n), n)]
    trainable = {}
    for n in names:
        b = get_module(model, n).bias
        b.stop_gradient = False
        trainable[n + ".bias"] = b
    logger.info("BitFit: biases of %d layers (%d added as zeros)", len(names), len(added))
    return trainable, BitFitTargets(tuple(names), tuple(added))


def bias_state(model, targets):
    return {n + ".bias": get_module(model, n).bias for n in targets.target_modules}


def export_fn(model, model_args, targets, tokenizer=None):
    conf = dict(targets.config(), base_model_name_or_path=base_name_for_config(
        model_args.model_name_or_path), paddletune_base_model=builtin_name(model_args.model_name_or_path))
    return lambda out_dir: save_own(model, out_dir, PEFT_TYPE, conf, bias_state(model, targets),
                                    tokenizer)


def setup(model, model_args, tokenizer=None):
    """(trainable, lr_scales, export_fn) for peft.apply; the export closes over the targets."""
    trainable, targets = apply(model, model_args)
    return trainable, None, export_fn(model, model_args, targets, tokenizer)


def load(model, path, trainable=False):
    conf, tensors = read_own(model, path, PEFT_TYPE)
    layers = dict(model.named_sublayers())
    for n in conf["target_modules"]:
        if n not in layers or linear_dims(layers[n]) is None:
            raise ValueError(f"{path}: bias for {n!r}, which this model has no Linear for")
    expect = {n + ".bias": [linear_dims(layers[n])[1]] for n in conf["target_modules"]}
    check_shapes(expect, tensors, path)
    for n in conf["target_modules"]:
        add_bias(layers[n], n)
    for n, a in tensors.items():
        b = layers[n[:-len(".bias")]].bias
        b.set_value(a.astype("float32"))
        b.stop_gradient = not trainable
    return conf
