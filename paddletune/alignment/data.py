"""Preference data: rows -> tokenised pairs (DPO) or examples (KTO) -> batches.

Rows, one JSON object a line (train_dataset_path / dev_dataset_path: a file or a directory of
*.json / *.jsonl files):
  PaddleNLP, DPO  {"src": str | [str], "tgt": [str], "response": [a, b], "sort": [sa, sb]}
                  rounds src[i] -> tgt[i], then the last src (one src more than tgt); the
                  response with the larger sort is chosen (PaddleNLP's llm/docs/dpo.md)
  PaddleNLP, KTO  {"src", "tgt", "response": [a], "sort": [1 | 0]}          1 = desirable
  TRL, DPO        {"prompt": str | messages, "chosen": str | messages, "rejected": ...}, or
                  {"chosen": messages, "rejected": messages}: the shared leading messages are the
                  prompt, each side's last (assistant) message the response
  TRL, KTO        {"prompt": str | messages, "completion": str | messages, "label": bool}
Messages ({"role", "content"} lists) need a chat template, as in SFT.

Tokens, as SFT tokenises a conversation ending with the response (data/sft.py): with a chat
template a response is the labelled part of the last assistant turn (its end-of-turn token
included) and the prompt everything before it (it must render the same whatever the response,
as every built-in template does); without one, a response is its text + EOS and the prompt
follows SFT's plain rules (BOS + src, its text cut from the left to max_prompt_len).
Budget, decided by the longest response so that both share one prompt: when prompt + longest >
max_seq_len, SFT's rules cut the conversation ending with the longest response (oldest rounds
dropped, system kept; then the last user text cut from the left to fit max_prompt_len); then every
response is cut from the right to max_seq_len - len(prompt) (losing its end token).
Example (plain, BOS 1, EOS 2, max_seq_len 5, max_prompt_len 3): src "a b c d" -> prompt
[1, c, d]; chosen "x y z" -> [x, y]; rejected "w" -> [w, 2].
KTO's KL term pairs example i's prompt with example (-i mod n)'s completion (PaddleNLP's run_kto.py:
example 0 keeps its own), cut to the same budget.

Batches: a pair is two sequences, prompt + chosen and prompt + rejected (a KTO example: prompt +
completion and prompt + KL completion). Labels are -100 except on response tokens; `unit_ids`
[B, L] names each label's sequence: chosen of pair k -> k, rejected -> P + k (KTO: completion k
-> k, KL completion -> E + k), -1 elsewhere; `loss_count` = P (E) is what the Trainer normalises
by. Padded: a micro-batch of P pairs is 2P right-padded rows [chosen..., rejected...] (TRL's
layout). Zero padding: whole pairs are packed into rows of 2 x max_seq_len tokens, the pair's
sequences adjacent segments (block-diagonal attention, positions restart at 0: no token sees
another sequence, so packed and padded give the same log-probabilities).
"""
import glob
import os

import logging

import numpy as np

from ..data.chat_template import (ChatTemplateError, encode_segments, normalize_conversation,
                                  template_context, template_for)
from ..data.collate import BatchPlan
from ..data.packing import pack
from ..data.sft import DataError, read_json_lines, tokenize_conversation, tokenize_rounds
from .sample import resolve as resolve_sample

IGNORE = -100


def row_files(path, key):
    """The JSON-lines files of `path` (a file, a directory of *.json / *.jsonl, or a built-in
    sample file such as paddletune/sample-dpo/train.jsonl: alignment/sample.py)."""
    path = resolve_sample(path)
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.json")) + glob.glob(os.path.join(path, "*.jsonl")))
        if files:
            return files
        raise DataError(f"{key}={path}: the directory holds no *.json / *.jsonl files")
    raise DataError(f"{key}={path}: no such file or directory (working directory {os.getcwd()})")


# ------------------------------------------------------------------------------ rows

def _messages(value, where, what):
    try:
        return normalize_conversation(value, f"{where}: {what}")
    except ChatTemplateError as e:
        raise DataError(str(e)) from None


