"""Lazy (streamed) datasets: disjoint covering DP shares, exact resume (against the
uninterrupted run), a ~300 MB file with bounded memory, and a real 2-process DP run."""
import bisect
import json
import os
import random

import numpy as np
import pytest

from conftest import TINY_TOKENIZER, launch, training_args, write_jsonl
from paddletune.args import DataArgument
from paddletune.data.builtin import WORDS
from paddletune.data.lazy import LazyDataset, LazySource
from paddletune.data.sft import DataError, ExampleBuilder, build_datasets
from paddletune.tokenizer import Tokenizer


def rows(n, seed=0, long_every=10):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(8, 40) if i % long_every == 0 else rng.randint(1, 6)
        out.append({"src": f"item {i}: " + " ".join(rng.choice(WORDS) for _ in range(k)),
                    "tgt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))})
    return out


def line_starts(paths):
    """Byte offsets (in the concatenated stream) of every non-empty line: the oracle."""
    out, base = [], 0
    for p in paths:
        data = open(p, "rb").read()
        at = 0
        for line in data.splitlines(keepends=True):
            if line.strip():
                out.append(base + at)
            at += len(line)
        base += len(data)
    return out


def one_pass(source):
    """Example ids of one full pass over the source's share (stops where pass 1 begins)."""
    ids = []
    for row, after in source._rows(source._state):
        if after["pass"] == 1:
            break
        ids += [e["id"] for e in row]
    return ids


def args_for(path, **kw):
    return DataArgument(dataset_name_or_path=str(path), src_length=48, max_length=96, **kw)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(TINY_TOKENIZER)


def test_shares_are_disjoint_and_cover_every_line(tmp_path, tok):
    d = tmp_path / "data"
    write_jsonl(d / "train" / "a.json", rows(37))
    write_jsonl(d / "train" / "b.json", rows(23, seed=1))
    with open(d / "train" / "b.json", "a") as f:          # blank line, last line without newline
        f.write("\n" + json.dumps(rows(1, seed=2)[0]))
    train, _ = build_datasets(args_for(d, lazy=True), tok)
    assert isinstance(train, LazyDataset) and not hasattr(train, "__len__")
    expect = line_starts(train.files)
    assert len(expect) == 61
    for world in (1, 2, 3, 7):
        shares = [one_pass(LazySource(train, 2, 1, world, r, zero_padding=r % 2 == 0, capacity=96))
                  for r in range(world)]
        flat = [i for s in shares for i in s]
        assert len(flat) == len(set(flat)) and sorted(flat) == expect, world
        assert all(shares)


def test_bad_input_fails_early(tmp_path, tok):
    d = tmp_path / "data"
    d.mkdir()
    (d / "train.json").write_text('{"src": "a", "tgt": "b"}\n{"src": "a"\n')
    with pytest.raises(DataError, match=r"train.json:2: not valid JSON"):
        build_datasets(args_for(d, lazy=True), tok)


def test_resume_continues_at_next_unseen_example(tmp_path, tok):
    """Source level: a fresh source given the position after step 3 yields steps 4.. exactly
    as the uninterrupted source; across the end of the share it wraps to a second pass."""
    d = tmp_path / "data"
    write_jsonl(d / "train.json", rows(120))
    train, _ = build_datasets(args_for(d, lazy=True), tok)
    plain_rest = None
    for zero, greedy in ((False, False), (True, False), (True, True)):
        src = LazySource(train, 3, 2, zero_padding=zero, greedy=greedy, capacity=96)
        it = src.iterate(0)
        first = [next(it) for _ in range(4)]
        state = src.state_dict()
        rest = [next(it) for _ in range(40)]            # crosses the end of the file
        if not zero:
            plain_rest = rest
        assert src.state_dict()["pass"] >= 1
        again = LazySource(train, 3, 2, zero_padding=zero, greedy=greedy, capacity=96)
        again.load_state_dict(json.loads(json.dumps(state)))
        for (s1, m1), (s2, m2) in zip(rest, again.iterate(0, 4)):
            assert s1 == s2
            for a, b in zip(m1, m2):
                assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        seen = [i for _, m in first for b in m for i in b["example_ids"].tolist()]
        assert seen[:5] == line_starts(train.files)[:5] or zero   # file order without packing
    replay = LazySource(train, 3, 2, capacity=96)                  # no saved position: re-read
    step, micro = next(replay.iterate(0, 4))
    assert step == 4 and np.array_equal(micro[0]["input_ids"], plain_rest[0][1][0]["input_ids"])


def test_trainer_resume_equals_uninterrupted(tmp_path, tok):
    """Trainer level with zero padding: 6 steps straight vs 3 steps, checkpoint, resume in a new
    Trainer -> identical weights (the data position travels in trainer_state.json)."""
    from paddletune.models import build_model
    from paddletune.trainer import Trainer

    d = tmp_path / "data"
    write_jsonl(d / "train.json", rows(120))
    train, _ = build_datasets(args_for(d, lazy=True), tok)
    cfg = dict(model_type="llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

    def run(out, steps, resume=None):
        model = build_model(cfg, seed=0)
        src = LazySource(train, 2, 1, zero_padding=True, greedy=True, capacity=96)
        args = training_args(out, max_steps=6, learning_rate=1e-3, save_strategy="steps", save_steps=3,
                             resume_from_checkpoint=resume)
        tr = Trainer(model, args, train_dataset=train, train_source=src, tokenizer=tok, export_fn=lambda x: None)
        if steps < 6:
            tr.callbacks.append(lambda t, info: (_ for _ in ()).throw(KeyboardInterrupt) if info["step"] == steps + 1 else None)
        try:
            tr.train()
        except KeyboardInterrupt:
            pass
        return {k: v.numpy() for k, v in model.state_dict().items()}

    straight = run(tmp_path / "a", 6)
    run(tmp_path / "b", 3)
    state = json.load(open(tmp_path / "b" / "checkpoint-3" / "trainer_state.json"))
    assert state["data_state"][0]["offset"] >= 0 and state["data_state"][0]["pass"] == 0
    resumed = run(tmp_path / "b", 6, resume=str(tmp_path / "b" / "checkpoint-3"))
    for k in straight:
        np.testing.assert_array_equal(resumed[k], straight[k], err_msg=k)


def _rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024


def test_300mb_file_streams_in_bounded_memory(tmp_path, tok):
    """~300 MB of JSON lines: build, draw 200 batches (greedy zero padding), resume after them
    and in the middle of the file; RSS grows < 100 MB."""
    block_rows = rows(2000, seed=7)
    lines = [json.dumps(r) + "\n" for r in block_rows]
    block = "".join(lines).encode()
    repeats = (300 << 20) // len(block) + 1
    path = tmp_path / "data" / "train.json"
    path.parent.mkdir()
    with open(path, "wb") as f:
        for _ in range(repeats):
            f.write(block)
    size = os.path.getsize(path)
    assert size > 290 << 20
    try:
        builder = ExampleBuilder(tok, args_for(path.parent, lazy=True))
        base = _rss_mb()
        ds = LazyDataset([str(path)], builder)
        src = LazySource(ds, 4, 1, zero_padding=True, greedy=True, capacity=96)
        it, peak = src.iterate(0), 0.0
        for _ in range(200):
            next(it)
            peak = max(peak, _rss_mb())
        state = src.state_dict()
        expected = next(it)[1]
        again = LazySource(ds, 4, 1, zero_padding=True, greedy=True, capacity=96)
        again.load_state_dict(state)
        got = next(again.iterate(0, 200))[1]
        assert all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(got, expected))
        # mid-file: the first example is the first line starting at or after the middle
        starts = np.cumsum([0] + [len(x.encode()) for x in lines])[:-1]
        all_starts = (starts[None, :] + len(block) * np.arange(repeats)[:, None]).reshape(-1)
        mid = size // 2 + 1
        middle = LazySource(ds, 4, 1, zero_padding=False, capacity=96)
        middle.load_state_dict({"pass": 0, "offset": mid, "skip": 0})
        for k, (_, micro) in zip(range(20), middle.iterate(0, 1)):
            peak = max(peak, _rss_mb())
            if k == 0:
                first = micro[0]["example_ids"][0]
        assert first == all_starts[bisect.bisect_left(all_starts.tolist(), mid)]
        print(f"RSS growth {peak - base:.1f} MB over a {size >> 20} MB file")
        assert peak - base < 100, f"RSS grew {peak - base:.0f} MB"
    finally:
        os.unlink(path)


WORKER = r'''
import json, os, sys
import paddletune
from paddletune import parallel
from paddletune.args import DataArgument, TrainingArguments
from paddletune.data.lazy import LazySource
from paddletune.data.packing import build_train_source
from paddletune.data.sft import build_datasets
from paddletune.models import build_model
from paddletune.tokenizer import Tokenizer
from paddletune.trainer import Trainer

data_dir, tok_dir, out = sys.argv[1:4]
args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3,
                         save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0)
topo = parallel.init(args)
tok = Tokenizer(tok_dir)
data_args = DataArgument(dataset_name_or_path=data_dir, src_length=48, max_length=96, lazy=True, zero_padding=True)
train, _ = build_datasets(data_args, tok)
source = build_train_source(data_args, args, tok, train, topo)
assert isinstance(source, LazySource)
ids = []
for row, after in source._rows(source._state):
    if after["pass"] == 1:
        break
    ids += [e["id"] for e in row]
cfg = dict(model_type="llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
state = Trainer(build_model(cfg, seed=0), args, train_dataset=train, train_source=source, tokenizer=tok,
                export_fn=lambda d: None, topology=topo).train()
losses = [r["loss"] for r in state["log_history"] if "loss" in r]
json.dump({"ids": ids, "losses": losses, "share": [source.lo, source.hi]},
          open(os.path.join(out, f"rank{topo.rank}.json"), "w"))
'''


def test_two_ranks_read_disjoint_shares_and_train(tmp_path):
    d = tmp_path / "data"
    write_jsonl(d / "train.json", rows(200, seed=3))
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    r = launch([str(worker), str(d), TINY_TOKENIZER, str(out)], nproc=2, log_dir=tmp_path / "logs")
    logs = "".join(open(os.path.join(tmp_path / "logs", f)).read() for f in os.listdir(tmp_path / "logs"))
    assert r.returncode == 0, (r.stderr[-3000:], logs[-3000:])
    r0, r1 = (json.load(open(out / f"rank{i}.json")) for i in (0, 1))
    assert r0["ids"] and r1["ids"] and not set(r0["ids"]) & set(r1["ids"])
    assert sorted(r0["ids"] + r1["ids"]) == line_starts([str(d / "train.json")])
    assert r0["share"][1] == r1["share"][0]
    assert len(r0["losses"]) == 3 and r0["losses"] == r1["losses"]   # one global loss, both ranks
