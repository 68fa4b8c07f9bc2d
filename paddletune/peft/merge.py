"""Merge a LoRA adapter into its base checkpoint: pure functions over tensors, streamed to disk.

    W' = W + s * B @ A      W [out, in], A [r, in], B [out, r]: torch layout, as both files hold
                            them, so the merge needs no transpose at all.

The base tensors are read from the base checkpoint files (models.hf.CheckpointReader), never from
an in-memory model: a QLoRA adapter trained on a quantized backbone merges into the original
full-precision weights. Tensors are read, merged, converted to the base dtype and written one at a
time, and each file's memory map is released after use, so peak memory stays near the largest
tensor rather than a model copy. The output mirrors the base layout (same shard files, same
index, same dtypes) and is published atomically with config.json and the tokenizer.
"""
import logging
import os
import shutil

import numpy as np

from ..io import atomic_dir, write_json
from ..models import hf
from . import lora as lora_mod
from .common import read_builtin_name

logger = logging.getLogger("paddletune")


def merge_lora_tensor(weight, A, B, scaling):
    """W + scaling * B @ A in float32. weight [out, in], A [r, in], B [out, r] (torch layout)."""
    w = np.asarray(weight, np.float32)
    return w + np.float32(scaling) * (np.asarray(B, np.float32) @ np.asarray(A, np.float32))


def merge_lora_state(tensors, modules, scaling):
    """Stream (name, array) pairs of a torch-layout state dict, merging LoRA where it applies.

    tensors: iterable of (HF name, np.ndarray); modules: {module name: (A, B)} (see above).
    A tensor "<module>.weight" is merged; every other tensor passes through unchanged. Raises if
    some adapted module never appeared (the base lacks it)."""
    pending = set(modules)
    for name, arr in tensors:
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        if module in modules:
            A, B = modules[module]
            if list(arr.shape) != [B.shape[0], A.shape[1]]:
                raise ValueError(f"{name}: base shape {list(arr.shape)} does not match the adapter "
                                 f"([out, in] = [{B.shape[0]}, {A.shape[1]}])")
            arr = merge_lora_tensor(arr, A, B, scaling)
            pending.discard(module)
        yield name, arr
    if pending:
        raise ValueError(f"the base checkpoint has no weight for adapted modules {sorted(pending)[:3]}")


def resolve_base(lora_path, conf, base_path=None):
    from ..models import resolve_model_path

    name = base_path or conf.get("base_model_name_or_path")
    builtin = read_builtin_name(lora_path, conf)
    if not base_path and builtin and not (name and os.path.isdir(name)):
        name = builtin   # a built-in base whose generated directory is not here: made again
    if not name:
        raise ValueError(f"{lora_path}/adapter_config.json has no base_model_name_or_path; pass "
                         "--model_name_or_path BASE_DIR")
    return resolve_model_path(name, "model_name_or_path" if base_path else
                              f"base_model_name_or_path in {lora_path}/adapter_config.json")


def _check_output(out_path, protected):
    out = os.path.abspath(out_path)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"merge_lora_model_path {out_path!r} is an existing file, which the merged "
                         "model directory would replace; choose a new directory")
    for p in protected:
        if out == os.path.abspath(p):
            raise ValueError(f"merge_lora_model_path {out_path!r} is the adapter or base directory; "
                             "choose a new directory")
    if os.path.isdir(out) and os.listdir(out) and not os.path.exists(os.path.join(out, "config.json")):
        raise ValueError(f"merge_lora_model_path {out_path!r} exists and is not a model directory; "
                         "choose a new or empty directory")
    from ..outdir import check_writable

    check_writable(out, "merge_lora_model_path")


