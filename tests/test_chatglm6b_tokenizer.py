"""ChatGLM-6B (v1) tokenizer, data layout, argument files, export and generation.

No independent implementation runs here (THUDM's tokenization_chatglm.py needs transformers'
remote code and the real ice_text.model; transformers has no ChatGLM-6B), so every oracle is
hand-worked from the shipped tiny ice_text.model (paddletune/assets/tiny-chatglm6b-tokenizer,
num_image_tokens 64) and THUDM's published layout:
    sentencepiece ids: <unk> 0, <s> 1, </s> 2, <pad> 3, <n> 4, trained pieces up to 699, then
    [MASK] 700, [gMASK] 701, [sMASK] 702, <unused_0> 703, <sop> 704, <eop> 705, <ENC> 706,
    <dBLOCK> 707, <|tab|> 708, <|blank_2|> .. <|blank_80|> 709 .. 787, <0x00> .. <0xFF> 788 .. 1043
    token id = sentencepiece id + 64, so [MASK] 764, [gMASK] 765, <sop> 768, <eop> 769, <pad> 67,
    <n> 68, <|tab|> 772, <|blank_N|> 771 + N, <0xBB> 852 + 0xBB; vocabulary 1108.
The trained pieces (e.g. "▁a") are looked up by name: their numbers are the trainer's choice.
"""
import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from conftest import ROOT, run_script, token_accuracy, training_args
from paddletune.models.tiny import ASSETS

TOK_DIR = os.path.join(ASSETS, "tiny-chatglm6b-tokenizer")
N_IMG = 64
MASK, GMASK, SOP, EOP, PAD, NL, TAB = 764, 765, 768, 769, 67, 68, 772


def blank(n):
    return 771 + n


@pytest.fixture(scope="module")
def tok():
    from paddletune.loading import load_tokenizer

    return load_tokenizer(TOK_DIR)


def piece(t, name):
    i = t._sp.piece_to_id(name)
    assert t._sp.id_to_piece(i) == name, name   # a trained piece of the tiny model
    return i + N_IMG


def test_layout_of_ids(tok):
    assert type(tok).__name__ == "ChatGLM6BTokenizer" and len(tok) == 1108
    assert [tok.token_to_id(t) for t in ("[MASK]", "[gMASK]", "[sMASK]", "<unused_0>", "<sop>",
                                          "<eop>", "<ENC>", "<dBLOCK>")] == list(range(764, 772))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (SOP, EOP, PAD, 64)
    assert tok.token_to_id("<n>") == NL and tok.token_to_id("<|tab|>") == TAB
    assert tok.token_to_id("<|blank_2|>") == 773 and tok.token_to_id("<|blank_80|>") == 851
    assert tok.token_to_id("<0x00>") == 852 and tok.token_to_id("<0xFF>") == 1107
    assert tok.id_to_token(5) == "<image_5>" and tok.token_to_id("<image_5>") == 5
    assert tok.config_token_ids() == {"bos_token_id": SOP, "eos_token_id": EOP, "mask_token_id": MASK,
                                      "gmask_token_id": GMASK, "pad_token_id": PAD}


def test_hand_worked_encode_decode(tok):
    a, b, x, y = (piece(tok, p) for p in ("▁a", "b", "▁x", "y"))
    # "\n" -> <n>, "\t" -> <|tab|>, a run of 4 spaces -> <|blank_4|>, one dummy "▁" in front
    assert tok.encode("a\nb", add_special_tokens=False) == [a, NL, b]
    assert tok.encode("x\ty", add_special_tokens=False) == [x, TAB, y]
    assert tok.encode("a    b", add_special_tokens=False) == [a, blank(4), b]
    assert tok.encode("a  \t\nb", add_special_tokens=False) == [a, blank(2), TAB, NL, b]
    # 81 spaces: the longest run first (80), the single space left is the next piece's "▁"
    ids = tok.encode("a" + " " * 81 + "b", add_special_tokens=False)
    assert ids[:2] == [a, blank(80)] and tok.id_to_token(ids[2]).startswith("▁")
    # the specials go AFTER the text: THUDM's build_inputs_with_special_tokens(a) = a + [gMASK, sop]
    assert tok.encode("a\nb") == [a, NL, b, GMASK, SOP]
    assert tok.special_tokens_around() == ([], [GMASK, SOP])
    # special-token strings in text are their ids; the text after one gets its own dummy prefix
    h, i = piece(tok, "▁h"), piece(tok, "i")
    assert tok.encode("[gMASK]<sop>hi<eop>", add_special_tokens=False) == [GMASK, SOP, h, i, EOP]
    # a character outside the trained pieces falls back to its UTF-8 bytes (<0xE4> ...)
    assert tok.encode("你", add_special_tokens=False)[-3:] == [852 + 0xE4, 852 + 0xBD, 852 + 0xA0]
    for text in ("a\nb", "x\ty", "a    b\n\tc", "def f(x):\n    return x", "问：你好"):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.decode([a, NL, b, GMASK, SOP, x, EOP]) == "a\nb[gMASK]<sop>x<eop>"
    # without the specials one sentencepiece run: "▁x" inside it is " x"
    assert tok.decode([a, NL, b, GMASK, SOP, x, EOP, PAD], skip_special_tokens=True) == "a\nb x"
    assert tok.decode([3, a, 7]) == "a"    # image ids (< num_image_tokens) are dropped, as THUDM's


