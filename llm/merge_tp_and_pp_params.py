"""Write a training checkpoint, whatever parallel layout wrote it, as ONE Hugging Face directory.

    python llm/merge_tp_and_pp_params.py --model_name_or_path ./checkpoints/llama_sft_ckpts/checkpoint-100
    python llm/merge_tp_and_pp_params.py --model_name_or_path ./checkpoints/llama_lora_ckpts --merge_lora true
    # --model_name_or_path           a checkpoint-N, or an output_dir (its newest checkpoint, said)
    # --output_path DIR              where to write (default: into the checkpoint directory itself)
    # --base_model_name_or_path B    the base model (default: the one meta.json records)
    # --merge_lora true              a LoRA checkpoint: write base + adapter as one full HF model

A checkpoint-N directory holds the trainable tensors only, sliced per tensor-parallel rank (or
split by pipeline stage): model_state-RRRRR.safetensors + shards.json, with meta.json naming the
base model and the run's model arguments. This script reassembles every tensor and writes:
  full fine-tuning  a HF model: config.json, model*.safetensors (every tensor: the checkpoint's,
                    plus any the run kept frozen, from the base), generation_config.json, tokenizer
  LoRA / prefix     the HF-PEFT adapter (adapter_config.json + adapter_model.safetensors), exactly
                    as the run's final export writes it; adapter / BitFit: the own adapter format
The checkpoint's own files are kept (resume still works); the new files appear only when complete.
Full models are streamed one tensor at a time. Bad input: one `error:` line, exit code 2, before
anything is written. The logic lives in paddletune/trainer/export.py.
"""
import argparse
import logging
import os
import shutil
import sys
import tempfile

try:
    import paddletune  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import paddletune  # noqa: F401

from paddletune import cli, runtime


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--model_name_or_path", required=True, help="the training checkpoint directory "
                   "(output_dir/checkpoint-N, written by llm/finetune_generation.py under any "
                   "tensor-/pipeline-parallel layout), or the output_dir (its newest checkpoint)")
    p.add_argument("--output_path", default=None, help="output directory (default: the checkpoint "
                   "directory itself, PaddleNLP's habit; its checkpoint files are never replaced)")
    p.add_argument("--base_model_name_or_path", default=None, help="base HF model directory or a "
                   "built-in name (paddletune/tiny-llama, ...); default: base_model in the "
                   "checkpoint's meta.json. Required for checkpoints without meta.json, which are "
                   "then taken to be full fine-tuning")
    p.add_argument("--max_shard_size", default="5GB", help="full models: largest model*.safetensors "
                   "file before the weights are split into shards + index (default 5GB, as "
                   "save_pretrained)")
    p.add_argument("--export_format", default="hf", choices=["hf", "glm"], help="hf: the model "
                   "family's layout (default); glm: ChatGLM2/3 as transformers' native "
                   "GlmForCausalLM (full models and LoRA adapters; paddletune/models/glm_export.py)")
    p.add_argument("--merge_lora", default="false", choices=["true", "false"], help="LoRA "
                   "checkpoints: merge the adapter into the base and write one full HF model "
                   "(llm/merge_lora_params.py in the same step)")
    p.add_argument("--device", default="cpu", help="accepted for PaddleNLP compatibility (cpu, gpu, "
                   "gpu:N); the merge streams through host memory either way")
    return p.parse_args(argv)


@cli.entry   # errors anywhere below: one `error:` line, exit 2 (PADDLETUNE_DEBUG=1: traceback)
def main(argv=None):
    runtime.setup_logging()
    a = parse(argv)
    if a.device not in ("cpu", "gpu") and not a.device.startswith("gpu:"):
        print(f"error: --device must be cpu or gpu, got {a.device!r}", file=sys.stderr)
        return 2
    from paddletune.trainer.export import prepare, write

    from paddletune.models import glm_export

    try:
        checkpoint = newest_checkpoint(a.model_name_or_path)
        merged_out = a.output_path or checkpoint
        if a.merge_lora == "true":   # the adapter goes to a temp dir beside the output, then merged
            a.output_path = tempfile.mkdtemp(prefix=".adapter-", dir=os.path.dirname(os.path.abspath(merged_out)))
        plan = prepare(checkpoint, a.output_path, a.base_model_name_or_path, a.max_shard_size)
        if a.merge_lora == "true" and plan.method != "lora":
            raise ValueError(f"--merge_lora true merges LoRA checkpoints; {checkpoint} is "
                             f"{'a ' + plan.method + ' adapter' if plan.method else 'a full model already'}")
        if a.export_format != "hf":
            glm_export.check_format(a.export_format, plan.model.config.model_type, "--export_format")
            if plan.method not in (None, "lora"):
                raise ValueError(f"--export_format {a.export_format} converts full models and LoRA "
                                 f"adapters; a {plan.method} adapter keeps its own format")
    except (ValueError, FileNotFoundError) as e:
        if a.merge_lora == "true" and a.output_path and os.path.basename(a.output_path).startswith(".adapter-"):
            shutil.rmtree(a.output_path, ignore_errors=True)
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = write(plan)
    if a.merge_lora == "true":
        out = merge_adapter(out, merged_out, plan.base)
    if a.export_format != "hf":
        glm_export.export_as(out, a.export_format, plan.model.config.to_dict(), a.max_shard_size)
    what = f"{plan.method} adapter" if plan.method and a.merge_lora != "true" else "model"
    print(f"{what} of {checkpoint} saved to {os.path.abspath(out)}")
    return 0


def newest_checkpoint(path):
    """path itself when it is a checkpoint-N; an output_dir: its newest complete checkpoint, said."""
    from paddletune.trainer.checkpoint import list_checkpoints

    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "trainer_state.json")):
        return path   # a checkpoint (or a bad path, which prepare() names)
    found = list_checkpoints(path)
    if not found:
        return path
    logging.getLogger("paddletune").info("%s is an output_dir: taking its newest checkpoint, %s",
                                         path, os.path.basename(found[-1]))
    return found[-1]


def merge_adapter(adapter_dir, out, base):
    """The adapter just written (a temp dir) merged into its base as a full HF model at `out`."""
    from paddletune import peft

    try:
        peft.merge_lora(adapter_dir, out, base)
    finally:
        shutil.rmtree(adapter_dir, ignore_errors=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
