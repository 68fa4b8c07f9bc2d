"""Built-in preference samples `paddletune/sample-dpo` and `paddletune/sample-kto`: the checkable
tasks of paddletune/sample-sft with a right and a wrong answer, in PaddleNLP's row format.

    DPO  {"src": [task], "tgt": [], "response": [right, wrong] (order varies), "sort": [.., ..]}
    KTO  {"src": [task], "tgt": [], "response": [right or wrong], "sort": [1 or 0]}

Argument files name the files as paddletune/sample-dpo/train.jsonl (dev.jsonl); `generate()`
reproduces the shipped files exactly.
"""
import json
import os
import random

from ..data.builtin import ASSETS, _task

BUILTIN = {"paddletune/sample-dpo": os.path.join(ASSETS, "sample-dpo"),
           "paddletune/sample-kto": os.path.join(ASSETS, "sample-kto")}


def resolve(path):
    """A built-in sample file name (paddletune/sample-dpo/train.jsonl) -> its path; else `path`."""
    for name, root in BUILTIN.items():
        if path == name or path.startswith(name + "/"):
            return os.path.join(root, path[len(name) + 1:]) if path != name else root
    return path


def wrong(src, right, rng):
    """A plausible wrong answer of the same task."""
    words = src.split(": ", 1)[-1].split()
    if src.startswith("Reverse"):
        return " ".join(words)
    if src.startswith("Sort"):
        return " ".join(map(str, sorted(map(int, words), reverse=True))) if len(set(words)) > 1 \
            else " ".join(words + words[:1])
    if src.startswith("Uppercase"):
        return right.lower()
    if src.startswith("Repeat"):
        return " ".join(words)
    return str(int(right) + rng.choice([-1, 1, 2]))   # add, count


def generate(n_train=600, n_dev=64, seed=4321):
    rng = random.Random(seed)
    dpo, kto = [], []
    for i in range(n_train + n_dev):
        src, right = _task(rng)
        bad = wrong(src, right, rng)
        flip = rng.random() < 0.5
        dpo.append({"src": [src], "tgt": [], "response": [bad, right] if flip else [right, bad],
                    "sort": [0, 1] if flip else [1, 0]})
        good = i % 2 == 0
        kto.append({"src": [src], "tgt": [], "response": [right if good else bad], "sort": [int(good)]})
    return {"sample-dpo": (dpo[:n_train], dpo[n_train:]), "sample-kto": (kto[:n_train], kto[n_train:])}


def write():
    for name, (train, dev) in generate().items():
        out = os.path.join(ASSETS, name)
        os.makedirs(out, exist_ok=True)
        for fname, rows in (("train.jsonl", train), ("dev.jsonl", dev)):
            with open(os.path.join(out, fname), "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    write()
