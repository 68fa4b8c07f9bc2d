"""The streaming detokenizer (paddletune/serve/detok.py): the pieces it sends, joined, equal the
tokenizer's decode of all ids at once (and decode_output's stop cut), on a SentencePiece
tokenizer with byte fallback and "▁" (tiny ChatGLM2) and a byte-level BPE one (tiny Qwen2);
a CJK character or an emoji split over several byte tokens is held back until complete."""
import numpy as np
import pytest

from paddletune.generation import decode_output
from paddletune.serve.detok import IncrementalDetokenizer, StreamText
from paddletune.loading import load_tokenizer

TEXTS = ["Hello world, 你好，世界 🙂 ok", "  two  spaces\nand a newline", "温故而知新🚀🚀 end",
         "def f(x):\n    return x  # 注释"]


@pytest.fixture(scope="module", params=["paddletune/tiny-chatglm2", "paddletune/tiny-qwen2"])
def tok(request):
    return load_tokenizer(request.param)


def pieces_of(tok, ids):
    d = IncrementalDetokenizer(tok, [tok.eos_token_id])
    out = [d.add(i) for i in ids]
    return out, d.flush()


def test_pieces_join_to_the_full_decode(tok):
    rng = np.random.default_rng(0)
    normal = [i for i in range(len(tok)) if i not in tok.special_ids and "\ufffd" not in tok.decode([i])]
    cases = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    cases += [rng.choice(normal, 30).tolist() for _ in range(5)]   # arbitrary answers of whole tokens
    for ids in cases:
        out, rest = pieces_of(tok, ids)
        assert "".join(out) + rest == tok.decode(ids, skip_special_tokens=True), ids
        assert all("\ufffd" not in p for p in out)


def test_incomplete_characters_are_held_back(tok):
    ids = tok.encode("a你🙂", add_special_tokens=False)
    out, rest = pieces_of(tok, ids)
    assert "".join(out) == "a你🙂" and rest == ""
    assert out.count("") >= 3           # the first bytes of 你 (3 bytes) and 🙂 (4) send nothing
    assert [p for p in out if p][-2:] == ["你", "🙂"]


def test_leading_space_marker(tok):
    """" world" as the second word keeps its space; the answer's first token does not gain one."""
    ids = tok.encode("Hello world again", add_special_tokens=False)
    out, _ = pieces_of(tok, ids)
    assert "".join(out) == tok.decode(ids) and " world" in "".join(out[1:])


def test_stop_strings_cut_like_decode_output(tok):
    for text, stops in (("one two. three", ["."]), ("abc END more", ["END", "xyz"]), ("no stop here", ["zz"]),
                        ("你好世界", ["世界"])):
        ids = tok.encode(text, add_special_tokens=False)
        s = StreamText(tok, [tok.eos_token_id], stops)
        sent = "".join(s.push(i) for i in ids) + s.finish()
        assert sent == decode_output(tok, ids, stops, [tok.eos_token_id]), (text, stops)
        assert not any(st in sent for st in stops)
