"""BLEU-4 / ROUGE against values worked out by hand, and against sacrebleu / rouge-score
(test-only dependencies: pip install sacrebleu rouge-score) where their tokenisation equals ours."""
import importlib
import math
import random

import pytest

from paddletune.trainer.metrics import (bleu_details, corpus_bleu, generation_metrics,
                                        lcs_length, rouge_l, rouge_n, tokenize)

EN_PRED = ["The cat sat on the mat", "a quick brown fox jumps"]
EN_REF = ["the cat is on the mat", "The quick brown fox jumps high"]
ZH_PRED, ZH_REF = "我爱北京天安门", "我爱北京的天安门广场"


def test_tokenize_rules():
    assert tokenize("The Cat,  sat\n") == ["the", "cat,", "sat"]
    assert tokenize("我爱北京。") == ["我", "爱", "北", "京", "。"]
    assert tokenize("用Paddle训练 LLM") == ["用", "paddle", "训", "练", "llm"]
    assert tokenize("") == [] and tokenize("  ") == []


def test_bleu_english_by_hand():
    # sentence 1: 1-grams 5/6, 2-grams 3/5 (the cat, on the, the mat), 3-grams 1/4 (on the mat),
    #             4-grams 0/3.  sentence 2: 4/5, 3/4, 2/3, 1/2.  c = 11, r = 12.
    d = bleu_details(EN_PRED, EN_REF)
    assert d["precisions"] == [9 / 11, 6 / 9, 3 / 7, 1 / 5]
    assert (d["hyp_len"], d["ref_len"]) == (11, 12)
    expected = math.exp(1 - 12 / 11) * (9 / 11 * 6 / 9 * 3 / 7 * 1 / 5) ** 0.25
    assert d["bleu"] == pytest.approx(expected, rel=1e-12)
    assert corpus_bleu(EN_PRED[:1], EN_REF[:1]) == 0.0   # no 4-gram match, no smoothing
    assert corpus_bleu(["a b c d e"], ["a b c d"]) == 1.0 * (4 / 5 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25
    assert corpus_bleu(["a b c d"], ["a b c d e"]) == pytest.approx(math.exp(1 - 5 / 4))


def test_bleu_clips_repeated_ngrams():
    # "the the the the" vs "the cat": unigram precision 1/4 (clipped), no bigram match
    d = bleu_details(["the the the the"], ["the cat"])
    assert d["precisions"][0] == 1 / 4 and d["bleu"] == 0.0


def test_bleu_and_rouge_chinese_by_hand():
    # characters: pred 7, ref 10. n-gram matches 7/7, 5/6, 3/5, 1/4; BP = exp(1 - 10/7)
    d = bleu_details([ZH_PRED], [ZH_REF])
    assert d["precisions"] == [1.0, 5 / 6, 3 / 5, 1 / 4]
    assert d["bleu"] == pytest.approx(math.exp(1 - 10 / 7) * (1 / 8) ** 0.25, rel=1e-12)
    assert rouge_n(ZH_PRED, ZH_REF, 1) == pytest.approx(14 / 17)     # P 1, R 7/10
    assert rouge_n(ZH_PRED, ZH_REF, 2) == pytest.approx(2 / 3)       # P 5/6, R 5/9
    assert rouge_l(ZH_PRED, ZH_REF) == pytest.approx(14 / 17)        # LCS 7


def test_rouge_english_by_hand():
    assert rouge_n(EN_PRED[0], EN_REF[0], 1) == pytest.approx(5 / 6)
    assert rouge_n(EN_PRED[0], EN_REF[0], 2) == pytest.approx(3 / 5)
    assert rouge_l(EN_PRED[0], EN_REF[0]) == pytest.approx(5 / 6)    # "the cat on the mat"
    assert rouge_n("", "a b", 1) == 0.0 and rouge_l("x", "y") == 0.0
    assert lcs_length(list("ABCBDAB"), list("BDCABA")) == 4           # CLRS example
    m = generation_metrics(EN_PRED + [ZH_PRED], EN_REF + [ZH_REF])
    assert set(m) == {"bleu4", "rouge1", "rouge2", "rougel"}
    assert m["rouge1"] == pytest.approx((5 / 6 + rouge_n(EN_PRED[1], EN_REF[1], 1) + 14 / 17) / 3)


def _random_corpus(rng, words, n=30):
    def sent():
        return " ".join(rng.choice(words) for _ in range(rng.randint(1, 14)))
    preds = [sent() for _ in range(n)]
    refs = [p if rng.random() < 0.2 else sent() for p in preds]
    return preds, refs


def test_bleu_equals_sacrebleu_on_whitespace_words():
    sacrebleu = __import__("sacrebleu")
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "mat", "dog", "A", "Big", "ran"]
    for _ in range(20):
        preds, refs = _random_corpus(rng, words)
        ref = sacrebleu.corpus_bleu(preds, [refs], tokenize="none", lowercase=True,
                                    smooth_method="none").score / 100
        assert corpus_bleu(preds, refs) == pytest.approx(ref, abs=1e-9)
    # several references per sentence: clipping by the max count, closest reference length
    preds, r1 = _random_corpus(rng, words)
    _, r2 = _random_corpus(rng, words)
    ref = sacrebleu.corpus_bleu(preds, [r1, r2], tokenize="none", lowercase=True,
                                smooth_method="none").score / 100
    assert corpus_bleu(preds, [list(x) for x in zip(r1, r2)]) == pytest.approx(ref, abs=1e-9)
    assert ref > 0


