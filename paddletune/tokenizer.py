"""Tokenizers from Hugging Face checkpoint directories, without transformers.

Backends: `tokenizer.json` through the `tokenizers` library (preferred when present), else
`tokenizer.model` through `sentencepiece`. Settings come from tokenizer_config.json and
special_tokens_map.json: bos/eos/unk/pad tokens, `add_bos_token` / `add_eos_token`, added tokens,
and the chat template (`chat_template` key or a `chat_template.jinja` file beside it).

Special tokens on encode:
- tokenizers backend: when tokenizer_config.json states add_bos_token/add_eos_token, those decide
  (as HF's Llama tokenizer rebuilds its post-processor from them); otherwise the post-processor
  in tokenizer.json decides (Llama-3 adds <|begin_of_text|>, Qwen2 adds nothing).
- sentencepiece backend: add_bos_token defaults to True, add_eos_token to False (Llama-2).
A checkpoint without a pad token (Llama-3) gets unk, or else eos, as pad.
"""
import functools
import json
import os
import re
import shutil

from .io import CONFIG_CAP, TEMPLATE_CAP, TOKENIZER_CAP, read_capped, read_json, read_text

FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
         "added_tokens.json", "chat_template.jinja", "chat_template.json")


def _content(tok):
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


MAX_VOCAB = 1 << 24   # tokens in one vocabulary (the largest published: ~256k); ids fit int32


def _check_tokenizer_json(path, d):
    """The added tokens of a parsed tokenizer.json, after sanity checks made before the
    `tokenizers` library builds it (which takes ~30x the file's size in memory): at most
    MAX_VOCAB tokens, and no more BPE merges than vocabulary entries (each merge makes one)."""
    if not isinstance(d, dict) or not isinstance(d.get("model", {}), dict):
        raise ValueError(f"{path}: not a Hugging Face tokenizer.json (expected an object with 'model')")
    model, added = d.get("model") or {}, d.get("added_tokens") or []
    vocab, merges = model.get("vocab") or {}, model.get("merges") or []
    if not isinstance(added, list) or not all(isinstance(t, dict) and isinstance(t.get("id"), int)
                                               and isinstance(t.get("content"), str) for t in added):
        raise ValueError(f"{path}: 'added_tokens' must be a list of {{id, content}} objects")
    if len(vocab) + len(added) > MAX_VOCAB or any(not 0 <= t["id"] < MAX_VOCAB for t in added):
        raise ValueError(f"{path}: {len(vocab) + len(added)} tokens or an id beyond {MAX_VOCAB}: "
                         "no model has a vocabulary that large; the file is damaged or hostile")
    if len(merges) > max(len(vocab), 1):
        raise ValueError(f"{path}: {len(merges)} BPE merges for {len(vocab)} vocabulary entries "
                         "(each merge makes one entry, so there cannot be more): the file is "
                         "damaged or hostile")
    return added


