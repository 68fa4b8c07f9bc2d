"""Chat templates: rendering against transformers, label masks against transformers' assistant
masks ({% generation %} templates), budget rules, template sources, and a tiny multi-turn
fine-tune that must learn every assistant turn."""
import json
import os
import shutil

import numpy as np
import pytest

from conftest import TINY_TOKENIZER, token_accuracy, training_args
from paddletune.data.chat_template import BUILTIN_TEMPLATES, ChatTemplateError, load_template
from paddletune.data.sft import DataError, ExampleBuilder, build_datasets, tokenize_conversation
from paddletune.tokenizer import Tokenizer

CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>", "<|user|>", "<|assistant|>", "<|system|>"]
SYS = {"role": "system", "content": "You are terse."}
TURNS = [{"role": "user", "content": "Reverse the words: apple river"},
         {"role": "assistant", "content": "river apple"},
         {"role": "user", "content": "Add 3 and 4."},
         {"role": "assistant", "content": "7"},
         {"role": "user", "content": "Uppercase: stone cloud"},
         {"role": "assistant", "content": "STONE CLOUD"}]
CONVERSATIONS = {"1 turn": TURNS[:2], "1 turn + system": [SYS] + TURNS[:2], "3 turns": TURNS,
                 "3 turns + system": [SYS] + TURNS, "open question": [SYS] + TURNS[:3]}
# a chatml template whose assistant spans are marked for transformers' assistant masks
CHATML_GEN = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
              "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
              "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA2_GEN = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] {{ m['content'] }} [/INST]"
              "{% else %}{% generation %} {{ m['content'] }} {{ eos_token }}{% endgeneration %}{% endif %}{% endfor %}")
# multi-line template: trim_blocks / lstrip_blocks decide its whitespace
MULTILINE = """{% for message in messages %}
    {% if message['role'] == 'system' %}
[SYS] {{ message['content'] }}
    {% elif message['role'] == 'user' %}
[USER] {{ message['content'] }}
    {% else %}
[BOT] {{ message['content'] }}{{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[BOT]
{% endif %}"""


