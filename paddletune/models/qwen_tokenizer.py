"""Qwen (1) tokenizer: `qwen.tiktoken` read from the checkpoint directory, without tiktoken and
without its network fetch (tiktoken.get_encoding downloads; nothing here does).

qwen.tiktoken holds one line per token: base64(token bytes) and its rank (0 .. n-1). Encoding is
tiktoken's byte-level BPE:
  1. split the text with Qwen's regex (PAT below: contractions, letter runs with one optional
     leading non-letter, single digits, punctuation runs, newlines, spaces);
  2. a piece that is itself a token is that token; otherwise its bytes are merged pairwise,
     always the adjacent pair whose concatenation has the lowest rank, until no pair is a token.
Step 2 is a `tokenizers` BPE model whose merges are every split (a, b) of every token a+b (a and
b tokens), ordered by the rank of a+b (so "lowest merged rank first" is the merge order), with
`ignore_merges` (a whole-piece token wins, as tiktoken looks the piece up first). Bytes map to
the byte-level alphabet of `tokenizers` (bytes_to_unicode below).
Special tokens follow the n ranks: <|endoftext|> = n, <|im_start|> = n+1, <|im_end|> = n+2,
<|extra_0|> .. <|extra_204|> = n+3 ... (Qwen's layout; 151643 .. 151850 for Qwen's vocabulary).
encode adds no BOS / EOS; EOS (and pad) is <|endoftext|> unless tokenizer_config.json names one.
Selected by tokenizer_config.json `"tokenizer_class": "QWenTokenizer"` (ModelSpec.tokenizer_classes).
"""
import base64
import json
import os
import shutil

from ..io import TOKENIZER_CAP, read_capped
from ..tokenizer import Tokenizer

VOCAB_FILE = "qwen.tiktoken"
PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
       r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>") + tuple(f"<|extra_{i}|>" for i in range(205))


def bytes_to_unicode():
    """The byte-level alphabet: byte b -> one printable character. Bytes that are printable
    Latin-1 ('!'..'~', '¡'..'¬', '®'..'ÿ') map to themselves, the other 68 to chr(256 + k) in
    byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) \
        | set(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def read_ranks(path):
    """{token bytes: rank} from a .tiktoken file; a malformed line raises naming the line."""
    ranks = {}
    # a regular file of at most TOKENIZER_CAP bytes (a FIFO, /dev/zero or a huge file is refused)
    for lineno, line in enumerate(read_capped(path, TOKENIZER_CAP, "Qwen tiktoken vocabulary").split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError:
            raise ValueError(f"{path}:{lineno}: expected '<base64 token> <rank>'") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be 0 .. {len(ranks) - 1}, each once")
    return ranks


def build_backend(ranks):
    """A `tokenizers.Tokenizer` equal to tiktoken's encoding over `ranks` (module docstring)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _Tok

    alphabet = bytes_to_unicode()

    def text(b):
        return "".join(alphabet[x] for x in b)

    vocab = {text(b): r for b, r in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            a, b = token[:i], token[i:]
            if a in ranks and b in ranks:
                merges.append((rank, ranks[a], ranks[b], text(a), text(b)))
    merges.sort()
    tok = _Tok(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    n = len(ranks)
    for i, s in enumerate(SPECIALS):
        if tok.token_to_id(s) != n + i:
            raise ValueError(f"special token {s} got id {tok.token_to_id(s)}, Qwen's is {n + i}")
    return tok


class QWenTokenizer(Tokenizer):
    def _own_backend(self):
        vocab = os.path.join(self.path, VOCAB_FILE)
        if not os.path.exists(vocab):
            raise FileNotFoundError(f"{self.path}: tokenizer_config.json names QWenTokenizer, which "
                                    f"reads {VOCAB_FILE}; copy it from the checkpoint")
        return build_backend(read_ranks(vocab))

    def __init__(self, path):
        super().__init__(path)
        self.add_bos_token = self.add_eos_token = False
        if self.eos_token is None:
            self.eos_token = "<|endoftext|>"
        if self.pad_token is None:
            self.pad_token, self.pad_added = self.eos_token, True

    def save_pretrained(self, out_dir):
        super().save_pretrained(out_dir)
        src, dst = os.path.join(self.path, VOCAB_FILE), os.path.join(out_dir, VOCAB_FILE)
        if os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(src, dst)

    def __repr__(self):
        return f"QWenTokenizer({self.path!r}, vocab={len(self)})"


def write_tiny_qwen_tokenizer(out_dir, texts, vocab_size=600):
    """A tiny qwen.tiktoken (+ tokenizer_config.json): byte-level BPE trained on `texts` with
    `tokenizers`; ranks = the 256 bytes in byte order, then the merged tokens in training order."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import models, pre_tokenizers, trainers

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    inverse = {c: b for b, c in bytes_to_unicode().items()}
    learned = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [bytes([b]) for b in range(256)]
    tokens += [bytes(inverse[c] for c in t) for t, _ in learned if len(t) > 1 or t not in inverse]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, VOCAB_FILE), "w") as f:
        for rank, t in enumerate(tokens):
            f.write(f"{base64.b64encode(t).decode()} {rank}\n")
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "QWenTokenizer", "model_max_length": 8192}, f, indent=2)
    return out_dir


if __name__ == "__main__":   # regenerate the shipped tiny tokenizer from the sample data
    from ..data.builtin import generate
    from .tiny import ASSETS

    train, dev = generate()
    texts = [r["src"] + "\n" + r["tgt"] for r in train + dev]
    write_tiny_qwen_tokenizer(os.path.join(ASSETS, "tiny-qwen-tokenizer"), texts)
