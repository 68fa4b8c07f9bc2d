"""Pre-train a causal LM on pre-tokenised corpora from a PaddleNLP-style argument file (llm/run_pretrain.py).

    python tools/preprocess_data.py --model_name_or_path DIR --input_path corpus.jsonl --output_prefix data/corpus --json_key text --append_eos --workers 2
    python llm/run_pretrain.py llm/llama/pretrain_argument.json [--key value ...]
    python -m paddle.distributed.launch --nproc_per_node 2 llm/run_pretrain.py llm/llama/pretrain_argument.json

Steps, top to bottom: arguments (paddletune/pretrain_args.py) -> checks of every input (model
config, tokenizer, corpora, split) -> process group -> model (random init from config.json with
continue_training false, the checkpoint's weights with true) -> Trainer.train() on fixed-length
windows of the train split (paddletune/data/pretrain.py; each data-parallel rank its own samples
through the Trainer's BatchPlan; resume continues at the next sample) -> eval on the valid
split (loss, ppl). Checkpoints and the final HF model are the fine-tuning ones. Bad input stops
before anything is written to output_dir (one `error:` line, exit code 2).
"""
import dataclasses
import os
import sys

try:
    import paddletune  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import paddletune  # noqa: F401

from paddletune import cli, outdir, parallel, runtime
from paddletune.args import ArgumentError
from paddletune.data import DataError
from paddletune.data.pretrain import CorpusError, build_pretrain_datasets, pretrain_collate
from paddletune.models import build_model, check_checkpoint, check_tokenizer, load_config, resolve_model_path
from paddletune.parallel.pipeline import check_stages
from paddletune.parallel.plan import check_layout
from paddletune.pretrain_args import parse_args
from paddletune.loading import load_model, load_tokenizer
from paddletune.trainer import Trainer
from paddletune.trainer.checkpoint import resume_path, verify_checkpoint


def prepare(argv=None):
    """Everything that can fail on user input, before any work or any write."""
    a = parse_args(argv, warn=lambda m: runtime.warn_once(m, m))
    args, p = a.training, a.pretrain
    if not args.do_train and not args.do_eval:
        raise ArgumentError("nothing to do: set do_train and/or do_eval to true")
    if parallel.world_from_env()[1] == 0:   # rank 0 tests output_dir and locks it for the job
        outdir.claim(args.output_dir)
    model_path = resolve_model_path(a.model.model_name_or_path)
    spec, config = load_config(model_path)
    if p.num_hidden_layers is not None and p.continue_training:
        have = config.to_dict()[_layers_key(config)]
        if have != p.num_hidden_layers:
            raise ArgumentError(f"{a.source('num_hidden_layers')}: 'num_hidden_layers' {p.num_hidden_layers} "
                                f"differs from the checkpoint's {have} layers ({model_path}); continued "
                                "pre-training loads every layer: drop the key, or set continue_training: "
                                "false for a random init of that depth")
    if p.num_hidden_layers is not None:
        config = spec.config_cls.from_dict({**config.to_dict(), _layers_key(config): p.num_hidden_layers})
    degrees = parallel.degrees_from_args(args, parallel.world_from_env()[0])
    check_layout(spec, config, degrees["tp"])
    check_stages(config, degrees["pp"])
    if not p.continue_training and (degrees["tp"] > 1 or degrees["pp"] > 1):
        raise ArgumentError("continue_training: false (random init) runs data parallel only here; for "
                            "tensor / pipeline parallel layouts write a random checkpoint first "
                            "(tools/make_tiny_checkpoint.py) and set continue_training: true")
    tok = load_tokenizer(a.model.tokenizer_name_or_path or model_path)
    check_tokenizer(config, tok, model_path)
    if p.continue_training:
        check_checkpoint(model_path, config)   # weight files: headers, names, shapes, dtypes
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "seq_length", None)
    if limit and p.max_seq_length > limit:
        raise ArgumentError(f"{a.source('max_seq_length')}: 'max_seq_length' {p.max_seq_length} is more "
                            f"than the model's {limit} positions ({model_path}/config.json)")
    args.resume_from_checkpoint = resume_path(args.output_dir, args.resume_from_checkpoint,
                                              args.overwrite_output_dir)
    if args.resume_from_checkpoint:
        verify_checkpoint(args.resume_from_checkpoint)
    train, valid, _ = build_pretrain_datasets(p.input_dir, p.split, p.max_seq_length, seed=args.seed,
                                              reset_position_ids=p.reset_position_ids,
                                              reset_attention_mask=p.reset_attention_mask,
                                              vocab_size=config.vocab_size)
    if args.do_train and train is None:
        raise DataError(f"input_dir {p.input_dir}: the train split ({p.split}) holds no sample of "
                        f"{p.max_seq_length} tokens; add data or lower max_seq_length")
    if args.do_eval and valid is None:
        runtime.warn_once("no valid", f"the valid split of {p.split} holds no sample of {p.max_seq_length} "
                          "tokens: no evaluation")
    return a, model_path, config, tok, train, valid


def _layers_key(config):
    d = config.to_dict()
    return next(k for k in ("num_hidden_layers", "num_layers", "n_layer") if k in d)


def make_model(a, model_path, config, topo):
    """continue_training: the checkpoint's weights (this rank's part); else random
    N(0, initializer_range) from the config, the same on every rank (seeded numpy draws)."""
    if a.pretrain.continue_training:
        return load_model(model_path, topology=topo, quant=a.quant)
    model = build_model(config, seed=a.training.seed)
    model.name_or_path = model_path
    return model


@cli.entry   # any later error (loading, resuming, a bad corpus, a full disk): one line, exit 2
def main(argv=None):
    logger = runtime.setup_logging(int(os.environ.get("PADDLE_TRAINER_ID", "0")))
    try:
        a, model_path, config, tok, train, valid = prepare(argv)
    except (ArgumentError, DataError, CorpusError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args, p = a.training, a.pretrain
    topo = parallel.init(args)
    runtime.log_runtime(paddletune.RUNTIME)
    runtime.set_device(args.device)
    runtime.set_seed(args.seed)
    for name, ds in (("train", train), ("valid", valid)):
        if ds is not None:
            logger.info("%s: %d samples of %d tokens from %s (split %s)", name, len(ds), p.max_seq_length,
                        p.input_dir, p.split)
    model = make_model(a, model_path, config, topo)
    model.flash_attention = a.model.use_flash_attention
    n_params = sum(int(x.size) for x in model.parameters())
    logger.info("%s %s (%s, %d layers, hidden %d, %d parameters)",
                "continued from" if p.continue_training else "random init from the config of", model_path,
                config.model_type, getattr(config, "num_hidden_layers", 0) or 0,
                getattr(config, "hidden_size", 0) or 0, n_params)
    meta = {"base_model": os.path.abspath(model_path), "model_args": dataclasses.asdict(a.model),
            "pretrain_args": dataclasses.asdict(p)}
    trainer = Trainer(model, args, train_dataset=train, eval_dataset=valid, tokenizer=tok,
                      collate=pretrain_collate, topology=topo, checkpoint_meta=meta)
    if args.do_train:
        trainer.train()
    if args.do_eval and valid is not None:
        metrics = trainer.evaluate()
        if topo.is_main:
            logger.info("eval: loss %.4f, ppl %.4f, accuracy %.4f", metrics["loss"], metrics["ppl"],
                        metrics["accuracy"])
    if args.do_train and topo.is_main:
        print(f"model saved to {os.path.abspath(args.output_dir)}")
    return 0


if __name__ == "__main__":
    cli.finish(main())
