"""Fine-tune a causal LM from a JSON argument file (PaddleNLP's llm/finetune_generation.py habits).

    python llm/finetune_generation.py llm/llama/sft_argument.json [--key value ...]
    python -m paddle.distributed.launch --nproc_per_node 2 llm/finetune_generation.py llm/llama/sft_argument.json

Steps, top to bottom: arguments -> process group -> checks of every input -> tokenizer ->
datasets -> model -> PEFT -> Trainer.train() -> final eval. Bad input stops before anything is
written to output_dir, with a message naming the file/key and the fix (exit code 2).
"""
import os
import sys

try:
    import paddletune  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import paddletune  # noqa: F401

from paddletune import cli, outdir, parallel, peft, runtime
from paddletune.args import ArgumentError, parse_args
from paddletune.data import DataError, build_datasets
from paddletune.data.collate import padding_collate
from paddletune.data.packing import build_train_source
from paddletune.data.sft import check_positions
from paddletune.generation import GenerationConfig, checkpoint_defaults
from paddletune.models import (check_checkpoint, check_tokenizer, glm_export, load_config,
                               position_limit, resolve_model_path)
from paddletune.models.memory import footprint
from paddletune.loading import load_model, load_tokenizer
from paddletune.parallel.pipeline import check_stages
from paddletune.parallel.plan import check_layout
from paddletune.trainer import Trainer
from paddletune.trainer.checkpoint import resume_path, verify_checkpoint
from paddletune.trainer.metrics import generation_eval_fn


def prepare(argv=None):
    """Everything that can fail on user input, before any work or any write."""
    model_args, data_args, quant_args, gen_args, args = parse_args(argv, warn=lambda m: runtime.warn_once(m, m))
    if not args.do_train and not args.do_eval:
        raise ArgumentError("nothing to do: set do_train and/or do_eval to true")
    if parallel.world_from_env()[1] == 0:   # rank 0 tests output_dir and locks it for the job
        outdir.claim(args.output_dir)
    model_path = resolve_model_path(model_args.model_name_or_path)
    spec, config = load_config(model_path)  # config.json readable and of a supported model type
    # the parallel layout: the launched processes factor into the degrees, the model can be cut
    degrees = parallel.degrees_from_args(args, parallel.world_from_env()[0])
    check_layout(spec, config, degrees["tp"])
    check_stages(config, degrees["pp"])
    tok = load_tokenizer(model_args.tokenizer_name_or_path or model_path)
    check_tokenizer(config, tok, model_path)
    check_checkpoint(model_path, config)   # weight files: headers, names, shapes, dtypes
    # PaddleNLP habit: rerunning continues from output_dir's latest checkpoint (the Trainer says
    # from where, and what is left, in one line)
    args.resume_from_checkpoint = resume_path(args.output_dir, args.resume_from_checkpoint,
                                              args.overwrite_output_dir)
    if args.resume_from_checkpoint:
        verify_checkpoint(args.resume_from_checkpoint)   # checksums: a damaged file fails here
    peft.validate(model_args, model_path)  # targets, saved adapter shapes: before any work
    if args.export_format != "hf":   # glm: ChatGLM2/3 full models and LoRA adapters only
        glm_export.check_format(args.export_format, config.model_type, "export_format")
        if peft.selected(model_args) not in (None, "lora"):
            raise ArgumentError(f"export_format={args.export_format} converts full models and LoRA "
                                f"adapters; {peft.selected(model_args)} adapters keep their own format")
    train_ds, dev_ds = build_datasets(data_args, tok, do_train=args.do_train, do_eval=args.do_eval)
    limit, scaled, learned = position_limit(config)
    check_positions(limit, scaled, data_args.max_length, (train_ds, dev_ds),
                    os.path.join(model_path, "config.json"), learned=learned)
    return model_args, data_args, quant_args, gen_args, args, model_path, tok, train_ds, dev_ds


def generation_config(gen_args, model_path, tok):
    """Decoding settings of generation eval: GenerateArgument + the checkpoint's eos/pad ids."""
    return GenerationConfig(
        max_new_tokens=gen_args.max_new_tokens, decode_strategy=gen_args.decode_strategy,
        temperature=gen_args.temperature, top_k=gen_args.top_k, top_p=gen_args.top_p,
        repetition_penalty=gen_args.repetition_penalty, seed=0,
        **checkpoint_defaults(model_path, tok)).validate()


