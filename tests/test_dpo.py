"""DPO / KTO beyond the loss oracle (tests/test_dpo_oracle.py): preference rows (PaddleNLP's and
TRL's formats) tokenised as SFT tokenises a conversation, the budget rules, batch layouts, the
argument files of PaddleNLP (tests/data/paddlenlp_alignment_configs.py) run as they are, bad
input, exact resume, learning a checkable preference, and one 2-rank launch (DP and TP)."""
import json
import os
import shutil

import numpy as np
import pytest

from conftest import ROOT, TINY_TOKENIZER, hf_checkpoint, launch_cases, rel_err, training_args, write_jsonl
from data.paddlenlp_alignment_configs import CONFIGS, TINY

DPO, KTO = "llm/alignment/dpo/run_dpo.py", "llm/alignment/kto/run_kto.py"


def tok():
    from paddletune.loading import load_tokenizer

    return load_tokenizer(TINY_TOKENIZER)


def pair_tokenizer(template=None, prompt=64, seq=128):
    from paddletune.alignment.data import PairTokenizer

    return PairTokenizer(tok(), template, prompt, seq)


# ------------------------------------------------------------------------------ rows and tokens

def test_paddlenlp_rows_follow_sft_plain_rules_and_the_longest_response_sets_the_budget():
    """{src, tgt, response, sort}: the larger sort is chosen; BOS + src cut from the left to
    max_prompt_len, responses + EOS cut from the right to max_seq_len - len(prompt) (the
    module docstring's worked example); earlier rounds come first, as SFT concatenates them."""
    from paddletune.alignment.data import parse_row
    from paddletune.data.sft import tokenize_rounds

    t = tok()
    enc = lambda s: t.encode(s, add_special_tokens=False)  # noqa: E731
    msgs, resp, _, _ = parse_row({"src": "a b c d", "tgt": [], "response": ["w", "x y z"], "sort": [0, 1]}, "r", "dpo")
    assert resp == ["x y z", "w"]   # chosen first
    prompt, (chosen, rejected) = pair_tokenizer(prompt=3, seq=5)(msgs, resp, "r")
    assert prompt == [t.bos_token_id] + enc("a b c d")[-2:]
    assert chosen == (enc("x y z") + [t.eos_token_id])[:2] and rejected == enc("w") + [t.eos_token_id]
    # two rounds, nothing cut: the prompt is SFT's source tokens of the conversation
    row = {"src": ["q one", "q two"], "tgt": ["a one"], "response": ["good", "bad answer"], "sort": [2, 1]}
    msgs, resp, _, _ = parse_row(row, "r", "dpo")
    prompt, (chosen, rejected) = pair_tokenizer()(msgs, resp, "r")
    ids, labels = tokenize_rounds(t, [("q one", "a one"), ("q two", "good")], 64, 128)
    assert prompt + chosen == ids and chosen == enc("good") + [t.eos_token_id]
    assert rejected == enc("bad answer") + [t.eos_token_id]


def test_trl_rows_with_a_chat_template_match_sft_and_share_one_cut_prompt():
    """TRL's explicit {prompt, chosen, rejected} messages and the implicit-prompt form give the
    same tokens; prompt + chosen is SFT's tokenisation of the conversation (the response is the
    labelled part of the last assistant turn). When too long, the oldest round goes, for both
    responses alike."""
    from paddletune.alignment.data import parse_row
    from paddletune.data.chat_template import load_template
    from paddletune.data.sft import tokenize_conversation

    t = tok()
    system = {"role": "system", "content": "be brief"}
    turns = [{"role": "user", "content": "first question here"}, {"role": "assistant", "content": "first answer"},
             {"role": "user", "content": "second question"}]
    ch, rj = {"role": "assistant", "content": "yes it is"}, {"role": "assistant", "content": "no"}
    explicit = parse_row({"prompt": [system] + turns, "chosen": [ch], "rejected": [rj]}, "r", "dpo")
    implicit = parse_row({"chosen": [system] + turns + [ch], "rejected": [system] + turns + [rj]}, "r", "dpo")
    assert explicit == implicit and explicit[3]   # conversational
    pt = pair_tokenizer("chatml", prompt=256, seq=512)
    prompt, (chosen, rejected) = pt(*explicit[:2], "r", True)
    ids, labels = tokenize_conversation(t, load_template("chatml"), [system] + turns + [ch], 256, 512)
    assert "first question" in t.decode(prompt)
    n = len(prompt) + len(chosen)
    assert ids[:n] == prompt + chosen and all(x == -100 for x in labels[len(prompt) - 1:len(prompt)])
    assert labels[len(prompt):n] == chosen and t.decode(chosen).startswith("yes it is")
    # too long: the first round is dropped (system kept) for both responses
    short = pair_tokenizer("chatml", prompt=len(prompt) - 1, seq=len(prompt) + len(chosen) - 1)
    p2, (c2, r2) = short(*explicit[:2], "r", True)
    text = t.decode(p2)
    assert "first question" not in text and "be brief" in text and "second question" in text
    assert c2 == chosen and r2 == rejected and len(p2) + len(c2) <= short.max_seq_len


