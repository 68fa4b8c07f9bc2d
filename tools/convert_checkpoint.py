"""Convert pickled checkpoints once into the formats paddletune reads (it never unpickles itself).

    python tools/convert_checkpoint.py --input THUDM_DIR --output DIR      # pytorch_model*.bin
    python tools/convert_checkpoint.py --input PADDLENLP_DIR --output DIR  # model_state*.pdparams, PaddleNLP safetensors
    python tools/convert_checkpoint.py --input LORA_DIR --output DIR       # lora_model_state.pdparams

- pytorch_model*.bin (THUDM ChatGLM2/3, older HF checkpoints) -> model.safetensors (+ index):
  read with torch.load(weights_only=True), which only rebuilds tensors and plain containers.
  Names and the torch [out, in] layout are kept; the other files (config.json, tokenizer, *.py)
  are copied.
- PaddleNLP model_state*.pdparams (or its safetensors "unified checkpoint", read without
  pickle) -> HF safetensors: names ("chatglm_v2.encoder...", "llama.layers...") become HF/THUDM
  names, Linear weights go from paddle [in, out] to [out, in], config.json gets the HF
  model_type; ChatGLM2's separate query/key/value are fused and its interleaved dense_h_to_4h
  columns put back in halves (paddletune/models/paddlenlp.py, --paddlenlp_mlp).
- PaddleNLP lora_model_state.pdparams + lora_config.json -> HF-PEFT adapter
  (adapter_config.json + adapter_model.safetensors): lora_A [in, r] -> lora_A.weight [r, in],
  lora_B [r, out] -> lora_B.weight [out, r]; scale alpha/r (alpha/sqrt(r) with rslora) kept.
Pickles are never given a free hand: .pdparams files are read by a restricted unpickler that
admits only what paddle's saver writes (numpy arrays and dtypes, dicts, lists, strings, numbers)
and refuses any other class or function by name before it is called (a hostile file cannot run
code); .bin files go through torch.load(weights_only=True), whose refusal is reported the same way.
The output directory appears only when complete, and is checked against the model's own
parameter names and shapes before it appears.
"""
import argparse
import fnmatch
import glob
import itertools
import math
import os
import pickle
import re
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from paddletune import cli  # noqa: E402
from paddletune.io import atomic_dir, inside, read_json, write_json  # noqa: E402
from paddletune.models import build_model, hf, spec_for_config  # noqa: E402
from paddletune.models.spec import conversion_fixups  # noqa: E402
from paddletune.models import paddlenlp as pnlp  # noqa: E402

COPY_SKIP = ("*.bin", "*.pdparams", "*.index.json", "*.pdopt", "*.safetensors")


class ConvertError(ValueError):
    pass


def warn(msg):
    print(f"WARNING: {msg}", file=sys.stderr)


def shard_files(src, base, ext):
    """[paths] of `base`.`ext`, or of the shards named by `base`.`ext`.index.json, or of
    `base`-*.`ext` (sorted)."""
    index = os.path.join(src, f"{base}.{ext}.index.json")
    if os.path.exists(index):
        wm = read_json(index, "index")
        wm = wm.get("weight_map") if isinstance(wm, dict) else None
        if not isinstance(wm, dict):
            raise ConvertError(f"{index}: has no \"weight_map\" object (tensor name -> file)")
        paths = [inside(src, n, index) for n in sorted(set(wm.values()))]
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            raise ConvertError(f"{index} names {os.path.basename(missing[0])}, which is missing from {src}")
        return paths
    single = os.path.join(src, f"{base}.{ext}")
    return [single] if os.path.exists(single) else sorted(glob.glob(os.path.join(src, f"{base}-*.{ext}")))


def torch_tensors(files):
    """(name, np.ndarray, dtype name) from .bin files, one file in memory at a time."""
    try:
        import torch
    except ImportError:
        raise ConvertError("reading pytorch_model*.bin needs torch: pip install torch (CPU is "
                           "enough); it is used by this tool only") from None
    for path in files:
        try:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:   # legacy (non-zip) serialisation cannot be memory-mapped
                state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            if not found and re.search(r"Unsupported operand|invalid load key|EOF|truncated", str(e)):
                raise ConvertError(f"{path} is not a PyTorch checkpoint: its bytes are not a pickle "
                                   "of tensors (a damaged or incomplete download, or another "
                                   "format); copy it again") from None
            what = f"the object {found.group(1)}" if found else "objects other than tensors"
            raise ConvertError(f"{path} holds {what}, not only tensors: it was refused before "
                               "anything in it ran. Loading it in full would run code from the "
                               "file; get the weights as safetensors (or a plain tensor file) from "
                               "a source you trust") from None
        if not isinstance(state, dict):
            raise ConvertError(f"{path} holds a {type(state).__name__}, not a state dict of tensors")
        for name, t in state.items():
            dt = str(t.dtype).replace("torch.", "")
            yield name, (t.float() if dt == "bfloat16" else t).contiguous().numpy(), dt
        del state


