"""Tokenizers against transformers' AutoTokenizer on tiny tokenizers built in the test."""
import json
import os

import pytest
from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, processors, trainers

from conftest import TINY_TOKENIZER
from paddletune.data.builtin import generate
from paddletune.models.tiny import train_sentencepiece
from paddletune.tokenizer import Tokenizer

TEXTS = ["Hello world", "Reverse the words: apple stone", " leading space", "你好 Héllo wörld",
         "a\nb  c\t d", "tail space ", "<s> inside </s>", ""]


def corpus():
    train, _ = generate()
    return [r["src"] + "\n" + r["tgt"] for r in train[:600]] + ["Héllo wörld 你好 tabs\t  spaces"]


def byte_bpe(path, specials, post_bos=None, config=None):
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=500, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if post_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{post_bos} $A", special_tokens=[(post_bos, tok.token_to_id(post_bos))])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def same_as_transformers(path, texts=TEXTS):
    from transformers import AutoTokenizer

    ours, ref = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    for t in texts:
        assert ours.encode(t) == ref(t).input_ids, t
        assert ours.encode(t, add_special_tokens=False) == ref(t, add_special_tokens=False).input_ids, t
        ids = ref(t).input_ids
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), t
    return ours, ref


def test_builtin_bpe_tokenizer_json():
    ours, ref = same_as_transformers(TINY_TOKENIZER)
    assert ours.bos_token_id == ref.bos_token_id == 1 and ours.eos_token_id == ref.eos_token_id == 2


def test_sentencepiece_llama2_style(tmp_path):
    path = train_sentencepiece(str(tmp_path / "sp"), corpus())
    ours, ref = same_as_transformers(path)
    assert ours.backend == "sentencepiece"
    assert ours.encode("x")[0] == ours.bos_token_id == 1


def test_llama3_style_bos_from_post_processor_and_pad_filled_in(tmp_path):
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    path = byte_bpe(tmp_path / "l3", specials, post_bos="<|begin_of_text|>", config={
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": False})
    ours, _ = same_as_transformers(path, TEXTS + ["<|eot_id|> special in text"])
    assert ours.encode("hi")[0] == ours.token_to_id("<|begin_of_text|>")
    assert ours.pad_token == "<|eot_id|>" and ours.pad_added   # Llama-3 ships no pad token
    ours.save_pretrained(str(tmp_path / "saved"))
    assert json.load(open(tmp_path / "saved" / "tokenizer_config.json"))["pad_token"] == "<|eot_id|>"


def test_qwen2_style_no_bos(tmp_path):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    path = byte_bpe(tmp_path / "q", specials, config={
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False})
    ours, _ = same_as_transformers(path, TEXTS + ["<|im_start|>user\nhi<|im_end|>"])
    assert ours.special_tokens_around() == ([], [])
    assert ours.pad_token_id == ours.token_to_id("<|endoftext|>")


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer(str(tmp_path))
