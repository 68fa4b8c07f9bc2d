"""Launched cases of tests/test_merge_tp.py: llm/finetune_generation.py's main() called on every
rank of one `paddle.distributed.launch` (tests/launch_cases.py), several runs per launch."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import paddletune  # noqa: E402,F401  (CPU threads before paddle)


def finetune(argv):
    """One training run of the finetune script in this process; returns its exit code."""
    from conftest import load_script

    return load_script("llm/finetune_generation.py").main(list(argv))
