"""Arguments of pre-training: PaddleNLP's llm/run_pretrain.py argument files, on paddletune.args.

    a = parse_args(argv)          # argv: ARGS.json [--key value ...]
    a.model, a.data, a.quant, a.training    # paddletune.args' dataclasses (model, training, parallel)
    a.pretrain                               # PretrainArgument below

A key paddletune.args knows (model_name_or_path, learning_rate, max_steps, tensor_parallel_degree,
use_fused_rms_norm, ...) means there what it means for SFT and is parsed there; the keys below are
the ones PaddleNLP's run_pretrain.py adds (its DataArguments / ModelArguments / PreTrainingArguments),
each with its table row in the metadata as in args.py (implemented / no_effect: warns once /
refused). `continue_training` is read here (PaddleNLP's pre-training meaning and default, false:
random init from model_name_or_path's config.json; true: load its weights), not with
paddletune.args' fine-tuning meaning. A key neither table knows fails naming the file and the
closest key of both. `dataset_name_or_path`, required by paddletune.args for SFT, is filled from
input_dir.
"""
import dataclasses
import difflib
import json
import sys
from dataclasses import dataclass
from typing import Optional

from . import args as base
from .args import F, ArgumentError


@dataclass
class PretrainArgument:
    input_dir: str = F(None, "corpora: a directory of PREFIX.bin/.idx (or PREFIX_ids.npy/_idx.npz) files (equal weights), one PREFIX, or 'w1 PREFIX1 w2 PREFIX2 ...' (tools/preprocess_data.py writes them)")
    split: str = F("949,50,1", "train,valid,test weights over each corpus's documents (PaddleNLP's rule: contiguous ranges)")
    max_seq_length: int = F(1024, "tokens per sample: documents are concatenated and cut into windows of this length")
    continue_training: bool = F(False, "true: load model_name_or_path's weights (continued pre-training); false: random init from its config.json")
    num_hidden_layers: Optional[int] = F(None, "the config's number of layers, overridden (random init; with continue_training it must equal the checkpoint's)")
    reset_position_ids: bool = F(False, "restart position ids at each document start inside a sample (Megatron's flag)")
    reset_attention_mask: bool = F(False, "no attention across document starts inside a sample (the packed-rows attention path; Megatron's flag)")
    share_folder: bool = F(False, "PaddleNLP: the nodes share one data folder", "no_effect", "the dataset indices are computed in memory on every rank; no index files are written")
    data_impl: str = F("mmap", "corpus layout: mmap (.bin/.idx) or lazy (PaddleNLP's older _ids.npy/_idx.npz; both are read whatever this says)", choices=["mmap", "lazy"])
    skip_warmup: bool = F(True, "PaddleNLP: skip pre-reading the memory map", "no_effect", "the .bin is read by windows; nothing is pre-read")
    data_cache: Optional[str] = F(None, "PaddleNLP: directory of cached index files", "no_effect", "the indices are computed in memory (flat arrays) at start")
    min_learning_rate: float = F(1e-5, "PaddleNLP: the floor of the decayed learning rate", "no_effect", "the schedule decays as lr_scheduler_type says (to 0 for linear / cosine)")
    enable_linear_fused_grad_add: bool = F(False, "fused gradient accumulation in Linear (GPU)", "no_effect", base.NOEFF_FUSED)
    use_fused_rms_norm: bool = F(False, "fused RMSNorm kernel (GPU)", "no_effect", base.NOEFF_FUSED)


OWN = {f.name: f for f in dataclasses.fields(PretrainArgument)}
# keys both tables have: the pre-training meaning wins (read here, not passed on)
OVERRIDES = ("continue_training",)


@dataclass
class PretrainArgs:
    model: object
    data: object
    quant: object
    generate: object
    training: object
    pretrain: PretrainArgument
    sources: dict
    given: frozenset = frozenset()

    def source(self, key):
        return self.sources.get(key, "arguments")


def markdown_table():
    rows = ["| key | default | status | meaning |", "|---|---|---|---|"]
    for name, f in OWN.items():
        m = f.metadata
        status = {"implemented": "implemented", "no_effect": "accepted, warns: " + (m["why"] or ""),
                  "refused": "refused: " + (m["why"] or "")}[m["status"]]
        rows.append(f"| `{name}` | `{f.default}` | {status} | {m['help']} |")
    return "\n".join(rows)


