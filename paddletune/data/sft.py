"""SFT data: JSON-lines files of {"src", "tgt"} (strings, or lists of strings for several rounds)
or {"messages": [{"role", "content"}, ...]} -> tokenised examples {input_ids, labels} with labels
-100 on everything but the targets.

With a chat template (the `chat_template` argument, else the checkpoint's), every row becomes a
conversation (src/tgt rounds -> user/assistant messages) tokenised by data/chat_template.py, the
same code Tokenizer.apply_chat_template uses at inference. Budget (`tokenize_conversation`):
max_length covers the whole conversation; the system prompt is kept; the oldest rounds are
dropped first; then the last round's user text is cut from the left so its prompt fits
src_length; then the answer is cut from the right (losing its end-of-turn token).
Without a template, src/tgt rows follow PaddleNLP's plain rules below; messages rows need one.

Where the files are (dataset_name_or_path = DIR):
    DIR/train.json, DIR/dev.json  (or .jsonl)   or   DIR/train/*.json, DIR/dev/*.json (or *.jsonl)
or one FILE.json / FILE.jsonl (train and dev both: logged), or a built-in name (paddletune/sample-sft).

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
import logging
import os
import re

import numpy as np

from .builtin import BUILTIN_DATASETS
from .chat_template import (ChatTemplateError, encode_segments, normalize_conversation,
                            template_context, template_for)

IGNORE = -100
logger = logging.getLogger("paddletune")


class DataError(ValueError):
    """Bad dataset input: names the file (and line) and what is wrong."""


def resolve_dataset_path(name):
    """A directory of split files, or one .json / .jsonl file; DataError naming the fix otherwise."""
    if name in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[name]
    if os.path.isdir(name) or (os.path.isfile(name) and name.endswith((".json", ".jsonl"))):
        return name
    what = "is not a .json / .jsonl file" if os.path.isfile(name) else "is not a directory or a file"
    raise DataError(f"dataset_name_or_path={name!r} {what} (working directory {os.getcwd()}); give a "
                    f"folder with train.json/dev.json (or .jsonl), one JSON-lines file, or the built-in "
                    f"{', '.join(BUILTIN_DATASETS)}")


def split_files(root, split):
    """Files of one split: root itself when it is one file (it serves every split), else
    root/{split}.json or .jsonl, or root/{split}/*.json(l) (sorted). May be []."""
    if os.path.isfile(root):
        return [root]
    for ext in (".json", ".jsonl"):
        single = os.path.join(root, split + ext)
        if os.path.isfile(single):
            return [single]
    return sorted(glob.glob(os.path.join(root, split, "*.json")) + glob.glob(os.path.join(root, split, "*.jsonl")))


_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json_line(line, where):
    """One JSON-lines row (str, or bytes that must be UTF-8) as a dict; DataError naming `where`
    (file:line) otherwise: not UTF-8, not JSON, not an object, or text with a lone surrogate
    escape ("\\ud800": JSON allows it, no tokenizer can encode it)."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not UTF-8 text (byte 0x{line[e.start]:02x} at column "
                            f"{e.start + 1}); save the file as UTF-8") from None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
    if _SURROGATE.search(line):
        try:
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(f"{where}: the text holds a lone surrogate escape ({e.object[e.start]!r}: "
                            "half of a UTF-16 pair, not a character); fix or remove the line") from None
    return row


def read_json_lines(path):
    """Yield (line_number, dict) for each non-empty line; a malformed line raises DataError
    naming the file and the line."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):   # a UTF-8 byte-order mark
                line = line[3:]
            if line.strip():
                yield lineno, parse_json_line(line, f"{path}:{lineno}")


class LineSkipper:
    """skip_invalid_lines: a bad line is logged and skipped instead of stopping the run; the
    count so far is in every message (and `count`)."""

    def __init__(self, enabled, split="train"):
        self.enabled, self.split, self.count = enabled, split, 0

    def skip(self, error):
        """Raise `error` (a DataError) unless skipping is on; else log it and count it."""
        if not self.enabled:
            raise error
        self.count += 1
        if self.count <= 20 or self.count % 100 == 0:
            logger.warning("skip_invalid_lines: skipped %s (%d %s line(s) skipped so far)", error,
                           self.count, self.split)


def target_text(row):
    """The text a row trains on (every answer), to find rows with nothing to learn."""
    if "messages" in row and isinstance(row["messages"], list):
        return "".join(str(m.get("content") or "") for m in row["messages"]
                       if isinstance(m, dict) and m.get("role") == "assistant")
    tgt = row.get("tgt")
    return "".join(tgt) if isinstance(tgt, list) else str(tgt or "")


def messages_of(row, where, template):
    """Conversation messages of a row ({"messages"} or src/tgt rounds), or None for plain src/tgt."""
    if "messages" in row:
        if template is None:
            raise DataError(f"{where}: \"messages\" rows need a chat template; set chat_template to a "
                            "built-in name (llama2, llama3, chatml, chatglm2, chatglm3, baichuan2), a jinja "
                            "file or a PaddleNLP chat_template.json (the checkpoint has none)")
        try:
            msgs = normalize_conversation(row["messages"], where)
        except ChatTemplateError as e:
            raise DataError(str(e)) from None
        while msgs and msgs[-1]["role"] != "assistant":   # trailing turns carry no label
            msgs.pop()
        if not msgs:
            raise DataError(f"{where}: the conversation has no assistant message to learn from")
        return msgs
    rounds = rounds_of(row, where)
    if template is None:
        return None
    return [{"role": r, "content": t} for src, tgt in rounds for r, t in (("user", src), ("assistant", tgt))]


def split_rounds(messages):
    """(system messages, rounds): a round starts at each user message that follows an assistant."""
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    rounds = []
    for m in messages[len(system):]:
        if not rounds or (m["role"] == "user" and rounds[-1][-1]["role"] == "assistant"):
            rounds.append([])
        rounds[-1].append(m)
    return system, rounds


def _round_lengths(segments, pieces, rounds):
    """Tokens per round, attributing each prompt piece to the round of the assistant after it."""
    owner, r, by_msg = [], len(rounds) - 1, {id(m): i for i, rd in enumerate(rounds) for m in rd}
    for seg in reversed(segments):
        if seg.is_assistant:
            r = by_msg[id(seg.message)]
        owner.append(r)
    owner = owner[::-1]
    lens = [0] * len(rounds)
    extra = len(pieces) - len(segments)   # a leading BOS piece added by encode_segments
    for i, (ids, _, _) in enumerate(pieces):
        lens[owner[max(i - extra, 0)]] += len(ids)
    return lens


def _cut_user(tok, segments, pieces, user_text, src_length):
    """Cut `user_text` inside the last prompt piece before the first answer from the left so
    that all prompt pieces together fit src_length; the text around it (system, markers) stays,
    and so do the specials that close the prompt (specials_after_prompt: ChatGLM-6B)."""
    extra = len(pieces) - len(segments)
    closing = list(tok.special_tokens_around()[1]) if getattr(tok, "specials_after_prompt", False) else []
    first = next(i for i, (_, _, a) in enumerate(pieces) if a)
    k = first - 1
    if k < extra:
        return pieces
    text, at = segments[k - extra].text, -1
    for candidate in (user_text, user_text.strip()):   # templates may trim the content
        if candidate and text.rfind(candidate) >= 0:
            user_text, at = candidate, text.rfind(candidate)
            break
    if at < 0:   # the template rewrote the text: cut the prompt tokens from the left instead
        others = sum(len(p[0]) for p in pieces[:extra])
        flat, keep = [i for p in pieces[extra:first] for i in p[0]], max(src_length - others, 0)
        ids = flat[len(flat) - keep:] if keep else []
        return pieces[:extra] + [(ids, [IGNORE] * len(ids), False)] + pieces[first:]
    enc = lambda t: tok.encode(t, add_special_tokens=False) if t else []  # noqa: E731
    pre, content, post = enc(text[:at]), enc(user_text), enc(text[at + len(user_text):])
    others = sum(len(p[0]) for i, p in enumerate(pieces[:first]) if i != k) + len(pre) + len(post) \
        + len(closing)
    keep = max(src_length - others, 0)
    ids = pre + (content[len(content) - keep:] if keep else []) + post + closing
    return pieces[:k] + [(ids, [IGNORE] * len(ids), False)] + pieces[first:]


def tokenize_conversation(tok, template, messages, src_length, max_length, autoregressive=False):
    """(input_ids, labels) of a conversation under the budget rules of the module docstring."""
    ctx = template_context(tok)
    system, rounds = split_rounds(messages)
    start = 0
    while True:
        msgs = system + [m for rd in rounds[start:] for m in rd]
        segments = template.segments(msgs, False, **ctx)
        pieces = encode_segments(tok, segments)
        total = sum(len(p[0]) for p in pieces)
        if total <= max_length or start == len(rounds) - 1:
            break
        lens, need, k = _round_lengths(segments, pieces, rounds[start:]), total - max_length, 0
        while k < len(lens) - 1 and need > 0:   # skip straight to the first likely fit
            need, k = need - lens[k], k + 1
        start += max(k, 1)
    if total > max_length:
        users = [m["content"] for m in rounds[-1] if m["role"] == "user"]
        prompt_len = sum(len(p[0]) for p in pieces[:next(i for i, p in enumerate(pieces) if p[2])])
        if prompt_len > src_length:
            pieces = _cut_user(tok, segments, pieces, users[-1] if users else "", src_length)
    input_ids, labels = [], []
    for ids, labs, _ in pieces:
        room = max_length - len(input_ids)
        input_ids += ids[:room]
        labels += labs[:room]
    return input_ids, (list(input_ids) if autoregressive else labels)


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
    if getattr(tok, "specials_after_prompt", False):
        return _tokenize_after_prompt(tok, rounds, src_length, max_length, autoregressive)
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


def _tokenize_after_prompt(tok, rounds, src_length, max_length, autoregressive=False):
    """Tokenizers whose specials close the prompt (ChatGLM-6B; PaddleNLP's convert_example_chatglm):
        source = prompt text tokens cut from the LEFT to src_length - len(specials), + specials
        target = target tokens cut from the RIGHT to max_length - len(source) (+ EOS when not cut)
    e.g. src "a b c", tgt "x y" -> [a, b, c, [gMASK], <sop>, x, y, <eop>], labels -100 x5, x, y,
    <eop> (PaddleNLP also labels <sop>, the step after [gMASK]; here only the answer and <eop>).
    One answer per row: earlier rounds' src and tgt tokens join the prompt, unlabelled
    (PaddleNLP's rule without a template reads the first round only)."""
    suffix, eos = list(tok.special_tokens_around()[1]), tok.eos_token_id
    prompt = []
    for src, tgt in rounds[:-1]:
        prompt += tok.encode(src, add_special_tokens=False) + tok.encode(tgt, add_special_tokens=False)
    prompt += tok.encode(rounds[-1][0], add_special_tokens=False)
    keep = max(0, src_length - len(suffix))
    source = (prompt[len(prompt) - keep:] if keep else []) + suffix
    budget = max_length - len(source)
    target = tok.encode(rounds[-1][1], add_special_tokens=False)[:max(budget, 0)]
    if 0 < budget and len(target) < budget and eos is not None:
        target = target + [eos]
    return source + target, (source if autoregressive else [IGNORE] * len(source)) + target


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


class ExampleBuilder:
    """row (dict from one JSON line) -> {"input_ids", "labels"} int64 arrays; shared by the
    in-memory and the lazy datasets so both tokenise identically."""

    def __init__(self, tok, data_args):
        self.tok, self.args = tok, data_args
        try:
            self.template = template_for(tok, data_args.chat_template)
        except ChatTemplateError as e:
            raise DataError(f"chat_template: {e}") from None

    def __call__(self, row, where):
        a = self.args
        msgs = messages_of(row, where, self.template)
        try:
            if msgs is None:
                ids, labels = tokenize_rounds(self.tok, rounds_of(row, where), a.src_length,
                                              a.max_length, a.autoregressive)
            else:
                ids, labels = tokenize_conversation(self.tok, self.template, msgs, a.src_length,
                                                    a.max_length, a.autoregressive)
        except ChatTemplateError as e:
            raise DataError(f"{where}: {e}") from None
        if not any(l != IGNORE for l in labels[1:]):
            raise DataError(f"{where}: no target token fits in max_length={a.max_length}")
        return {"input_ids": np.asarray(ids, np.int64), "labels": np.asarray(labels, np.int64)}


def load_split(root, split, tok, data_args, required=True, builder=None):
    files = split_files(root, split)
    if not files:
        if required:
            raise DataError(f"no {split} data in {root}: expected {split}.json, {split}.jsonl or {split}/*.json")
        return None
    if os.path.isfile(root) and split != "train":
        logger.info("%s data: the same file as train (%s); a directory with train.json and dev.json "
                    "keeps them apart", split, root)
    builder = builder or ExampleBuilder(tok, data_args)
    skipper = LineSkipper(getattr(data_args, "skip_invalid_lines", False), split)
    examples, empty = [], []
    for path in files:
        lines = read_json_lines(path)
        while True:
            try:
                lineno, row = next(lines)
                ex = builder(row, f"{path}:{lineno}")
            except StopIteration:
                break
            except DataError as e:
                skipper.skip(e)
                continue
            if not target_text(row).strip():
                empty.append(f"{path}:{lineno}")
            ex["id"] = len(examples)
            examples.append(ex)
    if not examples:
        raise DataError(f"{split} data in {root} is empty ({', '.join(files)})")
    if len(empty) == len(examples):
        raise DataError(f"{split} data in {root}: all {len(examples)} rows have an empty target "
                        f"(\"tgt\" or the assistant messages, e.g. {empty[0]}): the model would learn "
                        "only to stop at once; check the files' keys and contents")
    if empty:
        logger.warning("%s data: %d of %d rows have an empty target (first: %s)", split, len(empty),
                       len(examples), empty[0])
    if skipper.count:
        logger.warning("%s data: %d invalid line(s) skipped (skip_invalid_lines)", split, skipper.count)
    return SFTDataset(examples, files)


def build_datasets(data_args, tok, do_train=True, do_eval=False):
    """(train_dataset or None, dev_dataset or None), checked before any training starts."""
    root = resolve_dataset_path(data_args.dataset_name_or_path)
    if data_args.chat_template is not None:   # also used by inference and saved with the model
        try:
            tok.set_chat_template(data_args.chat_template)
        except ChatTemplateError as e:
            raise DataError(f"chat_template: {e}") from None
    builder = ExampleBuilder(tok, data_args)
    if do_train and data_args.lazy:   # streamed: files checked (head lines), not loaded
        from .lazy import LazyDataset

        files = split_files(root, "train")
        if not files:
            raise DataError(f"no train data in {root}: expected train.json, train.jsonl or train/*.json")
        check_all = getattr(data_args, "lazy_check", True)
        train = LazyDataset(files, builder, skip_invalid_lines=getattr(data_args, "skip_invalid_lines", False),
                            check_all=check_all, background=not check_all)
    else:
        train = load_split(root, "train", tok, data_args, builder=builder) if do_train else None
    dev = load_split(root, "dev", tok, data_args, required=do_eval, builder=builder) if do_eval else None
    return train, dev


def check_positions(limit, scaled, max_length, datasets, config_file, learned=False):
    """max_length beyond the `limit` positions the model was trained for (max_position_embeddings
    in `config_file`): refused for a learned position table (GPT-2, OPT: a position past it has
    no vector); RoPE and ALiBi compute any position, so there it warns once (as transformers and
    PaddleNLP allow it), saying whether the examples read so far fit and whether rope scaling
    stretches the positions."""
    if not limit or max_length <= limit:
        return
    if learned:
        raise DataError(f"max_length={max_length} is beyond the {limit} learned positions of the model "
                        f"(max_position_embeddings / n_positions in {config_file}): a position past "
                        f"the table has no embedding; lower max_length to {limit}")
    lengths = [len(e["input_ids"]) for ds in datasets if isinstance(ds, SFTDataset) for e in ds.examples]
    longest = max(lengths) if lengths else None
    logger.warning("max_length=%d is beyond the model's %d positions (max_position_embeddings in %s)%s",
                   max_length, limit, config_file,
                   ": rope scaling stretches them" if scaled else
                   f"; the examples read so far fit ({longest} tokens at most)" if longest is not None and longest <= limit else
                   f"; examples of up to {longest} tokens use positions the model never saw in training "
                   "(quality may drop there; rope_scaling in config.json stretches them)" if longest else
                   "; a streamed example longer than that would use positions the model never saw")
