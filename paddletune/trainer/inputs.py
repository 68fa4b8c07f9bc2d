"""The public Trainer's inputs -> the parts the training loop takes (what llm/finetune_generation.py
builds step by step, in one call):

    trainer = paddletune.Trainer(args, model, tokenizer, train_dataset, eval_dataset)

args      TrainingArguments; or the tuple paddletune.args.parse_args returns (ModelArgument,
          DataArgument, QuantArgument, GenerateArgument, TrainingArguments); or the path of a JSON
          argument file (parsed as the script parses it)
model     a paddle model (paddletune.load_model, maybe wrapped by paddletune.peft.apply: pass its
          setup's parts as options), or a model name / directory: loaded (quantized per
          weight_quantize_algo), and the PEFT method of the ModelArgument applied, as the script
          does; None = the arguments' model_name_or_path
tokenizer a Tokenizer; None = the model directory's
datasets  rows {"src", "tgt"} or {"messages": [...]} (tokenised with the DataArgument's lengths
          and chat-template rule, exactly as the script's data files), lists of token ids
          (language modelling: every token is a target), {"input_ids", "labels"} dicts, or a
          dataset the data package built; None with a dataset_name_or_path in the arguments = the
          script's train / dev files
Other keywords (trainable, export_fn, collate, callbacks, ...) go to the loop unchanged.
As in the script: PaddleNLP's TrainingArguments rules apply, a run whose output_dir holds
checkpoints continues from the latest one unless overwrite_output_dir, and under
paddle.distributed.launch every rank runs the same call.
"""
import dataclasses
import os

import numpy as np

from .. import args as A


def arguments(args):
    """(ModelArgument, DataArgument, QuantArgument, GenerateArgument, TrainingArguments)."""
    if isinstance(args, (str, os.PathLike)):
        return A.parse_args([os.fspath(args)], warn=_warn)
    if isinstance(args, (tuple, list)):
        found = {type(a): a for a in args}
        missing = [c.__name__ for c in (A.TrainingArguments,) if c not in found]
        if missing:
            raise TypeError(f"Trainer args: the tuple holds no {missing[0]}")
        objs = tuple(found.get(c) or c() for c in A.CLASSES)
    elif isinstance(args, A.TrainingArguments):
        objs = tuple(c() for c in A.CLASSES[:-1]) + (args,)
        A._paddlenlp_post_init(args, {}, _warn)   # what parse_args applies to a file's keys
    else:
        raise TypeError("Trainer args: a TrainingArguments, the tuple parse_args returns, or the path "
                        f"of a JSON argument file; got {type(args).__name__}")
    if objs[-1].output_dir is None:
        raise A.ArgumentError("'output_dir' is required (where checkpoints and the model go)")
    return objs


def _warn(msg):
    from .. import runtime

    runtime.warn_once(msg, msg)


def as_dataset(data, tok, data_args, what):
    """A dataset the loop can index: see the module docstring for what `data` may be."""
    from ..data.sft import DataError, ExampleBuilder, SFTDataset

    if data is None or not isinstance(data, (list, tuple)):
        return data   # None, or a dataset object (SFTDataset, LazyDataset, a user's own)
    if not data:
        raise DataError(f"{what} is empty")
    builder, examples = None, []
    for i, row in enumerate(data):
        where = f"{what}[{i}]"
        if isinstance(row, dict) and "input_ids" in row:
            ids = np.asarray(row["input_ids"], np.int64)
            labels = np.asarray(row.get("labels", ids), np.int64)
            if labels.shape != ids.shape:
                raise DataError(f"{where}: labels has {labels.size} entries, input_ids {ids.size}")
            ex = {"input_ids": ids, "labels": labels}
        elif isinstance(row, dict):
            if tok is None:
                raise DataError(f"{where}: text rows need a tokenizer")
            builder = builder or ExampleBuilder(tok, data_args)
            ex = builder(row, where)
        elif isinstance(row, (list, tuple, np.ndarray)) and all(
                isinstance(t, (int, np.integer)) for t in row):
            ids = np.asarray(row, np.int64)
            ex = {"input_ids": ids, "labels": ids.copy()}
        else:
            raise DataError(f"{where}: expected a row {{'src', 'tgt'}} / {{'messages'}}, a list of "
                            f"token ids or {{'input_ids', 'labels'}}, got {type(row).__name__}")
        if ex["input_ids"].size < 2:
            raise DataError(f"{where}: needs at least 2 tokens (one to predict)")
        ex["id"] = i
        examples.append(ex)
    return SFTDataset(examples, [what])


