"""Many multi-process test cases in one `paddle.distributed.launch` (each launch costs ~6-8 s
before any work, so the parallel tests run their cases in as few launches as possible).

    python -m paddle.distributed.launch --nproc_per_node N tests/launch_cases.py PLAN.json

PLAN.json: {"cases": [{"name": NAME, "target": "module:function", "kwargs": {...}}, ...]}.
Cases run in order on every rank; `target` is imported from tests/ (e.g. "dp_worker:train_case")
and called as function(**kwargs); its JSON-able return value is written to
<plan dir>/results/NAME/rank<R>.json, or {"error": traceback} when it raised. A case that fails
on every rank does not stop the later ones; one that fails on some ranks only may leave the others
waiting in a collective, and the caller's timeout ends the job (conftest.launch_cases).
Use conftest.launch_cases(cases, nproc, tmp_path) from a test.

After the last case every rank where no case failed ends through paddletune.parallel.engine.finish (a world barrier,
the store handshake, os._exit(0)), as the llm/ scripts do (cli.finish): an ordinary exit lets
paddle's communication objects be destroyed while peers exit, and a rank could crash at exit after
every case had written its results (engine.finish says how)."""
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
    failed = False
    for case in plan["cases"]:
        module, _, fn = case["target"].partition(":")
        try:
            result = getattr(importlib.import_module(module), fn)(**case.get("kwargs", {}))
        except BaseException:   # recorded per case; the test reports it with its name
            result = {"error": traceback.format_exc()}
            failed = True
        out = os.path.join(root, case["name"])
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    if not failed:   # (a case that failed on this rank may have left the others elsewhere)
        from paddletune.parallel import engine

        engine.finish(0)   # returns only when no case started the process group


if __name__ == "__main__":
    main(sys.argv[1])
