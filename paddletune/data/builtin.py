"""Built-in sample dataset `paddletune/sample-sft`: small instruction-following tasks whose answers
can be checked (reverse, sort, add, uppercase, count, repeat), generated deterministically.

The JSON-lines files ship in paddletune/assets/sample-sft/ (train.json 3000 lines, dev.json 200);
`generate()` reproduces them exactly (a test checks that).
"""
import json
import os
import random

ASSETS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets")
BUILTIN_DATASETS = {"paddletune/sample-sft": os.path.join(ASSETS, "sample-sft")}

WORDS = ("apple river stone cloud green house music paper light dream garden silver window "
         "orange forest summer winter yellow coffee planet rabbit bridge candle doctor engine "
         "flower guitar island jacket kitchen lemon market needle ocean pencil queen rocket "
         "sugar tiger umbrella violet wallet zebra anchor bottle carpet dragon eagle falcon "
         "ginger hammer igloo jungle kettle ladder mirror napkin oyster pepper quartz saddle "
         "tunnel velvet walnut basket cactus dolphin feather gravel harbor meadow puzzle").split()


def _task(rng):
    kind = rng.choice(["reverse", "sort", "add", "upper", "count", "repeat"])
    if kind == "reverse":
        ws = rng.sample(WORDS, rng.randint(2, 6))
        return f"Reverse the words: {' '.join(ws)}", " ".join(reversed(ws))
    if kind == "sort":
        ns = [rng.randint(0, 99) for _ in range(rng.randint(2, 7))]
        return f"Sort the numbers: {' '.join(map(str, ns))}", " ".join(map(str, sorted(ns)))
    if kind == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"Add {a} and {b}.", str(a + b)
    if kind == "upper":
        ws = rng.sample(WORDS, rng.randint(1, 4))
        return f"Uppercase: {' '.join(ws)}", " ".join(ws).upper()
    if kind == "count":
        ws = rng.sample(WORDS, rng.randint(1, 9))
        return f"Count the words: {' '.join(ws)}", str(len(ws))
    ws = rng.sample(WORDS, rng.randint(1, 3))
    return f"Repeat twice: {' '.join(ws)}", f"{' '.join(ws)} {' '.join(ws)}"


def generate(n_train=3000, n_dev=200, seed=1234):
    rng = random.Random(seed)
    rows = [dict(zip(("src", "tgt"), _task(rng))) for _ in range(n_train + n_dev)]
    return rows[:n_train], rows[n_train:]


def write(out_dir):
    train, dev = generate()
    os.makedirs(out_dir, exist_ok=True)
    for name, rows in (("train.json", train), ("dev.json", dev)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    write(BUILTIN_DATASETS["paddletune/sample-sft"])
