"""Write a training checkpoint, whatever parallel layout wrote it, as ONE Hugging Face directory.

    python llm/merge_tp_and_pp_params.py --model_name_or_path ./checkpoints/llama_sft_ckpts/checkpoint-100
    # --output_path DIR              where to write (default: into the checkpoint directory itself)
    # --base_model_name_or_path B    the base model (default: the one meta.json records)

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
import os
import sys

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
                   "tensor-/pipeline-parallel layout)")
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
        plan = prepare(a.model_name_or_path, a.output_path, a.base_model_name_or_path, a.max_shard_size)
        if a.export_format != "hf":
            glm_export.check_format(a.export_format, plan.model.config.model_type, "--export_format")
            if plan.method not in (None, "lora"):
                raise ValueError(f"--export_format {a.export_format} converts full models and LoRA "
                                 f"adapters; a {plan.method} adapter keeps its own format")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = write(plan)
    if a.export_format != "hf":
        glm_export.export_as(out, a.export_format, plan.model.config.to_dict(), a.max_shard_size)
    what = f"{plan.method} adapter" if plan.method else "model"
    print(f"{what} of {a.model_name_or_path} saved to {os.path.abspath(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
