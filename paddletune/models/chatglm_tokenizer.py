"""ChatGLM2 / ChatGLM3 tokenizer: THUDM's `tokenizer.model` (sentencepiece) plus special tokens
numbered after the sentencepiece vocabulary.

With n = the sentencepiece piece count (64789 for THUDM's model):
    ChatGLM2: [MASK]=n, [gMASK]=n+1, [sMASK]=n+2, sop=n+3, eop=n+4            (len n+5)
    ChatGLM3: the same, then <|system|>=n+5, <|user|>=n+6, <|assistant|>=n+7,
              <|observation|>=n+8                                             (len n+9)
encode(text) = [gMASK, sop] + ids(text); no BOS, no EOS (EOS is </s>, the sentencepiece eos;
pad is <unk>). Special-token strings inside the text map to their ids (bare "sop"/"eop" only as the
prefix "[gMASK]sop": they are ordinary letters elsewhere); the text between them is
encoded by sentencepiece piece by piece (each piece gets sentencepiece's dummy "▁" prefix), so
a rendered ChatGLM3 conversation "<|user|>\\n hi" gives [<|user|>] + sp("\\n hi"), which equals
THUDM's build_chat_input ([<|user|>] + sp("\\n") + sp("hi")) whenever "▁\\n" is one piece.
Difference from THUDM's ChatGLM2 code: there, a literal "[gMASK]" typed inside the text is
encoded as characters; here it is the special token (as in ChatGLM3's tokenizer_config).

Selected by tokenizer_config.json `"tokenizer_class": "ChatGLMTokenizer"` (ModelSpec.tokenizer_classes in chatglm2.py).
ChatGLM3 is recognised by role tokens in tokenizer_config.json's added_tokens_decoder, or else
by `<|observation|>` in the checkpoint's tokenization_chatglm.py (a chat template is no evidence:
one may be set for training on any tokenizer).
"""
import json
import os
import re
import shutil

from ..io import CONFIG_CAP, read_capped
from ..tokenizer import Tokenizer

SPECIALS = ("[MASK]", "[gMASK]", "[sMASK]", "sop", "eop")
ROLES = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
PREFIX = ("[gMASK]", "sop")
REMOTE_CODE = "tokenization_chatglm.py"


def is_chatglm3(path, config):
    """True when the tokenizer in `path` (with tokenizer_config `config`) has ChatGLM3's roles."""
    decl = config.get("added_tokens_decoder") or {}
    if any(isinstance(t, dict) and t.get("content") in ROLES for t in decl.values()):
        return True
    code = os.path.join(path, REMOTE_CODE)
    if os.path.lexists(code):   # only searched, never run; a FIFO / device / huge file is refused
        return b"<|observation|>" in read_capped(code, CONFIG_CAP, REMOTE_CODE)
    return False


class ChatGLMTokenizer(Tokenizer):
    def __init__(self, path):
        super().__init__(path)
        if self.backend != "sentencepiece":
            raise ValueError(f"{path}: ChatGLMTokenizer needs THUDM's tokenizer.model "
                             "(sentencepiece); this directory has tokenizer.json")
        self.version = 3 if is_chatglm3(path, self.config) else 2
        n = self._sp.get_piece_size()
        for i, name in enumerate(SPECIALS + (ROLES if self.version == 3 else ())):
            declared = self.added.get(name)
            if declared is not None and declared != n + i:
                raise ValueError(f"{path}/tokenizer_config.json gives {name} id {declared}, but "
                                 f"ChatGLM places it after the {n} sentencepiece pieces at {n + i}")
            self.added[name] = n + i
            self.special_ids.add(n + i)
        self.add_bos_token = self.add_eos_token = False
        self.prefix_ids = [self.added[t] for t in PREFIX]
        # strings matched in text: bare "sop"/"eop" are ordinary letters ("people" holds "eop"),
        # so they are matched only as the prefix "[gMASK]sop" that THUDM's templates write
        self._split_ids = {t: [i] for t, i in self.added.items() if t not in ("sop", "eop")}
        self._split_ids["".join(PREFIX)] = list(self.prefix_ids)
        self._split_re = re.compile(
            "(" + "|".join(map(re.escape, sorted(self._split_ids, key=len, reverse=True))) + ")")

    def encode(self, text, add_special_tokens=True):
        """Text -> ids; with add_special_tokens, [gMASK] sop in front (THUDM's prefix)."""
        ids = self._sp_encode(text)
        return self.prefix_ids + ids if add_special_tokens else ids

    def _sp_encode(self, text):
        ids = []
        for piece in self._split_re.split(text):
            if piece:
                ids += self._split_ids[piece] if piece in self._split_ids else self._sp.encode(piece)
        return ids

    def save_pretrained(self, out_dir):
        """Copy the tokenizer files and THUDM's tokenizer code (for trust_remote_code loaders)."""
        super().save_pretrained(out_dir)
        src = os.path.join(self.path, REMOTE_CODE)
        dst = os.path.join(out_dir, REMOTE_CODE)
        if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(src, dst)

    def __repr__(self):
        return f"ChatGLMTokenizer({self.path!r}, ChatGLM{self.version}, vocab={len(self)})"


def tokenizer_config(chatglm3=False, n_pieces=None):
    """tokenizer_config.json for a ChatGLM tokenizer; ChatGLM3 declares its special ids."""
    conf = {"tokenizer_class": "ChatGLMTokenizer", "remove_space": False, "do_lower_case": False,
            "padding_side": "left", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>",
            "clean_up_tokenization_spaces": False}
    if chatglm3:
        conf["added_tokens_decoder"] = {
            str(n_pieces + i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                "normalized": False, "single_word": False}
            for i, t in enumerate(SPECIALS + ROLES)}
    return conf


def train_chatglm_tokenizer(out_dir, texts, vocab_size=600, chatglm3=False):
    """A tiny ChatGLM-style tokenizer: sentencepiece BPE (<unk>=0, <s>=1, </s>=2, byte fallback)
    trained on `texts`, with ChatGLM's specials after it. Deterministic (one thread)."""
    import sentencepiece as spm

    from .tiny import train_sentencepiece

    train_sentencepiece(out_dir, texts, vocab_size=vocab_size)
    n = spm.SentencePieceProcessor(model_file=os.path.join(out_dir, "tokenizer.model")).get_piece_size()
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(chatglm3, n), f, indent=2, ensure_ascii=False)
    return out_dir


def sample_texts():
    """Training text of the shipped tiny tokenizer: the sample SFT set in ChatGLM2's prompt."""
    from ..data.builtin import generate

    train, dev = generate()
    return [f"[Round 1]\n\n问：{r['src']}\n\n答：{r['tgt']}\n\n" for r in train + dev]


if __name__ == "__main__":  # regenerate the shipped tiny tokenizer
    from .tiny import ASSETS

    train_chatglm_tokenizer(os.path.join(ASSETS, "tiny-chatglm-tokenizer"), sample_texts())