def _answer_text(value, where, what):
    """The response text of a TRL field: a string, or a list holding one assistant message."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict) and \
            value[0].get("role") == "assistant" and isinstance(value[0].get("content"), str):
        return value[0]["content"]
    raise DataError(f"{where}: \"{what}\" must be a string or a list with one assistant message")


def _paddlenlp_prompt(row, where):
    src, tgt = row.get("src"), row.get("tgt", [])
    src = [src] if isinstance(src, str) else src
    tgt = [tgt] if isinstance(tgt, str) else tgt
    if not (isinstance(src, list) and isinstance(tgt, list) and all(isinstance(x, str) for x in src + tgt)):
        raise DataError(f"{where}: \"src\" and \"tgt\" must be strings or lists of strings")
    if len(src) != len(tgt) + 1:
        raise DataError(f"{where}: \"src\" needs one item more than \"tgt\" (the rounds, then the "
                        f"prompt), got {len(src)} and {len(tgt)}")
    msgs = []
    for i, s in enumerate(src):
        msgs.append({"role": "user", "content": s})
        if i < len(tgt):
            msgs.append({"role": "assistant", "content": tgt[i]})
    return msgs


def parse_row(row, where, kind):
    """(prompt messages ending with a user turn, [response texts], label or None, conversational).
    DPO: [chosen, rejected]; KTO: [completion] and label 1 (desirable) / 0."""
    if "response" in row:   # PaddleNLP
        msgs, resp, sort = _paddlenlp_prompt(row, where), row["response"], row.get("sort")
        resp = [resp] if isinstance(resp, str) else resp
        want = 2 if kind == "dpo" else 1
        if not (isinstance(resp, list) and len(resp) == want and all(isinstance(r, str) for r in resp)):
            raise DataError(f"{where}: \"response\" must hold {want} string{'s' if want > 1 else ''}")
        if not (isinstance(sort, list) and len(sort) == want and all(isinstance(s, (int, float)) for s in sort)):
            raise DataError(f"{where}: \"sort\" must hold {want} number{'s' if want > 1 else ''} (one per response)")
        if kind == "kto":
            if sort[0] not in (0, 1):
                raise DataError(f"{where}: KTO \"sort\" must be [1] (desirable) or [0], got {sort}")
            return msgs, resp, int(sort[0]), False
        if sort[0] == sort[1]:
            raise DataError(f"{where}: the two \"sort\" values must differ (the larger one is chosen), got {sort}")
        return msgs, (resp if sort[0] > sort[1] else resp[::-1]), None, False
    keys = ("chosen", "rejected") if kind == "dpo" else ("completion",)
    missing = [k for k in keys if k not in row]
    if missing:
        need = ("{src, tgt, response, sort} (PaddleNLP) or {prompt, chosen, rejected} / {chosen, rejected} (TRL)"
                if kind == "dpo" else "{src, tgt, response, sort} (PaddleNLP) or {prompt, completion, label} (TRL)")
        raise DataError(f"{where}: needs the keys {need}; got {sorted(row)}")
    conversational = any(isinstance(row.get(k), list) for k in ("prompt",) + keys)
    if "prompt" in row:
        msgs = _messages(row["prompt"], where, "prompt")
        answers = [_answer_text(row[k], where, k) for k in keys]
    elif kind == "dpo":   # implicit prompt: the shared leading messages
        c, r = (_messages(row[k], where, k) for k in keys)
        n = 0
        while n < min(len(c), len(r)) - 1 and c[n] == r[n]:
            n += 1
        if len(c) != n + 1 or len(r) != n + 1 or c[n]["role"] != "assistant" or r[n]["role"] != "assistant":
            raise DataError(f"{where}: \"chosen\" and \"rejected\" must share every message but their "
                            "last, an assistant message")
        msgs, answers = c[:n], [c[n]["content"], r[n]["content"]]
    else:
        raise DataError(f"{where}: needs \"prompt\" beside \"completion\"")
    if not msgs or msgs[-1]["role"] != "user":
        raise DataError(f"{where}: the prompt must end with a user message")
    label = None
    if kind == "kto":
        if not isinstance(row.get("label"), bool):
            raise DataError(f"{where}: \"label\" must be true (desirable) or false, got {row.get('label')!r}")
        label = int(row["label"])
    return msgs, answers, label, conversational


# ------------------------------------------------------------------------------ tokens

class PairTokenizer:
    """(prompt messages, [responses]) -> (prompt ids, [response ids]) under the module's rules."""

    def __init__(self, tok, chat_template, max_prompt_len, max_seq_len):
        self.tok, self.max_prompt_len, self.max_seq_len = tok, max_prompt_len, max_seq_len
        try:
            self.template = template_for(tok, chat_template)
        except ChatTemplateError as e:
            raise DataError(f"chat_template: {e}") from None
        self.ctx = template_context(tok) if self.template is not None else None

    def __call__(self, msgs, responses, where, conversational=False):
        if any(not r for r in responses):
            raise DataError(f"{where}: a response is empty")
        try:
            if self.template is None:
                if conversational:
                    raise DataError(f"{where}: message rows need a chat template; set chat_template to a "
                                    "built-in name, a jinja file or a PaddleNLP chat_template.json")
                prompt, answers = self._plain(msgs, responses, where)
            else:
                prompt, answers = self._templated(msgs, responses, where)
        except ChatTemplateError as e:
            raise DataError(f"{where}: {e}") from None
        room = self.max_seq_len - len(prompt)
        if room <= 0:
            raise DataError(f"{where}: no response token fits in max_seq_len={self.max_seq_len}")
        return prompt, [a[:room] for a in answers]

    def _rounds(self, msgs, where):
        if any(m["role"] not in ("user", "assistant") for m in msgs) or any(
                m["role"] != ("user", "assistant")[i % 2] for i, m in enumerate(msgs)):
            raise DataError(f"{where}: without a chat template the prompt must alternate user / assistant "
                            "turns (a system message needs a chat template)")
        return [(msgs[i]["content"], msgs[i + 1]["content"]) for i in range(0, len(msgs) - 1, 2)]

    def _plain(self, msgs, responses, where):
        eos = [self.tok.eos_token_id] if self.tok.eos_token_id is not None else []
        answers = [self.tok.encode(r, add_special_tokens=False) + eos for r in responses]
        longest = max(range(len(answers)), key=lambda i: len(answers[i]))
        rounds = self._rounds(msgs, where) + [(msgs[-1]["content"], responses[longest])]
        ids, labels = tokenize_rounds(self.tok, rounds, self.max_prompt_len, self.max_seq_len)
        return _prompt_of(ids, labels, answers[longest], where), answers

    def _templated(self, msgs, responses, where):
        prompts, answers = [], []
        for r in responses:
            pieces = encode_segments(self.tok, self.template.segments(
                msgs + [{"role": "assistant", "content": r}], False, **self.ctx))
            last = max(i for i, p in enumerate(pieces) if p[2])
            ids, labels, _ = pieces[last]
            prompts.append([t for p in pieces[:last] for t in p[0]])
            answers.append(ids[:sum(1 for x in labels if x != IGNORE)])
        if any(p != prompts[0] for p in prompts):
            raise DataError(f"{where}: the chat template renders the prompt differently for the two "
                            "responses; preference pairs need one shared prompt")
        if not all(answers):
            raise DataError(f"{where}: a response renders to no labelled token under the chat template")
        longest = max(range(len(answers)), key=lambda i: len(answers[i]))
        if len(prompts[0]) + len(answers[longest]) <= self.max_seq_len:
            return prompts[0], answers
        ids, labels = tokenize_conversation(self.tok, self.template, msgs + [
            {"role": "assistant", "content": responses[longest]}], self.max_prompt_len, self.max_seq_len)
        return _prompt_of(ids, labels, answers[longest], where), answers


