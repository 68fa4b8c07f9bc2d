"""SFT data: token-by-token label masking on a hand-made word-level tokenizer, file errors."""
import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTok, models, pre_tokenizers, processors

from conftest import write_jsonl
from paddletune.args import DataArgument
from paddletune.data import builtin
from paddletune.data.sft import DataError, build_datasets, tokenize_rounds
from paddletune.tokenizer import Tokenizer

WORDS = ["<unk>", "<s>", "</s>"] + list("abcdepqrstxyz")
ID = {w: i for i, w in enumerate(WORDS)}
BOS, EOS, M = 1, 2, -100


@pytest.fixture(scope="module")
def wtok(tmp_path_factory):
    d = tmp_path_factory.mktemp("wordtok")
    t = HFTok(models.WordLevel(ID, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}))
    return Tokenizer(str(d))


def ids(s):
    return [ID[w] for w in s.split()]


@pytest.mark.parametrize("src,tgt,exp_ids,exp_labels", [
    # source cut from the LEFT to src_length=4 (BOS kept); short target gets EOS
    ("a b c d e", "x y", [BOS] + ids("c d e x y") + [EOS], [M] * 4 + ids("x y") + [EOS]),
    # target cut from the RIGHT to max_length - len(source) = 4: cut -> no EOS
    ("a b c d e", "p q r s t", [BOS] + ids("c d e p q r s"), [M] * 4 + ids("p q r s")),
    # target of exactly budget-1 tokens: not cut -> EOS fills the budget
    ("a b c d e", "p q r", [BOS] + ids("c d e p q r") + [EOS], [M] * 4 + ids("p q r") + [EOS]),
    # target exactly the budget: counts as cut (PaddleNLP rule len < budget) -> no EOS
    ("a b c d e", "p q r s", [BOS] + ids("c d e p q r s"), [M] * 4 + ids("p q r s")),
    # short source leaves a larger target budget (8 - 2 = 6)
    ("a", "p q r s t", [BOS] + ids("a p q r s t") + [EOS], [M] * 2 + ids("p q r s t") + [EOS]),
])
def test_label_masking_token_by_token(wtok, src, tgt, exp_ids, exp_labels):
    got_ids, got_labels = tokenize_rounds(wtok, [(src, tgt)], src_length=4, max_length=8)
    assert got_ids == exp_ids
    assert got_labels == exp_labels


def test_multi_round_labels_every_target(wtok):
    got_ids, got_labels = tokenize_rounds(wtok, [("a", "x"), ("b", "y z")], src_length=4, max_length=16)
    assert got_ids == [BOS] + ids("a x") + [EOS] + ids("b y z") + [EOS]
    assert got_labels == [M, M] + ids("x") + [EOS] + [M] + ids("y z") + [EOS]


def test_multi_round_drops_oldest_rounds(wtok):
    got_ids, _ = tokenize_rounds(wtok, [("a b c", "x y z"), ("d", "p")], src_length=4, max_length=6)
    assert got_ids == [BOS] + ids("d p") + [EOS]


def data_args(path, **kw):
    return DataArgument(dataset_name_or_path=str(path), src_length=4, max_length=8, **kw)


def test_directory_of_split_files_and_ids(wtok, tmp_path):
    write_jsonl(tmp_path / "train" / "part1.json", [{"src": "a", "tgt": "x"}])
    write_jsonl(tmp_path / "train" / "part2.json", [{"src": "b", "tgt": "y"}, {"src": "c", "tgt": "z"}])
    write_jsonl(tmp_path / "dev.json", [{"src": "d", "tgt": "p"}])
    train, dev = build_datasets(data_args(tmp_path), wtok, do_train=True, do_eval=True)
    assert len(train) == 3 and len(dev) == 1
    assert [e["id"] for e in train] == [0, 1, 2]
    np.testing.assert_array_equal(train[1]["input_ids"], [BOS, ID["b"], ID["y"], EOS])


@pytest.mark.parametrize("line,msg", [
    ('{"src": "a", "tgt": ', "train.json:2: not valid JSON"),
    ('{"source": "a", "target": "x"}', 'train.json:2: needs keys "src" and "tgt"'),
    ('{"src": "a", "tgt": 3}', "train.json:2: \"src\" and \"tgt\" must both be strings"),
    ('["a", "x"]', "train.json:2: each line must be a JSON object"),
])
def test_malformed_line_names_file_and_line(wtok, tmp_path, line, msg):
    (tmp_path / "train.json").write_text('{"src": "a", "tgt": "x"}\n' + line + "\n")
    with pytest.raises(DataError, match=msg):
        build_datasets(data_args(tmp_path), wtok)


def test_empty_and_missing_splits(wtok, tmp_path):
    (tmp_path / "train.json").write_text("\n\n")
    with pytest.raises(DataError, match="empty"):
        build_datasets(data_args(tmp_path), wtok)
    write_jsonl(tmp_path / "train.json", [{"src": "a", "tgt": "x"}])
    with pytest.raises(DataError, match="no dev data"):
        build_datasets(data_args(tmp_path), wtok, do_eval=True)
    with pytest.raises(DataError, match="not a directory"):
        build_datasets(data_args(tmp_path / "nope"), wtok)


def test_builtin_sample_files_equal_their_generator():
    train, dev = builtin.generate()
    root = builtin.BUILTIN_DATASETS["paddletune/sample-sft"]
    for name, rows in (("train.json", train), ("dev.json", dev)):
        with open(os.path.join(root, name)) as f:
            assert [json.loads(l) for l in f] == rows
    # the answers are checkable: spot-check the task rules
    for r in train[:200]:
        if r["src"].startswith("Add "):
            a, b = r["src"][4:-1].split(" and ")
            assert int(r["tgt"]) == int(a) + int(b)
        if r["src"].startswith("Reverse the words: "):
            assert r["tgt"].split() == r["src"][19:].split()[::-1]


@pytest.mark.parametrize("extra,check", [
    (["--pad_to_multiple_of", "64"], lambda L, longest: L % 64 == 0 and L - longest < 64),
    (["--pad_to_max_length", "true", "--max_length", "200", "--src_length", "100"],
     lambda L, longest: L == 200)])
def test_padded_batches_honour_padding_keys(tmp_path, monkeypatch, extra, check):
    """The finetune script's default (padded, not packed) batches follow pad_to_multiple_of and
    pad_to_max_length; every batch's real content is unchanged (a bug once ignored both keys)."""
    from conftest import ROOT, load_script
    from paddletune.trainer import Trainer

    mod = load_script("llm/finetune_generation.py")
    seen = []

    def recording_trainer(*a, **k):
        k["callbacks"] = [lambda tr, info: seen.extend(
            (b["input_ids"].shape[1], int(b["attention_mask"].sum(1).max())) for b in info["micro_batches"])]
        return Trainer(*a, **k)

    monkeypatch.setattr(mod, "Trainer", recording_trainer)
    code = mod.main([os.path.join(ROOT, "llm", "llama", "sft_argument.json"), "--output_dir", str(tmp_path / "o"),
                     "--max_steps", "2", "--per_device_train_batch_size", "4", "--do_eval", "false",
                     "--save_strategy", "no", "--evaluation_strategy", "no", "--load_best_model_at_end",
                     "false", "--disable_tqdm", "true"] + extra)
    assert code == 0 and len(seen) == 2
    assert all(check(L, longest) for L, longest in seen), seen
