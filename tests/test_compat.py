"""PaddleNLP argument-file compatibility: each file of tests/data/paddlenlp_argument_files (a copy
of ../shared/paddlenlp_argument_files) runs 2 steps on a tiny model, changing only what that
folder's README allows: model/dataset/output paths, step budget, lengths, batch sizes and parallel
degrees. Files whose features are not built yet are expected to fail (strict), naming the issue
that owns them, so the test turns green feature by feature."""
import dataclasses
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


# ---------------------------------------------------------------------------------------------
# PaddleNLP's *current* llm/config/{llama,chatglm2,qwen} files (issue 22): their key sets are
# test data (tests/data/paddlenlp_llm_configs.py). Every file parses with no unknown key and is
# accepted for its job, or refused naming the feature it needs or the job (and script) it is for.
import sys  # noqa: E402

from paddletune import args as A  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tests", "data"))
from paddlenlp_llm_configs import FILES as CURRENT  # noqa: E402

RUN = "run"
# file -> RUN, ("feature", words the message must hold) or ("job", job words, PaddleNLP script)
EXPECT = {name: RUN for name in (
    "llama/sft_argument.json", "llama/lora_argument.json", "llama/pt_argument.json",
    "llama/qlora_argument.json", "llama/wint8_lora_argument.json", "llama/sft_long_argument.json",
    "llama/longlora.json", "llama/ssa_argument.json", "llama/ARC-Challenge.json", "llama/ARC-Easy.json",
    "llama/boolq.json", "llama/data_slim.json", "llama/piqa.json", "llama/winogrande.json",
    "llama/winogrande_1.json", "llama/flashmask/sft.json", "llama/flashmask/lora.json",
    "chatglm2/sft_argument.json", "chatglm2/lora_argument.json", "chatglm2/pt_argument.json",
    "qwen/sft_argument.json", "qwen/sft_argument_0p5b.json", "qwen/sft_argument_0p5b_best.json",
    "qwen/lora_argument.json", "qwen/lora_argument_0p5b.json", "qwen/pt_argument.json",
    "qwen/pt_argument_0p5b.json", "qwen/ssa_argument.json")}
EXPECT.update({
    "llama/pose_yarn.json": ("feature", ["PoSE", "use_pose_convert"]),
    "llama/hqlora_argument.json": ("feature", ["HQ-LoRA"]),
    "llama/irqlora_argument.json": ("feature", ["IR-QLoRA"]),
    "llama/lqlora_argument.json": ("feature", ["LQ-LoRA"]),
    "llama/vera_argument.json": ("feature", ["VeRA"]),
    "llama/lokr_argument.json": ("feature", ["LoKr"]),
    "llama/dislora_argument.json": ("feature", ["DisLoRA"]),
    "qwen/dislora_argument.json": ("feature", ["DisLoRA"]),
    "llama/reft_argument.json": ("feature", ["ReFT"]),
    "llama/longlora_argument.json": ("feature", ["shifted sparse attention"]),
    "qwen/longlora_argument.json": ("feature", ["shifted sparse attention"]),
    "llama/ptq_argument.json": ("feature", ["PTQ"]),
    "llama/ptq_c8_argument.json": ("feature", ["PTQ"]),
    "chatglm2/ptq_argument.json": ("feature", ["PTQ"]),
    "llama/fp8_ptq_argument.json": ("feature", ["PTQ", "FP8"]),
    "llama/ceval_ptq_argument.json": ("feature", ["C-Eval"]),
    "llama/gptq_argument.json": ("feature", ["GPTQ"]),
    "chatglm2/gptq_argument.json": ("feature", ["GPTQ"]),
    "llama/awq_argument.json": ("feature", ["AWQ"]),
    "llama/foem_argument.json": ("feature", ["GPTQ", "FOEM"]),
})
for _name in CURRENT:
    _base = _name.split("/")[-1]
    if _name in EXPECT:
        continue
    if "pretrain" in _base:
        EXPECT[_name] = ("job", "pre-training", "llm/run_pretrain.py")
    elif "kto" in _base:
        EXPECT[_name] = ("job", "KTO", "llm/alignment/kto/run_kto.py")
    elif "dpo" in _base or "simpo" in _base:
        EXPECT[_name] = ("job", "DPO", "llm/alignment/dpo/run_dpo.py")
    elif _base.startswith("prm"):
        EXPECT[_name] = ("job", "process reward model", "llm/alignment/rm/flashmask/run_reward.py")
    elif _name in ("llama/rm_flashmask_argument.json", "llama/flashmask/rm.json"):
        EXPECT[_name] = ("job", "reward model", "llm/alignment/rm/flashmask/run_reward.py")
    elif _base == "rm.json":
        EXPECT[_name] = ("job", "reward model", "llm/alignment/rm/run_reward.py")
    elif "ppo" in _base or "grpo" in _base:
        EXPECT[_name] = ("job", "RLHF", "llm/alignment/ppo/run_ppo.py")
    elif "emb" in _base:
        EXPECT[_name] = ("job", "embedding", "llm/run_embedding.py")
