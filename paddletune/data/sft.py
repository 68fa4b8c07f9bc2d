"""SFT data: JSON-lines files of {"src", "tgt"} (strings, or lists of strings for several rounds)
-> tokenised examples {input_ids, labels} with labels -100 on everything but the targets.

Where the files are (dataset_name_or_path = DIR):
    DIR/train.json, DIR/dev.json          or   DIR/train/*.json, DIR/dev/*.json
or a built-in name (paddletune/sample-sft).

Token rules for one round (PaddleNLP's, worked example with src_length=4, max_length=8,
BOS added by the tokenizer):
    source = [BOS] + source text tokens cut from the LEFT to src_length - 1   (specials kept)
    target = target text tokens (no specials) cut from the RIGHT to max_length - len(source)
    EOS is appended only when the target was not cut: len(target) < max_length - len(source)
    input_ids = source + target (+ EOS);  labels = [-100] * len(source) + target (+ EOS)
e.g. src "a b c d e" -> [BOS, c, d, e]; tgt "x y" -> [x, y, EOS]; labels [-100 x4, x, y, EOS].
"""
import glob
import json
import os

import numpy as np

from .builtin import BUILTIN_DATASETS

IGNORE = -100


class DataError(ValueError):
    """Bad dataset input: names the file (and line) and what is wrong."""


def resolve_dataset_path(name):
    if name in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[name]
    if os.path.isdir(name):
        return name
    raise DataError(f"dataset_name_or_path={name!r} is not a directory (working directory "
                    f"{os.getcwd()}); give a folder with train.json/dev.json, or the built-in "
                    f"{', '.join(BUILTIN_DATASETS)}")


def split_files(root, split):
    """Files of one split: root/{split}.json, or root/{split}/*.json (sorted). May be []."""
    single = os.path.join(root, f"{split}.json")
    if os.path.isfile(single):
        return [single]
    return sorted(glob.glob(os.path.join(root, split, "*.json")) + glob.glob(os.path.join(root, split, "*.jsonl")))


def read_json_lines(path):
    """Yield (line_number, dict) for each non-empty line; a malformed line raises DataError."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}")
            yield lineno, row


def rounds_of(row, where):
    """[(src, tgt), ...] from {"src", "tgt"} with str or equal-length lists of str."""
    if "src" not in row or "tgt" not in row:
        raise DataError(f"{where}: needs keys \"src\" and \"tgt\" (or \"messages\"), got {sorted(row)}")
    src, tgt = row["src"], row["tgt"]
    if isinstance(src, str) and isinstance(tgt, str):
        return [(src, tgt)]
    if isinstance(src, list) and isinstance(tgt, list) and len(src) == len(tgt) and src and \
            all(isinstance(x, str) for x in src + tgt):
        return list(zip(src, tgt))
    raise DataError(f"{where}: \"src\" and \"tgt\" must both be strings, or lists of strings of "
                    f"equal length (one per round); got {type(src).__name__} and {type(tgt).__name__}")


def tokenize_rounds(tok, rounds, src_length, max_length, autoregressive=False):
    """Token ids and labels for one example, following the rules in the module docstring.
    Several rounds are concatenated (specials once, at the start; EOS after every target);
    when they do not fit, the oldest rounds are dropped first."""
    prefix, suffix = tok.special_tokens_around()
    eos = tok.eos_token_id
    keep = max(0, src_length - len(prefix) - len(suffix))
    pieces = []
    for src, tgt in rounds:
        content = tok.encode(src, add_special_tokens=False)
        pieces.append((content[len(content) - keep:] if keep else [],
                       tok.encode(tgt, add_special_tokens=False)))
    fixed = len(prefix) + len(suffix)
    while len(pieces) > 1 and fixed + sum(len(s) + len(t) + 1 for s, t in pieces) > max_length:
        pieces.pop(0)
    input_ids, labels = [], []
    for j, (content, target) in enumerate(pieces):
        source = prefix + content + suffix if j == 0 else content
        budget = max_length - len(input_ids) - len(source)
        if budget <= 0:
            break
        target = target[:budget]
        if len(target) < budget and eos is not None:
            target = target + [eos]
        input_ids += source + target
        labels += (source if autoregressive else [IGNORE] * len(source)) + target
    return input_ids, labels


class SFTDataset:
    """Tokenised examples in memory: list of {"input_ids": np.int64[L], "labels": np.int64[L]}."""

    def __init__(self, examples, files):
        self.examples = examples
        self.files = files

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]

    @property
    def num_tokens(self):
        return sum(len(e["input_ids"]) for e in self.examples)

    @property
    def num_target_tokens(self):
        return sum(int((e["labels"] != IGNORE).sum()) for e in self.examples)


def load_split(root, split, tok, data_args, required=True):
    files = split_files(root, split)
    if not files:
        if required:
            raise DataError(f"no {split} data in {root}: expected {split}.json or {split}/*.json")
        return None
    examples = []
    for path in files:
        for lineno, row in read_json_lines(path):
            where = f"{path}:{lineno}"
            ids, labels = tokenize_rounds(tok, rounds_of(row, where), data_args.src_length,
                                          data_args.max_length, data_args.autoregressive)
            if not any(l != IGNORE for l in labels[1:]):
                raise DataError(f"{where}: no target token fits in max_length={data_args.max_length}")
            examples.append({"input_ids": np.asarray(ids, np.int64),
                             "labels": np.asarray(labels, np.int64), "id": len(examples)})
    if not examples:
        raise DataError(f"{split} data in {root} is empty ({', '.join(files)})")
    return SFTDataset(examples, files)


def build_datasets(data_args, tok, do_train=True, do_eval=False):
    """(train_dataset or None, dev_dataset or None), checked before any training starts."""
    root = resolve_dataset_path(data_args.dataset_name_or_path)
    train = load_split(root, "train", tok, data_args) if do_train else None
    dev = load_split(root, "dev", tok, data_args, required=do_eval) if do_eval else None
    return train, dev
