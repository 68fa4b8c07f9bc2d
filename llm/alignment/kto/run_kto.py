"""Preference training with KTO from a PaddleNLP-style argument file (llm/alignment/kto/run_kto.py).

    python llm/alignment/kto/run_kto.py llm/llama/kto_argument.json [--key value ...]
    python -m paddle.distributed.launch --nproc_per_node 2 llm/alignment/kto/run_kto.py llm/llama/kto_argument.json

The same steps as llm/alignment/dpo/run_dpo.py (this runs its main() with kind "kto"): rows
{src, tgt, response: [completion], sort: [1 | 0]} (PaddleNLP) or {prompt, completion, label}
(TRL), the KTO loss with beta, desirable_weight and undesirable_weight, the reference as in DPO.
"""
import importlib.util
import os
import sys

_DPO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dpo", "run_dpo.py")


def main(argv=None):
    spec = importlib.util.spec_from_file_location("run_dpo", _DPO)
    run_dpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_dpo)
    return run_dpo.main(argv, kind="kto")


if __name__ == "__main__":
    code = main()
    from paddletune import cli   # importable now: run_dpo.py put the checkout on sys.path
    cli.finish(code)
