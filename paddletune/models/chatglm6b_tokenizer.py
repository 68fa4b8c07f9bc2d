"""ChatGLM-6B (v1) tokenizer: THUDM's `ice_text.model` (sentencepiece) read without icetk or
transformers. Written here from the published facts of THUDM's tokenization_chatglm.py and
PaddleNLP's chatglm tokenizer (no code taken from either):

- ids: id = sentencepiece id + `num_image_tokens` (tokenizer_config.json; ids below it are image
  tokens "<image_N>", dropped on decode). The class default is 20000, as in THUDM's and
  PaddleNLP's classes. Which value THUDM's final chatglm-6b release states cannot be checked here:
  its config.json says [MASK]=130000, [gMASK]=130001, <sop>=130004 (bos), <eop>=130005 (eos),
  <pad>=3, vocab_size 130528, which fits `num_image_tokens` 0 with [MASK] at sentencepiece id
  130000 (the earlier release, vocab 150528, used 20000). So the ids are checked at load against a
  config.json found beside the tokenizer, and a mismatch names `num_image_tokens`.
- ice_text.model layout (sentencepiece ids): <unk>=0, <s>=1, </s>=2, <pad>=3, <n>=4, text pieces,
  then [MASK], [gMASK], [sMASK], <unused_0>, <sop>, <eop>, <ENC>, <dBLOCK> consecutively, then
  <|tab|>, <|blank_2|> .. <|blank_80|>, then the 256 byte pieces <0x00> .. <0xFF>.
- text preprocessing before sentencepiece: "\\n" -> "<n>", "\\t" -> "<|tab|>", runs of N = 80..2
  spaces -> "<|blank_N|>" (longest first); decoding reverses it.
- encode(text, add_special_tokens=True) = ids(text) + [[gMASK], <sop>]: THUDM's
  build_inputs_with_special_tokens(a) = a + [gMASK, sop]; with an answer b: + b + [<eop>].
  The specials go AFTER the prompt (`specials_after_prompt`): data/sft.py and
  data/chat_template.py put [gMASK] <sop> between prompt and answer for this tokenizer.
- bos <sop>, eos <eop> (the end of an answer, generation stops there), pad <pad>, unk <unk>;
  "</s>" is THUDM's `end_token`. Padding is on the left (padding_side "left").
Special-token strings typed inside a text ([gMASK], <sop>, <eop>, ...) map to their ids; the text
between them is encoded piece by piece, each with sentencepiece's dummy "▁" prefix (as HF's slow
tokenizer splits around special tokens). No THUDM/PaddleNLP tokenizer runs here: the tests check
hand-worked strings against the shipped tiny model's pieces.
Selected by tokenizer_config.json `"tokenizer_class": "ChatGLMTokenizer"` (shared with ChatGLM2)
when the directory holds `ice_text.model` or its config.json is ChatGLM-6B's (models/spec.py).
"""
import json
import os
import re
import shutil

from ..io import TOKENIZER_CAP, read_capped, read_json
from ..tokenizer import Tokenizer

VOCAB_FILE = "ice_text.model"
NUM_IMAGE_TOKENS = 20000
SPECIALS = ("[MASK]", "[gMASK]", "[sMASK]", "<unused_0>", "<sop>", "<eop>", "<ENC>", "<dBLOCK>")
MAX_BLANK = 80
TAB = "<|tab|>"


def blank(n):
    return f"<|blank_{n}|>"


def preprocess(text, max_blank=MAX_BLANK):
    """THUDM's text preprocessing: newlines, tabs and runs of spaces as their own pieces."""
    text = text.replace("\n", "<n>").replace("\t", TAB)
    for n in range(max_blank, 1, -1):
        text = text.replace(" " * n, blank(n))
    return text


def postprocess(text, max_blank=MAX_BLANK):
    text = text.replace("<n>", "\n").replace(TAB, "\t")
    for n in range(2, max_blank + 1):
        text = text.replace(blank(n), " " * n)
    return text


