"""Loading above the layers: a checkpoint directory becomes this rank's model, its tokenizer, or
both ready to generate.

    model = load_model(dir, topology=topo, quant=quant_args)   # this rank's part, eval mode
    tok = load_tokenizer(dir)                                   # the family's Tokenizer class
    model, tok, path = load_for_generation(dir_or_adapter_dir, lora_path=..., prefix_path=...)

models/ builds one device's model and reads HF files; this module decides which part a rank
holds (parallel/: tensor, pipeline, expert), quantizes while weights stream in (quant/), applies
adapters (peft/) and picks the tokenizer class a family needs. Nothing below imports it.
"""
import logging
import os

import paddle

from . import models
from .io import read_json
from .models import build_model, load_config, load_weights, resolve_model_path
from .models.memory import check_fits
from .tokenizer import Tokenizer

logger = logging.getLogger("paddletune")


def _check_parallel_layout(path, spec, cfg, topology):
    """Every refusal of a layout the model cannot take, before anything is built."""
    if topology is None:
        return
    moe = getattr(cfg, "moe", None)
    if moe and topology.pp_degree > 1:
        raise ValueError(f"{path}: a Mixture-of-Experts model ({cfg.model_type}) has no pipeline-"
                         "parallel form yet (the router's load-balancing loss spans every stage): "
                         "set pipeline_parallel_degree to 1")
    if moe and topology.tp_degree > 1 and topology.ep_degree > 1:
        raise ValueError(f"{path}: tensor_parallel_degree {topology.tp_degree} with "
                         f"expert_parallel_degree {topology.ep_degree}: tensor and expert "
                         "parallel together are not built for Mixture-of-Experts models; set "
                         "one of them to 1")
    if topology.ep_degree > 1:
        from .parallel.expert import check_experts

        check_experts(cfg, topology.ep_degree)
    if topology.tp_degree > 1:
        from .parallel.plan import check_layout

        check_layout(spec, cfg, topology.tp_degree)
    if topology.pp_degree > 1:
        from .parallel.pipeline import check_stages

        check_stages(cfg, topology.pp_degree, topology.pipeline.get("virtual", 1))


def load_model(name_or_path, topology=None, quant=None, dtype="float32", training=None):
    """Load a HF-format checkpoint directory as a paddle model in eval mode.

    `topology` (parallel.Topology) says which part of the model this rank holds; every rank of a
    data-parallel layout holds all of it. `quant` (a QuantArgument with weight_quantize_algo set,
    or a quant.QuantConfig) quantizes the frozen Linear weights while they stream in: parameters
    are created under paddle.LazyGuard, so a Linear swapped for a QuantizedLinear never
    allocates its weight. `dtype`: the parameters' dtype (build_model; docs/gpu.md). `training`:
    models.memory.footprint(...) of a training run, so the fit check counts gradients, optimizer
    state and activations too (None: weights only)."""
    path = resolve_model_path(name_or_path)
    spec, cfg = load_config(path)
    check_fits(path, cfg, topology, quant, training)   # per rank x local ranks vs host memory
    _check_parallel_layout(path, spec, cfg, topology)
    tp = topology is not None and topology.tp_degree > 1
    pp = topology is not None and topology.pp_degree > 1
    model = build_model(cfg, dtype=dtype)
    model.name_or_path = path
    only = None
    if quant is not None:
        from .quant import quantize_model_lazily

        quantize_model_lazily(model, quant)   # no-op when weight_quantize_algo is unset
    if pp:   # this stage's blocks (and embedding / norm / head) only are read; the rest stays lazy
        from .parallel.pipeline import owned

        only = owned(model, topology.pp_rank, topology.pp_degree, topology.pipeline.get("virtual", 1))
    if getattr(cfg, "moe", None) and topology is not None and topology.data_degree > 1:
        from .parallel import expert

        # router statistics over the data ranks; under expert parallel this rank's experts only
        # are read (the others stay lazy: no memory)
        ep = expert.install(model, topology)
        if ep.degree > 1:
            only = ep.reads
    if tp:   # this rank's slices only, as DTensors; the plan's executors installed
        from .parallel import tensor as tensor_parallel

        group = tensor_parallel.TensorParallel(topology)
        tensor_parallel.load_sharded(model, path, group, only=only)
        tensor_parallel.install(model, group)
    else:
        load_weights(model, path, spec, only=only, dtype=dtype)
    if pp:
        from .parallel.pipeline import Pipeline

        model.pipeline = Pipeline(model, topology)
    if getattr(model, "quant_config", None) is not None:
        from .quant import format_report

        logger.info("%s", format_report(model))   # bytes held vs float32, whole model
    model.eval()
    return model