def test_shipped_model_regenerates(tmp_path):
    from paddletune.models.chatglm6b_tokenizer import sample_texts, train_ice_text

    train_ice_text(str(tmp_path), sample_texts())
    for f in ("ice_text.model", "tokenizer_config.json"):
        assert open(tmp_path / f, "rb").read() == open(os.path.join(TOK_DIR, f), "rb").read(), f


def test_selection_and_config_check(tmp_path, tok):
    from paddletune.loading import load_tokenizer

    # the same tokenizer_class: ChatGLM2's directory (tokenizer.model) keeps its own class
    assert type(load_tokenizer(os.path.join(ASSETS, "tiny-chatglm-tokenizer"))).__name__ == "ChatGLMTokenizer"
    d = tmp_path / "t"
    shutil.copytree(TOK_DIR, d)
    conf = {"model_type": "chatglm", "position_encoding_2d": True, "bos_token_id": 150004,
            "eos_token_id": EOP, "mask_token_id": MASK, "gmask_token_id": GMASK}
    json.dump(conf, open(d / "config.json", "w"))
    with pytest.raises(ValueError, match="num_image_tokens"):
        load_tokenizer(str(d))
    tok.save_pretrained(str(tmp_path / "saved"))
    assert sorted(os.listdir(tmp_path / "saved")) == ["ice_text.model", "tokenizer_config.json"]
    assert load_tokenizer(str(tmp_path / "saved")).encode("a\tb") == tok.encode("a\tb")