class PaddleUnpickler(pickle.Unpickler):
    """Unpickles only what paddle.save writes for a state dict: numpy arrays (rebuilt from their
    dtype, shape and bytes), dicts, lists, tuples, strings and numbers. Every other global a
    pickle names (os.system, builtins.eval, any class) is refused here, before it is called."""

    ALLOWED = {("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("collections", "OrderedDict"),
               ("builtins", "tuple")}

    def __init__(self, file, path):
        super().__init__(file)
        self.path = path

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise ConvertError(f"{self.path} asks to run {module}.{name} while loading, which "
                               "paddle's saver never writes: refused before it ran (a hostile or "
                               "foreign file). Only tensors and plain containers are read")
        return super().find_class(module, name)


def load_pdparams(path):
    """{name: np.ndarray} of a .pdparams state dict, read without running code (see above)."""
    with open(path, "rb") as f:
        try:
            state = PaddleUnpickler(f, path).load()
        except ConvertError:
            raise
        except Exception as e:   # truncated or not a pickle at all
            raise ConvertError(f"{path} cannot be read as a paddle state dict ({type(e).__name__}: "
                               f"{str(e)[:120]}); damaged or truncated?") from None
    if not isinstance(state, dict):
        raise ConvertError(f"{path} holds a {type(state).__name__}, not a state dict of tensors")
    out = {}
    for name, v in state.items():
        if isinstance(v, np.ndarray):
            if v.dtype.kind not in "biuf":
                raise ConvertError(f"{path}: {name} is an array of {v.dtype}, not numbers")
            out[name] = v
        elif not (isinstance(name, str) and name.endswith("@@")):   # paddle's own bookkeeping
            raise ConvertError(f"{path}: {name!r} holds a {type(v).__name__}, not a tensor")
    return out


def paddle_tensors(files):
    """(name, np.ndarray, dtype name) from .pdparams files: paddle stores bfloat16 as uint16."""
    for path in files:
        state = load_pdparams(path)
        for name, arr in state.items():
            if arr.dtype == np.uint16:
                yield name, hf.bf16_to_f32(arr), "bfloat16"
            else:
                yield name, arr, str(arr.dtype)
        del state


def safetensors_tensors(files):
    """(name, np.ndarray, dtype name) from PaddleNLP's safetensors (unified checkpoints)."""
    for path in files:
        st = hf.SafetensorsFile(path)
        for name in st.keys():
            code = st.dtype(name)
            dt = next((k for k, v in hf.DTYPE_NAMES.items() if v == code), "float32")
            yield name, st.get(name), dt


def plan(src, args):
    """Decide what to convert; every check that can fail on input happens here."""
    if not os.path.isdir(src):
        raise ConvertError(f"--input {src} is not a directory")
    if os.path.abspath(src) == os.path.abspath(args.output):
        raise ConvertError("--output must differ from --input")
    if os.path.exists(args.output) and os.listdir(args.output) and not args.overwrite:
        raise ConvertError(f"--output {args.output} exists and is not empty; pass --overwrite "
                           "to replace it")
    lora = os.path.join(src, "lora_model_state.pdparams")
    if os.path.exists(lora):
        if not os.path.exists(os.path.join(src, "lora_config.json")):
            raise ConvertError(f"{src} has lora_model_state.pdparams but no lora_config.json")
        conf = read_json(os.path.join(src, "lora_config.json"), "lora_config.json")
        for key in ("pissa", "lora_use_mixer", "use_mora"):
            if conf.get(key):
                raise ConvertError(f"lora_config.json: {key}=true has no HF-PEFT equivalent here")
        return "lora", [lora], conf
    kind, files = "bin", shard_files(src, "pytorch_model", "bin")
    if not files:
        kind, files = "pdparams", shard_files(src, "model_state", "pdparams")
    if not files:
        files = shard_files(src, "model", "safetensors")
        if files and not any(pnlp.prefix_of(k) for k in hf.SafetensorsFile(files[0]).keys()):
            raise ConvertError(f"{src} already holds Hugging Face safetensors; load it directly")
        kind = "safetensors"
    if not files:
        found = sorted(os.listdir(src))
        raise ConvertError(f"{src} holds no pytorch_model*.bin, model_state*.pdparams, PaddleNLP "
                           "safetensors or lora_model_state.pdparams (found: "
                           f"{', '.join(found[:10]) or 'nothing'})")
    conf = read_json(os.path.join(src, "config.json"), "config.json")
    if kind != "bin":
        conf = pnlp.hf_config(conf)
    # facts a family's files may not state (ChatGLM's rope_ratio meaning): models/ knows which
    conf.update(conversion_fixups(src, conf, {"rope_ratio_mode": args.rope_ratio_mode}))
    spec_for_config(conf).config_cls.from_dict(conf)  # must load here
    return kind, files, conf


def check_against_model(conf, shapes):
    """The written tensors must be exactly the model's parameters, in HF layout."""
    spec = spec_for_config(conf)
    model = build_model(conf)   # lazy: no weights allocated
    for name, p in model.named_parameters():
        if name not in shapes:
            raise ConvertError(f"converted checkpoint lacks {name}; is config.json from the same model?")
        want = hf.hf_shape(spec, name, p.shape)
        if shapes[name] != want:
            raise ConvertError(f"{name}: converted shape {shapes[name]}, the model expects {want}")


def source_dtype(args, first):
    if args.dtype != "auto":
        return args.dtype
    return first if first in hf.DTYPE_NAMES else "float32"


def convert_model(src, kind, files, conf, args, tmp):
    reader = {"bin": torch_tensors, "pdparams": paddle_tensors,
              "safetensors": safetensors_tensors}[kind](files)
    dtypes, shapes = [], {}

    def arrays():
        for name, arr, dt in reader:
            dtypes.append(dt)
            yield name, arr

    stream = arrays() if kind == "bin" else pnlp.to_hf(arrays(), conf["model_type"], args.paddlenlp_mlp)
    first = next(stream, None)   # the source dtype decides "auto"
    if first is None:
        raise ConvertError(f"{files[0]} holds no tensors")
    dtype = source_dtype(args, dtypes[0])

    def recorded():
        for name, arr in itertools.chain([first], stream):
            shapes[name] = list(arr.shape)
            yield name, arr

    hf.write_weights(tmp, recorded(), args.max_shard_size, dtype)
    check_against_model(conf, shapes)
    for name in os.listdir(src):
        full = os.path.join(src, name)
        if os.path.isfile(full) and not any(fnmatch.fnmatch(name, p) for p in COPY_SKIP):
            shutil.copyfile(full, os.path.join(tmp, name))
    write_json(os.path.join(tmp, "config.json"), conf)
    return len(shapes), dtype


def convert_lora(files, conf, args, tmp):
    r = int(conf.get("r", 8))
    dtypes = []

    def arrays():
        for name, arr, dt in paddle_tensors(files):
            dtypes.append(dt)
            yield name, arr

    try:
        tensors, modules = pnlp.lora_to_peft(arrays(), r, args.paddlenlp_mlp)
    except ValueError as e:
        raise ConvertError(f"{files[0]}: {e}") from None
    dtype = source_dtype(args, dtypes[0] if dtypes else "float32")
    hf.write_safetensors(os.path.join(tmp, "adapter_model.safetensors"), tensors, dtype=dtype)
    alpha = conf.get("lora_alpha", r)
    adapter = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
               "lora_dropout": float(conf.get("lora_dropout", 0.0)),
               "use_rslora": bool(conf.get("rslora", False)), "target_modules": modules,
               "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
               "init_lora_weights": True, "modules_to_save": None,
               "base_model_name_or_path": conf.get("base_model_name_or_path")}
    write_json(os.path.join(tmp, "adapter_config.json"), adapter)
    scale = alpha / (math.sqrt(r) if adapter["use_rslora"] else r)
    return len(tensors), dtype, scale