def tokenizer_class(path):
    """The Tokenizer class that reads the tokenizer in `path`: the family's subclass named by
    tokenizer_config.json's tokenizer_class where a ModelSpec claims that name
    (models.spec.tokenizer_class_of), else the plain Tokenizer."""
    return models.spec.tokenizer_class_of(path) or Tokenizer


def load_tokenizer(name_or_path):
    """The tokenizer of a checkpoint directory or built-in model name, in its family's class."""
    path = resolve_model_path(name_or_path, key="tokenizer path")
    return tokenizer_class(path)(path)


def adapter_base(path):
    """(base model, "lora_path" | "prefix_path") when `path` is an adapter directory (a LoRA /
    prefix-tuning run's output_dir: adapter_config.json and no config.json), else None. The base
    is the adapter's base_model_name_or_path; ValueError when that is missing or the adapter
    type has no generation form."""
    conf = os.path.join(path, "adapter_config.json")
    # lexists: a FIFO / device there is refused by read_json (naming it), not taken for "no adapter"
    if not os.path.lexists(conf) or os.path.lexists(os.path.join(path, "config.json")):
        return None
    ac = read_json(conf, "adapter_config.json")
    base, kind = ac.get("base_model_name_or_path"), str(ac.get("peft_type", "LORA")).upper()
    key = {"LORA": "lora_path", "PREFIX_TUNING": "prefix_path"}.get(kind)
    if not base or key is None:
        raise ValueError(f"model_name_or_path={path!r} is an adapter directory ({kind}) without a "
                         "usable base_model_name_or_path; give --model_name_or_path BASE --lora_path DIR")
    logger.info("%s is a %s adapter: base %s", path, kind, base)
    return base, key


def adapter_as_model(args):
    """args.model_name_or_path naming an adapter directory (and no lora_path / prefix_path given)
    becomes its base, with the directory as args.lora_path or args.prefix_path: the scripts'
    "--model_name_or_path LORA_OUT" (predictor.py, the server). ValueError from adapter_base."""
    if args.lora_path or args.prefix_path:
        return
    found = adapter_base(args.model_name_or_path)
    if found is not None:
        setattr(args, found[1], args.model_name_or_path)
        args.model_name_or_path = found[0]


def load_for_generation(model, tokenizer=None, lora_path=None, prefix_path=None, merge_lora=True,
                        topology=None, dtype="float32"):
    """(model in eval mode, tokenizer, checkpoint dir or None) from a checkpoint directory /
    built-in name, an adapter directory (its base model with it), or an already built model. A
    LoRA adapter (HF-PEFT files) is loaded on top and, with merge_lora, folded into the weights
    (W += s A B: faster, same outputs); prefixes (prefix tuning) are loaded as the model's prefix
    encoder and fill every KV cache. `topology` (parallel.Topology) with a tensor-parallel degree
    > 1 loads this rank's slices; adapters are then sliced too and LoRA stays unmerged (merging
    works on whole weights). `dtype`: the parameters' dtype when loading from a directory
    (load_model)."""
    path = None
    if isinstance(model, str):
        found = None if (lora_path or prefix_path) else adapter_base(model)
        if found is not None:
            adapter_dir, (model, key) = model, found
            lora_path, prefix_path = ((adapter_dir, None) if key == "lora_path" else (None, adapter_dir))
        path = resolve_model_path(model)
        model = load_model(path, topology=topology, dtype=dtype)
    else:
        path = getattr(model, "name_or_path", None)
    if tokenizer is None or isinstance(tokenizer, str):
        if tokenizer is None and path is None:
            raise ValueError("pass tokenizer= (a Tokenizer or its directory) with an in-memory model")
        tokenizer = load_tokenizer(tokenizer or path)
    if lora_path or prefix_path:
        from . import peft

        peft.load_adapter(model, lora_path=lora_path, prefix_path=prefix_path)
        tp = getattr(model, "tensor_parallel", None)
        if tp is not None:   # the adapters' slices, LoRA's collectives, the local prefix heads
            from .parallel import tensor as tensor_parallel

            tensor_parallel.finalize(model, tp)
        layers = peft.lora.lora_layers(model)
        plain = layers and all(isinstance(m.base_layer, paddle.nn.Linear) for m in layers.values())
        if merge_lora and tp is None and plain:
            peft.lora.merge(model)   # (a quantized backbone keeps its adapters unmerged)
    model.eval()
    return model, tokenizer, path
