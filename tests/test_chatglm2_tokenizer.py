"""ChatGLM tokenizer on a hand-made sentencepiece model whose every piece id is written below, so
each expected id sequence is worked out by hand from the table (no trained vocabulary involved).

Unigram model, dummy "▁" prefix on, identity normaliser. Whole-word pieces score -1 and single
characters -10, so Viterbi takes the whole words ("你好" = 10, not "你" "好" = 22, 23).
"""
import json
import os

import pytest

from paddletune.models.chatglm_tokenizer import ROLES, SPECIALS, tokenizer_config
from paddletune.loading import load_tokenizer

PIECES = [  # (piece, type) with type 1 normal, 2 unknown, 3 control
    ("<unk>", 2), ("<s>", 3), ("</s>", 3),                      # 0 1 2
    ("▁[Round", 1), ("▁1", 1), ("]", 1), ("\n\n", 1), ("\n", 1),  # 3 4 5 6 7
    ("问", 1), ("：", 1), ("你好", 1), ("答", 1), ("▁", 1),        # 8 9 10 11 12
    ("▁\n", 1), ("▁hi", 1), ("▁You", 1), ("▁are", 1), ("▁GLM", 1),  # 13 14 15 16 17
    ("▁hello", 1), (".", 1), ("▁people", 1), ("▁sop", 1),          # 18 19 20 21
    ("你", 1), ("好", 1),                                          # 22 23
]
N = len(PIECES)   # 24: [MASK]=24 [gMASK]=25 [sMASK]=26 sop=27 eop=28
GMASK, SOP, EOP = 25, 27, 28
SYSTEM, USER, ASSISTANT, OBSERVATION = 29, 30, 31, 32


def write_tokenizer(path, chatglm3=False, declare=True):
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    for piece, kind in PIECES:
        p = m.pieces.add()
        p.piece, p.type = piece, kind
        p.score = -10.0 if len(piece.lstrip("▁")) == 1 and kind == 1 else -1.0
    m.trainer_spec.model_type = pb.TrainerSpec.UNIGRAM
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id = 0, 1, 2
    m.trainer_spec.pad_id = -1
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = True
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "tokenizer.model"), "wb") as f:
        f.write(m.SerializeToString())
    conf = tokenizer_config(chatglm3 and declare, N)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(conf, f)
    return str(path)


@pytest.fixture
def glm2(tmp_path):
    return load_tokenizer(write_tokenizer(tmp_path / "glm2"))


@pytest.fixture
def glm3(tmp_path):
    return load_tokenizer(write_tokenizer(tmp_path / "glm3", chatglm3=True))


def test_special_ids_follow_the_sentencepiece_vocabulary(glm2, glm3):
    assert type(glm2).__name__ == "ChatGLMTokenizer" and glm2.version == 2
    assert [glm2.token_to_id(t) for t in SPECIALS] == [24, 25, 26, 27, 28]
    assert len(glm2) == 29 and glm2.token_to_id("<|user|>") is None
    assert glm3.version == 3 and len(glm3) == 33
    assert [glm3.token_to_id(t) for t in ROLES] == [SYSTEM, USER, ASSISTANT, OBSERVATION]
    assert (glm2.eos_token_id, glm2.pad_token_id, glm2.unk_token_id) == (2, 0, 0)
    assert glm2.special_tokens_around() == ([GMASK, SOP], [])


def test_chatglm2_prompt_hand_worked(glm2):
    # "▁[Round" "▁1" "]" "\n\n" "问" "：" "你好" "\n\n" "答" "："
    prompt = "[Round 1]\n\n问：你好\n\n答："
    assert glm2.encode(prompt) == [GMASK, SOP, 3, 4, 5, 6, 8, 9, 10, 6, 11, 9]
    assert glm2.encode(prompt, add_special_tokens=False) == [3, 4, 5, 6, 8, 9, 10, 6, 11, 9]
    assert glm2.decode(glm2.encode(prompt), skip_special_tokens=True) == prompt
    assert glm2.decode([GMASK, SOP, 14]) == "[gMASK]sophi"


