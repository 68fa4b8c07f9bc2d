"""The built-in pre-training sample: docstrings of Python's standard library -> JSON lines -> .bin/.idx.

    python tools/make_sample_corpus.py [--max_bytes 300000] [--out paddletune/assets/sample-pretrain]

Each document is one docstring (a module's, a class's or a function's) of the modules in MODULES,
in a fixed order, whitespace-normalised; ASCII only. The corpus is tokenised with the built-in tiny
tokenizer (paddletune/assets/tiny-tokenizer) by tools/preprocess_data.py into OUT/stdlib.bin +
OUT/stdlib.idx (llm/llama/pretrain_argument.json reads OUT). Docstrings differ a little between
Python versions: the committed files are what CI uses; this script is the recipe.
"""
import argparse
import importlib
import inspect
import json
import os
import re
import subprocess
import sys

MODULES = ("argparse", "collections", "json", "os", "pathlib", "re", "string", "textwrap", "shutil",
           "subprocess", "itertools", "functools", "datetime", "calendar", "csv", "logging", "heapq",
           "bisect", "random", "statistics", "fractions", "decimal", "zipfile", "tarfile", "email",
           "http.client", "urllib.parse", "unittest", "typing", "dataclasses", "enum", "inspect",
           "threading", "queue", "socket", "ssl", "sqlite3", "xml.dom.minidom", "configparser", "pickle")


def docstrings(module_names=MODULES):
    seen = set()
    for name in module_names:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        objs = [mod] + [v for _, v in sorted(vars(mod).items()) if inspect.isclass(v) or inspect.isfunction(v)]
        for obj in objs:
            members = [obj] + ([v for _, v in sorted(vars(obj).items()) if inspect.isfunction(v)]
                               if inspect.isclass(obj) else [])
            for o in members:
                doc = o.__doc__ if isinstance(getattr(o, "__doc__", None), str) else None
                if not doc:
                    continue
                text = re.sub(r"[ \t]+", " ", inspect.cleandoc(doc)).strip()
                text = text.encode("ascii", "ignore").decode()
                if len(text) < 80 or text in seen:
                    continue
                seen.add(text)
                yield text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max_bytes", type=int, default=150_000)
    p.add_argument("--out", default=os.path.join("paddletune", "assets", "sample-pretrain"))
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    jsonl = os.path.join(a.out, "stdlib.jsonl")
    total = 0
    with open(jsonl, "w", encoding="utf-8") as f:
        for text in docstrings():
            if total + len(text) > a.max_bytes:
                break
            f.write(json.dumps({"text": text}) + "\n")
            total += len(text)
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, os.path.join(here, "preprocess_data.py"), "--model_name_or_path",
                    os.path.join(os.path.dirname(here), "paddletune", "assets", "tiny-tokenizer"),
                    "--input_path", jsonl, "--output_prefix", os.path.join(a.out, "stdlib"),
                    "--json_key", "text", "--append_eos", "--workers", "2", "--overwrite"], check=True)


if __name__ == "__main__":
    main()