def _same_place(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def warn_other_base(lora_path, conf, base_path, base):
    """--model_name_or_path overriding adapter_config.json's base: said with both names, since
    an adapter merged into another base (even of the same shapes) is a different model."""
    recorded = conf.get("base_model_name_or_path")
    if not base_path or not recorded:
        return
    from ..models import BUILTIN_MODELS, resolve_model_path

    if recorded in BUILTIN_MODELS or os.path.isdir(recorded):
        same = _same_place(resolve_model_path(recorded), base)
    else:
        same = os.path.basename(os.path.normpath(recorded)) == os.path.basename(os.path.normpath(base))
    if not same:
        logger.warning("%s/adapter_config.json says the adapter was trained on %s, but it is merged "
                       "into %s (--model_name_or_path): make sure that is the same model", lora_path,
                       recorded, base_path)


def merge_lora(lora_path, out_path, base_path=None):
    """Write base + LoRA as a HF model directory at out_path (atomically). Returns out_path."""
    conf, modules, _ = lora_mod.read(lora_path)
    base = resolve_base(lora_path, conf, base_path)
    _check_output(out_path, (lora_path, base))
    warn_other_base(lora_path, conf, base_path, base)
    reader = hf.CheckpointReader(base)
    for module, (A, B) in modules.items():         # every check before anything is written
        name = module + ".weight"
        if name not in reader:
            raise ValueError(f"{lora_path}: adapter targets {module!r}, but the base checkpoint "
                             f"{base} has no tensor {name}")
        if reader.shape(name) != [B.shape[0], A.shape[1]]:
            raise ValueError(f"{lora_path}: {module} adapter is for [out, in] = [{B.shape[0]}, "
                             f"{A.shape[1]}], the base {base} holds {reader.shape(name)}: the "
                             "adapter belongs to a base model of other shapes")
    files = {}
    for name, st in reader.files.items():          # base file -> its tensors in file order
        files.setdefault(st, []).append(name)
    with atomic_dir(out_path) as tmp:
        pending = dict(modules)
        for st, names in files.items():
            names.sort(key=lambda n: st.header[n]["data_offsets"][0])
            mine = {m: pending.pop(m) for m in list(pending) if m + ".weight" in names}
            header = {n: {"dtype": st.dtype(n), "shape": st.shape(n)} for n in names}
            hf.stream_safetensors(os.path.join(tmp, os.path.basename(st.path)), header,
                                  merge_lora_state(_read_each(st, names), mine, conf["_scaling"]),
                                  metadata=st.metadata or None)
            st.release()
        for extra in ("config.json", "generation_config.json", "model.safetensors.index.json"):
            if os.path.exists(os.path.join(base, extra)):
                shutil.copyfile(os.path.join(base, extra), os.path.join(tmp, extra))
        _copy_tokenizer(lora_path, base, tmp)
        write_json(os.path.join(tmp, "merge_info.json"), {
            "base_model": base, "lora_path": os.path.abspath(lora_path), "r": conf["r"],
            "lora_alpha": conf.get("lora_alpha"), "use_rslora": bool(conf.get("use_rslora")),
            "merged_modules": len(modules)})
    logger.info("merged %d LoRA modules of %s into %s -> %s", len(modules), lora_path, base, out_path)
    return out_path


def _read_each(st, names):
    """Tensors of one file, one at a time; the map is dropped after each so RSS stays flat."""
    for n in names:
        arr = st.get(n)
        st.release()
        yield n, arr


def _copy_tokenizer(lora_path, base, out):
    """The tokenizer saved with the adapter (the fine-tuned run's), else the base's, copied by its
    family's class (loading.tokenizer_class's choice; peft sits below loading, so it asks the
    models registry itself)."""
    from ..models.spec import tokenizer_class_of
    from ..tokenizer import Tokenizer

    for src in (lora_path, base):
        if any(os.path.exists(os.path.join(src, f)) for f in ("tokenizer.json", "tokenizer.model")):
            (tokenizer_class_of(src) or Tokenizer)(src).save_pretrained(out)
            return
    logger.warning("no tokenizer files in %s or %s; the merged model has none", lora_path, base)
