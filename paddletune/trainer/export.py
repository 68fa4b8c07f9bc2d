"""A training checkpoint -> one Hugging Face directory (llm/merge_tp_and_pp_params.py).

checkpoint-N/ (trainer/checkpoint.py) holds only the trainable tensors, each under its full-model
name with its global shape, in whatever pieces the writing layout produced (tensor-parallel slices
today, pipeline stages later). `CheckpointReader.read(name)` assembles the whole tensor from the
pieces, so nothing here knows or cares which layout wrote it. What the tensors belong to comes
from the checkpoint's meta.json (the base model directory and the run's ModelArgument):

  full fine-tuning  a HF model directory exactly as the run's final save_pretrained writes it:
                    config.json (the base config), model*.safetensors with every parameter of the
                    model in model order (the checkpoint's tensors; any the run kept frozen come
                    from the base checkpoint), generation_config.json and the tokenizer. Streamed:
                    read, convert to HF layout, write, one tensor at a time.
  PEFT              the adapter exactly as the run's export_fn writes it (HF-PEFT for LoRA and
                    prefix tuning, the own format for adapters / BitFit): a model is built lazily
                    from the base config (no weights are allocated or read), peft.apply wraps it
                    as the run did, the trainable tensors are set from the checkpoint, export_fn
                    writes. Only the adapter tensors are ever materialised.

    plan = prepare(checkpoint_dir, output=None, base=None)   # every check; nothing written
    write(plan)                                              # -> plan.output

The output goes into the checkpoint directory by default (PaddleNLP's habit), beside the
checkpoint's own files, which are never replaced: the names written (config.json, model.safetensors
or model-0000K-of-0000N.safetensors, adapter_*, tokenizer files) are disjoint from a checkpoint's
(model_state-*, optimizer-*, shards.json, trainer_state.json, meta.json), which is checked before
anything is moved in. Files appear atomically (io.publish_into, config files last).
"""
import dataclasses
import fnmatch
import itertools
import json
import os
import shutil
from typing import Dict, List, Optional

import numpy as np

from ..io import publish_into, read_json, write_json
from ..models import hf
from . import checkpoint as ckpt
from .checkpoint import CheckpointReader, list_checkpoints

# a checkpoint's own files (version 2 and version 1): never written by the merge
CHECKPOINT_FILES = ("model_state*.safetensors", "optimizer*.safetensors", "shards.json",
                    "trainer_state.json", "meta.json")
# files an earlier merge into the same directory may have left (a different shard count)
STALE_MODEL = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json")
STALE_ADAPTER = ("adapter_model*.safetensors", "paddletune_adapter.safetensors")


@dataclasses.dataclass
class MergePlan:
    """Everything `write` needs, checked by `prepare`."""
    checkpoint: str
    output: str
    base: str                      # resolved base model directory
    model: object                  # built lazily from the base config (PEFT: wrapped)
    method: Optional[str]          # PEFT selection method, None for full fine-tuning
    setup: object                  # peft.PeftSetup (export_fn for PEFT runs)
    tokenizer: object
    reader: CheckpointReader
    tensors: Dict[str, object]     # name -> parameter: what the checkpoint provides
    frozen: List[str]              # full fine-tuning: parameters read from the base checkpoint
    max_shard_size: str = "5GB"


# ------------------------------------------------------------------------------ checks