def test_chatglm3_conversation_hand_worked(glm3):
    """THUDM's build_chat_input for history [system "You are GLM."], query "hi":
    [gMASK] sop <|system|> sp("\\n") sp("You are GLM.") <|user|> sp("\\n") sp("hi") <|assistant|>
    with sp("\\n") = "▁\\n" (13), sp("You are GLM.") = "▁You" "▁are" "▁GLM" "." (15 16 17 19),
    sp("hi") = "▁hi" (14). The same conversation rendered as text (THUDM's chat_template style:
    "<|role|>\\n content") encodes to the same ids."""
    expected = [GMASK, SOP, SYSTEM, 13, 15, 16, 17, 19, USER, 13, 14, ASSISTANT]
    sp = lambda s: glm3.encode(s, add_special_tokens=False)  # noqa: E731
    pieced = ([GMASK, SOP, SYSTEM] + sp("\n") + sp("You are GLM.") + [USER] + sp("\n") + sp("hi")
              + [ASSISTANT])
    assert pieced == expected
    text = "<|system|>\n You are GLM.<|user|>\n hi<|assistant|>"
    assert glm3.encode(text) == expected
    assert glm3.encode("[gMASK]sop" + text, add_special_tokens=False) == expected
    # a second round continues with the answer and the next role token
    more = text + "\n hello<|observation|>"
    assert glm3.encode(more)[len(expected):] == [13, 18, OBSERVATION]


def test_bare_sop_and_eop_are_ordinary_text(glm3):
    assert glm3.encode("people sop", add_special_tokens=False) == [20, 21]
    assert EOP not in glm3.encode("people") and SOP not in glm3.encode("people sop")[2:]


def test_chatglm3_recognised_from_remote_code(tmp_path):
    """Older ChatGLM3 revisions declare nothing in tokenizer_config.json; their
    tokenization_chatglm.py lists the role tokens."""
    path = write_tokenizer(tmp_path / "old3", chatglm3=True, declare=False)
    assert load_tokenizer(path).version == 2
    with open(os.path.join(path, "tokenization_chatglm.py"), "w") as f:
        f.write('role_special_tokens = ["<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]\n')
    tok = load_tokenizer(path)
    assert tok.version == 3 and tok.encode("<|user|>", add_special_tokens=False) == [USER]
    tok.save_pretrained(str(tmp_path / "saved"))
    assert load_tokenizer(str(tmp_path / "saved")).version == 3


def test_wrong_declared_id_is_refused(tmp_path):
    path = write_tokenizer(tmp_path / "bad", chatglm3=True)
    conf = json.load(open(os.path.join(path, "tokenizer_config.json")))
    conf["added_tokens_decoder"]["99"] = conf["added_tokens_decoder"].pop(str(USER))
    json.dump(conf, open(os.path.join(path, "tokenizer_config.json"), "w"))
    with pytest.raises(ValueError, match=r"<\|user\|> id 99.*at 30"):
        load_tokenizer(path)


def test_builtin_tiny_chatglm2_tokenizer_and_sample_sft():
    """The shipped tiny tokenizer: ChatGLM2 specials after its pieces; sample-sft rows become
    [gMASK] sop + source, then target + </s> with labels on the target only."""
    import numpy as np

    from paddletune.args import DataArgument
    from paddletune.data import build_datasets

    tok = load_tokenizer("paddletune/tiny-chatglm2")
    n = tok._sp.get_piece_size()
    assert tok.version == 2 and tok.prefix_ids == [n + 1, n + 3] and len(tok) == n + 5
    train, _ = build_datasets(DataArgument(dataset_name_or_path="paddletune/sample-sft",
                                           src_length=64, max_length=128), tok)
    ex = train[0]
    assert list(ex["input_ids"][:2]) == tok.prefix_ids and ex["input_ids"][-1] == tok.eos_token_id
    target = ex["labels"][ex["labels"] != -100]
    assert target[-1] == tok.eos_token_id and len(target) >= 2
    assert max(int(e["input_ids"].max()) for e in train.examples) < len(tok)
    assert (tok.unk_token_id not in np.concatenate([e["input_ids"] for e in train.examples]))