# values the tests choose for a tiny model (PaddleNLP's files all log every step)
FIT = {"src_length": 64, "max_length": 128, "per_device_train_batch_size": 2, "per_device_eval_batch_size": 4,
       "gradient_accumulation_steps": 1, "max_steps": 2, "logging_steps": 1, "num_train_epochs": 1,
       "learning_rate": 3e-4, "warmup_steps": 0, "eval_accumulation_steps": 16, "save_total_limit": 1,
       "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1, "sharding_parallel_degree": 1}


def current_file(tmp_path, name, overrides=()):
    """The file `name` as a user has it (its keys; the recorded values; the rest fitted to a tiny
    model), written under its own file name."""
    data = CURRENT[name]
    family = name.split("/")[0]
    values = {}
    for k in data["keys"]:
        if k in data["values"]:
            values[k] = data["values"][k]
        elif k in FIT:
            values[k] = FIT[k]
        elif k == "model_name_or_path":
            values[k] = TINY.get(family, "paddletune/tiny-qwen2")
        elif k == "dataset_name_or_path":
            values[k] = "paddletune/sample-sft"
        elif k == "output_dir":
            values[k] = str(tmp_path / "out")
        elif A.ALIASES.get(k, k) in A.TABLE:
            f = A.TABLE[A.ALIASES.get(k, k)][1]
            values[k] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        else:   # a key of another job: its value does not matter here
            values[k] = 1
    for k in ("tensor_parallel_degree", "pipeline_parallel_degree", "sharding_parallel_degree"):
        if k in values:
            values[k] = 1   # the process count of these tests
    if "max_length" in values and "src_length" not in values:
        values["src_length"] = FIT["src_length"]   # the default 1024 would not fit max_length 128
    values.update(overrides)
    path = tmp_path / name.split("/")[-1]
    path.write_text(json.dumps(values))
    return str(path)


def test_current_key_sets_cover_the_three_families():
    assert set(EXPECT) == set(CURRENT)
    assert {n.split("/")[0] for n in CURRENT} == {"llama", "chatglm2", "qwen"}
    assert len(CURRENT) >= 70


@pytest.mark.parametrize("name", sorted(CURRENT))
def test_current_paddlenlp_file_is_accepted_or_refused_by_name(name, tmp_path):
    path = current_file(tmp_path, name)
    seen = []
    expect = EXPECT[name]
    if expect == RUN:
        A.parse_args([path], warn=seen.append)
        assert not any("unknown" in w for w in seen)
        return
    with pytest.raises(A.ArgumentError) as e:
        A.parse_args([path], warn=seen.append)
    msg = str(e.value)
    assert "unknown key" not in msg and path in msg, msg
    if expect[0] == "feature":
        assert "not built here" in msg and all(w in msg for w in expect[1]), msg
    else:
        assert expect[1] in msg and expect[2] in msg and "finetune_generation.py" in msg, msg
        assert "\n" not in msg   # one message


RUN_TWO_STEPS = [   # one file per job and per accepted feature
    "llama/sft_argument.json",          # SFT; bf16 on CPU; sharding stage2 on one rank
    "llama/lora_argument.json",         # LoRA; do_eval false + steps: PaddleNLP evaluates; save_steps 1
    "llama/pt_argument.json",           # prefix tuning
    "llama/qlora_argument.json",        # QLoRA nf4
    "qwen/ssa_argument.json",           # no/no strategies with load_best_model_at_end, generation eval unused
    "llama/flashmask/lora.json",        # benchmark mode, greedy zero padding, lazy data, flash_mask
    "qwen/sft_argument_0p5b_best.json",  # fused-kernel keys, zero padding
    "llama/wint8_lora_argument.json",   # LoRA on a weight-only int8 backbone
    "llama/sft_long_argument.json",     # lazy data, recompute full, fused-head keys, flash_mask
    "llama/longlora.json",              # LoRA with pissa / use_mora off, sharding stage1 on one rank
    "chatglm2/sft_argument.json",       # ChatGLM2 SFT, fp16 on CPU
    "chatglm2/pt_argument.json",        # ChatGLM2 prefix tuning
]


@pytest.mark.parametrize("name", RUN_TWO_STEPS)
def test_current_paddlenlp_file_runs_two_steps(name, tmp_path):
    path = current_file(tmp_path, name, {"max_steps": 2})   # the step budget
    code = load_script("llm/finetune_generation.py").main([path])
    assert code == 0
    out = tmp_path / "out"
    log = [json.loads(l) for l in open(out / "train_log.jsonl")]
    assert [e["step"] for e in log if "loss" in e] == [1, 2]
    evals = [e["step"] for e in log if "eval_loss" in e]
    if name == "llama/lora_argument.json":   # evaluation_strategy steps turned do_eval on; eval_steps = 1
        assert evals == [1, 2]
    if name in ("qwen/ssa_argument.json", "llama/flashmask/lora.json"):
        assert evals == []                   # no evaluation at all
    assert len(evals) == len(set(evals))     # each step's eval is logged once
    assert (out / "config.json").exists() or (out / "adapter_config.json").exists()


def test_do_eval_follows_paddlenlp_rules(tmp_path):
    base = {"model_name_or_path": "m", "dataset_name_or_path": "d", "output_dir": "o", "logging_steps": 3}
    t = A.build(dict(base, evaluation_strategy="steps", do_eval=False), warn=lambda m: None)[-1]
    assert t.do_eval is True and t.eval_steps == 3
    seen = []
    t = A.build(dict(base, do_eval=True), warn=seen.append)[-1]
    assert t.evaluation_strategy == "steps" and any("evaluation_strategy set to 'steps'" in w for w in seen)
    t = A.build(dict(base, load_best_model_at_end=True, evaluation_strategy="no", save_strategy="no"),
                warn=lambda m: None)[-1]
    assert t.do_eval is False and t.metric_for_best_model == "loss"
    with pytest.raises(A.ArgumentError, match="save_strategy .*equal to"):
        A.build(dict(base, load_best_model_at_end=True, evaluation_strategy="steps", save_strategy="epoch"))
    with pytest.raises(A.ArgumentError, match="multiple of eval_steps"):
        A.build(dict(base, load_best_model_at_end=True, evaluation_strategy="steps", save_strategy="steps",
                     eval_steps=4, save_steps=6))
    with pytest.raises(A.ArgumentError, match="bf16.*fp16"):
        A.build(dict(base, fp16=True, bf16=True), warn=lambda m: None)


def test_every_unknown_key_at_once_with_close_suggestions_only(tmp_path):
    p = tmp_path / "a.json"
    p.write_text(json.dumps({"model_name_or_path": "m", "dataset_name_or_path": "d", "output_dir": "o",
                             "lerning_rate": 1, "flash_masks": 1, "zzz_custom": 1, "model_name": "x"}))
    with pytest.raises(A.ArgumentError) as e:
        A.parse_args([str(p)])
    msg = str(e.value)
    assert str(p) in msg and "4 unknown keys" in msg
    assert "'lerning_rate' (did you mean 'learning_rate'?)" in msg
    assert "'flash_masks' (did you mean 'flash_mask'?)" in msg
    assert "'model_name' (did you mean 'model_name_or_path'?)" in msg
    assert "'zzz_custom'," in msg or "'zzz_custom';" in msg   # no far-fetched hint
    for far in ("train_datasets", "input_dir", "zzz_custom"):   # once: lowrank_adapter, output_dir
        assert A.suggestion(far) is None, far


def test_fp16_cpu_warning_is_printed_once(tmp_path, capsys):
    if A.TABLE and __import__("paddle").is_compiled_with_cuda():
        pytest.skip("a CUDA build: fp16 is real there")
    from paddletune import runtime

    runtime._WARNED.clear()
    path = current_file(tmp_path, "chatglm2/lora_argument.json", {"do_eval": False, "evaluation_strategy": "no",
                                                                  "save_strategy": "no",
                                                                  "load_best_model_at_end": False,
                                                                  "max_steps": 2})
    assert load_script("llm/finetune_generation.py").main([path]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert text.count("'fp16: true' has no effect on CPU") == 1, text