def open_checkpoint(path):
    """CheckpointReader of a checkpoint-N directory; errors say what the path is instead."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    if not os.path.isdir(path):
        raise ValueError(f"{path} is a file; give a checkpoint-N directory")
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        inner = list_checkpoints(path)
        if inner:
            hint = f"; it holds checkpoints, e.g. the latest: {inner[-1]}"
        elif os.path.isfile(os.path.join(path, "config.json")):
            hint = " (it holds config.json: already a Hugging Face model directory)"
        else:
            hint = ""
        raise ValueError(f"{path} is not a training checkpoint (no trainer_state.json){hint}")
    if not os.path.isfile(os.path.join(path, "shards.json")):
        raise ValueError(f"{path} is an incomplete checkpoint: it has no shards.json")
    reader = CheckpointReader(path)
    if not reader.names("model"):
        raise ValueError(f"{path} holds no model tensors")
    return reader


def model_arguments(checkpoint, meta, base=None):
    """(ModelArgument of the run, resolved base directory). `base` (a directory or built-in
    name) overrides meta.json's base model; without meta.json it is required and the run is
    taken to be full fine-tuning (a PEFT method's settings are known only from meta.json)."""
    from ..args import ModelArgument
    from ..models import BUILTIN_MODELS, resolve_model_path

    raw = dict((meta or {}).get("model_args") or {})
    known = {f.name for f in dataclasses.fields(ModelArgument)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{checkpoint}/meta.json: model_args has keys this version does not know "
                         f"({', '.join(unknown[:3])}): written by another paddletune version?")
    args = ModelArgument(**raw)
    if base:
        path = resolve_model_path(base, "base_model_name_or_path")
        args.model_name_or_path = base
    elif meta is None:
        raise ValueError(f"{checkpoint} has no meta.json (llm/finetune_generation.py writes it), so "
                         "its base model is unknown: pass --base_model_name_or_path BASE_DIR")
    else:
        recorded, name = meta.get("base_model"), args.model_name_or_path
        if recorded and os.path.isdir(recorded):
            path = recorded
        elif name in BUILTIN_MODELS:
            path = resolve_model_path(name)
        else:
            raise ValueError(f"{checkpoint}/meta.json names the base model {recorded!r}, which is "
                             "not a directory (moved?): pass --base_model_name_or_path BASE_DIR")
        if name not in BUILTIN_MODELS:   # the run's export writes this, made absolute there
            args.model_name_or_path = path
    return args, path


def check_tensors(reader, expected, checkpoint, base, method, meta):
    """Every checkpoint tensor has a place in the model built from `base` (expected: {name:
    parameter}) with the same global shape; a PEFT run's checkpoint holds all of its tensors."""
    names = reader.names("model")
    extra = [n for n in names if n not in expected]
    what = f"the {method} setup of {base}" if method else f"the model of {base}/config.json"
    if extra:
        hint = ""
        if method is None and any(k in n for n in extra for k in (".lora_", "prefix_encoder.", ".adapter_")):
            hint = ("; they are PEFT tensors, and " + ("without meta.json the method and its settings "
                    "are unknown" if meta is None else "meta.json records no PEFT method"))
        raise ValueError(f"{checkpoint} holds {len(extra)} tensors {what} has no place for, e.g. "
                         f"{extra[:3]}{hint}")
    for n in names:
        want = [int(d) for d in expected[n].shape]
        if reader.global_shape(n) != want:
            raise ValueError(f"{checkpoint}: {n} has global shape {reader.global_shape(n)} in the "
                             f"checkpoint, {what} has {want} (paddle layout): the base model "
                             "(or the PEFT settings) do not match the checkpoint")
    if method is not None:
        missing = [n for n in expected if n not in names]
        if missing:
            raise ValueError(f"{checkpoint} lacks {len(missing)} tensors {what} trains, e.g. "
                             f"{missing[:3]}: was it written by another PEFT setup?")


def check_frozen(model, base, frozen):
    """Full fine-tuning: the parameters the checkpoint lacks are in the base checkpoint."""
    if not frozen:
        return
    from ..models import check_checkpoint_shapes

    params = dict(model.named_parameters())
    check_checkpoint_shapes(model, base, model.spec, hf.CheckpointReader(base),
                            {n: params[n] for n in frozen}, {})


def check_output(output, base):
    out = os.path.abspath(output)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"output_path {output!r} is a file; give a directory (default: the "
                         "checkpoint directory)")
    if out == os.path.abspath(base):
        raise ValueError(f"output_path {output!r} is the base model directory, whose files the "
                         "merge would replace; choose another directory")
    from ..outdir import check_writable

    check_writable(out, "output_path")
    return output


def prepare(checkpoint, output=None, base=None, max_shard_size="5GB"):
    """Check every input and build the (lazy) model; nothing is read beyond headers and the
    small JSON files, nothing is written. Raises ValueError / FileNotFoundError for people."""
    from .. import peft
    from ..models import build_model, load_config
    from ..loading import load_tokenizer

    reader = open_checkpoint(checkpoint)
    meta_path = os.path.join(checkpoint, "meta.json")
    meta = read_json(meta_path, "checkpoint meta") if os.path.isfile(meta_path) else None
    args, base_dir = model_arguments(checkpoint, meta, base)
    try:
        hf.parse_size(max_shard_size)
    except ValueError:
        raise ValueError(f"max_shard_size {max_shard_size!r} is not a size such as 5GB or 200MB") from None
    _, cfg = load_config(base_dir)
    tok = load_tokenizer(args.tokenizer_name_or_path or base_dir)
    model = build_model(cfg)              # lazy: no parameter memory until a value is set
    model.name_or_path = base_dir
    setup = peft.apply(model, args, tokenizer=tok)
    params = dict(model.named_parameters())
    expected = setup.trainable if setup.method else params
    check_tensors(reader, expected, checkpoint, base_dir, setup.method, meta)
    names = set(reader.names("model"))
    frozen = [n for n in params if n not in names] if setup.method is None else []
    check_frozen(model, base_dir, frozen)
    output = check_output(output or checkpoint, base_dir)
    return MergePlan(checkpoint, output, base_dir, model, setup.method, setup, tok, reader,
                     {n: expected[n] for n in reader.names("model")}, frozen, max_shard_size)


# ------------------------------------------------------------------------------ writing

def shard_plan(sizes, limit):
    """[[names]] per output file: a file is closed before the tensor that would take it past
    `limit` bytes (models/hf.write_weights' rule, so the merge shards as the run's export does).
    sizes: [(name, bytes)] in file order. Example: sizes 4, 4, 4 with limit 10 -> [[a, b], [c]]."""
    shards, cur, cur_size = [], [], 0
    for name, n in sizes:
        if cur and cur_size + n > limit:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(name)
        cur_size += n
    return shards + [cur] if cur or not shards else shards