def checkpoint_meta(model_args, model_path):
    """What each checkpoint-N records of the run (meta.json), for llm/merge_tp_and_pp_params.py:
    the resolved base model directory and the model arguments (PEFT method and settings)."""
    import dataclasses

    return {"base_model": os.path.abspath(model_path), "model_args": dataclasses.asdict(model_args)}


@cli.entry   # any later error (loading, resuming, a bad data line, a full disk): one line, exit 2
def main(argv=None):
    logger = runtime.setup_logging(int(os.environ.get("PADDLE_TRAINER_ID", "0")))
    try:
        (model_args, data_args, quant_args, gen_args, args, model_path, tok, train_ds,
         dev_ds) = prepare(argv)
    except (ArgumentError, DataError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    topo = parallel.init(args)
    runtime.log_runtime(paddletune.RUNTIME)
    runtime.set_device(args.device)
    runtime.set_seed(args.seed)
    if train_ds is not None and data_args.lazy:
        logger.info("train: streamed from %s (%d bytes), file order", ", ".join(train_ds.files), train_ds.total)
    elif train_ds is not None:
        logger.info("train: %d examples, %d tokens (%d target) from %s", len(train_ds),
                    train_ds.num_tokens, train_ds.num_target_tokens, ", ".join(train_ds.files))
    # zero padding / lazy data become the Trainer's train_source (None: padded in-memory batches)
    train_source = build_train_source(data_args, args, tok, train_ds, topo) if train_ds is not None else None
    model = load_model(model_path, topology=topo, quant=quant_args,   # logs the quantized byte ratio
                       training=footprint(peft.selected(model_args), model_args, data_args, args))
    model.flash_attention = model_args.use_flash_attention   # packed rows: varlen flash on GPU
    logger.info("loaded %s (%s, %d layers, hidden %d)", model_path, model.config.model_type,
                model.config.num_hidden_layers, model.config.hidden_size)

    setup = peft.apply(model, model_args, tokenizer=tok)   # wraps the frozen model; None = full FT
    eval_fn = None
    if data_args.eval_with_do_generation and dev_ds is not None:
        eval_fn = generation_eval_fn(dev_ds, tok, generation_config(gen_args, model_path, tok),
                                     args.output_dir, data_args.save_generation_output,
                                     args.per_device_eval_batch_size)
    collate = padding_collate(tok.pad_token_id or 0, data_args.pad_to_multiple_of,
                              data_args.pad_to_max_length, data_args.max_length)
    trainer = Trainer(model, args, train_dataset=train_ds, eval_dataset=dev_ds, tokenizer=tok,
                      collate=collate, trainable=setup.trainable, export_fn=setup.export_fn, loss_fn=setup.loss_fn,
                      lr_scales=setup.lr_scales, eval_fn=eval_fn, train_source=train_source,
                      topology=topo, checkpoint_meta=checkpoint_meta(model_args, model_path))
    if args.do_train:
        trainer.train()
        if args.export_format != "hf" and topo.is_main:   # the HF export, rewritten in place
            glm_export.export_as(args.output_dir, args.export_format, model.config.to_dict())
            logger.info("exported as %s (transformers' GlmForCausalLM)", args.export_format)
    if args.do_eval and dev_ds is not None:
        metrics = trainer.evaluate()
        if topo.is_main:
            logger.info("eval: loss %.4f, ppl %.4f, accuracy %.4f", metrics["loss"], metrics["ppl"],
                        metrics["accuracy"])
            if eval_fn is not None:
                logger.info("eval (generation): bleu4 %.4f, rouge1 %.4f, rouge2 %.4f, rougel %.4f",
                            metrics["bleu4"], metrics["rouge1"], metrics["rouge2"], metrics["rougel"])
    if args.do_train and topo.is_main:
        print(f"model saved to {os.path.abspath(args.output_dir)}")
    return 0


if __name__ == "__main__":
    cli.finish(main())
