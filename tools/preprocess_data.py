"""JSON lines -> a pre-tokenised corpus PREFIX.bin + PREFIX.idx (PaddleNLP's create_pretraining_data.py flags).

    python tools/preprocess_data.py --model_name_or_path paddletune/tiny-llama --input_path corpus.jsonl \\
        --output_prefix data/corpus --json_key text --append_eos --workers 2

Each line {"text": ...} (the --json_key) is one document: its ids (BOS as the tokenizer adds it),
then EOS with --append_eos. Lines are read as a stream and tokenised by a pool of --workers
processes, in order; the output goes to PREFIX.bin.tmp / PREFIX.idx.tmp and is renamed at the
end, so an interrupted run leaves no output that looks complete and a rerun starts over. An
existing complete output is refused unless --overwrite is given. The format is documented in
paddletune/data/pretrain.py (Megatron / PaddleNLP mmap indexed datasets). Bad input: one
`error:` line, exit code 2.
"""
import argparse
import json
import multiprocessing
import os
import sys
import time

import numpy as np

try:
    import paddletune  # noqa: F401
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import paddletune  # noqa: F401

from paddletune import cli
from paddletune.data.pretrain import CorpusWriter, best_dtype

_TOK = None   # the tokenizer of this (worker) process
_KEY = None


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_name_or_path", required=True, help="model directory or built-in name whose tokenizer is used")
    p.add_argument("--tokenizer_name_or_path", default=None, help="tokenizer directory when it differs")
    p.add_argument("--input_path", required=True, help="JSON-lines file, one document per line")
    p.add_argument("--output_prefix", required=True, help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    p.add_argument("--data_format", default="JSON", choices=["JSON"], help="input format (JSON lines)")
    p.add_argument("--json_key", default="text", help="the key of each line holding the text")
    p.add_argument("--split_sentences", action="store_true", help="split documents into sentences (refused: not built)")
    p.add_argument("--append_eos", action="store_true", help="append the tokenizer's EOS after each document")
    p.add_argument("--data_impl", default="mmap", choices=["mmap"], help="output layout (mmap: .bin + .idx)")
    p.add_argument("--log_interval", type=int, default=100, help="update the progress line every N documents")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument("--chunk_size", type=int, default=64, help="lines handed to a worker at once")
    p.add_argument("--overwrite", action="store_true", help="replace an existing complete output")
    p.add_argument("--no_progress", action="store_true", help="no tqdm progress bar")
    return p


def _init(tok, key):
    global _TOK, _KEY
    _TOK, _KEY = tok, key


def _encode(item):
    """(line number, text line) -> (line number, ids or None for a blank line, error or None)."""
    n, line = item
    if not line.strip():
        return n, None, None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        return n, None, f"not valid JSON ({e})"
    if not isinstance(row, dict) or _KEY not in row or not isinstance(row[_KEY], str):
        return n, None, f"has no string field {_KEY!r} (set --json_key)"
    return n, np.asarray(_TOK.encode(row[_KEY]), np.int32), None   # an array pickles ~10x smaller than a list


def _lines(path):
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not UTF-8 text (byte {e.start} of the line: "
                                 f"{raw[e.start:e.start + 1]!r}); convert the file to UTF-8 first "
                                 "(e.g. iconv -f latin1 -t utf-8)") from None


def check(a):
    if a.split_sentences:
        raise ValueError("--split_sentences is not built here: every line is one document (one sequence); "
                         "drop the flag")
    if not os.path.isfile(a.input_path):
        raise FileNotFoundError(f"--input_path {a.input_path}: no such file")
    if a.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {a.workers}")
    done = [p for p in (a.output_prefix + ".bin", a.output_prefix + ".idx") if os.path.exists(p)]
    if done and not a.overwrite:
        raise ValueError(f"{done[0]} exists (a complete earlier run); pass --overwrite to replace it "
                         "or choose another --output_prefix")


@cli.entry
def main(argv=None):
    a = parser().parse_args(argv)
    check(a)
    from paddletune.models import resolve_model_path
    from paddletune.loading import load_tokenizer

    tok = load_tokenizer(a.tokenizer_name_or_path or resolve_model_path(a.model_name_or_path))
    eos = tok.eos_token_id
    if a.append_eos and eos is None:
        raise ValueError("--append_eos: the tokenizer has no EOS token")
    writer = CorpusWriter(a.output_prefix, best_dtype(len(tok)))
    bar = None
    if not a.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=_count_lines(a.input_path), unit="doc", desc="tokenizing", mininterval=0.5)
    docs, t0 = 0, time.time()
    ctx = multiprocessing.get_context("fork")
    pool = ctx.Pool(a.workers, initializer=_init, initargs=(tok, a.json_key)) if a.workers > 1 else None
    try:
        _init(tok, a.json_key)
        items = _lines(a.input_path)
        results = pool.imap(_encode, items, chunksize=a.chunk_size) if pool else map(_encode, items)
        for n, ids, err in results:
            if err:
                raise ValueError(f"{a.input_path}: line {n} {err}")
            if ids is None:
                continue
            if a.append_eos:
                ids = np.append(ids, np.int32(eos))
            writer.add_document(ids)
            docs += 1
            if bar is not None and docs % max(1, a.log_interval) == 0:
                bar.update(n - bar.n)
                bar.set_postfix(tokens=writer.tokens, refresh=False)
        if pool:   # workers end normally (terminate's SIGTERM makes paddle print a crash report)
            pool.close()
            pool.join()
            pool = None
    except BaseException:
        writer.abort()
        raise
    finally:
        if pool:
            pool.terminate()
        if bar is not None:
            bar.update(bar.total - bar.n)
            bar.close()
    if docs == 0:
        writer.abort()
        raise ValueError(f"{a.input_path}: no documents (every line is blank)")
    writer.close()
    print(f"wrote {a.output_prefix}.bin / .idx: {docs} documents, {writer.tokens} tokens "
          f"({writer.dtype.name}) in {time.time() - t0:.1f}s")
    return 0


def _count_lines(path):
    """Lines of the file (a streamed pass: the progress bar's total)."""
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


if __name__ == "__main__":
    sys.exit(main())