def _model_tensors(plan, names):
    """(HF name, HF-layout array) in `names` order, one at a time: the checkpoint's whole tensor
    (paddle layout, assembled from its pieces, transposed for Linear weights) or the base's."""
    spec = plan.model.spec
    base = hf.CheckpointReader(plan.base) if plan.frozen else None
    for name in names:
        if name in plan.tensors:
            arr = hf.to_hf_layout(spec, name, plan.reader.read(name))
            plan.reader.release()           # unmap: the pages read stop counting as ours
        else:
            arr = base.get(name).astype(np.float32, copy=False)    # HF layout already
            base.files[name].release()
        yield name, arr


def _write_model(plan, tmp):
    """The files save_pretrained writes for the full model, with the weights streamed from the
    checkpoint. (save_pretrained itself would hold a whole shard in memory before writing it,
    and its stale-file pattern "model*.safetensors" matches the checkpoint's model_state files.)"""
    from ..models import declared_dtype

    model, spec, cfg = plan.model, plan.model.spec, plan.model.config
    dtype = declared_dtype(cfg)
    code = hf.DTYPE_NAMES[dtype]
    item = 2 if dtype in ("bfloat16", "float16") else 4
    shapes = {n: hf.hf_shape(spec, n, [int(d) for d in p.shape]) for n, p in model.named_parameters()}
    names = list(shapes)
    shards = shard_plan([(n, int(np.prod(shapes[n])) * item) for n in names],
                        hf.parse_size(plan.max_shard_size))
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    tensors = _model_tensors(plan, names)
    for fname, group in zip(files, shards):
        header = {n: {"dtype": code, "shape": shapes[n]} for n in group}
        hf.stream_safetensors(os.path.join(tmp, fname), header, itertools.islice(tensors, len(group)))
    if len(shards) > 1:
        total = sum(int(np.prod(shapes[n])) * item for n in names)
        weight_map = {n: f for f, group in zip(files, shards) for n in group}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    conf = cfg.to_dict()
    conf["architectures"] = list(spec.architectures)
    src = os.path.join(plan.base, "generation_config.json")
    gen = read_json(src) if os.path.isfile(src) else {
        k: conf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if conf.get(k) is not None}
    write_json(os.path.join(tmp, "generation_config.json"), gen)
    if plan.tokenizer is not None:
        plan.tokenizer.save_pretrained(tmp)
    write_json(os.path.join(tmp, "config.json"), conf)


def _write_adapter(plan, tmp):
    """The run's own export of the adapter, after setting its tensors from the checkpoint."""
    for name, p in plan.tensors.items():
        p.set_value(plan.reader.read(name))
    plan.reader.release()
    plan.setup.export_fn(tmp)


def write(plan):
    """Write the merged directory (atomically, into plan.output). Returns plan.output."""
    stale = STALE_MODEL if plan.method is None else STALE_ADAPTER
    with publish_into(plan.output, stale_patterns=stale) as tmp:
        (_write_model if plan.method is None else _write_adapter)(plan, tmp)
        clash = [n for n in os.listdir(tmp) if any(fnmatch.fnmatch(n, p) for p in CHECKPOINT_FILES)]
        if clash:   # a programming error, caught before anything is moved into the checkpoint
            raise RuntimeError(f"the merge would overwrite checkpoint files {clash}")
    plan.reader.release()
    return plan.output


def merge_checkpoint(checkpoint, output=None, base=None, max_shard_size="5GB"):
    """prepare + write: checkpoint dir -> HF model or adapter dir. Returns the plan (written)."""
    plan = prepare(checkpoint, output, base, max_shard_size)
    write(plan)
    return plan


# ---------------------------------------------------------------- from the Trainer `t`
def through_checkpoint(t, out_dir):
    """Pipeline stages: no rank holds the whole model, so every rank writes its tensors in the
    checkpoint format into a temp dir beside the output, and rank 0 merges that into one HF
    model / HF-PEFT adapter (as llm/merge_tp_and_pp_params.py does)."""
    tmp = os.path.join(out_dir, ".export-pieces")
    model_pieces, _, _ = t.par.pieces(t.trainable, t.optimizer, ckpt)
    ckpt.save_checkpoint(tmp, t.topo, model_pieces, [], {"global_step": t.state["global_step"]},
                         writer=t.topo.dp_rank == 0, meta=t.checkpoint_meta)
    if t.main:
        merge_checkpoint(tmp, output=out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
    t.topo.barrier()


def unified_checkpoint(t, path):
    """unified_checkpoint: the checkpoint, read back whole, also written into itself as one HF
    model / HF-PEFT adapter (as llm/merge_tp_and_pp_params.py does)."""
    if t.checkpoint_meta is None:
        from ..runtime import warn_once

        warn_once("unified", "unified_checkpoint needs the run's checkpoint_meta (base model, "
                  "model arguments), which this Trainer was not given: skipped")
        return
    merge_checkpoint(path)