@pytest.mark.parametrize("row, kind, message", [
    ({"src": "q", "tgt": [], "response": ["a", "b"], "sort": [1, 1]}, "dpo", "must differ"),
    ({"src": ["q", "r"], "tgt": [], "response": ["a", "b"], "sort": [1, 0]}, "dpo", "one item more"),
    ({"src": "q", "tgt": [], "response": ["a"], "sort": [2]}, "kto", "must be [1]"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, "dpo", "need a chat template"),
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "dpo", "empty"),
    ({"prompt": "q", "answer": "a"}, "dpo", "needs the keys"),
    ({"prompt": "q", "completion": "a", "label": "yes"}, "kto", "\"label\" must be"),
])
def test_bad_rows_fail_naming_file_and_line(tmp_path, row, kind, message):
    from paddletune.alignment.data import load_preference_split
    from paddletune.data import DataError

    path = write_jsonl(tmp_path / "train.jsonl", [{"src": "ok", "tgt": [], "response": ["a", "b"][:2 if kind == "dpo" else 1],
                                                   "sort": [1, 0][:2 if kind == "dpo" else 1]}, row])
    with pytest.raises(DataError, match="train.jsonl:2") as e:
        load_preference_split(path, "train_dataset_path", kind, pair_tokenizer())
    assert message in str(e.value)


def test_kto_rows_labels_and_mismatched_kl_completions(tmp_path):
    """PaddleNLP's {response: [x], sort: [1|0]} and TRL's {prompt, completion, label}; the KL
    completion of example i is example (-i mod n)'s completion after i's own prompt."""
    from paddletune.alignment.data import load_preference_split

    rows = [{"src": "q0", "tgt": [], "response": ["a zero"], "sort": [1]},
            {"prompt": "q1", "completion": "b one two", "label": False},
            {"src": ["q2"], "tgt": [], "response": ["c"], "sort": [0]}]
    ds = load_preference_split(write_jsonl(tmp_path / "k.jsonl", rows), "train_dataset_path", "kto", pair_tokenizer())
    assert [e["label"] for e in ds.examples] == [1, 0, 0]
    for i, e in enumerate(ds.examples):
        assert list(e["kl"]) == list(ds.examples[(-i) % 3]["completion"])