class ChatGLM6BTokenizer(Tokenizer):
    vocab_file = VOCAB_FILE
    specials_after_prompt = True

    def __init__(self, path):   # noqa: D401 (own backend: the base needs tokenizer.json/.model)
        import sentencepiece as spm

        self.path = path
        self.config = self._read_optional("tokenizer_config.json")
        model = os.path.join(path, VOCAB_FILE)
        if not os.path.lexists(model):
            raise FileNotFoundError(f"no {VOCAB_FILE} in {path}: ChatGLM-6B's tokenizer reads THUDM's "
                                    f"{VOCAB_FILE}; copy it from the checkpoint")
        proto = read_capped(model, TOKENIZER_CAP, "ChatGLM-6B sentencepiece vocabulary")   # FIFO, /dev/zero, huge: refused
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=proto)
        except Exception as e:   # sentencepiece raises RuntimeError/OSError on a bad model
            raise ValueError(f"{model} cannot be read as a sentencepiece model ({str(e)[:200]}): "
                             "the file is damaged; copy it again from the checkpoint") from None
        self.backend = "sentencepiece"
        self.offset = int(self.config.get("num_image_tokens", NUM_IMAGE_TOKENS))
        self.max_blank = int(self.config.get("max_blank_length", MAX_BLANK))
        self.do_lower_case = bool(self.config.get("do_lower_case", False))
        self.remove_space = bool(self.config.get("remove_space", False))
        self.added, self.special_ids = {}, set()
        for name in SPECIALS + ("<unk>", "<pad>", "<s>", "</s>"):
            sid = self._sp.piece_to_id(name)
            if sid == self._sp.unk_id() and name != "<unk>":
                if name in ("[MASK]", "[gMASK]", "<sop>", "<eop>"):
                    raise ValueError(f"{model} has no piece {name}: not ChatGLM-6B's ice_text.model")
                continue
            self.added[name] = sid + self.offset
            self.special_ids.add(sid + self.offset)
        self._split_re = re.compile(
            "(" + "|".join(map(re.escape, sorted(self.added, key=len, reverse=True))) + ")")
        tok = lambda k, d: (self.config.get(k) if isinstance(self.config.get(k), str) else None) or d  # noqa: E731
        self.bos_token, self.eos_token = tok("bos_token", "<sop>"), tok("eos_token", "<eop>")
        self.unk_token, self.pad_token = tok("unk_token", "<unk>"), tok("pad_token", "<pad>")
        self.mask_token, self.gmask_token = tok("mask_token", "[MASK]"), tok("gmask_token", "[gMASK]")
        self.legacy, self.pad_added, self.explicit_specials = False, False, True
        self.add_bos_token = self.add_eos_token = False
        self.suffix_ids = [self.added[self.gmask_token], self.added[self.bos_token]]
        self.chat_template = self._load_chat_template()
        self._template = None
        self._template_set = self._template_explicit = False
        self._check_model_config()

    def _check_model_config(self):
        """A config.json beside the tokenizer must give the specials the ids computed here."""
        p = os.path.join(self.path, "config.json")
        if not os.path.exists(p):
            return
        conf = read_json(p)
        for key, name in (("bos_token_id", self.bos_token), ("eos_token_id", self.eos_token),
                          ("mask_token_id", self.mask_token), ("gmask_token_id", self.gmask_token)):
            want = conf.get(key)
            if isinstance(want, int) and want != self.added[name]:
                raise ValueError(
                    f"{p}: {key}={want} but {VOCAB_FILE} with num_image_tokens={self.offset} "
                    f"(tokenizer_config.json) gives {name} id {self.added[name]}; set "
                    f"\"num_image_tokens\": {want - self.added[name] + self.offset} in "
                    "tokenizer_config.json")

    # ------------------------------------------------------------------ ids
    def config_token_ids(self):
        """config.json keys whose ids this tokenizer fixes (a tiny checkpoint is made with them)."""
        return {"bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "mask_token_id": self.added[self.mask_token],
                "gmask_token_id": self.added[self.gmask_token], "pad_token_id": self.pad_token_id}

    def token_to_id(self, token):
        if token is None:
            return None
        if token in self.added:
            return self.added[token]
        m = re.fullmatch(r"<image_(\d+)>", token)
        if m and int(m.group(1)) < self.offset:
            return int(m.group(1))
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() else i + self.offset

    def id_to_token(self, i):
        i = int(i)
        if i < self.offset:
            return f"<image_{i}>"
        return self._sp.id_to_piece(i - self.offset)

    def __len__(self):
        return self.offset + self._sp.get_piece_size()

    vocab_size = property(__len__)

    # ------------------------------------------------------------------ encode / decode
    def _text_ids(self, text):
        if self.remove_space:
            text = " ".join(text.strip().split())
        if self.do_lower_case:
            text = text.lower()
        return [i + self.offset for i in self._sp.encode(preprocess(text, self.max_blank))]

    def encode(self, text, add_special_tokens=True):
        """Text -> ids; with add_special_tokens, [gMASK] <sop> after the text (THUDM's layout)."""
        ids = []
        for piece in self._split_re.split(text):
            if piece:
                ids += [self.added[piece]] if piece in self.added else self._text_ids(piece)
        return ids + self.suffix_ids if add_special_tokens else ids

    def encode_continuation(self, text):
        """Ids of `text` continuing an earlier text: without sentencepiece's dummy "▁" in front
        (THUDM's add_dummy_prefix=False: encode "<n>" + text, drop the "▁" and "<n>" pieces)."""
        return self.encode("<n>" + text, add_special_tokens=False)[2:] if text else []

    def decode(self, ids, skip_special_tokens=False):
        ids = [int(i) for i in ids if int(i) >= self.offset]   # image tokens: dropped (THUDM)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        inv = {v: k for k, v in self.added.items()}
        out, run = [], []
        for i in ids + [None]:
            if i is None or i in inv:
                if run:
                    out.append(postprocess(self._sp.decode(run), self.max_blank))
                    run = []
                if i is not None:
                    out.append(inv[i])
            else:
                run.append(i - self.offset)
        return "".join(out)

    def save_pretrained(self, out_dir):
        """Copy ice_text.model and the tokenizer settings (base: tokenizer_config.json, template)."""
        super().save_pretrained(out_dir)
        src, dst = os.path.join(self.path, VOCAB_FILE), os.path.join(out_dir, VOCAB_FILE)
        if os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(src, dst)

    def __repr__(self):
        return (f"ChatGLM6BTokenizer({self.path!r}, vocab={len(self)}, "
                f"num_image_tokens={self.offset})")


