"""Greedy generation on an nf4 backbone equals transformers' greedy generate on the same
checkpoint with its Linear weights replaced by brute-force nf4-dequantized weights (the test's own
quantizer in tests/test_quant.py, not paddletune's; blocks along `out` for the row-parallel
o_proj / down_proj, along `in` for the rest; block size 32 so that the 128-long lines have 4
blocks and are double-quantized, which needs at least 3 blocks per line)."""
import numpy as np
import torch

from conftest import hf_checkpoint
from paddletune.generation import generate
from paddletune.loading import load_model
from paddletune.quant import QuantConfig
from test_quant import brute_force, reference_axis


def test_nf4_greedy_ids_equal_dequantized_reference(tmp_path):
    path, hf = hf_checkpoint(tmp_path / "ck", hidden_size=128, intermediate_size=256, seed=3)
    model = load_model(path, quant=QuantConfig("nf4", 32, True, 256))
    with torch.no_grad():
        for name, mod in hf.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                axis = reference_axis(name)
                w = brute_force(mod.weight.numpy(), "nf4", 32, True, block_axis=axis)
                mod.weight.copy_(torch.tensor(w))
    prompts = [np.random.default_rng(i).integers(3, 600, size=n).tolist() for i, n in ((0, 7), (1, 11))]
    out = generate(model, prompts, max_new_tokens=24, eos_token_id=[], pad_token_id=0)
    for p, seq in zip(prompts, out.sequences):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                          pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
        assert seq == ref