def help_text():
    lines = ["usage: python llm/run_pretrain.py ARGS.json [--key value ...]", "",
             "pre-training keys (PaddleNLP's names); every key of llm/finetune_generation.py below also applies:"]
    for name, f in OWN.items():
        m = f.metadata
        tag = {"implemented": "", "no_effect": " [accepted, no effect here]", "refused": " [refused]"}[m["status"]]
        lines.append(f"  --{name} ({base._type_of(f).__name__}, default {f.default}){tag}")
        lines.append(f"      {m['help']}" + (f" ({m['why']})" if m["status"] != "implemented" else ""))
    return "\n".join(lines) + "\n\n" + base.help_text()


def parse_args(argv=None, warn=None):
    """argv (default sys.argv[1:]) -> PretrainArgs; ArgumentError on any bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        raise SystemExit(0)
    warn = warn or (lambda msg: print("WARNING: " + msg, file=sys.stderr))
    is_bool = lambda k: (k in OWN and base._type_of(OWN[k]) is bool) or base._is_bool_key(k)  # noqa: E731
    values, sources = base.read_argv(argv, is_bool)
    shared, own = {}, {}
    for key, value in values.items():
        src = sources.get(key, "arguments")
        if key in OWN and (key in OVERRIDES or key not in base.TABLE):
            own[key] = _own_value(key, value, OWN[key], src, warn)
        elif key in base.TABLE or key in base.ALIASES:
            shared[key] = value
        else:
            m = difflib.get_close_matches(key, list(base.TABLE) + list(OWN), n=1, cutoff=0.6)
            hint = f"; did you mean '{m[0]}'?" if m else "; run with --help for the keys of run_pretrain.py"
            raise ArgumentError(f"{src}: unknown key '{key}'{hint}")
    p = PretrainArgument(**own)
    if not p.input_dir:
        raise ArgumentError(f"'input_dir' is required ({OWN['input_dir'].metadata['help']})")
    if "dataset_name_or_path" not in shared:   # required by paddletune.args; unused here
        shared["dataset_name_or_path"], sources["dataset_name_or_path"] = p.input_dir, sources.get("input_dir", "arguments")
    model, data, quant, gen, training = base.build(shared, sources, warn)
    a = PretrainArgs(model, data, quant, gen, training, p, sources, frozenset(values))
    _check(a, warn)
    return a


def _own_value(key, value, f, src, warn):
    v = base._convert(key, value, f, src)
    choices = f.metadata["choices"]
    if choices and v not in choices:
        raise ArgumentError(f"{src}: '{key}' must be one of {choices}, got {v!r}")
    if v != f.default and f.metadata["status"] == "refused":
        raise ArgumentError(f"{src}: '{key}: {json.dumps(value)}' is not supported: {f.metadata['why']}")
    if v != f.default and f.metadata["status"] == "no_effect":
        warn(f"'{key}: {json.dumps(value)}' has no effect here: {f.metadata['why']}")
    return v


def _check(a, warn):
    def err(key, msg):
        raise ArgumentError(f"{a.source(key)}: '{key}' {msg}")

    p, m = a.pretrain, a.model
    if p.max_seq_length <= 1:
        err("max_seq_length", f"must be > 1, got {p.max_seq_length}")
    if p.num_hidden_layers is not None and p.num_hidden_layers <= 0:
        err("num_hidden_layers", f"must be positive, got {p.num_hidden_layers}")
    peft = [k for k in base.PEFT_METHODS if getattr(m, k)]
    if peft:
        err(peft[0], "is not available for pre-training (all weights train); use llm/finetune_generation.py")
    for key, on in (("zero_padding", a.data.zero_padding), ("lazy", a.data.lazy),
                    ("eval_with_do_generation", a.data.eval_with_do_generation)):
        if on:
            err(key, "has no meaning in pre-training (samples are fixed windows of max_seq_length); remove it")
    for key, instead in (("src_length", "max_seq_length"), ("max_length", "max_seq_length"),
                         ("dataset_name_or_path", "input_dir")):
        if key in a.given:
            warn(f"'{key}' has no effect in pre-training: use {instead}")
