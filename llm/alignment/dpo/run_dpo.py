"""Preference training with DPO from a PaddleNLP-style argument file (llm/alignment/dpo/run_dpo.py).

    python llm/alignment/dpo/run_dpo.py llm/llama/dpo_argument.json [--key value ...]
    python llm/alignment/dpo/run_dpo.py llm/llama/dpo_lora_argument.json
    python -m paddle.distributed.launch --nproc_per_node 2 llm/alignment/dpo/run_dpo.py llm/llama/dpo_lora_argument.json

llm/alignment/kto/run_kto.py runs this file's main() with kind "kto". Steps, top to bottom:
arguments -> checks of every input (model, layout, tokenizer, preference rows) -> process group
-> model -> LoRA -> the reference (a frozen copy; with LoRA the same model with its adapters off;
none when reference_free) -> Trainer.train() with the preference loss -> final eval. Bad input
stops before anything is written to output_dir (one `error:` line, exit code 2). The output is a
Hugging Face model (full fine-tuning) or an HF-PEFT adapter (LoRA), as in SFT.
"""
import dataclasses
import os
import sys

try:
    import paddletune  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    import paddletune  # noqa: F401

from paddletune import cli, outdir, parallel, peft, runtime
from paddletune.alignment.args import ArgumentError, parse_args
from paddletune.alignment.data import PackedPairSource, build_preference_datasets, padded_collate
from paddletune.alignment.loss import AdapterOffReference, DPOLoss, FrozenReference, KTOLoss
from paddletune.data import DataError
from paddletune.models import check_checkpoint, check_tokenizer, load_config, resolve_model_path
from paddletune.parallel.plan import check_layout
from paddletune.loading import load_model, load_tokenizer
from paddletune.trainer import Trainer
from paddletune.trainer.checkpoint import resume_path, verify_checkpoint


def prepare(argv, kind):
    """Everything that can fail on user input, before any work or any write."""
    a = parse_args(argv, kind, warn=lambda m: runtime.warn_once(m, m))
    args = a.training
    if not args.do_train and not args.do_eval:
        raise ArgumentError("nothing to do: set do_train and/or do_eval to true")
    if parallel.world_from_env()[1] == 0:   # rank 0 tests output_dir and locks it for the job
        outdir.claim(args.output_dir)
    model_path = resolve_model_path(a.model.model_name_or_path)
    spec, config = load_config(model_path)
    degrees = parallel.degrees_from_args(args, parallel.world_from_env()[0])
    check_layout(spec, config, degrees["tp"])
    tok = load_tokenizer(a.model.tokenizer_name_or_path or model_path)
    check_tokenizer(config, tok, model_path)
    check_checkpoint(model_path, config)   # weight files: headers, names, shapes, dtypes
    # PaddleNLP habit: rerunning continues from the latest checkpoint (the Trainer says so)
    args.resume_from_checkpoint = resume_path(args.output_dir, args.resume_from_checkpoint,
                                              args.overwrite_output_dir)
    if args.resume_from_checkpoint:
        verify_checkpoint(args.resume_from_checkpoint)   # checksums: a damaged file fails here
    peft.validate(a.model, model_path)
    train_ds, dev_ds = build_preference_datasets(a, tok)
    return a, model_path, tok, train_ds, dev_ds


def reference_for(a, setup, model_path, topo):
    """The reference of the preference loss: none (reference_free), the policy with its LoRA
    adapters off, or a frozen second copy of the initial model (same parallel layout)."""
    if getattr(a.config, "reference_free", False):
        return None
    if setup.method == "lora":
        return AdapterOffReference()
    return FrozenReference(load_model(model_path, topology=topo, quant=a.quant))


@cli.entry   # any later error (loading, resuming, a bad data line, a full disk): one line, exit 2
def main(argv=None, kind="dpo"):
    logger = runtime.setup_logging(int(os.environ.get("PADDLE_TRAINER_ID", "0")))
    try:
        a, model_path, tok, train_ds, dev_ds = prepare(argv, kind)
    except (ArgumentError, DataError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args, d = a.training, a.pref_data
    topo = parallel.init(args)
    runtime.log_runtime(paddletune.RUNTIME)
    runtime.set_device(args.device)
    runtime.set_seed(args.seed)
    for name, ds in (("train", train_ds), ("dev", dev_ds)):
        if ds is not None:
            logger.info("%s: %d %s, %d tokens from %s", name, len(ds), "pairs" if kind == "dpo" else
                        "examples", ds.num_tokens, ", ".join(ds.files))
    pad_id = tok.pad_token_id or 0
    source = None
    if train_ds is not None and a.data.zero_padding:   # whole pairs packed into rows of 2 x max_seq_len
        source = PackedPairSource(train_ds, 2 * d.max_seq_len, args.per_device_train_batch_size,
                                  args.gradient_accumulation_steps, topo.data_degree, topo.data_rank,
                                  seed=args.data_seed if args.data_seed is not None else args.seed,
                                  greedy=a.data.greedy_zero_padding, pad_id=pad_id,
                                  pad_to_multiple_of=a.data.pad_to_multiple_of,
                                  pad_to_max_length=a.data.pad_to_max_length, drop_last=args.dataloader_drop_last)
        logger.info("zero padding: %d %s -> %d rows of <= %d tokens", len(train_ds),
                    "pairs" if kind == "dpo" else "examples", len(source.packs), 2 * d.max_seq_len)

    model = load_model(model_path, topology=topo, quant=a.quant)
    model.flash_attention = a.model.use_flash_attention
    logger.info("loaded %s (%s, %d layers, hidden %d)", model_path, model.config.model_type,
                model.config.num_hidden_layers, model.config.hidden_size)
    setup = peft.apply(model, a.model, tokenizer=tok)   # LoRA wraps the frozen model; None = full FT
    reference = reference_for(a, setup, model_path, topo)
    logger.info("%s: loss %s, beta %g, reference: %s", kind.upper(), getattr(a.config, "loss_type", "kto"),
                a.config.beta, "none" if reference is None else
                "the model without its LoRA adapters" if isinstance(reference, AdapterOffReference)
                else "a frozen copy of the initial model")
    loss_fn = DPOLoss(a.config, reference) if kind == "dpo" else KTOLoss(a.config, reference, topo)
    collate = padded_collate(train_ds if train_ds is not None else dev_ds, pad_id, a.data.pad_to_multiple_of,
                             d.max_seq_len if a.data.pad_to_max_length else None)
    meta = {"base_model": os.path.abspath(model_path), "model_args": dataclasses.asdict(a.model)}
    trainer = Trainer(model, args, train_dataset=train_ds, eval_dataset=dev_ds, tokenizer=tok,
                      collate=collate, trainable=setup.trainable, export_fn=setup.export_fn,
                      loss_fn=loss_fn, lr_scales=setup.lr_scales, train_source=source,
                      topology=topo, checkpoint_meta=meta)
    if args.do_train:
        trainer.train()
    if args.do_eval and dev_ds is not None:
        metrics = trainer.evaluate()
        if topo.is_main:
            logger.info("eval: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    if args.do_train and topo.is_main:
        print(f"model saved to {os.path.abspath(args.output_dir)}")
    return 0


if __name__ == "__main__":
    cli.finish(main())
