"""Convert pickled checkpoints once into the formats paddletune reads (it never unpickles itself).

    python tools/convert_checkpoint.py --input THUDM_DIR --output DIR      # pytorch_model*.bin
    python tools/convert_checkpoint.py --input PADDLENLP_DIR --output DIR  # model_state*.pdparams
    python tools/convert_checkpoint.py --input LORA_DIR --output DIR       # lora_model_state.pdparams

- pytorch_model*.bin (THUDM ChatGLM2/3, older HF checkpoints) -> model.safetensors (+ index):
  read with torch.load(weights_only=True), which only rebuilds tensors and plain containers.
  Names and the torch [out, in] layout are kept; the other files (config.json, tokenizer, *.py)
  are copied.
- PaddleNLP model_state*.pdparams -> HF safetensors: PaddleNLP names ("chatglm_v2.encoder...",
  "llama.layers...") become HF/THUDM names, Linear weights go from paddle [in, out] to
  [out, in], config.json gets the HF model_type.
- PaddleNLP lora_model_state.pdparams + lora_config.json -> HF-PEFT adapter
  (adapter_config.json + adapter_model.safetensors): lora_A [in, r] -> lora_A.weight [r, in],
  lora_B [r, out] -> lora_B.weight [out, r]; scale alpha/r (alpha/sqrt(r) with rslora) kept.
paddle.load unpickles arbitrary objects: use the .pdparams routes only on files you trust.
The output directory appears only when complete, and is checked against the model's own
parameter names and shapes before it appears.
"""
import argparse
import fnmatch
import glob
import json
import math
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from paddletune.io import atomic_dir, read_json, write_json  # noqa: E402
from paddletune.models import hf  # noqa: E402

# PaddleNLP model_type -> (HF model_type, PaddleNLP name prefix, HF name prefix)
PADDLENLP = {"chatglm_v2": ("chatglm", "chatglm_v2.", "transformer."),
             "llama": ("llama", "llama.", "model."), "qwen2": ("qwen2", "qwen2.", "model."),
             "mistral": ("mistral", "mistral.", "model.")}
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
        names = sorted(set(read_json(index, "index")["weight_map"].values()))
        missing = [n for n in names if not os.path.exists(os.path.join(src, n))]
        if missing:
            raise ConvertError(f"{index} names {missing[0]}, which is missing from {src}")
        return [os.path.join(src, n) for n in names]
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
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:   # legacy (non-zip) serialisation cannot be memory-mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
        for name, t in state.items():
            dt = str(t.dtype).replace("torch.", "")
            yield name, (t.float() if dt == "bfloat16" else t).contiguous().numpy(), dt
        del state


def paddle_tensors(files):
    """(name, np.ndarray, dtype name) from .pdparams files (paddle.load unpickles)."""
    import paddle

    for path in files:
        state = paddle.load(path)
        for name, t in state.items():
            if not isinstance(t, paddle.Tensor):
                t = paddle.to_tensor(np.asarray(t))
            dt = str(t.dtype).replace("paddle.", "")
            yield name, (t.astype("float32") if dt == "bfloat16" else t).numpy(), dt
        del state


def rope_ratio_mode(src, conf, override):
    """ChatGLM's rope_ratio scales the rope base (ChatGLM3/GLM-4) or the positions (ChatGLM2-32K);
    the checkpoint's modeling_chatglm.py says which."""
    if conf.get("model_type") not in ("chatglm", "chatglm_v2") or float(conf.get("rope_ratio", 1) or 1) == 1:
        return None
    if override or conf.get("rope_ratio_mode"):
        return override or conf["rope_ratio_mode"]
    code = os.path.join(src, "modeling_chatglm.py")
    if os.path.exists(code):
        text = open(code, encoding="utf-8", errors="replace").read()
        if "base = base * self.rope_ratio" in text:
            return "base"
        if "/ self.rope_ratio" in text:
            return "position"
    raise ConvertError(f"{src}/config.json has rope_ratio={conf['rope_ratio']} and no "
                       "modeling_chatglm.py to tell its meaning; pass --rope_ratio_mode base "
                       "(ChatGLM3/GLM-4) or position (ChatGLM2-6B-32K)")


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
    files = shard_files(src, "pytorch_model", "bin")
    kind = "bin"
    if not files:
        files, kind = shard_files(src, "model_state", "pdparams"), "pdparams"
    if not files:
        found = sorted(os.listdir(src))
        raise ConvertError(f"{src} holds no pytorch_model*.bin, model_state*.pdparams or "
                           f"lora_model_state.pdparams (found: {', '.join(found[:10]) or 'nothing'})")
    if glob.glob(os.path.join(src, "*.safetensors")):
        raise ConvertError(f"{src} already has *.safetensors weights; load it directly")
    conf = read_json(os.path.join(src, "config.json"), "config.json")
    if kind == "pdparams":
        mt = conf.get("model_type")
        if mt not in PADDLENLP:
            raise ConvertError(f"{src}/config.json: PaddleNLP model_type {mt!r} is not known to "
                               f"this tool; known: {sorted(PADDLENLP)}")
        conf = dict(conf, model_type=PADDLENLP[mt][0])
    from paddletune.models import get_spec

    spec = get_spec(conf.get("model_type", "llama"))
    mode = rope_ratio_mode(src, conf, args.rope_ratio_mode)
    conf = dict(conf, architectures=conf.get("architectures") if kind == "bin" else list(spec.architectures))
    if mode:
        conf["rope_ratio_mode"] = mode
    spec.config_cls.from_dict(conf)   # the converted config must load here
    return kind, files, conf