def test_batches_padded_and_packed_keep_sequences_apart():
    """Padded: rows [chosen..., rejected...]; packed: whole pairs in rows of <= capacity tokens,
    each sequence its own segment with positions from 0 and its first token unlabelled; the
    unit ids name the sequence of every label (chosen k -> k, rejected k -> P + k)."""
    from paddletune.alignment.data import PackedPairSource, PreferenceDataset, padded_collate

    a = lambda x: np.asarray(x, np.int64)  # noqa: E731
    ex = [{"prompt": a([1, 5]), "chosen": a([6, 2]), "rejected": a([7, 8, 2]), "id": 0},
          {"prompt": a([1, 9, 9]), "chosen": a([10, 2]), "rejected": a([11, 2]), "id": 1}]
    ds = PreferenceDataset("dpo", ex, [])
    b = padded_collate(ds, 0)(ex)
    assert b["input_ids"].shape == (4, 5) and int(b["loss_count"]) == 2
    assert b["unit_ids"].tolist()[1] == [-1, -1, -1, 1, 1] and b["labels"].tolist()[2] == [-100, -100, 7, 8, 2]
    src = PackedPairSource(ds, 20, micro_batch=1, accumulation=1)
    assert src.packs == [[0, 1]]
    p = src.collate([0])
    assert p["input_ids"].tolist() == [[1, 5, 6, 2, 1, 5, 7, 8, 2, 1, 9, 9, 10, 2, 1, 9, 9, 11, 2]]
    assert p["segment_ids"].tolist() == [[0] * 4 + [1] * 5 + [2] * 5 + [3] * 5]
    assert p["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]
    assert p["unit_ids"].tolist() == [[-1, -1, 0, 0, -1, -1, 2, 2, 2, -1, -1, -1, 1, 1, -1, -1, -1, 3, 3]]


# ------------------------------------------------------------------------------ argument files

def _rows(tmp, kind, n):
    from paddletune.alignment.sample import generate

    train, dev = generate(n_train=n, n_dev=4)["sample-" + kind]
    if kind == "dpo":   # TRL rows mixed in
        train[1] = {"prompt": "Add 1 and 2.", "chosen": "3", "rejected": "4"}
    return write_jsonl(tmp / f"{kind}_train.jsonl", train), write_jsonl(tmp / f"{kind}_dev.jsonl", dev)


def paddlenlp_argv(name, tmp, out, **sizes):
    """PaddleNLP's file `name` as it is, with the model, paths, sizes and parallel degrees changed."""
    kind = "kto" if "kto" in name else "dpo"
    cfg = dict(CONFIGS[name])
    train, dev = _rows(tmp, kind, 16)
    cfg.update(model_name_or_path=TINY[name.split("/")[0]], train_dataset_path=train, dev_dataset_path=dev,
               output_dir=str(out), max_steps=2, max_seq_len=128, max_prompt_len=64, per_device_train_batch_size=2,
               gradient_accumulation_steps=1, per_device_eval_batch_size=4, tensor_parallel_degree=1,
               **({"lora_rank": 8} if cfg.get("lora") else {}))
    cfg["sharding_parallel_degree"] = 1   # sharding over several ranks is not built yet
    cfg.update(sizes)
    path = tmp / f"{out.parent.name}-{out.name}-{name.replace('/', '_')}"
    path.write_text(json.dumps(cfg))
    return kind, [str(path)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_paddlenlp_argument_files_parse_with_warnings_only(tmp_path, name):
    """Every key of PaddleNLP's 12 DPO / KTO files is known; keys without effect here
    (flash_mask: true, bf16 on CPU, ...) warn instead of failing."""
    from paddletune.alignment.args import parse_args

    kind, argv = paddlenlp_argv(name, tmp_path, tmp_path / "out")
    warned = []
    a = parse_args(argv, kind, warn=warned.append)
    assert a.model.lora == bool(CONFIGS[name].get("lora"))
    if CONFIGS[name].get("flash_mask"):
        assert any("flash_mask" in w for w in warned)
    if CONFIGS[name].get("rslora_plus"):
        assert (a.model.rslora, a.model.lora_plus_scale, a.model.lora_alpha) == (True, 4.0, 4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_paddlenlp_argument_files_train_two_steps(tmp_path, name):
    """llama / chatglm2 / qwen, DPO and KTO, full and LoRA: 2 steps, eval, and the HF model or
    HF-PEFT adapter in output_dir, with rewards logged."""
    from dpo_cases import script_run

    kind, argv = paddlenlp_argv(name, tmp_path, tmp_path / "out")
    res = script_run(DPO if kind == "dpo" else KTO, argv)
    assert res["rc"] == 0
    out = tmp_path / "out"
    assert (out / ("adapter_model.safetensors" if CONFIGS[name].get("lora") else "model.safetensors")).exists()
    log = [json.loads(l) for l in open(out / "train_log.jsonl")]
    assert [r["step"] for r in log if "loss" in r] == [1, 2] and "rewards/chosen" in log[0]
    assert any("eval_loss" in r for r in log)


@pytest.mark.parametrize("extra, message", [
    (["--ref_model_update_steps", "5"], "ref_model_update_steps"),
    (["--loss_typ", "ipo"], "did you mean 'loss_type'"),
    (["--loss_type", "dpo"], "must be one of"),
    (["--prefix_tuning", "true"], "not available for DPO"),
    (["--reference_free", "true", "--loss_type", "dpop"], "reference_free"),
    (["--max_prompt_len", "256"], "max_prompt_len"),
    (["--pipeline_parallel_degree", "2"], "pipeline_parallel_degree"),
    (["--train_dataset_path", "/nonexistent.jsonl"], "train_dataset_path"),
])
def test_bad_input_is_one_error_line_before_any_write(tmp_path, capsys, extra, message):
    from dpo_cases import script_run

    _, argv = paddlenlp_argv("llama/dpo_argument.json", tmp_path, tmp_path / "out")
    capsys.readouterr()
    assert script_run(DPO, argv + extra)["rc"] == 2
    errors = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "out").exists()


def test_bad_input_exit_status_from_the_command_line(tmp_path):
    from conftest import run_script

    _, argv = paddlenlp_argv("llama/kto_argument.json", tmp_path, tmp_path / "out")
    r = run_script([os.path.join(ROOT, KTO)] + argv + ["--loss_type", "sigmoid"])   # a DPO key
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error:"), r.stderr[-2000:]
    assert "unknown key 'loss_type'" in r.stderr and not (tmp_path / "out").exists()


def test_orpo_resolves_as_paddlenlp_does():
    from paddletune.alignment.args import parse_args

    a = parse_args(["--model_name_or_path", "paddletune/tiny-llama", "--output_dir", "/tmp/x", "--do_train", "true",
                    "--loss_type", "orpo"], "dpo", warn=lambda m: None)
    assert (a.config.loss_type, a.config.reference_free, a.config.sft_loss_ratio) == ("or", True, 1.0)


# ------------------------------------------------------------------------------ resume, learning

def test_resume_is_exact_with_packed_pairs(tmp_path):
    """Full DPO with zero padding: 4 steps in one run equal 2 steps + resume from checkpoint-2
    (losses and every weight of the final model)."""
    from dpo_cases import script_run
    from paddletune.models.hf import CheckpointReader

    common = ["--zero_padding", "true", "--max_steps", "4", "--save_steps", "2", "--eval_steps", "100",
              "--logging_steps", "1", "--do_eval", "false", "--load_best_model_at_end", "false",
              "--learning_rate", "1e-3", "--unified_checkpoint", "false"]
    _, argv = paddlenlp_argv("llama/dpo_argument.json", tmp_path, tmp_path / "a")
    assert script_run(DPO, argv + common)["rc"] == 0
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    _, argv = paddlenlp_argv("llama/dpo_argument.json", tmp_path, tmp_path / "b")
    assert script_run(DPO, argv + common)["rc"] == 0   # a rerun continues from checkpoint-2
    losses = lambda d: [json.loads(l)["loss"] for l in open(d / "train_log.jsonl") if '"loss"' in l]  # noqa: E731
    assert losses(tmp_path / "b")[-2:] == losses(tmp_path / "a")[-2:]
    a, b = CheckpointReader(str(tmp_path / "a")), CheckpointReader(str(tmp_path / "b"))
    assert all(np.array_equal(a.get(k), b.get(k)) for k in a.keys())


def sorting_pairs(n, seed):
    """Prompt: BOS + 5 distinct numbers shuffled; chosen: them sorted + EOS; rejected: another
    (unsorted) order + EOS. Both answers hold the same tokens: only the order tells them apart."""
    from paddletune.alignment.data import PreferenceDataset

    rng, out = np.random.default_rng(seed), []
    for i in range(n):
        x = rng.choice(np.arange(3, 40), 5, replace=False)
        srt, rej = np.sort(x), rng.permutation(x)
        while (rej == srt).all():
            rej = rng.permutation(x)
        out.append({"prompt": np.r_[1, rng.permutation(x)], "chosen": np.r_[srt, 2], "rejected": np.r_[rej, 2], "id": i})
    return PreferenceDataset("dpo", out, [])


def test_dpo_learns_to_prefer_the_sorted_answer_on_held_out_pairs(tmp_path):
    """A tiny random model prefers the sorted answer (higher log-probability) on ~half of 64
    held-out pairs; after 50 DPO steps on 256 others, on >= 95% of them, and its implicit reward
    ranks them the same way (eval rewards/accuracies)."""
    import paddle

    from paddletune.alignment.args import DPOConfig
    from paddletune.alignment.data import padded_collate
    from paddletune.alignment.loss import DPOLoss, FrozenReference, sequence_logps
    from paddletune.loading import load_model
    from paddletune.trainer import Trainer

    path, _ = hf_checkpoint(tmp_path / "ck", vocab_size=64, hidden_size=64, intermediate_size=128, tokenizer_dir=None)
    train, held = sorting_pairs(256, 0), sorting_pairs(64, 1)
    model = load_model(path)

    def preferred():
        batch = padded_collate(held, 0)(held.examples)
        model.eval()
        with paddle.no_grad():
            lp = sequence_logps(model, {k: paddle.to_tensor(v) for k, v in batch.items()}, 128)[0].numpy()
        return float((lp[:64] > lp[64:]).mean())

    before = preferred()
    assert 0.3 <= before <= 0.7
    args = training_args(tmp_path / "out", per_device_train_batch_size=16, learning_rate=3e-3, max_steps=50,
                         logging_steps=10)
    trainer = Trainer(model, args, train_dataset=train, eval_dataset=held, collate=padded_collate(train, 0),
                      loss_fn=DPOLoss(DPOConfig(beta=0.1), FrozenReference(load_model(path))))
    trainer.train()
    assert preferred() >= 0.95
    assert trainer.evaluate()["rewards/accuracies"] >= 0.95


# ------------------------------------------------------------------------------ one 2-rank launch

def test_two_rank_launch_dp_and_tp_equal_one_process(tmp_path):
    """One launch, 2 ranks: DPO LoRA under data parallel (the ranks read disjoint pairs), full DPO
    under TP=2 (the LM head and the frozen reference on vocabulary shards: log-probabilities from
    sharded_token_logprobs), KTO under data parallel (the KL estimate averaged over the ranks) and
    KTO LoRA on Qwen2 (tied embeddings) under TP=2 (the reference: the adapters off on every rank):
    losses, rewards and the written model / adapter equal the single-process run with the same
    global batch."""
    from dpo_cases import script_run
    from paddletune.models.hf import CheckpointReader, SafetensorsFile

    quick = ["--logging_steps", "1", "--do_eval", "false", "--load_best_model_at_end", "false",
             "--max_steps", "3", "--adam_epsilon", "1e-4", "--learning_rate", "1e-3"]
    runs = {"dp_lora": ("llama/dpo_lora_argument.json", ["--per_device_train_batch_size", "2"],
                        ["--per_device_train_batch_size", "4"]),
            "tp_full": ("llama/dpo_argument.json", ["--tensor_parallel_degree", "2"], []),
            "dp_kto": ("llama/kto_argument.json", ["--per_device_train_batch_size", "2"],
                       ["--per_device_train_batch_size", "4"]),
            "tp_kto_lora": ("qwen/kto_lora_argument.json", ["--tensor_parallel_degree", "2"], [])}
    cases, single = [], {}
    for key, (name, launched, alone) in runs.items():
        kind, argv = paddlenlp_argv(name, tmp_path, tmp_path / key / "two")
        script = DPO if kind == "dpo" else KTO
        cases.append((key, "dpo_cases:script_run", {"relpath": os.path.join(ROOT, script).replace(ROOT + "/", ""),
                                                    "argv": argv + quick + launched}))
        _, argv1 = paddlenlp_argv(name, tmp_path, tmp_path / key / "one")
        single[key] = script_run(script, argv1 + quick + alone)
    got = launch_cases(cases, tmp_path)
    logs = lambda d: [json.loads(l) for l in open(d / "train_log.jsonl") if '"loss"' in l]  # noqa: E731
    for key, ranks in got.items():
        assert [r["rc"] for r in ranks] == [0, 0] and single[key]["rc"] == 0, (key, ranks, single[key])
        two, one = logs(tmp_path / key / "two"), logs(tmp_path / key / "one")
        assert len(two) == len(one) == 3
        # (a KTO step without a desirable example logs no rewards/chosen.) abs 5e-6: a reward is
        # beta x (policy - reference) sequence log-probs of tens of nats each, whose float32
        # summation-order noise is ~1e-5 nats on one process vs vocabulary shards
        for a, b in zip(two, one):
            assert {k for k in a if "/" in k} == {k for k in b if "/" in k}
            for k in {"loss", "rewards/chosen", "rewards/rejected"} & set(b):
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=5e-6), (key, k)
        if key.startswith("dp"):   # disjoint shares of each global batch, together the single run's
            for s0, s1, s in zip(ranks[0]["examples"], ranks[1]["examples"], single[key]["examples"]):
                assert not set(s0) & set(s1) and sorted(s0 + s1) == s
    local, whole = got["tp_full"][0]["lm_head"]
    assert local[1] * 2 == whole[1]   # each rank holds half the vocabulary columns
    for key in ("dp_lora", "tp_kto_lora"):
        a = SafetensorsFile(str(tmp_path / key / "two" / "adapter_model.safetensors"))
        b = SafetensorsFile(str(tmp_path / key / "one" / "adapter_model.safetensors"))
        assert max(rel_err(a.get(k), b.get(k)) for k in b.keys() if "lora_B" in k) <= 1e-3, key
    for key in ("tp_full", "dp_kto"):
        a, b = CheckpointReader(str(tmp_path / key / "two")), CheckpointReader(str(tmp_path / key / "one"))
        assert max(rel_err(a.get(k), b.get(k)) for k in b.keys()) <= 1e-4


@pytest.mark.parametrize("name", ["dpo_argument.json", "dpo_lora_argument.json", "kto_argument.json",
                                  "kto_lora_argument.json"])
def test_shipped_argument_files_parse_without_warnings_and_train(tmp_path, name):
    """llm/llama/{dpo,dpo_lora,kto,kto_lora}_argument.json (tiny Llama, the built-in sample sets)
    parse without a warning on CPU; the LoRA DPO one trains 2 steps as it is otherwise."""
    from dpo_cases import script_run
    from paddletune.alignment.args import parse_args

    kind = "kto" if name.startswith("kto") else "dpo"
    path = os.path.join(ROOT, "llm", "llama", name)
    warned = []
    a = parse_args([path], kind, warn=warned.append)
    assert not warned and a.pref_data.train_dataset_path.startswith(f"paddletune/sample-{kind}/")
    if name == "dpo_lora_argument.json":
        out = tmp_path / "out"
        assert script_run(DPO, [path, "--output_dir", str(out), "--max_steps", "2", "--eval_steps", "2",
                                "--save_steps", "2"])["rc"] == 0
        assert (out / "adapter_model.safetensors").exists() and (out / "checkpoint-2" / "adapter_config.json").exists()
        _adapter_loads_in_peft_with_our_logits(out)


def _adapter_loads_in_peft_with_our_logits(out):
    """The DPO-trained adapter is an HF-PEFT adapter: torch peft loads it offline on the recorded
    base (a built-in's portable name, resolved to its directory), and its logits equal
    paddletune's model with that adapter."""
    import paddle
    import torch
    import transformers
    from peft import PeftModel

    from paddletune.loading import load_for_generation
    from paddletune.models import resolve_model_path

    recorded = json.load(open(out / "adapter_config.json"))["base_model_name_or_path"]
    assert recorded == "paddletune/tiny-llama"
    model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
        resolve_model_path(recorded)), str(out)).eval()
    ids = [[1, 5, 9, 13, 21, 34, 55]]
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
        with model.disable_adapter():
            ref_base = model(torch.tensor(ids)).logits.numpy()
    base = json.load(open(out / "adapter_config.json"))["base_model_name_or_path"]
    ours, _, _ = load_for_generation(base, lora_path=str(out))
    got = ours(paddle.to_tensor(ids)).logits.numpy()
    assert rel_err(got, ref) < 1e-4
    # the adapter really acts (trained B != 0) and is resolved: the difference from peft is a
    # small fraction of what the adapter changes
    assert np.abs(got - ref).max() <= 0.01 * np.abs(ref - ref_base).max()


def test_arguments_md_key_table_is_generated():
    from paddletune.alignment.args import markdown_table

    text = open(os.path.join(ROOT, "docs", "arguments.md")).read()
    assert markdown_table() in text.split("<!-- ALIGNMENT-ARGS:BEGIN")[1].split("<!-- ALIGNMENT-ARGS:END")[0]


def test_dpo_output_dir_is_locked_for_the_job(tmp_path):
    """run_dpo.py (and run_kto.py, the same main) claims output_dir like finetune_generation.py:
    a second job on a directory another live process holds is refused with exit 2 before any work."""
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "from paddletune import outdir; outdir.claim(sys.argv[2]); print('held', flush=True); "
                               "time.sleep(60)", ROOT, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        _, argv = paddlenlp_argv("llama/dpo_argument.json", tmp_path, out)
        r = subprocess.run([sys.executable, DPO] + argv + ["--max_steps", "2"], capture_output=True,
                           text=True, cwd=ROOT)
        errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
        assert r.returncode == 2 and len(errors) == 1 and f"PID {holder.pid}" in errors[0], r.stderr[-2000:]
        assert sorted(os.listdir(out)) == [".paddletune.lock"]
    finally:
        holder.kill()
        holder.wait()