@pytest.fixture(scope="module")
def chat_tok_dir(tmp_path_factory):
    """The tiny BPE tokenizer plus chat special tokens (as Qwen/Llama-3 tokenizers have)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as T

    d = str(tmp_path_factory.mktemp("chat_tok"))
    t = T.from_file(os.path.join(TINY_TOKENIZER, "tokenizer.json"))
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in CHAT_SPECIALS])
    t.save(os.path.join(d, "tokenizer.json"))
    shutil.copy(os.path.join(TINY_TOKENIZER, "tokenizer_config.json"), d)
    return d


@pytest.fixture(scope="module")
def hf_tok(chat_tok_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(chat_tok_dir)


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES) + ["multiline", "chatml_gen", "llama2_gen"])
def test_rendering_matches_transformers(name, chat_tok_dir, hf_tok):
    source = {"multiline": MULTILINE, "chatml_gen": CHATML_GEN, "llama2_gen": LLAMA2_GEN}.get(
        name, BUILTIN_TEMPLATES.get(name))
    tok = Tokenizer(chat_tok_dir)
    tok.set_chat_template(source)
    for label, conv in CONVERSATIONS.items():
        if name in ("llama2_gen",) and conv[0]["role"] == "system":
            continue
        for gen in (False, True):
            ours = tok.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            theirs = hf_tok.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False,
                                                chat_template=source)
            assert ours == theirs, (label, gen)
            segs = tok.template.segments(conv, gen, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                         pad_token="<unk>")
            assert "".join(s.text for s in segs) == theirs
            assert sum(s.is_assistant for s in segs) == sum(m["role"] == "assistant" for m in conv)


def test_raise_exception_like_transformers(hf_tok, chat_tok_dir):
    tok = Tokenizer(chat_tok_dir)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="alternate"):
        hf_tok.apply_chat_template(bad, tokenize=False, chat_template=BUILTIN_TEMPLATES["llama2"])
    with pytest.raises(ChatTemplateError, match="alternate"):
        tok.apply_chat_template(bad, tokenize=False, chat_template="llama2")


@pytest.mark.parametrize("source", [CHATML_GEN, LLAMA2_GEN])
def test_label_mask_equals_transformers_assistant_mask(source, chat_tok_dir, hf_tok):
    """Token by token: our ids equal transformers' ids (after our BOS) and labels sit exactly on
    the tokens transformers marks as assistant-generated."""
    tok = Tokenizer(chat_tok_dir)
    tok.set_chat_template(source)
    for label, conv in CONVERSATIONS.items():
        if conv[-1]["role"] != "assistant" or (source is LLAMA2_GEN and conv[0]["role"] == "system"):
            continue
        ids, labels = tokenize_conversation(tok, tok.template, conv, 500, 1000)
        out = hf_tok.apply_chat_template(conv, tokenize=True, return_dict=True, chat_template=source,
                                         return_assistant_tokens_mask=True)
        hf_ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        offset = 0 if hf_ids[:1] == [tok.bos_token_id] else 1   # our BOS when the text has none
        assert ids[offset:] == hf_ids, label
        assert [l != -100 for l in labels[offset:]] == [bool(m) for m in mask], label
        assert [l for l in labels if l != -100] == [i for i, m in zip(hf_ids, mask) if m]


def test_end_of_turn_rules(chat_tok_dir):
    """chatml: '<|im_end|>' labelled, the newline after it not; chatglm2 (no end token in the
    template): EOS inserted after each answer, labelled, in training and inference alike."""
    tok = Tokenizer(chat_tok_dir)
    conv = [SYS] + TURNS[:4]
    tok.set_chat_template("chatml")
    ids, labels = tokenize_conversation(tok, tok.template, conv, 500, 1000)
    labelled = [i for i, l in zip(ids, labels) if l != -100]
    assert tok.decode(labelled) == "river apple<|im_end|>7<|im_end|>"
    tok.set_chat_template("chatglm2")
    ids, labels = tokenize_conversation(tok, tok.template, conv, 500, 1000)
    labelled = [i for i, l in zip(ids, labels) if l != -100]
    assert labelled.count(tok.eos_token_id) == 2 and tok.decode(labelled) == "river apple</s>7</s>"
    assert tok.decode(ids) == "<s>" + tok.apply_chat_template(conv, tokenize=False).replace(
        "river apple", "river apple</s>") + "</s>"
    # inference prompt for the 2nd answer = the training prefix before that answer
    prompt = tok.apply_chat_template(conv[:4], add_generation_prompt=True)
    assert ids[:len(prompt)] == prompt and labels[len(prompt)] != -100 and labels[len(prompt) - 1] == -100


def test_budget_drops_oldest_rounds_keeps_system(chat_tok_dir):
    tok = Tokenizer(chat_tok_dir)
    tok.set_chat_template("chatml")
    conv = [SYS] + TURNS
    full = tok.apply_chat_template(conv)
    last_two = tok.apply_chat_template([SYS] + TURNS[2:])
    last_one = tok.apply_chat_template([SYS] + TURNS[4:])
    ids, _ = tokenize_conversation(tok, tok.template, conv, 64, len(full))
    assert ids == full
    ids, labels = tokenize_conversation(tok, tok.template, conv, 64, len(full) - 1)
    assert ids == last_two                      # round 1 dropped, system kept
    ids, labels = tokenize_conversation(tok, tok.template, conv, 64, len(last_two) - 1)
    assert ids == last_one
    assert tok.decode([i for i, l in zip(ids, labels) if l != -100]) == "STONE CLOUD<|im_end|>"


def test_budget_cuts_last_user_from_left_then_answer(chat_tok_dir):
    tok = Tokenizer(chat_tok_dir)
    tok.set_chat_template("chatml")
    words = " ".join(f"w{i}" for i in range(80))
    conv = [SYS, {"role": "user", "content": words}, {"role": "assistant", "content": "river apple"}]
    ids, labels = tokenize_conversation(tok, tok.template, conv, 45, 70)   # markers+system: 33 tokens
    first = next(i for i, l in enumerate(labels) if l != -100)
    prompt = tok.decode(ids[:first])
    assert 40 <= first <= 45 and prompt.startswith("<s><|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n")
    assert prompt.endswith("w79<|im_end|>\n<|im_start|>assistant\n") and "w0 " not in prompt
    assert tok.decode(ids[first:]) == "river apple<|im_end|>\n"
    # the answer is then cut from the right, losing its end-of-turn token
    conv[2]["content"] = " ".join(["river apple"] * 40)
    ids, labels = tokenize_conversation(tok, tok.template, conv, 45, 70)
    assert len(ids) == 70
    assert "<|im_end|>" not in tok.decode(ids[first:]) and labels[-1] != -100


def test_template_sources(tmp_path, chat_tok_dir):
    # checkpoint's own template (tokenizer_config.json), then chat_template.jinja beside it
    d = tmp_path / "ckpt"
    shutil.copytree(chat_tok_dir, d)
    conf = json.load(open(d / "tokenizer_config.json"))
    conf["chat_template"] = BUILTIN_TEMPLATES["llama3"]
    json.dump(conf, open(d / "tokenizer_config.json", "w"))
    msgs = TURNS[:2]
    assert "<|eot_id|>" in Tokenizer(str(d)).apply_chat_template(msgs, tokenize=False)
    del conf["chat_template"]
    json.dump(conf, open(d / "tokenizer_config.json", "w"))
    (d / "chat_template.jinja").write_text(BUILTIN_TEMPLATES["chatml"])
    assert "<|im_end|>" in Tokenizer(str(d)).apply_chat_template(msgs, tokenize=False)
    # PaddleNLP chat_template.json: system / conversation [user, bot] / query, 0-based index
    pd = tmp_path / "chat_template.json"
    pd.write_text(json.dumps({"system": "<<{{system}}>>", "conversation": ["Q{{index}}: {{user}}\n", "A: {{bot}}</s>"],
                              "query": "Q{{index}}: {{query}}\nA:"}))
    tok = Tokenizer(str(d))
    assert tok.apply_chat_template([SYS] + TURNS[:3], add_generation_prompt=True, tokenize=False,
                                   chat_template=str(pd)) == \
        "<<You are terse.>>Q0: Reverse the words: apple river\nA: river apple</s>Q1: Add 3 and 4.\nA:"
    tok.set_chat_template(str(pd))
    ids, labels = tokenize_conversation(tok, tok.template, TURNS[:4], 100, 200)
    assert tok.decode([i for i, l in zip(ids, labels) if l != -100]) == "A: river apple</s>A: 7</s>"
    # PaddleNLP pairs input form
    assert tok.apply_chat_template([["Add 3 and 4.", "7"], ["Add 1 and 1."]], add_generation_prompt=True,
                                   tokenize=False) == "<<>>Q0: Add 3 and 4.\nA: 7</s>Q1: Add 1 and 1.\nA:"
    # errors name the problem
    with pytest.raises(ChatTemplateError, match="neither a built-in"):
        load_template("no-such-template")
    with pytest.raises(ChatTemplateError, match="not valid jinja"):
        load_template("{% for x in %}")
    with pytest.raises(ChatTemplateError, match="prefix-stable at message"):
        t = load_template("{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}")
        t.segments(TURNS[:2])
    assert load_template("none") is None


def test_sft_rows_and_export(tmp_path, chat_tok_dir):
    """messages rows and src/tgt rows go through the same template; the template travels with
    the saved tokenizer; messages without a template are refused with the fix."""
    from conftest import write_jsonl
    from paddletune.args import DataArgument

    data = tmp_path / "data"
    write_jsonl(data / "train.json", [{"messages": [SYS] + TURNS[:2]},
                                      {"src": [TURNS[0]["content"], TURNS[2]["content"]], "tgt": ["river apple", "7"]}])
    tok = Tokenizer(chat_tok_dir)
    args = DataArgument(dataset_name_or_path=str(data), chat_template="chatml", src_length=64, max_length=128)
    train, _ = build_datasets(args, tok)
    ex0, ex1 = train[0], train[1]
    assert list(ex0["input_ids"]) == tok.apply_chat_template([SYS] + TURNS[:2])
    assert list(ex1["input_ids"]) == tok.apply_chat_template(TURNS[:4])
    out = tmp_path / "export"
    tok.save_pretrained(str(out))
    assert Tokenizer(str(out)).apply_chat_template(TURNS[:4]) == list(ex1["input_ids"])
    with pytest.raises(DataError, match="need a chat template"):
        ExampleBuilder(Tokenizer(TINY_TOKENIZER), DataArgument(dataset_name_or_path=str(data)))(
            {"messages": TURNS[:2]}, "train.json:1")
    with pytest.raises(DataError, match="train.json:3: message 1 has role 'bot'"):
        ExampleBuilder(tok, args)({"messages": [{"role": "bot", "content": "x"}]}, "train.json:3")


def _greedy(model, ids, stop, limit=20):
    import paddle

    out = []
    with paddle.no_grad():
        for _ in range(limit):
            logits = model(paddle.to_tensor([ids + out])).logits
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            if nxt == stop:
                break
    return out


def test_multi_turn_finetune_learns_every_assistant_turn(tmp_path, chat_tok_dir):
    """16 three-turn chatml conversations with random-word answers: after training, teacher-forced
    accuracy on all assistant tokens is 100%, and greedy decoding from the inference prompt
    (apply_chat_template(history, add_generation_prompt=True)) reproduces each last answer."""
    import random

    from paddletune.data.builtin import WORDS
    from paddletune.models import build_model
    from paddletune.trainer import Trainer

    tok = Tokenizer(chat_tok_dir)
    tok.set_chat_template("chatml")
    rng = random.Random(0)
    convs, examples = [], []
    for i in range(16):
        conv = [SYS]
        for t in range(3):
            conv += [{"role": "user", "content": f"say {rng.choice(WORDS)}"},
                     {"role": "assistant", "content": " ".join(rng.sample(WORDS, 2))}]
        ids, labels = tokenize_conversation(tok, tok.template, conv, 128, 256)
        convs.append(conv)
        examples.append({"input_ids": np.array(ids), "labels": np.array(labels), "id": i})
    cfg = dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    model = build_model(cfg, seed=0)
    Trainer(model, training_args(tmp_path, max_steps=150, learning_rate=5e-3), train_dataset=examples,
            tokenizer=tok, export_fn=lambda d: None).train()
    assert token_accuracy(model, examples) == 1.0
    model.eval()
    stop = tok.token_to_id("<|im_end|>")
    for conv in convs[:4]:
        prompt = tok.apply_chat_template(conv[:-1], add_generation_prompt=True)
        assert tok.decode(_greedy(model, prompt, stop)) == conv[-1]["content"] + "<|im_end|>"
