"""Recipe of the pre-trained built-in models (paddletune/assets/pretrained/NAME/).

    python tools/make_pretrained_builtins.py                      # every name in PRETRAINED below
    python tools/make_pretrained_builtins.py --names paddletune/tiny-llama --work ./data/builtin-corpus

For each built-in name:
1. corpus: the docstrings of the standard library's modules (tools/make_sample_corpus.py's rule,
   every module of sys.stdlib_module_names that imports) and the paragraphs of pydoc_data.topics
   (the language reference's help topics), ASCII, one JSON line per document;
2. tools/preprocess_data.py with the model's tokenizer -> WORK/<tokenizer>/stdlib.bin + .idx;
3. llm/run_pretrain.py llm/llama/pretrain_builtin_argument.json from a random init of the built-in
   configuration (continue_training false), evaluated on the valid split;
4. OUT/<short name>/model.safetensors (the run's weights) + pretrained.json (steps, corpus tokens,
   valid perplexity, the add-one unigram baseline's, Python version, sha256 of the weights).
paddletune/models/tiny.py then builds the built-in directory with these weights instead of random
ones. Docstrings differ a little between Python versions and CPU float sums between machines: the
committed files are what everyone uses (CI never rebuilds them); this script is how they were made.
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

ARGFILE = os.path.join(ROOT, "llm", "llama", "pretrain_builtin_argument.json")
OUT = os.path.join(ROOT, "paddletune", "assets", "pretrained")
# the built-in names that ship pre-trained (same recipe, same argument file)
PRETRAINED = ("paddletune/tiny-llama", "paddletune/tiny-qwen2")
SKIP = ("test", "idlelib", "tkinter", "turtle", "antigravity", "this", "_")


def corpus_texts():
    """Standard-library docstrings, then pydoc_data.topics paragraphs of >= 80 characters."""
    from make_sample_corpus import docstrings
    import pydoc_data.topics

    names = sorted(n for n in sys.stdlib_module_names if not n.startswith(SKIP))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        texts = list(docstrings(names))
    for key in sorted(pydoc_data.topics.topics):
        for para in re.split(r"\n\s*\n", pydoc_data.topics.topics[key]):
            p = re.sub(r"[ \t]+", " ", para).strip().encode("ascii", "ignore").decode()
            if len(p) >= 80:
                texts.append(p)
    return texts


def build_corpus(work, tokenizer_dir):
    """WORK/corpus.jsonl (once) tokenized with `tokenizer_dir` -> the corpus prefix."""
    os.makedirs(work, exist_ok=True)
    jsonl = os.path.join(work, "corpus.jsonl")
    if not os.path.exists(jsonl):
        tmp = jsonl + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for text in corpus_texts():
                f.write(json.dumps({"text": text}) + "\n")
        os.replace(tmp, jsonl)
    prefix = os.path.join(work, os.path.basename(tokenizer_dir.rstrip("/")), "stdlib")
    if not os.path.exists(prefix + ".idx"):
        subprocess.run([sys.executable, os.path.join(HERE, "preprocess_data.py"), "--model_name_or_path",
                        tokenizer_dir, "--input_path", jsonl, "--output_prefix", prefix, "--json_key", "text",
                        "--append_eos", "--workers", "2"], check=True)
    return prefix


def pretrain(name, prefix, run_dir, extra):
    subprocess.run([sys.executable, os.path.join(ROOT, "llm", "run_pretrain.py"), ARGFILE,
                    "--model_name_or_path", name, "--tokenizer_name_or_path", name, "--input_dir", prefix,
                    "--output_dir", run_dir] + list(extra), check=True)


def record(name, prefix, run_dir):
    """pretrained.json: what the run reached, next to the unigram baseline on the same split."""
    from paddletune.data.pretrain import build_pretrain_datasets, unigram_ppl

    conf = json.load(open(ARGFILE))
    evals = [r for r in map(json.loads, open(os.path.join(run_dir, "train_log.jsonl"))) if "eval_ppl" in r]
    train, valid, _ = build_pretrain_datasets(prefix, conf["split"], conf["max_seq_length"], seed=conf["seed"])
    vocab = json.load(open(os.path.join(run_dir, "config.json")))["vocab_size"]
    weights = os.path.join(run_dir, "model.safetensors")
    with open(weights, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"name": name, "steps": evals[-1]["step"], "valid_ppl": round(evals[-1]["eval_ppl"], 4),
            "unigram_ppl": round(unigram_ppl(train, valid, vocab), 4),
            "corpus_tokens": int(os.path.getsize(prefix + ".bin") // 2), "argument_file": os.path.relpath(ARGFILE, ROOT),
            "python": sys.version.split()[0], "sha256": digest}


def make(name, work, keep, extra, out=OUT):
    from paddletune.models.tiny import ASSETS, BUILTIN

    overrides = BUILTIN[name][1]
    prefix = build_corpus(work, os.path.join(ASSETS, overrides.get("tokenizer", "tiny-tokenizer")))
    run_dir = tempfile.mkdtemp(prefix="pretrain-", dir=work)
    try:
        pretrain(name, prefix, run_dir, extra)
        info = record(name, prefix, run_dir)
        dest = os.path.join(out, name.split("/")[-1])
        tmp = dest + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        shutil.copyfile(os.path.join(run_dir, "model.safetensors"), os.path.join(tmp, "model.safetensors"))
        with open(os.path.join(tmp, "pretrained.json"), "w") as f:
            json.dump(info, f, indent=2)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
        print(f"{name}: valid ppl {info['valid_ppl']} (unigram {info['unigram_ppl']}) -> {dest}")
    finally:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--names", nargs="+", default=list(PRETRAINED), help="built-in names to pre-train")
    ap.add_argument("--work", default=os.path.join("data", "builtin-corpus"), help="corpus and run directory")
    ap.add_argument("--out", default=OUT, help="asset directory (default: the shipped one)")
    ap.add_argument("--keep_run", action="store_true", help="keep the run directories (checkpoints, logs)")
    a, extra = ap.parse_known_args(argv)   # the rest go to run_pretrain.py (e.g. --max_steps 100)
    for name in a.names:
        make(name, a.work, a.keep_run, extra, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