def test_shipped_tokenizer_regenerates(tmp_path):
    import sentencepiece as spm

    from paddletune.models.chatglm_tokenizer import sample_texts, train_chatglm_tokenizer
    from paddletune.models.tiny import ASSETS

    out = train_chatglm_tokenizer(str(tmp_path / "t"), sample_texts())
    shipped = os.path.join(ASSETS, "tiny-chatglm-tokenizer")
    a = spm.SentencePieceProcessor(model_file=os.path.join(out, "tokenizer.model"))
    b = spm.SentencePieceProcessor(model_file=os.path.join(shipped, "tokenizer.model"))
    assert [a.id_to_piece(i) for i in range(a.get_piece_size())] == \
        [b.id_to_piece(i) for i in range(b.get_piece_size())]
    assert json.load(open(os.path.join(out, "tokenizer_config.json"))) == \
        json.load(open(os.path.join(shipped, "tokenizer_config.json")))


def test_chatglm2_template_hand_worked(glm2):
    """The built-in chatglm2 template (data/chat_template.py) gives the hand-worked prompt ids;
    a training row labels the answer and the EOS (</s> = 2) only."""
    from paddletune.data.chat_template import load_template
    from paddletune.data.sft import tokenize_conversation

    msgs = [{"role": "user", "content": "你好"}]
    assert glm2.apply_chat_template(msgs, add_generation_prompt=True, chat_template="chatglm2") == \
        [GMASK, SOP, 3, 4, 5, 6, 8, 9, 10, 6, 11, 9]
    ids, labels = tokenize_conversation(glm2, load_template("chatglm2"),
                                        msgs + [{"role": "assistant", "content": "hi"}], 64, 128)
    assert ids == [GMASK, SOP, 3, 4, 5, 6, 8, 9, 10, 6, 11, 9, 14, 2]
    assert labels == [-100] * 12 + [14, 2]


def test_chatglm3_template_hand_worked(glm3):
    """The built-in chatglm3 template gives THUDM's build_chat_input ids (worked out above); in
    training the answer "\\n hello" (13 18) and EOS are labelled, the role tokens are not."""
    from paddletune.data.chat_template import load_template
    from paddletune.data.sft import tokenize_conversation

    msgs = [{"role": "system", "content": "You are GLM."}, {"role": "user", "content": "hi"}]
    assert glm3.apply_chat_template(msgs, add_generation_prompt=True, chat_template="chatglm3") == \
        [GMASK, SOP, SYSTEM, 13, 15, 16, 17, 19, USER, 13, 14, ASSISTANT]
    ids, labels = tokenize_conversation(glm3, load_template("chatglm3"),
                                        msgs + [{"role": "assistant", "content": "hello"}], 64, 128)
    assert ids == [GMASK, SOP, SYSTEM, 13, 15, 16, 17, 19, USER, 13, 14, ASSISTANT, 13, 18, 2]
    assert labels == [-100] * 12 + [13, 18, 2]
    # THUDM's own tokenizer_config template writes the prefix itself: not doubled
    thudm = ("{% for m in messages %}{% if loop.first %}[gMASK]sop<|{{ m['role'] }}|>\n {{ m['content'] }}"
             "{% else %}<|{{ m['role'] }}|>\n {{ m['content'] }}{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    assert glm3.apply_chat_template(msgs, add_generation_prompt=True, chat_template=thudm) == \
        [GMASK, SOP, SYSTEM, 13, 15, 16, 17, 19, USER, 13, 14, ASSISTANT]
