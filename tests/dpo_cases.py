"""Script runs of llm/alignment/{dpo,kto} for tests/test_dpo.py: in a launched rank (through
tests/launch_cases.py) or in the test process (the single-process reference). Besides the exit
code, each run reports what shows the work is split: the example ids every optimizer step read
on this rank, and the local / whole shape of the LM head weight (vocabulary shards under TP)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import paddletune  # noqa: E402,F401


def script_run(relpath, argv):
    from conftest import load_script
    from paddletune.trainer import trainer as trainer_mod

    seen, shapes = [], {}
    step = trainer_mod.Trainer.training_step

    def recording(self, micro_batches, lr):
        seen.append(sorted(int(i) for b in micro_batches for i in b["example_ids"]))
        p = dict(self.model.named_parameters()).get("lm_head.weight")
        if p is not None:
            shapes["lm_head"] = [list(self._local(p).shape), list(p.shape)]
        return step(self, micro_batches, lr)

    trainer_mod.Trainer.training_step = recording
    try:
        rc = load_script(relpath).main(list(argv))
    finally:
        trainer_mod.Trainer.training_step = step
    return {"rc": rc, "examples": seen, "lm_head": shapes.get("lm_head")}
