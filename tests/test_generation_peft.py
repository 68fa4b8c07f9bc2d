"""Generation with PEFT weights: LoRA (unmerged, merged in memory, merged into a checkpoint) and
prefix tuning, against torch `peft` on the transformers model.

Oracles: torch peft's generate (LoRA); for prefixes a greedy loop of full torch-peft forwards
(peft 0.21's generate drops the prefix under transformers 5: 'Both past_key_values and cache are
set ... ignoring past_key_values'), and our own uncached recomputation."""
import pytest
import torch
from conftest import hf_checkpoint, load_script, rel_err, write_jsonl

import paddletune
from paddletune import peft
from paddletune.generation import generate
from paddletune.loading import load_for_generation

PROMPTS = [[1, 5, 9, 33, 44], [1, 7, 8], [1, 100, 200, 300, 400, 500, 9]]
N = 16


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("gen_lora")
    path, hf = hf_checkpoint(root / "base", seed=8)
    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "o_proj"],
                     init_lora_weights=False, task_type="CAUSAL_LM")
    pm = get_peft_model(hf, cfg).eval()
    with torch.no_grad():   # make the adapter matter: larger B
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.mul_(20)
    pm.save_pretrained(str(root / "adapter"))
    return path, str(root / "adapter"), pm, root


def torch_generate(pm, prompt, n=N):
    x = torch.tensor([prompt])
    with torch.no_grad():
        g = pm.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                        min_new_tokens=n, do_sample=False, pad_token_id=0)
    return g[0, len(prompt):].tolist()


def test_lora_unmerged_merged_and_merged_checkpoint_equal_torch_peft(lora_setup):
    path, adapter, pm, root = lora_setup
    expected = [torch_generate(pm, p) for p in PROMPTS]
    plain, _, _ = load_for_generation(path)
    base_ids = generate(plain, PROMPTS, max_new_tokens=N, eos_token_id=[]).sequences
    assert base_ids != expected                      # the adapter changes the answers
    unmerged, _, _ = load_for_generation(path, lora_path=adapter, merge_lora=False)
    merged, _, _ = load_for_generation(path, lora_path=adapter)
    assert len(peft.lora.lora_layers(unmerged)) == 8
    assert all(m.merged for m in peft.lora.lora_layers(merged).values())
    assert not any(m.merged for m in peft.lora.lora_layers(unmerged).values())
    a = generate(unmerged, PROMPTS, max_new_tokens=N, eos_token_id=[], return_logits=True)
    b = generate(merged, PROMPTS, max_new_tokens=N, eos_token_id=[], return_logits=True)
    assert a.sequences == expected and b.sequences == expected     # batched, left padded
    assert all(rel_err(x, y) < 1e-5 for x, y in zip(a.logits, b.logits))
    out = peft.merge_lora(adapter, str(root / "merged"), base_path=path)   # merged checkpoint
    file_merged, _, _ = load_for_generation(out)
    assert generate(file_merged, PROMPTS, max_new_tokens=N, eos_token_id=[]).sequences == expected


def test_pipeline_and_predictor_with_lora(lora_setup, tmp_path):
    import io
    import json


    path, adapter, pm, _ = lora_setup
    pipe = paddletune.pipeline("text-generation", model=path, lora=adapter, max_new_tokens=8)
    text = "Reverse the words: apple"
    ids = pipe.tokenizer.encode(text)
    expected = torch_generate(pm, ids, 8)
    eos = 2
    expected = expected[:expected.index(eos) + 1] if eos in expected else expected
    want = pipe.tokenizer.decode([t for t in expected if t != eos], skip_special_tokens=True)
    assert pipe(text, return_full_text=False)[0]["generated_text"] == want
    pred = load_script("llm/predictor.py")
    data = write_jsonl(str(tmp_path / "d.json"), [{"src": text, "tgt": ""}])
    out = io.StringIO()
    assert pred.main(["--model_name_or_path", path, "--lora_path", adapter, "--data_file", data,
                      "--decode_strategy", "greedy_search", "--max_length", "8"], stdout=out) == 0
    assert json.loads(out.getvalue().splitlines()[0])["output"] == want
    # the adapter directory alone (a LoRA run's output_dir): its base_model_name_or_path + itself
    import os
    import shutil

    alone = str(tmp_path / "adapter_only")
    shutil.copytree(adapter, alone)
    conf = json.load(open(os.path.join(alone, "adapter_config.json")))
    json.dump(dict(conf, base_model_name_or_path=path), open(os.path.join(alone, "adapter_config.json"), "w"))
    out = io.StringIO()
    assert pred.main(["--model_name_or_path", alone, "--data_file", data, "--decode_strategy", "greedy_search",
                      "--max_length", "8"], stdout=out) == 0
    assert json.loads(out.getvalue().splitlines()[0])["output"] == want
    # loading.load_for_generation takes the adapter directory alone as well: torch peft's answers
    from_adapter, _, _ = load_for_generation(alone)
    assert len(peft.lora.lora_layers(from_adapter)) == 8
    assert (generate(from_adapter, PROMPTS, max_new_tokens=N, eos_token_id=[]).sequences
            == [torch_generate(pm, p) for p in PROMPTS])


@pytest.fixture(scope="module")
def prefix_setup(tmp_path_factory):
    from peft import PrefixTuningConfig, get_peft_model

    root = tmp_path_factory.mktemp("gen_prefix")
    path, hf = hf_checkpoint(root / "base", seed=4)
    torch.manual_seed(0)
    pm = get_peft_model(hf, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5)).eval()
    with torch.no_grad():
        pm.prompt_encoder.default.embedding.weight.normal_(0, 1.0)
    pm.save_pretrained(str(root / "prefix"))
    return path, str(root / "prefix"), pm


def torch_prefix_greedy(pm, prompt, n=N):
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = pm(input_ids=seq, attention_mask=torch.ones_like(seq)).logits[:, -1].argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], 1)
    return seq[0, len(prompt):].tolist()


def test_prefix_generation_equals_torch_peft_and_uncached(prefix_setup):
    path, prefix_dir, pm = prefix_setup
    model, tok, _ = load_for_generation(path, prefix_path=prefix_dir)
    assert model.prefix_encoder.num_tokens == 5
    cached = generate(model, PROMPTS, max_new_tokens=N, eos_token_id=[], return_logits=True)
    for p, s in zip(PROMPTS, cached.sequences):
        assert s == torch_prefix_greedy(pm, p)
    uncached = generate(model, PROMPTS, max_new_tokens=N, eos_token_id=[], return_logits=True,
                        use_cache=False)
    assert uncached.sequences == cached.sequences
    assert all(rel_err(x, y) < 1e-5 for x, y in zip(cached.logits, uncached.logits))
    plain, _, _ = load_for_generation(path)
    assert generate(plain, PROMPTS, max_new_tokens=N, eos_token_id=[]).sequences != cached.sequences
    pipe = paddletune.pipeline("text-generation", model=path, prefix=prefix_dir, max_new_tokens=N,
                               eos_token_id=[])
    want = torch_prefix_greedy(pm, tok.encode("hi"))
    assert pipe("hi", return_full_text=False)[0]["generated_text"] == tok.decode(want, skip_special_tokens=True)
