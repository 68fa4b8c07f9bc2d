"""paddletune.pipeline("text-generation") against transformers' own text-generation pipeline
on the same checkpoint (greedy)."""
import json
import os

import pytest
import torch
from conftest import hf_checkpoint

import paddletune
from paddletune.text_generation import TextGenerationPipeline

PROMPTS = ["Reverse the words: apple river", "Sort the numbers: 3 1 2", "hello"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hf_checkpoint(tmp_path_factory.mktemp("pipe"), seed=11)


def hf_pipeline_texts(path, hf_model, prompts, n, **kw):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    pipe = transformers.pipeline("text-generation", model=hf_model, tokenizer=tok, device="cpu")
    with torch.no_grad():
        return [pipe(p, max_new_tokens=n, do_sample=False, **kw)[0]["generated_text"] for p in prompts]


def test_pipeline_equals_transformers_pipeline(ckpt):
    path, hf = ckpt
    pipe = paddletune.pipeline("text-generation", model=path, max_new_tokens=12)
    assert isinstance(pipe, TextGenerationPipeline)
    expected = hf_pipeline_texts(path, hf, PROMPTS, 12)
    assert [pipe(p)[0]["generated_text"] for p in PROMPTS] == expected
    # a list is batched (left padding) and gives the same texts
    assert [r[0]["generated_text"] for r in pipe(PROMPTS)] == expected
    only_new = hf_pipeline_texts(path, hf, PROMPTS[:1], 12, return_full_text=False)
    assert pipe(PROMPTS[0], return_full_text=False)[0]["generated_text"] == only_new[0]


def test_pipeline_generation_overrides_and_eos_from_generation_config(ckpt, tmp_path):
    path, hf = ckpt
    pipe = paddletune.pipeline("text-generation", model=path, max_new_tokens=10, batch_size=2)
    free = pipe(PROMPTS[0], return_full_text=False, max_new_tokens=6)[0]["generated_text"]
    assert free == hf_pipeline_texts(path, hf, PROMPTS[:1], 6, return_full_text=False)[0]
    a = pipe(PROMPTS, decode_strategy="sampling", seed=5, temperature=2.0)
    assert a == pipe(PROMPTS, decode_strategy="sampling", seed=5, temperature=2.0)
    # an end-of-turn id listed in generation_config.json stops generation (Llama-3 / Qwen2 habit)
    ids = pipe.tokenizer.encode(PROMPTS[1])
    first = paddletune.generation.generate(pipe.model, [ids], max_new_tokens=3).sequences[0]
    with open(os.path.join(path, "generation_config.json")) as f:
        gen = json.load(f)
    gen["eos_token_id"] = [2, first[1]]
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(gen, f)
    try:
        pipe2 = paddletune.pipeline("text-generation", model=path, max_new_tokens=10)
        assert pipe2.config.eos_token_id == [2, first[1]]
        out = pipe2(PROMPTS[1], return_full_text=False)[0]["generated_text"]
        assert out == pipe.tokenizer.decode(first[:1], skip_special_tokens=True)
    finally:
        hf.generation_config.save_pretrained(path)


def test_pipeline_builtin_model_name():
    pipe = paddletune.pipeline("text-generation", model="paddletune/tiny-llama", max_new_tokens=4)
    out = pipe("Reverse the words: a b")
    assert out[0]["generated_text"].startswith("Reverse the words: a b")


def test_pipeline_bad_input_fails_before_loading(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="task 'summarization'"):
        paddletune.pipeline("summarization", model=missing)
    with pytest.raises(TypeError, match="max_len"):
        paddletune.pipeline("text-generation", model=missing, max_len=3)
    with pytest.raises(ValueError, match="temperature"):
        paddletune.pipeline("text-generation", model=missing, temperature=-1)
    with pytest.raises(ValueError, match="not a local directory"):
        paddletune.pipeline("text-generation", model=missing)
    with pytest.raises(ValueError, match="needs model="):
        paddletune.pipeline("text-generation")


def test_pipeline_chat_messages_equal_transformers_pipeline(tmp_path):
    """Messages are rendered with the checkpoint's chat template (here the built-in llama2
    text, which starts with BOS as transformers' rendering does)."""
    import transformers

    from paddletune.data.chat_template import BUILTIN_TEMPLATES

    path, hf = hf_checkpoint(tmp_path / "chat", seed=12)
    conf_path = os.path.join(path, "tokenizer_config.json")
    conf = json.load(open(conf_path))
    conf["chat_template"] = BUILTIN_TEMPLATES["llama2"]
    json.dump(conf, open(conf_path, "w"))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "Sort 3 1 2"}]
    pipe = paddletune.pipeline("text-generation", model=path, max_new_tokens=8)
    ours = pipe(chat)[0]["generated_text"]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ref = transformers.pipeline("text-generation", model=hf, tokenizer=tok, device="cpu")
    with torch.no_grad():
        expected = ref(chat, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert ours == expected and ours[-1]["role"] == "assistant" and ours[:-1] == chat
    assert pipe([chat, chat[:2]], return_full_text=False)[0][0]["generated_text"] == expected[-1]["content"]


def test_chat_template_end_of_turn_token_stops_generation(tmp_path):
    """With a chatml template and <|im_end|> a special token, <|im_end|> ends generation (as
    transformers does when generation_config lists it), besides EOS."""
    import numpy as np
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as T

    from conftest import TINY_TOKENIZER
    from paddletune.data.chat_template import BUILTIN_TEMPLATES
    from paddletune.generation import checkpoint_defaults, generate

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    t = T.from_file(os.path.join(TINY_TOKENIZER, "tokenizer.json"))
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ("<|im_start|>", "<|im_end|>")])
    t.save(str(tok_dir / "tokenizer.json"))
    conf = json.load(open(os.path.join(TINY_TOKENIZER, "tokenizer_config.json")))
    conf["chat_template"] = BUILTIN_TEMPLATES["chatml"]
    json.dump(conf, open(tok_dir / "tokenizer_config.json", "w"))
    path, _ = hf_checkpoint(tmp_path / "m", tokenizer_dir=str(tok_dir), vocab_size=602, seed=3)
    pipe = paddletune.pipeline("text-generation", model=path, max_new_tokens=6)
    im_end = pipe.tokenizer.token_to_id("<|im_end|>")
    assert im_end == 601 and pipe.config.eos_token_id == [2, im_end]
    assert checkpoint_defaults(path, pipe.tokenizer)["eos_token_id"] == [2, im_end]
    # the pipeline stops at <|im_end|>: answers are cut there, and it is not in the text
    chat = [{"role": "user", "content": "hi"}]
    ids = pipe.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    free = generate(pipe.model, [ids], max_new_tokens=6, eos_token_id=[]).sequences[0]
    arr = pipe.model.lm_head.weight.numpy()     # [hidden, vocab]: make <|im_end|> score as the
    arr[:, im_end] = arr[:, free[2]]            # 3rd answer token does, plus a margin
    arr[:, im_end] += 1e-3 * np.sign(arr[:, free[2]])
    pipe.model.lm_head.weight.set_value(arr)
    out = generate(pipe.model, [ids], pipe.config, tokenizer=pipe.tokenizer)
    k = out.sequences[0].index(im_end)
    assert out.finish_reasons == ["eos"] and out.sequences[0] == out.sequences[0][:k + 1]
    assert "<|im_end|>" not in out.texts[0]
    assert pipe(chat, return_full_text=False)[0]["generated_text"] == out.texts[0]
