"""PaddleNLP argument-file compatibility: each file of tests/data/paddlenlp_argument_files (a copy
of ../shared/paddlenlp_argument_files) runs 2 steps on a tiny model, changing only what that
folder's README allows: model/dataset/output paths, step budget, lengths, batch sizes and parallel
degrees. Files whose features are not built yet are expected to fail (strict), naming the issue
that owns them, so the test turns green feature by feature."""
import json
import os

import pytest

from conftest import ROOT, load_script

FILES = os.path.join(ROOT, "tests", "data", "paddlenlp_argument_files")
TINY = {"llama": "paddletune/tiny-llama", "chatglm2": "paddletune/tiny-chatglm2"}
PENDING = {}  # file -> the issue whose feature it needs (none pending)
ALLOWED = {"model_name_or_path", "dataset_name_or_path", "output_dir", "max_steps", "src_length",
           "max_length", "per_device_train_batch_size", "per_device_eval_batch_size",
           "gradient_accumulation_steps", "tensor_parallel_degree", "pipeline_parallel_degree",
           "sharding_parallel_degree"}


def cases():
    out = []
    for family in sorted(os.listdir(FILES)):
        if not os.path.isdir(os.path.join(FILES, family)):
            continue
        for name in sorted(os.listdir(os.path.join(FILES, family))):
            rel = f"{family}/{name}"
            marks = [pytest.mark.xfail(strict=True, reason=PENDING[rel])] if rel in PENDING else []
            out.append(pytest.param(rel, marks=marks, id=rel))
    return out


@pytest.mark.parametrize("rel", cases())
def test_paddlenlp_file_runs_two_steps(rel, tmp_path):
    path = os.path.join(FILES, rel)
    original = json.load(open(path))
    changes = {"model_name_or_path": TINY[rel.split("/")[0]], "dataset_name_or_path": "paddletune/sample-sft",
               "output_dir": str(tmp_path / "out"), "max_steps": 2, "src_length": 64, "max_length": 128,
               "per_device_train_batch_size": 2, "per_device_eval_batch_size": 4,
               "gradient_accumulation_steps": 1}
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "sharding_parallel_degree"):
        if key in original:
            changes[key] = 1
    assert set(changes) <= ALLOWED
    argv = [path] + [f"--{k}={v}" for k, v in changes.items()]
    code = load_script("llm/finetune_generation.py").main(argv)
    assert code == 0
    log = [json.loads(l) for l in open(tmp_path / "out" / "train_log.jsonl")]
    assert [e["step"] for e in log if "loss" in e] == [1, 2]
    assert os.path.exists(tmp_path / "out" / "config.json") or os.path.exists(tmp_path / "out" / "adapter_config.json")
