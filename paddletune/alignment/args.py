"""Arguments of preference training: PaddleNLP's DPO / KTO argument files, on paddletune.args.

    a = parse_args(argv, "dpo")     # or "kto"; argv: ARGS.json [--key value ...]
    a.model, a.data, a.quant, a.training    # paddletune.args' dataclasses (LoRA, training, parallel)
    a.pref_data, a.config, a.extras         # the dataclasses below

A key paddletune.args knows (model_name_or_path, lora, lora_rank, learning_rate, tensor_parallel_
degree, chat_template, zero_padding, ...) means there what it means for SFT and is parsed there;
the keys below are the ones PaddleNLP's llm/alignment/{dpo,kto}/*_argument.py add (its
DPOConfig / KTOConfig, DPODataArgument, DPOModelArgument), with each field's table row in its
metadata as in args.py (implemented / no_effect: warns once / refused). A key neither table
knows fails naming the file and the closest key of both. `dataset_name_or_path`, required by
paddletune.args for SFT, is filled from train_dataset_path (preference data is read from the two
paths, not from a directory).

Resolved values (PaddleNLP's llm/alignment/dpo/run_dpo.py habits, the one step that changes a
parsed value):
  loss_type orpo          -> loss_type or, reference_free true, sft_loss_ratio 1.0
  loss_type or / simpo    -> reference_free true (warned when it was false)
  rslora_plus             -> rslora true, lora_plus_scale 4, lora_alpha 4
"""
import dataclasses
import difflib
import json
import sys
from dataclasses import dataclass

from .. import args as base
from ..args import F, ArgumentError

DPO_LOSSES = ("sigmoid", "hinge", "ipo", "kto_pair", "sppo_hard", "nca_pair", "dpop", "or", "orpo", "simpo")
REFERENCE_FREE_OK = ("sigmoid", "hinge", "ipo", "or", "simpo")   # PaddleNLP's DPOTrainer rule
AVERAGED = ("ipo", "or", "simpo")   # losses on per-token mean log-probabilities (PaddleNLP, TRL)


@dataclass
class PreferenceDataArgument:
    train_dataset_path: str = F("./data/train.jsonl", "JSON-lines file (or a directory of *.json / *.jsonl) of training rows: PaddleNLP's {src, tgt, response, sort} or TRL's {prompt, chosen, rejected} / {chosen, rejected} messages (KTO: {prompt, completion, label})")
    dev_dataset_path: str = F("./data/dev.jsonl", "dev rows in the same formats (read with do_eval)")
    max_seq_len: int = F(4096, "max tokens of one sequence, prompt + one response (as max_length in SFT); responses are cut from the right")
    max_prompt_len: int = F(2048, "max tokens of the prompt when a sequence is too long (as src_length in SFT: oldest rounds dropped, then the last user text cut from the left)")


@dataclass
class DPOConfig:
    beta: float = F(0.1, "beta: a response's reward is beta x (log p_policy - log p_reference); the strength of the pull towards the reference")
    simpo_gamma: float = F(0.5, "SimPO target margin gamma (loss_type simpo)")
    label_smoothing: float = F(0.0, "conservative DPO: the preference label is wrong with this probability (sigmoid, simpo)")
    loss_type: str = F("sigmoid", "sigmoid (DPO), hinge (RSO), ipo, kto_pair, sppo_hard, nca_pair, dpop, or / orpo (ORPO), simpo", choices=list(DPO_LOSSES))
    pref_loss_ratio: float = F(1.0, "weight of the preference loss")
    sft_loss_ratio: float = F(0.0, "weight of the chosen responses' token-mean negative log-likelihood added to the loss")
    dpop_lambda: float = F(50.0, "DPOP lambda: penalty on the chosen log-ratio falling below the reference (loss_type dpop)")
    ref_model_update_steps: int = F(-1, "copy the policy into the reference every N steps", "refused", "the reference stays the initial model (or, with LoRA, the base without the adapter); remove the key or set -1")
    reference_free: bool = F(False, "no reference model: log-ratios are the policy's log-probabilities (sigmoid, hinge, ipo, or, simpo)")


@dataclass
class KTOConfig:
    beta: float = F(0.1, "beta: a response's reward is beta x (log p_policy - log p_reference); the strength of the pull towards the reference")
    desirable_weight: float = F(1.0, "weight of the desirable (label 1) examples' losses")
    undesirable_weight: float = F(1.0, "weight of the undesirable (label 0) examples' losses")