def data_args(**kw):
    base = dict(src_length=16, max_length=32, autoregressive=False, chat_template=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_sft_row_layout_by_hand(tok):
    from paddletune.data.sft import ExampleBuilder

    a, b, x, y = (piece(tok, p) for p in ("▁a", "b", "▁x", "y"))
    # no template: prompt, [gMASK], <sop>, answer, <eop>; labels on the answer and <eop>
    ex = ExampleBuilder(tok, data_args(chat_template="none"))({"src": "a\nb", "tgt": "x\ty"}, "row")
    assert ex["input_ids"].tolist() == [a, NL, b, GMASK, SOP, x, TAB, y, EOP]
    assert ex["labels"].tolist() == [-100] * 5 + [x, TAB, y, EOP]
    # the prompt is cut from the left to src_length (the specials kept), the answer from the
    # right to max_length (then without <eop>)
    ex = ExampleBuilder(tok, data_args(src_length=4, max_length=7, chat_template="none"))(
        {"src": "a\nb", "tgt": "x\ty"}, "row")
    assert ex["input_ids"].tolist() == [NL, b, GMASK, SOP, x, TAB, y]
    assert ex["labels"].tolist() == [-100] * 4 + [x, TAB, y]
    # two rounds without a template: one answer per row, the first round joins the prompt
    ex = ExampleBuilder(tok, data_args(chat_template="none"))({"src": ["a", "b"], "tgt": ["x", "y"]}, "row")
    sp_, b_ = piece(tok, "▁"), piece(tok, "▁b")   # "y" alone: "▁" then "y" (no "▁y" piece)
    assert ex["input_ids"].tolist() == [a, x, b_, GMASK, SOP, sp_, y, EOP]
    assert ex["labels"].tolist() == [-100] * 5 + [sp_, y, EOP]
    # the built-in "plain" template gives the same ids as no template
    ex2 = ExampleBuilder(tok, data_args(chat_template="plain"))({"src": "a\nb", "tgt": "x\ty"}, "row")
    assert ex2["input_ids"].tolist() == [a, NL, b, GMASK, SOP, x, TAB, y, EOP]
    # the "chatglm" template: "[Round 0]\n问：a\n答：" then [gMASK] <sop> then the answer
    ex = ExampleBuilder(tok, data_args(chat_template="chatglm", max_length=64))(
        {"src": "a", "tgt": "x"}, "row")
    prompt = tok.encode("[Round 0]\n问：a\n答：", add_special_tokens=False)
    assert tok.decode(prompt) == "[Round 0]\n问：a\n答："
    assert ex["input_ids"].tolist() == prompt + [GMASK, SOP, x, EOP]
    assert ex["labels"].tolist() == [-100] * (len(prompt) + 2) + [x, EOP]
    # two rounds: one answer per row (the model has one <sop>); the first round is prompt
    ex = ExampleBuilder(tok, data_args(chat_template="chatglm", max_length=64))(
        {"src": ["a", "b"], "tgt": ["x", "y"]}, "row")
    ids = ex["input_ids"].tolist()
    assert ids.count(GMASK) == 1 and ids.count(SOP) == 1 and ids[-1] == EOP
    assert [i for i, l in zip(ids, ex["labels"].tolist()) if l != -100] == ids[ids.index(SOP) + 1:]
    # ... and its ids are those of the whole prompt text encoded at once (THUDM's chat builds
    # one prompt string): the pieces after the first continue without a dummy "▁"
    history = "[Round 0]\n问：a\n答：x\n[Round 1]\n问：b\n答："
    assert ids[:ids.index(SOP) + 1] == tok.encode(history)
    # inference prompt = the training prompt
    tok2 = type(tok)(TOK_DIR)
    tok2.set_chat_template("chatglm")
    assert tok2.apply_chat_template("a", add_generation_prompt=True) == prompt + [GMASK, SOP]
    conv = [["a", "x"], ["b"]]   # a generation prompt after one round: the specials at the end
    assert tok2.apply_chat_template(conv, add_generation_prompt=True) == tok.encode(history)


@pytest.fixture(scope="module")
def tiny_dir():
    from paddletune.models import resolve_model_path

    return resolve_model_path("paddletune/tiny-chatglm6b")


def test_builtin_export_round_trip(tmp_path, tiny_dir):
    from paddletune.models import save_pretrained
    from paddletune.loading import load_model
    from paddletune.loading import load_tokenizer

    conf = json.load(open(os.path.join(tiny_dir, "config.json")))
    assert conf["model_type"] == "chatglm" and conf["position_encoding_2d"] is True
    assert (conf["bos_token_id"], conf["eos_token_id"], conf["mask_token_id"], conf["gmask_token_id"],
            conf["pad_token_id"], conf["vocab_size"]) == (SOP, EOP, MASK, GMASK, PAD, 1108)
    model = load_model(tiny_dir)
    tok = load_tokenizer(tiny_dir)   # its config.json agrees with the tokenizer's ids (checked at load)
    save_pretrained(model, str(tmp_path / "out"), tokenizer=tok)
    back = load_model(str(tmp_path / "out"))
    assert type(back).__name__ == "ChatGLMForConditionalGeneration"
    ids = paddle.to_tensor([tok.encode("a\nb") + tok.encode("x", add_special_tokens=False)])
    model.eval()
    back.eval()
    np.testing.assert_array_equal(back(ids).logits.numpy(), model(ids).logits.numpy())
    assert type(load_tokenizer(str(tmp_path / "out"))).__name__ == "ChatGLM6BTokenizer"


def test_generation_cache_equals_full_forward_argmax(tiny_dir):
    from paddletune.generation import generate
    from paddletune.loading import load_model

    model = load_model(tiny_dir)
    model.eval()
    from paddletune.loading import load_tokenizer

    tok = load_tokenizer(tiny_dir)
    prompts = [tok.encode("a\nb"), tok.encode("hello there, friend\tx")]   # lengths differ: left pads
    out = generate(model, prompts, max_new_tokens=6, eos_token_id=[-1])
    for p, seq in zip(prompts, out.sequences):   # reference: argmax of the full forward, no cache
        ids = list(p)
        for _ in range(6):
            with paddle.no_grad():
                logits = model(paddle.to_tensor([ids])).logits.numpy()[0, -1]
            ids.append(int(logits.argmax()))
        assert seq == ids[len(p):]
    assert out.sequences == generate(model, prompts, max_new_tokens=6, eos_token_id=[-1],
                                     use_cache=False).sequences


def copy_rows(n=16, seed=0):
    rng = np.random.default_rng(seed)
    words = "a b c d e f g h k m n p r s t x y".split()
    rows = []
    for _ in range(n):
        text = " ".join(rng.choice(words, size=5))
        rows.append({"src": text, "tgt": text})
    return rows


def test_lora_learns_copy_pairs_and_adapter_loads_back(tmp_path):
    from paddletune import peft
    from paddletune.args import ModelArgument
    from paddletune.data.sft import ExampleBuilder
    from paddletune.generation import generate
    from paddletune.loading import load_for_generation
    from paddletune.loading import load_model
    from paddletune.loading import load_tokenizer
    from paddletune.trainer import Trainer

    from paddletune.models.tiny import make_tiny_checkpoint

    # the spec's tiny size with the shipped tokenizer; weights N(0, 0.1) as in test_chatglm6b (from
    # N(0, 0.02) a LoRA on a random base does not leave the unigram plateau in a test's steps)
    base = make_tiny_checkpoint(str(tmp_path / "base"), "chatglm6b", seed=0, tokenizer_dir=TOK_DIR,
                                initializer_range=0.1)
    tok = load_tokenizer(base)
    build = ExampleBuilder(tok, data_args(chat_template="none"))
    data = [dict(build(r, f"row {i}"), id=i) for i, r in enumerate(copy_rows())]
    model = load_model(base)
    assert token_accuracy(model, data) < 0.2
    setup = peft.apply(model, ModelArgument(model_name_or_path=base, lora=True, lora_rank=8))
    Trainer(model, training_args(tmp_path, max_steps=120), train_dataset=data,
            trainable=setup.trainable, export_fn=setup.export_fn).train()
    assert token_accuracy(model, data) == 1.0
    setup.export_fn(str(tmp_path / "adapter"))
    back, _, _ = load_for_generation(base, lora_path=str(tmp_path / "adapter"))
    model.eval()
    x = paddle.to_tensor([data[0]["input_ids"].tolist()])
    with paddle.no_grad():
        np.testing.assert_allclose(back(x).logits.numpy(), model(x).logits.numpy(), atol=1e-4)
    # greedy generation from prompt + [gMASK] <sop> reproduces the copy and stops at <eop>
    ids = data[0]["input_ids"].tolist()
    prompt = ids[:ids.index(SOP) + 1]
    out = generate(back, [prompt], max_new_tokens=12, tokenizer=tok)
    assert out.sequences[0] == ids[len(prompt):] and out.finish_reasons == ["eos"]


@pytest.mark.parametrize("name", ["sft", "lora", "pt"])
def test_argument_files_run_two_steps(tmp_path, name):
    conf = json.load(open(os.path.join(ROOT, "llm", "chatglm", f"{name}_argument.json")))
    assert conf["model_name_or_path"] == "paddletune/tiny-chatglm6b" and conf["chat_template"] == "chatglm"
    out = str(tmp_path / name)
    res = run_script(["llm/finetune_generation.py", f"llm/chatglm/{name}_argument.json",
                      "--output_dir", out, "--max_steps", "2", "--logging_steps", "1",
                      "--evaluation_strategy", "no", "--save_strategy", "no", "--do_eval", "false",
                      "--load_best_model_at_end", "false", "--disable_tqdm", "true"])
    assert res.returncode == 0, res.stderr[-3000:]
    logs = [json.loads(l) for l in open(os.path.join(out, "train_log.jsonl"))]
    losses = [r["loss"] for r in logs if "loss" in r]
    assert len(losses) == 2 and np.isfinite(losses).all()
    assert os.path.exists(os.path.join(out, "ice_text.model"))
    if name == "sft":   # the full model: loads back, the chat template travels with it
        from paddletune.loading import load_model
        from paddletune.loading import load_tokenizer

        assert type(load_model(out)).__name__ == "ChatGLMForConditionalGeneration"
        assert load_tokenizer(out).apply_chat_template("hi", add_generation_prompt=True, tokenize=False) \
            == "[Round 0]\n问：hi\n答："
    else:
        adapter = json.load(open(os.path.join(out, "adapter_config.json")))
        assert adapter["peft_type"] == ("LORA" if name == "lora" else "PREFIX_TUNING")
    if name == "lora":   # the predictor chats with the adapter on the built-in base
        import subprocess
        import sys

        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        res = subprocess.run([sys.executable, "llm/predictor.py", "--model_name_or_path",
                              "paddletune/tiny-chatglm6b", "--lora_path", out, "--chat",
                              "--max_length", "4"], input="hi\nhow are you\n/exit\n", cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        assert len([l for l in res.stdout.splitlines() if l.strip()]) >= 2