def check_against_model(conf, shapes):
    """The written tensors must be exactly the model's parameters, in HF layout."""
    from paddletune.models import build_model, get_spec

    spec = get_spec(conf["model_type"])
    model = build_model(conf)   # lazy: no weights allocated
    for name, p in model.named_parameters():
        if name not in shapes:
            raise ConvertError(f"converted checkpoint lacks {name}; is config.json from the same model?")
        want = list(p.shape)[::-1] if hf.is_linear_weight(spec, name, len(p.shape)) else list(p.shape)
        if shapes[name] != want:
            raise ConvertError(f"{name}: converted shape {shapes[name]}, the model expects {want}")


def out_dtype(args, first):
    return first if args.dtype == "auto" else args.dtype


def convert_model(src, kind, files, conf, args, tmp):
    from paddletune.models import get_spec

    spec = get_spec(conf["model_type"])
    shapes, seen = {}, {}
    pre = PADDLENLP.get(read_json(os.path.join(src, "config.json")).get("model_type"), (None, None, None))

    def tensors():
        reader = torch_tensors(files) if kind == "bin" else paddle_tensors(files)
        for name, arr, dt in reader:
            seen.setdefault("dtype", dt)
            if kind == "pdparams":
                if pre[1] and name.startswith(pre[1]):
                    name = pre[2] + name[len(pre[1]):]
                arr = hf.to_hf_layout(spec, name, arr)
            shapes[name] = list(arr.shape)
            yield name, arr

    gen = tensors()
    first = next(gen, None)   # the source dtype decides "auto"
    if first is None:
        raise ConvertError(f"{files[0]} holds no tensors")
    dtype = out_dtype(args, seen["dtype"] if seen["dtype"] in hf.DTYPE_NAMES else "float32")

    def chain():
        yield first
        yield from gen

    hf.write_weights(tmp, chain(), args.max_shard_size, dtype)
    check_against_model(conf, shapes)
    for name in os.listdir(src):
        full = os.path.join(src, name)
        if os.path.isfile(full) and not any(fnmatch.fnmatch(name, p) for p in COPY_SKIP):
            shutil.copyfile(full, os.path.join(tmp, name))
    conf = dict(conf)
    if kind == "pdparams":
        conf.setdefault("torch_dtype", dtype)
    write_json(os.path.join(tmp, "config.json"), conf)
    return len(shapes), dtype


def convert_lora(files, conf, args, tmp):
    tensors, modules, first = {}, set(), None
    for name, arr, dt in paddle_tensors(files):
        first = first or dt
        head, _, leaf = name.rpartition(".")
        if leaf not in ("lora_A", "lora_B"):
            raise ConvertError(f"{files[0]}: {name} is not a lora_A/lora_B matrix; only plain "
                               "LoRA adapters convert to HF-PEFT")
        prefix = next((p for p in PADDLENLP.values() if head.startswith(p[1])), None)
        if prefix is None:
            raise ConvertError(f"{files[0]}: {name} has no known PaddleNLP model prefix "
                               f"({', '.join(p[1] for p in PADDLENLP.values())})")
        module = prefix[2] + head[len(prefix[1]):]
        modules.add(module)
        tensors[f"base_model.model.{module}.{leaf}.weight"] = np.ascontiguousarray(arr.T)
    r = int(conf.get("r", 8))
    for m in sorted(modules):
        a, b = (tensors.get(f"base_model.model.{m}.lora_{x}.weight") for x in "AB")
        if a is None or b is None or a.shape[0] != r or b.shape[1] != r:
            raise ConvertError(f"{m}: needs lora_A [in, {r}] and lora_B [{r}, out] (r from "
                               "lora_config.json)")
    dtype = out_dtype(args, first if first in hf.DTYPE_NAMES else "float32")
    hf.write_safetensors(os.path.join(tmp, "adapter_model.safetensors"), tensors, dtype=dtype)
    alpha = conf.get("lora_alpha", r)
    adapter = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
               "lora_dropout": float(conf.get("lora_dropout", 0.0)),
               "use_rslora": bool(conf.get("rslora", False)), "target_modules": sorted(modules),
               "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
               "init_lora_weights": True, "modules_to_save": None,
               "base_model_name_or_path": conf.get("base_model_name_or_path")}
    write_json(os.path.join(tmp, "adapter_config.json"), adapter)
    scale = alpha / (math.sqrt(r) if adapter["use_rslora"] else r)
    return len(tensors), dtype, scale


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", required=True, help="directory with the pickled checkpoint")
    ap.add_argument("--output", required=True, help="new directory to write")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="dtype of the written float tensors (auto: as the source)")
    ap.add_argument("--max_shard_size", default="5GB", help="split model weights into shards of this size")
    ap.add_argument("--rope_ratio_mode", choices=["base", "position"], default=None,
                    help="ChatGLM rope_ratio meaning when modeling_chatglm.py is absent")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    args = ap.parse_args(argv)
    try:
        kind, files, conf = plan(args.input, args)
        what = "torch.load(weights_only=True)" if kind == "bin" else "paddle.load, which unpickles"
        warn(f"reading {len(files)} pickle file(s) with {what}: convert only files you trust")
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
