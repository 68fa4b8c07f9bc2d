"""The ordered end of a launched run (paddletune.parallel.engine.finish; cli.finish in the llm/
scripts, tests/launch_cases.py): a world barrier, a handshake on the job's store that keeps the
store servers up until every rank has passed it, then os._exit. engine.finish's docstring says
why an ordinary exit can crash a rank after a successful run. One 4-rank launch."""
import json
import os

import pytest

from conftest import ROOT, launch

WORKER = os.path.join(ROOT, "tests", "finish_worker.py")


def test_launched_ranks_end_in_order_and_leave_with_finish_code(tmp_path):
    from finish_worker import DELAYS

    out = tmp_path / "out"
    out.mkdir()
    r = launch([WORKER, str(out)], nproc=4, timeout=600, log_dir=tmp_path / "log")
    logs = "\n".join(open(tmp_path / "log" / n).read()[-1500:] for n in sorted(os.listdir(tmp_path / "log"))
                     if n.startswith("workerlog"))
    # finish(3) ended every rank: the launcher reports 3, not the sys.exit(9) after it
    assert r.returncode == 3, (r.returncode, logs)
    assert not [n for n in os.listdir(out) if n.startswith("after")], logs
    ranks = [json.load(open(out / f"rank{i}.json")) for i in range(4)]
    # the job really ran tp 2 x dp 2 (per-group stores on ranks 0 and 2) and used each group
    assert [x["groups"]["tp"] for x in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [x["groups"]["dp"] for x in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [x["sums"] for x in ranks] == [{"tp": 1.0, "dp": 2.0}, {"tp": 1.0, "dp": 4.0},
                                          {"tp": 5.0, "dp": 2.0}, {"tp": 5.0, "dp": 4.0}]
    # no rank left finish before the last one arrived (rank 3, DELAYS[3] s after rank 0)
    last = max(x["arrived"] for x in ranks)
    assert max(DELAYS) - min(DELAYS) >= 2.0
    for x in ranks:
        assert x["returned"] >= last, (x["rank"], x["returned"] - last)
    # every rank passed and left through the job's store (4 of 4 in both phases)
    assert [x["counts"] for x in ranks] == [{"passed": 4, "left": 4}] * 4


def test_finish_outside_a_launched_process_group(monkeypatch):
    """One process, or a launched rank whose process group never started (it failed before
    parallel.init): nothing to order; cli.finish is sys.exit(code)."""
    from paddletune import cli
    from paddletune.parallel import engine

    for world in ("1", "2"):
        monkeypatch.setenv("PADDLE_TRAINERS_NUM", world)
        monkeypatch.setenv("PADDLE_TRAINER_ID", "1" if world == "2" else "0")
        assert engine.finish(0) is None
        for code in (0, 2):
            with pytest.raises(SystemExit) as e:
                cli.finish(code)
            assert e.value.code == code