def _prompt_of(ids, labels, answer, where):
    """The prompt of an SFT-tokenised conversation: the tokens before its last labelled run,
    which must be (a prefix of) `answer`."""
    end = max((i for i, x in enumerate(labels) if x != IGNORE), default=None)
    start = end
    while start is not None and start > 0 and labels[start - 1] != IGNORE:
        start -= 1
    if end is None or list(ids[start:end + 1]) != list(answer[:end + 1 - start]):
        raise DataError(f"{where}: no response token fits in max_seq_len after cutting the prompt "
                        "(a long system prompt?)")
    return list(ids[:start])


# ------------------------------------------------------------------------------ datasets

class PreferenceDataset:
    """Tokenised examples in memory. DPO: {"prompt", "chosen", "rejected", "id"}; KTO: {"prompt",
    "completion", "kl", "label", "id"} (int64 arrays; label 1 = desirable)."""

    def __init__(self, kind, examples, files):
        self.kind, self.examples, self.files = kind, examples, files

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]

    def sequences(self, e):
        """The example's two sequences as (token ids, prompt length)."""
        p = e["prompt"]
        second = ("chosen", "rejected") if self.kind == "dpo" else ("completion", "kl")
        return [(np.concatenate([p, e[k]]), len(p)) for k in second]

    def length(self, i):
        return sum(len(s) for s, _ in self.sequences(self.examples[i]))

    @property
    def num_tokens(self):
        return sum(self.length(i) for i in range(len(self)))


