"""Everything in one run (PaddleNLP's claim): nf4 QLoRA on a quantized backbone under TP2 x PP2 x
sharding stage3 over 2 ranks = 8 launched processes (one launch, one case, a tiny 4-block Llama).
Losses, grad norms, eval and the trained adapter tensors equal one process at the same global
batch (micro 2 x accumulation 2 x 2 data ranks = 4 x 2); per rank the AdamW state, the gradients
after the reduction and the resident trainable values between steps are half of the rank's
tensor- and pipeline-parallel slice."""
import os
import sys


from conftest import ROOT, hf_checkpoint, launch_cases

sys.path.insert(0, os.path.join(ROOT, "tests"))


def test_qlora_tp2_pp2_sharding2_on_eight_processes(tmp_path):
    from test_sharding import _compare
    from tp_cases import train_case

    ck = hf_checkpoint(tmp_path / "ck", "llama", seed=3, num_hidden_layers=4)[0]
    kw = {"method": "qlora", "quant": "nf4", "lr": 2e-2}
    got = launch_cases([("all", "tp_cases:train_case", dict(kw, ckpt=ck, out_dir=str(tmp_path / "all"), micro=2,
                                                            tp=2, pp=2, sharding="stage3"))],
                       tmp_path / "eight", nproc=8, timeout=1200)["all"]
    ref = train_case(ck, str(tmp_path / "single"), micro=4, **kw)
    _compare(got, ref, tmp_path / "all", tmp_path / "single")
    assert got[0]["degrees"] == {"dp": 1, "pp": 2, "sharding": 2, "tp": 2}
    for r in got:
        h, total = r["held"][-1], r["trainable_numel"]
        assert h["optimizer_numel"] == total          # 2 moments of half the slice
        assert h["shard"]["grad_numel"] == h["resident"] == total // 2, h
    assert len({frozenset(r["shapes"]) for r in got}) == 2   # two pipeline stages' tensors
