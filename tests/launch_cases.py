"""Many multi-process test cases in one `paddle.distributed.launch` (each launch costs ~6-8 s
before any work, so the parallel tests run their cases in as few launches as possible).

    python -m paddle.distributed.launch --nproc_per_node N tests/launch_cases.py PLAN.json

PLAN.json: {"cases": [{"name": NAME, "target": "module:function", "kwargs": {...}}, ...]}.
Cases run in order on every rank; `target` is imported from tests/ (e.g. "dp_worker:train_case")
and called as function(**kwargs); its JSON-able return value is written to
<plan dir>/results/NAME/rank<R>.json, or {"error": traceback} when it raised. A case that fails
on every rank does not stop the later ones; one that fails on some ranks only may leave the others
waiting in a collective, and the caller's timeout ends the job (conftest.launch_cases).
Use conftest.launch_cases(cases, nproc, tmp_path) from a test."""
import importlib
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import paddletune  # noqa: E402,F401  (CPU threads before paddle)


def main(plan_path):
    plan = json.load(open(plan_path))
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    root = os.path.join(os.path.dirname(os.path.abspath(plan_path)), "results")
    for case in plan["cases"]:
        module, _, fn = case["target"].partition(":")
        try:
            result = getattr(importlib.import_module(module), fn)(**case.get("kwargs", {}))
        except BaseException:   # recorded per case; the test reports it with its name
            result = {"error": traceback.format_exc()}
        out = os.path.join(root, case["name"])
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