def test_bleu_equals_sacrebleu_zh_on_chinese_characters():
    sacrebleu = __import__("sacrebleu")
    rng = random.Random(1)
    chars = list("我爱北京天安门的广场人民")
    for _ in range(20):
        preds = ["".join(rng.choice(chars) for _ in range(rng.randint(3, 20))) for _ in range(20)]
        refs = [p[: len(p) // 2] + "".join(rng.choice(chars) for _ in range(5)) for p in preds]
        ref = sacrebleu.corpus_bleu(preds, [refs], tokenize="zh", smooth_method="none").score / 100
        assert corpus_bleu(preds, refs) == pytest.approx(ref, abs=1e-9)


def test_rouge_equals_rouge_score():
    rs = importlib.import_module("rouge_score.rouge_scorer")
    scorer = rs.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False)
    rng = random.Random(2)
    words = ["the", "cat", "sat", "on", "mat", "dog", "big", "ran"]  # a-z only: same tokens
    preds, refs = _random_corpus(rng, words, n=60)
    for p, r in zip(preds, refs):
        s = scorer.score(r, p)   # (target, prediction)
        assert rouge_n(p, r, 1) == pytest.approx(s["rouge1"].fmeasure, abs=1e-12)
        assert rouge_n(p, r, 2) == pytest.approx(s["rouge2"].fmeasure, abs=1e-12)
        assert rouge_l(p, r) == pytest.approx(s["rougeL"].fmeasure, abs=1e-12)


def test_rouge_chinese_with_rouge_score_given_character_tokens():
    rs = importlib.import_module("rouge_score.rouge_scorer")
    default = rs.RougeScorer(["rouge1"])
    # why the default rouge-score tokenizer is not an oracle for Chinese: it drops CJK characters
    assert default.score(ZH_REF, ZH_PRED)["rouge1"].fmeasure == 0.0

    class CharTokenizer:   # characters, the same rule as ours for pure Chinese text
        def tokenize(self, text):
            return list(text)

    scorer = rs.RougeScorer(["rouge1", "rouge2", "rougeL"], tokenizer=CharTokenizer())
    rng = random.Random(3)
    chars = list("我爱北京天安门的广场人民")
    for _ in range(40):
        p = "".join(rng.choice(chars) for _ in range(rng.randint(1, 15)))
        r = "".join(rng.choice(chars) for _ in range(rng.randint(1, 15)))
        s = scorer.score(r, p)
        assert rouge_n(p, r, 1) == pytest.approx(s["rouge1"].fmeasure, abs=1e-12)
        assert rouge_n(p, r, 2) == pytest.approx(s["rouge2"].fmeasure, abs=1e-12)
        assert rouge_l(p, r) == pytest.approx(s["rougeL"].fmeasure, abs=1e-12)


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        generation_metrics(["a", "b"], ["a"])