def load_preference_split(path, key, kind, tokenizer):
    files = row_files(path, key)
    examples, same = [], []
    for f in files:
        for lineno, row in read_json_lines(f):
            where = f"{f}:{lineno}"
            msgs, responses, label, conv = parse_row(row, where, kind)
            prompt, answers = tokenizer(msgs, responses, where, conv)
            e = {"prompt": np.asarray(prompt, np.int64), "id": len(examples)}
            if kind == "dpo":
                e["chosen"], e["rejected"] = (np.asarray(a, np.int64) for a in answers)
                if np.array_equal(e["chosen"], e["rejected"]):
                    same.append(where)
            else:
                e["completion"], e["label"] = np.asarray(answers[0], np.int64), label
            examples.append(e)
    if not examples:
        raise DataError(f"{key}={path}: no rows in {', '.join(files)}")
    if same:   # such a pair has zero DPO gradient: it only dilutes the batch
        logging.getLogger("paddletune").warning(
            "%d of %d pairs have a chosen answer equal to the rejected one (they teach nothing), "
            "e.g. %s", len(same), len(examples), ", ".join(same[:3]))
    if kind == "kto":   # the KL term's mismatched completions (see the module docstring)
        n = len(examples)
        for i, e in enumerate(examples):
            e["kl"] = examples[(-i) % n]["completion"][:tokenizer.max_seq_len - len(e["prompt"])]
    return PreferenceDataset(kind, examples, files)


def build_preference_datasets(a, tok):
    """(train or None, dev or None) of parsed PreferenceArgs `a`; DataError on bad rows."""
    if a.data.chat_template is not None:   # also saved with the model, as in SFT
        try:
            tok.set_chat_template(a.data.chat_template)
        except ChatTemplateError as e:
            raise DataError(f"chat_template: {e}") from None
    pt = PairTokenizer(tok, a.data.chat_template, a.pref_data.max_prompt_len, a.pref_data.max_seq_len)
    train = load_preference_split(a.pref_data.train_dataset_path, "train_dataset_path", a.kind, pt) \
        if a.training.do_train else None
    dev = load_preference_split(a.pref_data.dev_dataset_path, "dev_dataset_path", a.kind, pt) \
        if a.training.do_eval else None
    return train, dev


# ------------------------------------------------------------------------------ batches

