"""Generation metrics: corpus BLEU-4 and ROUGE-1/2/L F1, all as fractions in [0, 1].

Tokenisation (`tokenize`), the same for predictions and references:
  1. lower-case;  2. split on whitespace;  3. inside each piece, every CJK character (Chinese
  ideographs, CJK punctuation such as ，。, full-width forms, kana) becomes its own token, and
  each run of other characters stays one token. Punctuation is not split off English words.
So Chinese is scored on characters and other languages on lower-cased whitespace words:
  "The cat, sat" -> ["the", "cat,", "sat"];  "我爱北京。" -> ["我", "爱", "北", "京", "。"];
  "用Paddle训练" -> ["用", "paddle", "训", "练"].

BLEU-4 (Papineni et al. 2002), corpus level, no smoothing:
  p_n = sum over sentences of clipped n-gram matches / sum of hypothesis n-grams  (n = 1..4),
        clipped: an n-gram counts at most as often as in the reference (the max over references)
  BP  = 1 if c > r else exp(1 - r / c)   (c = hypothesis tokens, r = reference tokens; with
        several references per sentence, the one closest in length, shorter on ties)
  BLEU = BP * exp(mean_n log p_n), and 0 when any p_n is 0 or c = 0.
ROUGE-N F1 per sentence: overlap = sum of min(count_hyp(g), count_ref(g)) over n-grams g,
  P = overlap / hyp n-grams, R = overlap / ref n-grams, F1 = 2PR / (P + R) (0 when overlap = 0).
ROUGE-L F1 per sentence: the same with overlap = length of the longest common subsequence and
  unigram counts as denominators. ROUGE scores are averaged over sentences.
"""
import math
import os
from collections import Counter

_CJK = ((0x3000, 0x303F), (0x3040, 0x30FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF),
        (0xF900, 0xFAFF), (0xFF00, 0xFFEF), (0x20000, 0x2A6DF), (0x2A700, 0x2EBEF),
        (0x2F800, 0x2FA1F))


def is_cjk(ch):
    o = ord(ch)
    return any(lo <= o <= hi for lo, hi in _CJK)


def tokenize(text):
    """Scoring tokens of `text` (see module docstring)."""
    tokens = []
    for word in text.lower().split():
        run = ""
        for ch in word:
            if is_cjk(ch):
                if run:
                    tokens.append(run)
                    run = ""
                tokens.append(ch)
            else:
                run += ch
        if run:
            tokens.append(run)
    return tokens


def ngrams(tokens, n):
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def _as_refs(ref):
    return [ref] if isinstance(ref, str) else list(ref)


def bleu_details(predictions, references, max_n=4):
    """Corpus BLEU with its parts: {"bleu", "precisions" [max_n], "bp", "hyp_len", "ref_len"}.
    references[i] is a string or a list of strings (several references)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    matches, totals = [0] * max_n, [0] * max_n
    c = r = 0
    for pred, ref in zip(predictions, references):
        hyp = tokenize(pred)
        refs = [tokenize(x) for x in _as_refs(ref)]
        c += len(hyp)
        r += min((abs(len(x) - len(hyp)), len(x)) for x in refs)[1]
        for n in range(1, max_n + 1):
            h = ngrams(hyp, n)
            best = Counter()
            for x in refs:
                best |= ngrams(x, n)          # element-wise max over references
            matches[n - 1] += sum(min(k, best[g]) for g, k in h.items())
            totals[n - 1] += max(len(hyp) - n + 1, 0)
    precisions = [m / t if t else 0.0 for m, t in zip(matches, totals)]
    bp = 0.0 if c == 0 else (1.0 if c > r else math.exp(1 - r / c))
    if min(precisions) == 0:
        score = 0.0
    else:
        score = bp * math.exp(sum(math.log(p) for p in precisions) / max_n)
    return {"bleu": score, "precisions": precisions, "bp": bp, "hyp_len": c, "ref_len": r}


def corpus_bleu(predictions, references, max_n=4):
    """Corpus BLEU-`max_n` in [0, 1] (see module docstring)."""
    return bleu_details(predictions, references, max_n)["bleu"]


def _f1(overlap, n_hyp, n_ref):
    if overlap == 0 or n_hyp == 0 or n_ref == 0:
        return 0.0
    p, r = overlap / n_hyp, overlap / n_ref
    return 2 * p * r / (p + r)


def rouge_n(pred, ref, n):
    """ROUGE-N F1 of one sentence pair (strings)."""
    h, g = ngrams(tokenize(pred), n), ngrams(tokenize(ref), n)
    overlap = sum(min(k, g[x]) for x, k in h.items())
    return _f1(overlap, sum(h.values()), sum(g.values()))


def lcs_length(a, b):
    """Longest common subsequence length of token lists, O(len(a) * len(b)) with one row."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for x in a:
        diag = 0
        for j, y in enumerate(b, 1):
            keep = row[j]
            row[j] = diag + 1 if x == y else max(row[j], row[j - 1])
            diag = keep
    return row[-1]