@dataclass
class PaddleNLPExtras:
    """Keys of PaddleNLP's alignment argument classes that paddletune.args has no field for."""
    flash_mask: bool = F(False, "FlashMask inside GPU flash attention", "no_effect", "packed rows get exact block-diagonal attention here")
    sequence_parallel: bool = F(False, "Megatron sequence parallelism", "no_effect", "activations are not split along the sequence (same results)")
    tensor_parallel_output: bool = F(True, "keep the logits split over tensor-parallel ranks", "no_effect", "under tensor parallelism the log-probabilities always come from vocabulary shards")
    rslora_plus: bool = F(False, "PaddleNLP's rsLoRA+ preset: rslora true, lora_plus_scale 4, lora_alpha 4")
    autotuner_benchmark: bool = F(False, "PaddleNLP's autotuner benchmark mode", "no_effect", "use benchmarks/")


def own_classes(kind):
    return (PreferenceDataArgument, DPOConfig if kind == "dpo" else KTOConfig, PaddleNLPExtras)


def own_table(kind):
    """{key: (class, field)} of the keys this module adds for `kind` that paddletune.args lacks."""
    return {f.name: (cls, f) for cls in own_classes(kind) for f in dataclasses.fields(cls)
            if f.name not in base.TABLE}


@dataclass
class PreferenceArgs:
    kind: str
    model: object
    data: object
    quant: object
    generate: object
    training: object
    pref_data: PreferenceDataArgument
    config: object
    extras: PaddleNLPExtras
    sources: dict
    given: frozenset = frozenset()   # the keys the file and command line set

    def source(self, key):
        return self.sources.get(key, "arguments")


def markdown_table():
    """The README's table of the DPO / KTO keys (generated, so it cannot drift)."""
    rows = ["| key | script | default | status | meaning |", "|---|---|---|---|---|"]
    seen = {}
    for kind in ("dpo", "kto"):
        for name, (cls, f) in own_table(kind).items():
            seen.setdefault(name, (cls, f, []))[2].append(kind)
    for name, (cls, f, kinds) in seen.items():
        m = f.metadata
        status = {"implemented": "implemented", "no_effect": "accepted, warns: " + (m["why"] or ""),
                  "refused": "refused: " + (m["why"] or "")}[m["status"]]
        rows.append(f"| `{name}` | {' / '.join(k.upper() for k in kinds)} | `{f.default}` | {status} | {m['help']} |")
    return "\n".join(rows)


def help_text(kind):
    lines = [f"usage: python llm/alignment/{kind}/run_{kind}.py ARGS.json [--key value ...]", "",
             f"{kind.upper()} keys (PaddleNLP's names); every key of llm/finetune_generation.py below also applies:"]
    for name, (cls, f) in own_table(kind).items():
        m = f.metadata
        tag = {"implemented": "", "no_effect": " [accepted, no effect here]", "refused": " [refused]"}[m["status"]]
        lines.append(f"  --{name} ({base._type_of(f).__name__}, default {f.default}){tag}")
        lines.append(f"      {m['help']}" + (f" ({m['why']})" if m["status"] != "implemented" else ""))
    return "\n".join(lines) + "\n\n" + base.help_text()


