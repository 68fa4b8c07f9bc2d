"""Multi-node with paddle's own launcher: two launchers on this machine, `--nnodes 2 --rank R
--master 127.0.0.1:PORT`, one process each, form one job over loopback (gloo). The job equals one
process at the doubled global batch, every rank reads its own examples, and a node that does not
see rank 0's output_dir stops the job before any work."""
import json
import os
import socket
import subprocess
import sys

import numpy as np

from conftest import ROOT, hf_checkpoint, rel_err
from paddletune.models.hf import SafetensorsFile

WORKER = os.path.join(ROOT, "tests", "dp_worker.py")


def _port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _two_nodes(tmp_path, ck, outs, micro, steps):
    """Node launchers 0 and 1 (outs[r]: the output_dir node r passes); returns their results."""
    port = _port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--master", f"127.0.0.1:{port}",
               "--nnodes", "2", "--rank", str(node), "--nproc_per_node", "1",
               "--log_dir", str(tmp_path / f"log{node}"), WORKER, ck, str(outs[node]), str(micro), "1",
               str(steps)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        results.append((p.returncode, out))
    return results


def _log(tmp_path, node):
    logs = [f for f in os.listdir(tmp_path / f"log{node}") if f.startswith("workerlog")]
    return "".join(open(tmp_path / f"log{node}" / f).read() for f in logs)


def test_two_launchers_form_one_job_equal_to_one_process(tmp_path):
    ck, _ = hf_checkpoint(tmp_path / "ck", "llama")
    single = tmp_path / "single"
    r = subprocess.run([sys.executable, WORKER, ck, str(single), "4", "1", "3"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "multi"
    results = _two_nodes(tmp_path, ck, [out, out], micro=2, steps=3)
    assert all(rc == 0 for rc, _ in results), [o[-2000:] for _, o in results] + [_log(tmp_path, 0)[-3000:]]
    topo = [json.load(open(out / f"topology-rank{r}.json")) for r in (0, 1)]
    assert [t["world"] for t in topo] == [2, 2] and sorted(t["rank"] for t in topo) == [0, 1]
    assert [t["data_degree"] for t in topo] == [2, 2] and topo[0]["pid"] != topo[1]["pid"]
    assert [t["nnodes"] for t in topo] == ["2", "2"]
    ids = [json.load(open(out / f"ids-rank{r}.json")) for r in (0, 1)]
    single_ids = json.load(open(single / "ids-rank0.json"))
    for step in range(3):   # disjoint shares whose union is the one process's global batch
        a = [i for mb in ids[0][step] for row in mb for i in np.ravel(row).tolist()]
        b = [i for mb in ids[1][step] for row in mb for i in np.ravel(row).tolist()]
        s = [i for mb in single_ids[step] for row in mb for i in np.ravel(row).tolist()]
        assert a and b and not set(a) & set(b) and sorted(a + b) == sorted(s)
    l_multi, l_single = json.load(open(out / "losses.json")), json.load(open(single / "losses.json"))
    assert len(l_multi) == 3
    np.testing.assert_allclose(l_multi, l_single, rtol=1e-5, atol=0)
    w = SafetensorsFile(str(out / "weights.safetensors"))
    ref = SafetensorsFile(str(single / "weights.safetensors"))
    flat = lambda st: np.concatenate([st.get(k).ravel() for k in sorted(st.keys())])  # noqa: E731
    assert rel_err(flat(w), flat(ref)) <= 1e-5


def test_a_node_that_does_not_see_rank0s_output_dir_stops_the_job(tmp_path):
    """Node 1 is given another directory (as a node without the shared mount would see an empty
    local one): both nodes end with exit code != 0 before training, node 1 naming itself."""
    ck, _ = hf_checkpoint(tmp_path / "ck", "llama")
    results = _two_nodes(tmp_path, ck, [tmp_path / "shared", tmp_path / "local"], micro=2, steps=2)
    assert all(rc != 0 for rc, _ in results)
    logs = _log(tmp_path, 0) + _log(tmp_path, 1)
    assert "is not shared: rank 1 on " in logs, logs[-3000:]
    assert not (tmp_path / "shared" / "losses.json").exists()
    assert not [f for f in os.listdir(tmp_path / "shared") if f.startswith(".paddletune-shared-")]
