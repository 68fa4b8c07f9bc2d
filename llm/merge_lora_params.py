"""Merge a LoRA adapter (HF-PEFT layout) into its base model and write a plain HF model directory.

    python llm/merge_lora_params.py --lora_path ./checkpoints/llama_lora_ckpts \
        --merge_lora_model_path ./checkpoints/llama_lora_merged
    # --model_name_or_path BASE   base checkpoint (default: base_model_name_or_path of the adapter)
    # --merge_model_path          alias of --merge_lora_model_path (PaddleNLP's older name)
    # --device cpu|gpu            accepted; the merge is streamed through host memory either way

W' = W + s * B @ A is computed tensor by tensor from the base checkpoint files (never from a
model in memory, so a QLoRA adapter merges into the full-precision weights), in float32, and
stored in each tensor's original dtype. The output keeps the base's shard layout, config.json,
generation_config.json and the tokenizer (the adapter directory's if it has one), and appears
only when complete. Exit code 2 on bad input, before anything is written.
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
from paddletune.peft import merge_lora


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lora_path", required=True, help="adapter directory (adapter_config.json + "
                   "adapter_model.safetensors)")
    p.add_argument("--merge_lora_model_path", "--merge_model_path", dest="out", required=True,
                   help="output directory for the merged HF model")
    p.add_argument("--model_name_or_path", default=None, help="base checkpoint directory or "
                   "built-in name (default: base_model_name_or_path from adapter_config.json)")
    p.add_argument("--device", default="cpu", help="accepted for PaddleNLP compatibility; the "
                   "merge runs on the host")
    p.add_argument("--low_gpu_mem", default=None, help="accepted; the merge always streams")
    p.add_argument("--safe_serialization", default=None, help="accepted; output is safetensors")
    p.add_argument("--export_format", default="hf", choices=["hf", "glm"], help="hf: the base's "
                   "layout (default); glm: a ChatGLM2/3 base written as transformers' native "
                   "GlmForCausalLM (paddletune/models/glm_export.py)")
    return p.parse_args(argv)


@cli.entry   # errors anywhere below: one `error:` line, exit 2 (PADDLETUNE_DEBUG=1: traceback)
def main(argv=None):
    runtime.setup_logging()
    a = parse(argv)
    if a.device not in ("cpu", "gpu") and not a.device.startswith("gpu:"):
        print(f"error: --device must be cpu or gpu, got {a.device!r}", file=sys.stderr)
        return 2
    try:
        if a.export_format != "hf":   # checked before anything is written
            from paddletune.models import glm_export, load_config
            from paddletune.peft.lora import read
            from paddletune.peft.merge import resolve_base

            glm_export.check_format(a.export_format, load_config(
                resolve_base(a.lora_path, read(a.lora_path)[0], a.model_name_or_path))[1].model_type,
                "--export_format")
        out = merge_lora(a.lora_path, a.out, base_path=a.model_name_or_path)
        if a.export_format != "hf":
            glm_export.export_as(out, a.export_format)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"merged model saved to {os.path.abspath(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