# ----------------------------------------------------------------------------- tiny model
def tokenizer_config(num_image_tokens):
    return {"tokenizer_class": "ChatGLMTokenizer", "num_image_tokens": num_image_tokens,
            "bos_token": "<sop>", "eos_token": "<eop>", "end_token": "</s>", "mask_token": "[MASK]",
            "gmask_token": "[gMASK]", "pad_token": "<pad>", "unk_token": "<unk>",
            "padding_side": "left", "remove_space": False, "do_lower_case": False}


def train_ice_text(out_dir, texts, vocab_size=700, num_image_tokens=64):
    """A tiny ice_text.model in THUDM's layout (module docstring): sentencepiece BPE trained on
    `texts` (after THUDM's preprocessing) with <unk> <s> </s> <pad> <n> at 0..4, then the eight
    specials, <|tab|>, <|blank_2..80|> and the byte pieces appended to the model. Deterministic."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    os.makedirs(out_dir, exist_ok=True)
    corpus = os.path.join(out_dir, ".corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:   # one line per text, newlines as <n>; tabs and
        f.write("\n".join(re.sub(r"[ \t]+", " ", t).replace("\n", "<n>") for t in texts))  # blanks: own pieces
    prefix = os.path.join(out_dir, ".ice")
    spm.SentencePieceTrainer.train(
        input=corpus, model_prefix=prefix, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=3, user_defined_symbols=["<n>"],
        add_dummy_prefix=True, num_threads=1, minloglevel=2, remove_extra_whitespaces=False,
        normalization_rule_name="identity", byte_fallback=False)
    proto = pb.ModelProto()
    with open(prefix + ".model", "rb") as f:
        proto.ParseFromString(f.read())
    P = pb.ModelProto.SentencePiece
    for t in SPECIALS:
        proto.pieces.append(P(piece=t, score=0.0, type=P.CONTROL))
    for t in [TAB] + [blank(n) for n in range(2, MAX_BLANK + 1)]:
        proto.pieces.append(P(piece=t, score=0.0, type=P.USER_DEFINED))
    for b in range(256):
        proto.pieces.append(P(piece=f"<0x{b:02X}>", score=0.0, type=P.BYTE))
    proto.trainer_spec.byte_fallback = True
    del proto.trainer_spec.input[:]            # the temporary paths: the file is path-independent
    proto.trainer_spec.model_prefix = ""
    with open(os.path.join(out_dir, VOCAB_FILE), "wb") as f:
        f.write(proto.SerializeToString())
    for p in (corpus, prefix + ".model", prefix + ".vocab"):
        os.unlink(p)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(num_image_tokens), f, indent=2, ensure_ascii=False)
    return out_dir


def sample_texts():
    """Training text of the shipped tiny tokenizer: the sample SFT set in ChatGLM-6B's prompt,
    plus code-like lines with tabs and indentation."""
    from ..data.builtin import generate

    train, dev = generate()
    rows = [f"[Round 0]\n问：{r['src']}\n答：{r['tgt']}" for r in train + dev]
    return rows + ["def f(x):\n    return x\n\tif x:\n\t\tpass"] * 20


if __name__ == "__main__":  # regenerate the shipped tiny tokenizer
    from .tiny import ASSETS

    train_ice_text(os.path.join(ASSETS, "tiny-chatglm6b-tokenizer"), sample_texts())
