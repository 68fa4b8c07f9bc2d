"""The shipped sharding argument files through llm/finetune_generation.py: llm/chatglm2's SFT file
(PaddleNLP's sharding stage3, with sharding_parallel_degree -1), llm/llama/sft_sharding_argument.json
(stage2, -1) and PaddleNLP's own ChatGLM2 SFT file (stage3, degree 4) on 4 launched ranks (both in ONE launch, the script's main() in-process on each
rank) shard over all 4 ranks; losses and the exported Hugging Face model equal the same file in
one process (sharding warned off there) at the same global batch (2 x 4 ranks = 8 x 1). The
4-rank run's checkpoint records sharding 4, and each owner wrote its own tensors once."""
import json
import os

import pytest

from conftest import ROOT, launch_cases, rel_err, run_script
from paddletune.models.hf import CheckpointReader

SCRIPT = "llm/finetune_generation.py"
QUICK = ["--max_steps", "3", "--logging_steps", "1", "--save_strategy", "no", "--evaluation_strategy",
         "no", "--load_best_model_at_end", "false", "--do_eval", "false", "--disable_tqdm", "true",
         "--adam_epsilon", "1e-4", "--warmup_steps", "0"]
FILES = {"chatglm2_stage3": "llm/chatglm2/sft_argument.json", "llama_stage2": "llm/llama/sft_sharding_argument.json",
         # PaddleNLP's own file (sharding_parallel_degree 4, fp16 O2: float32 on CPU), on the tiny model
         "paddlenlp_chatglm2_sft": "tests/data/paddlenlp_argument_files/chatglm2/sft_argument.json"}
TINY = {"paddlenlp_chatglm2_sft": ["--model_name_or_path", "paddletune/tiny-chatglm2", "--dataset_name_or_path",
                                   "paddletune/sample-sft", "--src_length", "64", "--max_length", "128",
                                   "--gradient_accumulation_steps", "1"]}
ONE = {"paddlenlp_chatglm2_sft": ["--sharding_parallel_degree", "1"]}   # its 4 in one process


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("shardscripts")
    cases = [(k, "tp_cases:script_main", {"relpath": SCRIPT, "argv": [os.path.join(ROOT, f), "--output_dir",
                                                                      str(base / k / "four")] + QUICK
                                          + TINY.get(k, []) + ["--per_device_train_batch_size", "2",
                                                               "--save_strategy", "steps", "--save_steps", "3"]})
             for k, f in FILES.items()]
    got = launch_cases(cases, base, nproc=4)
    assert all(code == 0 for res in got.values() for code in res)
    logs = {}
    for k, f in FILES.items():
        r = run_script([os.path.join(ROOT, SCRIPT), os.path.join(ROOT, f), "--output_dir", str(base / k / "one"),
                        "--per_device_train_batch_size", "8"] + QUICK + TINY.get(k, []) + ONE.get(k, []))
        assert r.returncode == 0, r.stderr[-3000:]
        logs[k] = r.stdout + r.stderr
    return base, logs


def _losses(d):
    return [json.loads(l)["loss"] for l in open(d / "train_log.jsonl") if '"loss"' in l]


@pytest.mark.parametrize("run", list(FILES))
def test_sharding_file_on_four_ranks_equals_one_process(outputs, run):
    base, logs = outputs
    four, one = base / run / "four", base / run / "one"
    assert "has no effect with one sharding rank" in logs[run]
    assert len(_losses(four)) == 3 and _losses(four) == pytest.approx(_losses(one), rel=1e-5)
    a, b = CheckpointReader(str(four)), CheckpointReader(str(one))
    assert sorted(a.keys()) == sorted(b.keys())
    assert max(rel_err(a.get(k), b.get(k)) for k in b.keys()) <= 1e-4
    # sharded for real: the checkpoint says so, and each of the 4 owners wrote its own tensors once
    state = json.load(open(four / "checkpoint-3" / "trainer_state.json"))
    assert state["degrees"] == {"dp": 1, "pp": 1, "sharding": 4, "tp": 1} and state["global_batch"] == 8
    index = json.load(open(four / "checkpoint-3" / "shards.json"))
    for kind in ("model", "optimizer"):
        assert len({p["file"] for e in index[kind].values() for p in e["pieces"]}) == 4
        assert all(len(e["pieces"]) == 1 for e in index[kind].values())


def test_sharding_memory_benchmark_smoke():
    from conftest import run_script

    r = run_script([os.path.join(ROOT, "benchmarks", "sharding_memory.py"), "--smoke"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| stage3 |" in r.stdout and "analytic share" in r.stdout
