"""paddletune peer: load the shared HF checkpoint, (LoRA), and time Trainer.training_step.

    PYTHONPATH=. python benchmarks/peers/paddletune_train.py SPEC.json   (see common.py)

The step is the library's own (forward with logits only at labelled positions, loss_sum / n,
backward, global-norm clipping, paddletune AdamW), as `llm/finetune_generation.py` runs it.
LoRA comes from paddletune.peft.apply and zero padding from paddletune.data.packing (sequential
packing, blocked attention over packed rows); where either is missing the row reports "pending".
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the checkout, before any install

import common  # noqa: E402


def apply_lora(model, spec):
    """LoRA through the library's entry point (paddletune.peft.apply), as the finetune script does.
    Returns the {name: parameter} dict the Trainer trains."""
    from paddletune import peft

    if not hasattr(peft, "apply"):
        common.not_available("paddletune.peft.apply is not on this branch yet (peft branch)")
    from paddletune.args import ModelArgument

    margs = ModelArgument(model_name_or_path=spec["checkpoint"], lora=True, lora_rank=spec["lora_rank"],
                          lora_alpha=spec["lora_alpha"], lora_target_modules=[rf".*\.{n}$" for n in spec["lora_targets"]])
    return peft.apply(model, margs).trainable


def packed_batches(spec, greedy=False):
    """Zero padding: the same examples packed into rows of <= seq tokens by the library's packer,
    sequentially (`zero_padding: true`) or greedily (`greedy_zero_padding: true`: each example
    into the open pack with most room, within buffers of 500); `batch` rows per step."""
    try:
        from paddletune.data.packing import collate_packed, pack
    except ImportError:
        common.not_available("paddletune.data.packing (zero padding) is not on this branch yet (data branch)")
    examples = common.load_examples(spec["data"])
    packs = pack([len(e["input_ids"]) for e in examples], spec["seq"], greedy=greedy)
    rows = [[examples[i] for i in p] for p in packs]
    return [collate_packed(rows[i:i + spec["batch"]], pad_id=0) for i in range(0, len(rows), spec["batch"])]


def build(spec):
    """(trainer, batches) ready to step: the shared checkpoint loaded, LoRA applied if asked."""
    from paddletune import runtime
    from paddletune.args import TrainingArguments
    from paddletune.loading import load_model
    from paddletune.trainer import Trainer

    runtime.set_seed(spec["seed"])
    model = load_model(spec["checkpoint"])
    trainable = apply_lora(model, spec) if spec["method"] == "lora" else None
    if spec["layout"] in ("zero_padding", "greedy_zero_padding"):
        batches = packed_batches(spec, greedy=spec["layout"] == "greedy_zero_padding")
    else:
        batches = common.load_batches(spec["data"])
    model.train()
    args = TrainingArguments(output_dir=os.path.join(spec["workdir"], "paddletune-out"),
                             per_device_train_batch_size=spec["batch"], max_steps=spec["warmup"] + spec["steps"],
                             learning_rate=spec["lr"], max_grad_norm=spec["max_grad_norm"], weight_decay=0.0,
                             disable_tqdm=True, save_strategy="no", recompute=bool(spec.get("recompute", False)))
    return Trainer(model, args, train_dataset=[], export_fn=lambda d: None, trainable=trainable), batches


def runtime_choices(paddletune):
    """What the set-up decided in this process (threads, strided views), plus the choices made
    while training (malloc, the CPU kernels), for the result's `threads` field."""
    from paddletune import kernels, runtime

    return (paddletune.RUNTIME.plus("malloc", runtime.reuse_freed_memory())
            .plus("cpu kernels", "on" if kernels.cpu_ops() is not None else "off"))


def main():
    spec = common.read_spec()
    import paddletune  # before paddle: the runtime's thread settings

    import paddle

    rss_import = common.rss_mb()
    trainer, batches = build(spec)

    def step(batch):
        loss, *_ = trainer.training_step([batch], spec["lr"])
        return float(loss)

    result = common.time_steps(step, batches, spec)
    result.update(rss_after_import_mb=rss_import, trainable_params=common.count_params(trainer.trainable.values()),
                  versions={"paddletune": paddletune.__version__, "paddle": paddle.__version__},
                  threads=f"runtime: {runtime_choices(paddletune).describe()}")
    common.emit(result)


if __name__ == "__main__":
    main()