def rouge_l(pred, ref):
    """ROUGE-L F1 of one sentence pair (strings)."""
    h, g = tokenize(pred), tokenize(ref)
    return _f1(lcs_length(h, g), len(h), len(g))


def generation_metrics(predictions, references):
    """{"bleu4", "rouge1", "rouge2", "rougel"} in [0, 1] for lists of strings (one reference
    per prediction). The names are those `metric_for_best_model` accepts."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    n = max(len(predictions), 1)
    return {
        "bleu4": corpus_bleu(predictions, references, 4),
        "rouge1": sum(rouge_n(p, r, 1) for p, r in zip(predictions, references)) / n,
        "rouge2": sum(rouge_n(p, r, 2) for p, r in zip(predictions, references)) / n,
        "rougel": sum(rouge_l(p, r) for p, r in zip(predictions, references)) / n,
    }


# ------------------------------------------------------------------------------ evaluation by generation

def split_source_target(example, eos_ids=()):
    """(prompt ids, reference ids) of a tokenised SFT example: the reference is the last run of
    labelled tokens (the final answer, EOS removed), the prompt everything before it."""
    labels = [int(x) for x in example["labels"]]
    ids = [int(x) for x in example["input_ids"]]
    labelled = [i for i, x in enumerate(labels) if x != -100]
    if not labelled:
        return ids, []
    end = labelled[-1] + 1
    start = end
    while start > 1 and labels[start - 1] != -100:
        start -= 1
    return ids[:start], [t for t in ids[start:end] if t not in eos_ids]


def generation_eval_fn(dataset, tokenizer, gen_config, output_dir=None, save_output=False,
                       batch_size=8):
    """Trainer eval_fn: generate an answer for every dev example and score it.

    Each data-parallel rank generates for examples rank, rank + world, ...; texts are gathered
    so every rank returns the same {"bleu4", "rouge1", "rouge2", "rougel"}. With save_output,
    rank 0 writes output_dir/generated_output.json (JSON lines {"src", "tgt", "output"},
    replaced atomically at each evaluation)."""
    from ..generation import generate

    eos = set(gen_config.eos_token_id or [tokenizer.eos_token_id])
    pairs = [split_source_target(dataset[i], eos) for i in range(len(dataset))]

    def eval_fn(trainer):
        topo = trainer.topo
        mine = list(range(topo.data_rank, len(pairs), topo.data_degree))
        rows = []
        for k in range(0, len(mine), batch_size):
            idx = mine[k:k + batch_size]
            out = generate(trainer.model, [pairs[i][0] for i in idx], gen_config, tokenizer=tokenizer)
            rows += [[i, out.texts[j]] for j, i in enumerate(idx)]
        gathered = sorted({tuple(r) for part in topo.all_gather_json(rows) for r in part})
        preds = [text for _, text in gathered]
        refs = [tokenizer.decode(pairs[i][1], skip_special_tokens=True) for i, _ in gathered]
        if save_output and topo.is_main and output_dir:
            lines = [{"src": tokenizer.decode(pairs[i][0], skip_special_tokens=True), "tgt": ref,
                      "output": p} for (i, p), ref in zip(gathered, refs)]
            write_json_lines(os.path.join(output_dir, "generated_output.json"), lines)
        return generation_metrics(preds, refs)

    return eval_fn


def write_json_lines(path, rows):
    """Write dicts as JSON lines atomically (temp file beside `path`, then os.replace)."""
    import json

    from ..io import temp_file

    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = temp_file(d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