class Tokenizer:
    # Where encode(add_special_tokens=True)'s specials go: False (most): in front of the text
    # (BOS; ChatGLM2's [gMASK] sop), so a prompt starts with them; True (ChatGLM-6B): after the
    # prompt, before its answer (prompt, [gMASK], <sop>, answer): then a row holds one answer and
    # training data puts them between prompt and answer (data/sft.py, data/chat_template.py)
    specials_after_prompt = False

    def __init__(self, path):
        self.path = path
        self.config = self._read_optional("tokenizer_config.json")
        special_map = self._read_optional("special_tokens_map.json")
        self.added = {}   # token string -> id, tokens matched before the model's tokenisation
        self.special_ids = set()
        tj, tm = (os.path.join(path, f) for f in ("tokenizer.json", "tokenizer.model"))
        custom = self._own_backend()
        if custom is not None:   # a family's vocabulary file, as a `tokenizers` Tokenizer
            self.backend, self._tok = "tokenizers", custom
            for i, t in custom.get_added_tokens_decoder().items():
                self.added[t.content] = i
                if t.special:
                    self.special_ids.add(i)
        elif os.path.lexists(tj):
            from tokenizers import Tokenizer as _Tok

            self.backend = "tokenizers"
            raw = read_capped(tj, TOKENIZER_CAP, "tokenizer.json")
            try:
                try:
                    text = raw.decode("utf-8")
                    d = json.loads(text)
                except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                    raise RuntimeError(e) from None   # reported as the damaged-file error below
                added = _check_tokenizer_json(tj, d)
                self._tok = _Tok.from_str(text)
                for t in added:
                    self.added[t["content"]] = t["id"]
                    if t.get("special"):
                        self.special_ids.add(t["id"])
            except ValueError:
                raise
            except Exception as e:   # tokenizers raises its own Exception type on a bad file
                raise ValueError(f"{tj} cannot be read as a tokenizer ({str(e)[:200] or type(e).__name__}): "
                                 "the file is damaged or not a Hugging Face tokenizer.json; copy "
                                 "it again from the checkpoint") from None
        elif os.path.lexists(tm):
            import sentencepiece as spm

            self.backend = "sentencepiece"
            try:
                self._sp = spm.SentencePieceProcessor(
                    model_proto=read_capped(tm, TOKENIZER_CAP, "tokenizer.model"))
            except ValueError as e:
                if str(e).startswith(tm):
                    raise
                raise ValueError(f"{tm} cannot be read as a sentencepiece model ({str(e)[:200]}): "
                                 "the file is damaged; copy it again from the checkpoint") from None
            except Exception as e:   # sentencepiece raises RuntimeError/OSError on a bad model
                raise ValueError(f"{tm} cannot be read as a sentencepiece model ({str(e)[:200]}): "
                                 "the file is damaged; copy it again from the checkpoint") from None
            for sid, t in (self.config.get("added_tokens_decoder") or {}).items():
                self.added[t["content"]] = int(sid)
                if t.get("special", True):
                    self.special_ids.add(int(sid))
            self.added.update(self._read_optional("added_tokens.json"))
            for i in range(self._sp.get_piece_size()):
                if self._sp.is_control(i) or self._sp.is_unknown(i):
                    self.special_ids.add(i)
        else:
            raise FileNotFoundError(
                f"no tokenizer.json or tokenizer.model in {path}; copy the checkpoint's tokenizer "
                "files into that directory")
        def tok(name):
            return _content(self.config.get(name)) or _content(special_map.get(name))

        self.bos_token, self.eos_token = tok("bos_token"), tok("eos_token")
        self.unk_token, self.pad_token = tok("unk_token"), tok("pad_token")
        if self.backend == "sentencepiece":
            sp = self._sp
            self.bos_token = self.bos_token or (sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else None)
            self.eos_token = self.eos_token or (sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else None)
            self.unk_token = self.unk_token or (sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else None)
        if self.backend == "sentencepiece":  # special token strings in text map to their ids
            for t in (self.bos_token, self.eos_token, self.unk_token, self.pad_token):
                if t is not None and t not in self.added and self.token_to_id(t) is not None:
                    self.added[t] = self.token_to_id(t)
        self._added_re = (re.compile("(" + "|".join(map(re.escape, sorted(self.added, key=len, reverse=True))) + ")")
                          if self.added and self.backend == "sentencepiece" else None)
        self.legacy = bool(self.config.get("legacy", False))
        self.pad_added = self.pad_token is None
        if self.pad_token is None:
            self.pad_token = self.unk_token or self.eos_token
        self.explicit_specials = "add_bos_token" in self.config or "add_eos_token" in self.config \
            or self.backend == "sentencepiece"
        self.add_bos_token = bool(self.config.get("add_bos_token", self.backend == "sentencepiece"))
        self.add_eos_token = bool(self.config.get("add_eos_token", False))
        self.chat_template = self._load_chat_template()
        self._template = None       # compiled template (data/chat_template.py), built on first use
        self._template_set = self._template_explicit = False

    # ------------------------------------------------------------------ files
    def _own_backend(self):
        """A `tokenizers.Tokenizer` built from a family's own vocabulary file (a subclass's, e.g.
        Qwen's qwen.tiktoken), or None: tokenizer.json / tokenizer.model are read."""
        return None

    def _read_optional(self, name):
        p = os.path.join(self.path, name)
        d = read_json(p, name, CONFIG_CAP) if os.path.lexists(p) else {}
        if not isinstance(d, dict):
            raise ValueError(f"{p}: must hold one JSON object")
        return d

    def _load_chat_template(self):
        t = self.config.get("chat_template")
        if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
            t = next((x["template"] for x in t if x.get("name") == "default"), t[0]["template"] if t else None)
        jinja = os.path.join(self.path, "chat_template.jinja")
        self._template_file = os.path.join(self.path, "tokenizer_config.json") + " chat_template"
        if t is None and os.path.lexists(jinja):
            t = read_text(jinja, TEMPLATE_CAP, "chat template")
            self._template_file = jinja
        return t

    # ------------------------------------------------------------------ chat template
    @property
    def template(self):
        """The compiled chat template in effect (None when there is none): one set with
        set_chat_template, else the checkpoint's jinja template, else its PaddleNLP
        chat_template.json."""
        if not self._template_set:
            from .data.chat_template import load_template

            pd = os.path.join(self.path, "chat_template.json")
            if self.chat_template is not None:
                self._template = load_template(self.chat_template, getattr(self, "_template_file", f"{self.path} chat_template"))
            elif os.path.exists(pd):
                self._template = load_template(pd)
            self._template_set = True
        return self._template

    def set_chat_template(self, source):
        """Use `source` (built-in name, .jinja / chat_template.json path, jinja text, or "none")."""
        from .data.chat_template import load_template

        self._template = load_template(source)
        self._template_set = self._template_explicit = True
        return self._template

    init_chat_template = set_chat_template   # PaddleNLP's name

    def apply_chat_template(self, conversation, add_generation_prompt=False, tokenize=True,
                            chat_template=None, **kwargs):
        """Render a conversation (messages [{role, content}], PaddleNLP [[user, bot], ...,
        [query]], or a query string) with the chat template; token ids when tokenize=True
        (encoded exactly as training data is: see data/chat_template.py), else the text."""
        from .data.chat_template import apply_chat_template

        return apply_chat_template(self, conversation, add_generation_prompt, tokenize,
                                   chat_template, **kwargs)

    def save_pretrained(self, out_dir):
        """Copy the tokenizer files; record the pad token when it was filled in here."""
        os.makedirs(out_dir, exist_ok=True)
        for name in FILES:
            src = os.path.join(self.path, name)
            if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(os.path.join(out_dir, name)):
                shutil.copyfile(src, os.path.join(out_dir, name))
        conf = dict(self.config)
        if self.pad_added:
            conf["pad_token"] = self.pad_token
        explicit = self._template_explicit and self._template is not None
        if explicit:   # the template set for training travels with the model
            for name in ("chat_template.jinja", "chat_template.json"):
                if os.path.exists(os.path.join(out_dir, name)) and os.path.abspath(out_dir) != os.path.abspath(self.path):
                    os.unlink(os.path.join(out_dir, name))
            conf.pop("chat_template", None)
            t = self._template
            if hasattr(t, "spec"):    # PaddleNLP {system, conversation, query}
                with open(os.path.join(out_dir, "chat_template.json"), "w", encoding="utf-8") as f:
                    json.dump(t.spec, f, indent=2, ensure_ascii=False)
            else:
                conf["chat_template"] = t.source
        if self.pad_added or explicit:
            with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
                json.dump(conf, f, indent=2, ensure_ascii=False)

    # ------------------------------------------------------------------ ids
    def token_to_id(self, token):
        if token is None:
            return None
        if token in self.added:
            return self.added[token]
        if self.backend == "tokenizers":
            return self._tok.token_to_id(token)
        i = self._sp.piece_to_id(token)
        return None if (i == self._sp.unk_id() and token != self.unk_token) else i

    def id_to_token(self, i):
        if self.backend == "tokenizers":
            return self._tok.id_to_token(i)
        inv = {v: k for k, v in self.added.items()}
        return inv.get(i) or self._sp.id_to_piece(i)

    @functools.cached_property
    def special_token_pattern(self):
        """Regex matching any special-token string of this tokenizer (those of special_ids, and
        eos; never unk), longest first; None when there is none. Chat-template encoding uses it
        to find where an assistant turn ends (data/chat_template.py). Built on first use and
        kept: the special tokens are fixed once the tokenizer is loaded."""
        names = {self.id_to_token(i) for i in self.special_ids} | {self.eos_token}
        names = sorted((n for n in names if n and n != self.unk_token), key=len, reverse=True)
        return re.compile("|".join(map(re.escape, names))) if names else None

    @property
    def bos_token_id(self):
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self):
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self):
        return self.token_to_id(self.pad_token)

    @property
    def unk_token_id(self):
        return self.token_to_id(self.unk_token)

    def __len__(self):
        if self.backend == "tokenizers":
            return self._tok.get_vocab_size(with_added_tokens=True)
        return max([self._sp.get_piece_size() - 1] + list(self.added.values())) + 1

    vocab_size = property(__len__)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text, add_special_tokens=True):
        """Text -> ids. With add_special_tokens, BOS/EOS are added as the checkpoint says."""
        if self.backend == "tokenizers":
            if not self.explicit_specials:
                return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
            ids = self._tok.encode(text, add_special_tokens=False).ids
        else:
            ids = self._sp_encode(text)
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids = [self.bos_token_id] + ids
            if self.add_eos_token and self.eos_token_id is not None:
                ids = ids + [self.eos_token_id]
        return ids

    def _sp_encode(self, text):
        """sentencepiece encode, splitting out added/special tokens first. With legacy=False (the
        transformers default for Llama) a dummy-prefix space is added only at the very start of
        the text, and never after a special token or before text that starts with a space."""
        pieces = self._added_re.split(text) if self._added_re is not None else [text]
        ids = []
        for i, piece in enumerate(pieces):
            if not piece:
                continue
            if piece in self.added:
                ids.append(self.added[piece])
            elif self.legacy or (i == 0 and not piece.startswith(" ")):
                ids += self._sp.encode(piece)
            else:
                ids += self._sp_encode_no_prefix(piece)
        return ids

    def _sp_encode_no_prefix(self, text):
        # sentencepiece always adds its dummy-prefix space at the start of an input; encoding
        # unk_text + text and dropping unk_text's tokens leaves `text` without it.
        anchor = self._sp.id_to_piece(self._sp.unk_id())
        n = len(self._sp.encode(anchor))
        return self._sp.encode(anchor + text)[n:]

    def special_tokens_around(self):
        """(prefix_ids, suffix_ids) that encode(..., add_special_tokens=True) puts around text,
        e.g. ([bos], []) for Llama-2/3, ([], []) for Qwen2."""
        plain = self.encode("a", add_special_tokens=False)
        full = self.encode("a", add_special_tokens=True)
        for i in range(len(full) - len(plain) + 1):
            if full[i:i + len(plain)] == plain:
                return full[:i], full[i + len(plain):]
        return [], []

    def decode(self, ids, skip_special_tokens=False):
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        if self.backend == "tokenizers":
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        out, run = [], []
        inv = {v: k for k, v in self.added.items()}
        for i in ids:
            if i in inv:
                if run:
                    out.append(self._sp.decode(run))
                    run = []
                out.append(inv[i])
            else:
                run.append(i)
        if run:
            out.append(self._sp.decode(run))
        return "".join(out)

    def __repr__(self):
        return (f"Tokenizer({self.path!r}, backend={self.backend}, vocab={len(self)}, "
                f"bos={self.bos_token!r}, eos={self.eos_token!r}, pad={self.pad_token!r})")