def build_batch(rows, pad_id, length=None, pad_to_multiple_of=None, packed=False):
    """rows: [[(ids, prompt length, unit), ...] per row] -> {input_ids, labels, unit_ids,
    attention_mask [, position_ids, segment_ids]} [B, L] int64 (see the module docstring)."""
    L = length or max(sum(len(s) for s, _, _ in row) for row in rows)
    if pad_to_multiple_of:
        L = -(-L // pad_to_multiple_of) * pad_to_multiple_of
    B = len(rows)
    out = {k: np.full((B, L), v, np.int64) for k, v in (("input_ids", pad_id), ("labels", IGNORE),
                                                        ("unit_ids", -1), ("attention_mask", 0),
                                                        ("position_ids", 0), ("segment_ids", 0))}
    for b, row in enumerate(rows):
        at = 0
        for s, (ids, n_prompt, unit) in enumerate(row):
            n, first = len(ids), max(n_prompt, 1)   # a segment's first token is never a label
            out["input_ids"][b, at:at + n] = ids
            out["labels"][b, at + first:at + n] = ids[first:]
            out["unit_ids"][b, at + first:at + n] = unit
            out["attention_mask"][b, at:at + n] = 1
            out["position_ids"][b, at:at + n] = np.arange(n)
            out["segment_ids"][b, at:at + n] = s
            at += n
        out["segment_ids"][b, at:] = len(row)
    if not packed:
        del out["position_ids"], out["segment_ids"]
    return out


def _sequences(ds, examples):
    """[[(ids, prompt length, unit) of every example's first sequence], [... second]]."""
    n = len(examples)
    seqs = [ds.sequences(e) for e in examples]
    return [[(seqs[k][j][0], seqs[k][j][1], k + j * n) for k in range(n)] for j in range(2)]


def _with_counts(out, ds, examples):
    out["loss_count"] = np.asarray(len(examples), np.int64)
    out["example_ids"] = np.asarray([e["id"] for e in examples], np.int64)
    if ds.kind == "kto":
        out["kto_labels"] = np.asarray([e["label"] for e in examples], np.float32)
    return out


def padded_collate(ds, pad_id, pad_to_multiple_of=None, length=None):
    """collate(examples) -> a padded batch: rows [first sequence of each example..., second...]
    (`length`: pad every batch to it, e.g. max_seq_len with pad_to_max_length)."""
    def collate(examples):
        first, second = _sequences(ds, examples)
        return _with_counts(build_batch([[s] for s in first + second], pad_id, length, pad_to_multiple_of),
                            ds, examples)

    return collate


class PackedPairSource:
    """Trainer `train_source` of zero padding: whole pairs / KTO examples packed into rows of
    `capacity` tokens (data/packing.py's sequential or greedy rule), a BatchPlan over the packs
    (shuffled per epoch, data-parallel shares, exact resume from the step)."""

    def __init__(self, ds, capacity, micro_batch, accumulation, dp_world=1, dp_rank=0, seed=42,
                 greedy=False, pad_id=0, pad_to_multiple_of=None, pad_to_max_length=False, drop_last=False):
        self.ds, self.pad_id, self.multiple = ds, pad_id, pad_to_multiple_of
        self.length = capacity if pad_to_max_length else None
        self.packs = pack([ds.length(i) for i in range(len(ds))], capacity, greedy)
        self.plan = BatchPlan(len(self.packs), micro_batch, accumulation, dp_world, dp_rank, seed=seed,
                              drop_last=drop_last)

    @property
    def steps_per_epoch(self):
        return self.plan.steps_per_epoch

    def collate(self, pack_indices):
        examples = [self.ds[i] for p in pack_indices for i in self.packs[p]]
        first, second = _sequences(self.ds, examples)
        rows, at = [], 0
        for p in pack_indices:   # each pack's examples, both sequences of one adjacent
            rows.append([s for k in range(at, at + len(self.packs[p])) for s in (first[k], second[k])])
            at += len(self.packs[p])
        return _with_counts(build_batch(rows, self.pad_id, self.length, self.multiple, packed=True), self.ds, examples)

    def iterate(self, epoch, start_step=0):
        for step, micro in self.plan.iterate(epoch, start_step):
            yield step, [self.collate(idx) for idx in micro]