def parse_args(argv=None, kind="dpo", warn=None):
    """argv (default sys.argv[1:]) -> PreferenceArgs; ArgumentError on any bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(kind))
        raise SystemExit(0)
    warn = warn or (lambda msg: print("WARNING: " + msg, file=sys.stderr))
    table = own_table(kind)
    is_bool = lambda k: base._is_bool_key(k) or (k in table and base._type_of(table[k][1]) is bool)  # noqa: E731
    values, sources = base.read_argv(argv, is_bool)
    shared, own = {}, {cls: {} for cls in own_classes(kind)}
    for key, value in values.items():
        src = sources.get(key, "arguments")
        if key in base.TABLE or key in base.ALIASES:
            shared[key] = value
        elif key in table:
            cls, f = table[key]
            own[cls][key] = _own_value(key, value, f, src, warn)
        else:
            names = list(base.TABLE) + list(table)
            m = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f"; did you mean '{m[0]}'?" if m else f"; run with --help for the keys of run_{kind}.py"
            raise ArgumentError(f"{src}: unknown key '{key}'{hint}")
    pref_data = PreferenceDataArgument(**own[PreferenceDataArgument])
    if "dataset_name_or_path" not in shared:   # required by paddletune.args; unused here
        shared["dataset_name_or_path"] = pref_data.train_dataset_path
        sources["dataset_name_or_path"] = sources.get("train_dataset_path", "arguments")
    model, data, quant, gen, training = base.build(shared, sources, warn)
    config_cls = DPOConfig if kind == "dpo" else KTOConfig
    a = PreferenceArgs(kind, model, data, quant, gen, training, pref_data, config_cls(**own[config_cls]),
                       PaddleNLPExtras(**own[PaddleNLPExtras]), sources, frozenset(values))
    _resolve(a, warn)
    _check(a, warn)
    return a


def _own_value(key, value, f, src, warn):
    v = base._convert(key, value, f, src)
    choices = f.metadata["choices"]
    if choices and v not in choices:
        raise ArgumentError(f"{src}: '{key}' must be one of {choices}, got {v!r}")
    status = f.metadata["status"]
    if v != f.default and status == "refused":
        raise ArgumentError(f"{src}: '{key}: {json.dumps(value)}' is not supported: {f.metadata['why']}")
    if v != f.default and status == "no_effect":
        warn(f"'{key}: {json.dumps(value)}' has no effect here: {f.metadata['why']}")
    return v


def _resolve(a, warn):
    c, m = a.config, a.model
    if a.kind == "dpo" and c.loss_type == "orpo":
        c.loss_type, c.reference_free, c.sft_loss_ratio = "or", True, 1.0
    if a.kind == "dpo" and c.loss_type in ("or", "simpo") and not c.reference_free:
        warn(f"loss_type {c.loss_type} has no reference model: reference_free set to true")
        c.reference_free = True
    if a.extras.rslora_plus and not getattr(m, "rslora_plus", False):
        m.rslora, m.lora_plus_scale, m.lora_alpha = True, 4.0, 4


def _check(a, warn):
    """Value rules, the first error wins; none changes a value."""
    def err(key, msg):
        raise ArgumentError(f"{a.source(key)}: '{key}' {msg}")

    d, c, m = a.pref_data, a.config, a.model
    for key in ("max_seq_len", "max_prompt_len"):
        if getattr(d, key) <= 0:
            err(key, f"must be positive, got {getattr(d, key)}")
    if d.max_prompt_len >= d.max_seq_len:
        err("max_prompt_len", f"({d.max_prompt_len}) must be smaller than max_seq_len ({d.max_seq_len}) so "
            "some response tokens fit")
    if c.beta <= 0:
        err("beta", f"must be > 0, got {c.beta}")
    if a.kind == "dpo":
        if not 0 <= c.label_smoothing < 0.5:
            err("label_smoothing", f"must be in [0, 0.5), got {c.label_smoothing}")
        for key in ("pref_loss_ratio", "sft_loss_ratio"):
            if getattr(c, key) < 0:
                err(key, f"must be >= 0, got {getattr(c, key)}")
        if c.reference_free and c.loss_type not in REFERENCE_FREE_OK:
            err("reference_free", f"cannot be used with loss_type {c.loss_type} (it needs the reference's "
                f"log-probabilities); reference-free losses: {', '.join(REFERENCE_FREE_OK)}")
    else:
        for key in ("desirable_weight", "undesirable_weight"):
            if getattr(c, key) < 0:
                err(key, f"must be >= 0, got {getattr(c, key)}")
    if a.training.pipeline_parallel_degree > 1:
        err("pipeline_parallel_degree", f"({a.training.pipeline_parallel_degree}) is not available for "
            f"{a.kind.upper()}: the pair log-probabilities are not built on pipeline stages; use "
            "tensor_parallel_degree and data parallelism, or set it to 1")
    peft = [k for k in base.PEFT_METHODS if k != "lora" and getattr(m, k)]
    if peft:
        err(peft[0], f"is not available for {a.kind.upper()}: preference training runs full fine-tuning or "
            "lora (whose reference is the model without the adapter)")
    for key, on, why in (
            ("rdrop", m.rdrop, "the preference loss has no second dropout pass"),
            ("neftune", m.neftune, "the embedding noise would also reach the reference pass"),
            ("autoregressive", a.data.autoregressive, "only the responses carry labels"),
            ("lazy", a.data.lazy, "preference rows are loaded in memory (the KTO mismatched pairs and "
             "the pair packing need the whole split)"),
            ("eval_with_do_generation", a.data.eval_with_do_generation,
             "evaluation reports the preference loss, rewards and accuracies")):
        if on:
            err(key, f"cannot be used with {a.kind.upper()}: {why}; remove it")
    for key, instead in (("src_length", "max_prompt_len"), ("max_length", "max_seq_len"),
                         ("dataset_name_or_path", "train_dataset_path / dev_dataset_path")):
        if key in a.given:
            warn(f"'{key}' has no effect in {a.kind.upper()} training: use {instead}")