@cli.entry   # errors anywhere below: one `error:` line, exit 2
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", required=True, help="directory with the pickled checkpoint")
    ap.add_argument("--output", required=True, help="new directory to write")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="dtype of the written float tensors (auto: as the source)")
    ap.add_argument("--max_shard_size", default="5GB", help="split model weights into shards of this size")
    ap.add_argument("--rope_ratio_mode", choices=["base", "position"], default=None,
                    help="ChatGLM rope_ratio meaning when modeling_chatglm.py is absent")
    ap.add_argument("--paddlenlp_mlp", choices=["interleaved", "halves"], default="interleaved",
                    help="column order of PaddleNLP ChatGLM2 dense_h_to_4h: interleaved (PaddleNLP's "
                         "tensor-parallel layout, the default) or halves (THUDM's, older releases)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    args = ap.parse_args(argv)
    try:
        kind, files, conf = plan(args.input, args)
        if kind in ("bin", "pdparams", "lora"):
            what = "torch.load(weights_only=True)" if kind == "bin" else "a restricted unpickler"
            warn(f"reading {len(files)} pickle file(s) with {what} (tensors and plain containers only)")
        with atomic_dir(args.output) as tmp:
            if kind == "lora":
                n, dtype, scale = convert_lora(files, conf, args, tmp)
                print(f"wrote HF-PEFT adapter: {n} tensors ({dtype}), scale {scale:g} -> {args.output}")
            else:
                n, dtype = convert_model(args.input, kind, files, conf, args, tmp)
                print(f"wrote {n} tensors ({dtype}) as safetensors -> {args.output}")
    except (ConvertError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
