"""Qwen (1)'s qwen.tiktoken read without tiktoken (models/qwen_tokenizer.py): ids equal tiktoken's
own Encoding built locally from the same ranks (the oracle; no network either way), special
tokens sit after the ranks, decode inverts encode, the chatml template renders and the
vocabulary file travels with a saved tokenizer."""
import os

import pytest
import tiktoken

from paddletune.models.qwen_tokenizer import PAT, SPECIALS, read_ranks
from paddletune.models.tiny import ASSETS
from paddletune.loading import load_tokenizer

TINY = os.path.join(ASSETS, "tiny-qwen-tokenizer")
TEXTS = ["Add 2 and 3.", "hello world  \n\n  foo\r\nbar", "问：你好吗？答：很好 1234567",
         "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "don't I'LL we've\t\ttabs   end ",
         "émoji 😀 mixed ÀÉ", "a" * 50, "  leading", "x<|extra_7|>y", ""]


@pytest.fixture(scope="module")
def pair():
    ranks = read_ranks(os.path.join(TINY, "qwen.tiktoken"))
    enc = tiktoken.Encoding("qwen-tiny", pat_str=PAT, mergeable_ranks=ranks,
                            special_tokens={s: len(ranks) + i for i, s in enumerate(SPECIALS)})
    return load_tokenizer(TINY), enc, len(ranks)


def test_ids_equal_tiktoken(pair):
    from paddletune.data.builtin import generate

    tok, enc, n = pair
    train, _ = generate()
    for text in TEXTS + [r["src"] + "\n" + r["tgt"] for r in train[:200]]:
        ids = tok.encode(text)
        assert ids == enc.encode(text, allowed_special="all"), text
        assert tok.decode(ids) == text


def test_specials_and_defaults(pair):
    tok, _, n = pair
    assert type(tok).__name__ == "QWenTokenizer" and len(tok) == n + 208
    assert tok.token_to_id("<|endoftext|>") == n and tok.token_to_id("<|im_end|>") == n + 2
    assert tok.token_to_id("<|extra_204|>") == n + 207
    assert tok.eos_token == tok.pad_token == "<|endoftext|>" and tok.bos_token_id is None
    assert tok.special_tokens_around() == ([], [])
    assert tok.decode(tok.encode("a<|im_end|>b"), skip_special_tokens=True) == "ab"


def test_chatml_template_and_save(pair, tmp_path):
    tok, _, n = pair
    tok.set_chat_template("chatml")
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tok.save_pretrained(str(tmp_path / "out"))
    assert os.path.exists(tmp_path / "out" / "qwen.tiktoken")
    again = load_tokenizer(str(tmp_path / "out"))
    assert again.encode(TEXTS[2]) == tok.encode(TEXTS[2])


def test_missing_or_malformed_vocabulary(tmp_path):
    import shutil

    d = tmp_path / "t"
    d.mkdir()
    shutil.copy(os.path.join(TINY, "tokenizer_config.json"), d)
    with pytest.raises(FileNotFoundError, match="qwen.tiktoken"):
        load_tokenizer(str(d))
    (d / "qwen.tiktoken").write_text("AA== 0\nnot-a-line\n")
    with pytest.raises(ValueError, match="qwen.tiktoken:2"):
        load_tokenizer(str(d))