def public_inputs(args=None, model=None, tokenizer=None, train_dataset=None, eval_dataset=None,
                  **options):
    """Keyword arguments of Trainer._setup from the public call (module docstring)."""
    from .. import parallel, peft, runtime
    from ..data import build_datasets
    from ..data.chat_template import ChatTemplateError
    from ..data.collate import padding_collate
    from ..data.sft import DataError
    from ..generation import GenerationConfig
    from ..loading import load_model, load_tokenizer
    from ..models import resolve_model_path
    from .checkpoint import resume_path

    model_args, data_args, quant_args, gen_args, targs = arguments(args)
    topo = options.pop("topology", None) or parallel.init(targs)
    if not runtime.logger.handlers:   # the script's log format (rank 0 logs, others warn)
        runtime.setup_logging(topo.rank)
    runtime.set_device(targs.device)
    runtime.set_seed(targs.seed)
    parts, path = {}, getattr(model, "name_or_path", None)
    if model is None or isinstance(model, (str, os.PathLike)):
        name = os.fspath(model) if model is not None else model_args.model_name_or_path
        if not name:
            raise A.ArgumentError("Trainer: no model (pass one, or set model_name_or_path)")
        model_args.model_name_or_path = name
        path = resolve_model_path(name)
        tokenizer = tokenizer or load_tokenizer(model_args.tokenizer_name_or_path or path)
        peft.validate(model_args, path)
        model = load_model(path, topology=topo, quant=quant_args)
        setup = peft.apply(model, model_args, tokenizer=tokenizer)
        parts.update(trainable=setup.trainable, export_fn=setup.export_fn, loss_fn=setup.loss_fn,
                     lr_scales=setup.lr_scales,
                     checkpoint_meta={"base_model": os.path.abspath(path),
                                      "model_args": dataclasses.asdict(model_args)})
    elif tokenizer is None and path:
        tokenizer = load_tokenizer(path)
    if train_dataset is None and eval_dataset is None and data_args.dataset_name_or_path:
        train_dataset, eval_dataset = build_datasets(data_args, tokenizer, do_train=targs.do_train,
                                                     do_eval=targs.do_eval)
    elif data_args.chat_template is not None and tokenizer is not None:
        try:
            tokenizer.set_chat_template(data_args.chat_template)
        except ChatTemplateError as e:
            raise DataError(f"chat_template: {e}") from None
    targs.resume_from_checkpoint = resume_path(targs.output_dir, targs.resume_from_checkpoint,
                                               targs.overwrite_output_dir)
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    parts.update(model=model, args=targs, tokenizer=tokenizer, topology=topo,
                 train_dataset=as_dataset(train_dataset, tokenizer, data_args, "train_dataset"),
                 eval_dataset=as_dataset(eval_dataset, tokenizer, data_args, "eval_dataset"),
                 collate=padding_collate(pad, data_args.pad_to_multiple_of, data_args.pad_to_max_length,
                                         data_args.max_length),
                 generation=GenerationConfig(
                     max_new_tokens=gen_args.max_new_tokens, decode_strategy=gen_args.decode_strategy,
                     temperature=gen_args.temperature, top_k=gen_args.top_k, top_p=gen_args.top_p,
                     repetition_penalty=gen_args.repetition_penalty, seed=targs.seed,
                     src_length=data_args.src_length))
    parts.update(options)
    return parts


def predict(trainer, prompts, **generation):
    """Answers of trainer.model for `prompts` (a string, a list of strings, or chat messages),
    with the tokenizer's chat template when it has one (else raw text, as in training)."""
    from ..generation import GenerationConfig, checkpoint_defaults, generate
    from ..text_generation import encode_prompt

    tok = trainer.tokenizer
    if tok is None:
        raise ValueError("predict needs the Trainer's tokenizer")
    single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict))
    items = [prompts] if single else list(prompts)
    cfg = GenerationConfig.from_kwargs(trainer.generation or GenerationConfig(max_new_tokens=64), **generation)
    if cfg.eos_token_id is None:
        defaults = checkpoint_defaults(getattr(trainer.model, "name_or_path", None), tok)
        cfg.eos_token_id, cfg.pad_token_id = defaults["eos_token_id"], defaults["pad_token_id"]
    use_template = tok.template is not None
    ids = [encode_prompt(tok, x, use_template or not isinstance(x, str), cfg.src_length) for x in items]
    was_training = trainer.model.training
    trainer.model.eval()
    try:
        texts = generate(trainer.model, ids, cfg.validate(), tokenizer=tok).texts
    finally:
        if was_training:
            trainer.model.train()
    return texts[0] if single else texts
