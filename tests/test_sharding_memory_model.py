"""benchmarks/sharding_memory.py's memory model (Llama-2-70B LoRA / QLoRA on 8 ranks, seq 4096,
recompute) against hand-worked counts and against paddletune/models/memory.py's estimator where the
two overlap; where they differ the difference is hand-worked (memory.py counts float32, the CPU
dtype, never shards master weights and keeps no recompute working set). Plus the --peft smoke run
(2 launched ranks, stage 3): per-rank held bytes of trainable / frozen / buffer tensors."""
import os
import re
import sys
from types import SimpleNamespace

import pytest

from conftest import ROOT, run_script

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import sharding_memory as sm  # noqa: E402
from paddletune.models import memory  # noqa: E402

CFG = sm.LLAMA2_70B
# hand-worked: H 8192, L 80, n 64, k 8, d 128, I 28672, V 32000
M = 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672)     # 80 * 855,638,016
F = 2 * 32000 * 8192 + 161 * 8192
T = 80 * 8 * (2 * 16384 + 2 * 9216 + 3 * 36864)                   # 80 * 1,294,336
ACT = 2 * 4096 * 8192 * 80 + 2 * 4096 * (10 * 8192 + 3 * 28672) + 8 * 4096 * 32000


def test_hand_worked_counts():
    assert (M, F, T) == (68_451_041_280, 525_606_912, 103_546_880)
    assert M + F == 68_976_648_192                                   # Llama-2-70B's parameter count
    assert ACT == 5_368_709_120 + 1_375_731_712 + 1_048_576_000 == 7_793_016_832
    lora0 = sm.memory_model(CFG, "lora", 0)
    assert lora0 == {"frozen": 2 * (M + F), "adapters": 2 * T, "gradients": 4 * T, "optimizer": 12 * T,
                     "activations": ACT, "gather": 0}
    lora3 = sm.memory_model(CFG, "lora", 3)
    assert lora3["frozen"] == 2 * (M + F) / 8 and lora3["gather"] == 2 * 1_711_276_032   # 2 blocks, bf16
    assert lora3["adapters"] == 2 * T / 8 and lora3["gradients"] == 4 * T / 8 and lora3["optimizer"] == 12 * T / 8
    assert sm.memory_model(CFG, "lora", 1)["gradients"] == 4 * T          # stage 1 shards only the optimizer
    assert sm.memory_model(CFG, "lora", 2)["frozen"] == 2 * (M + F)        # stages 1-2 never shard weights
    q0 = sm.memory_model(CFG, "qlora", 0)
    assert q0["frozen"] == 38_503_710_720 + 1_051_213_824                  # 0.5625 * M + 2 * F
    whole = sm.memory_model(CFG, "qlora", 3, shard_buffers=False)
    assert whole["frozen"] == 38_503_710_720 + 1_051_213_824 / 8 and whole["gather"] == 0
    kept = sm.memory_model(CFG, "lora", 3, frozen_kept=True)                # paddle 3.3.1 as shipped
    assert kept["frozen"] == 2 * (M + F) and kept["gather"] == 0 and kept["optimizer"] == 12 * T / 8
    assert sm.memory_model(CFG, "qlora", 3, frozen_kept=True)["frozen"] == q0["frozen"]
    split = sm.memory_model(CFG, "qlora", 3, shard_buffers=True)
    assert split["frozen"] == (38_503_710_720 + 1_051_213_824) / 8 and split["gather"] == 2 * 481_296_384


def test_against_memory_estimator():
    cfg = SimpleNamespace(**CFG)
    full, _ = memory.weight_bytes(cfg)
    assert full == 4 * (M + F) == 2 * sm.memory_model(CFG, "lora", 0)["frozen"]   # float32 vs bf16
    nf4, _ = memory.weight_bytes(cfg, algo="nf4")
    # same codes + scales; memory.py keeps embeddings, head and norms in float32 (2 bytes more each)
    assert nf4 - sm.memory_model(CFG, "qlora", 0)["frozen"] == 2 * F == 1_051_213_824
    assert memory.trainable_values(cfg, "lora", 8) == T
    for stage in (0, 1, 2, 3):
        ours = sm.memory_model(CFG, "lora", stage)
        est = memory.training_bytes(cfg, T, 1, 4096, sharding=8, stage=stage, dtype="bfloat16", recompute=True)
        assert est["gradients"] == ours["gradients"]
        s1 = 8 if stage >= 1 else 1
        assert est["optimizer"] == ours["optimizer"] - 4 * T / s1 == 8 * T / s1          # the moments
        # master weights: memory.py 4*T at every stage; ours / S from stage 1 (each rank keeps the
        # master copies of the parameters it updates)
        assert est["master"] == 4 * T and ours["optimizer"] - est["optimizer"] == 4 * T / s1
        # activations: memory.py keeps the block inputs in float32 and no recompute working set
        assert est["activations"] == 4 * 4096 * (80 * 8192 + 2 * 32000) == 11_785_994_240
        assert est["activations"] - ours["activations"] == 2 * 4096 * 8192 * 80 - 2 * 4096 * (10 * 8192 + 3 * 28672)


def test_model_flag_prints_rows_and_formula(capsys):
    sm.main(["--model", "llama2-70b"])
    out = capsys.readouterr().out
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line.split("|")[-2].strip()
            for line in out.splitlines() if line.startswith("| LoRA") or line.startswith("| QLoRA")}
    assert len(rows) == 11
    assert rows[("LoRA bf16", "stage3, paddle as shipped (frozen kept whole after backward)")] == "no"
    assert [rows[("LoRA bf16", s)] for s in ("none (dp)", "stage1", "stage2", "stage3")] == ["no", "no", "no", "yes"]
    assert all(v == "yes" for k, v in rows.items() if k[0] == "QLoRA nf4")
    assert ("QLoRA nf4", "stage3 codes whole (paddle: buffers)") in rows
    assert ("QLoRA nf4", "stage3 codes sharded (ours)") in rows
    assert "M = L * (2*H*n*d" in out and "8*b*s*V" in out
    line = next(x for x in out.splitlines() if x.startswith("| LoRA bf16 | stage3 |"))
    assert line.split("|")[3].strip() == f"{2 * (M + F) / 8 / 2 ** 30:.2f}" == "16.06"


@pytest.mark.parametrize("method", ["qlora"])
def test_peft_held_bytes_smoke(method):
    r = run_script([os.path.join(ROOT, "benchmarks", "sharding_memory.py"), "--smoke", "--peft", method])
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("| stage3 |"))
    cells = [re.findall(r"\(([\d.]+)\)", c) for c in line.split("|")[2:6]]
    trainable, frozen, buffers, everything = ([float(v) for v in c] for c in cells)
    assert len(trainable) == 2 and all(0.4 <= s <= 0.6 for s in trainable)   # trainable: about 1/S each
    assert all(0 < s <= 1.0 for s in frozen + buffers + everything)
