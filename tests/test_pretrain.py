"""Pre-training: the indexed corpus format (both layouts), the preprocessing tool, splits, windows,
mixing, flat memory, and llm/run_pretrain.py (resume, 2 ranks, learning vs a unigram baseline)."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from paddletune.data.pretrain import (BlendedDataset, IndexedCorpus, PretrainDataset, build_pretrain_datasets,
                                      parse_input_dir, pretrain_collate, split_ranges, write_corpus)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "paddletune", "assets", "tiny-tokenizer")
SAMPLE = os.path.join(ROOT, "paddletune", "assets", "sample-pretrain")


def run(cmd, env=None, **kw):
    env = dict(env or os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(cmd, capture_output=True, text=True, cwd=kw.pop("cwd", ROOT), env=env, **kw)


# ------------------------------------------------------------------ format

def test_tool_output_reads_back_as_tokenizer_ids(tmp_path, capsys):
    from paddletune.loading import load_tokenizer

    texts = ["The quick brown fox.", "", "jumps over the lazy dog", "x" * 50, "tabs\tand\nnewlines"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"content": t}) + "\n" if t else "\n" for t in texts))
    out = str(tmp_path / "out" / "corpus")
    cmd = [sys.executable, "tools/preprocess_data.py", "--model_name_or_path", TOKENIZER, "--input_path",
           str(src), "--output_prefix", out, "--json_key", "content", "--append_eos", "--workers", "2",
           "--log_interval", "1", "--data_impl", "mmap", "--data_format", "JSON"]
    r = run(cmd)
    assert r.returncode == 0, r.stderr
    assert "4 documents" in r.stdout and "tokenizing" in r.stderr   # the tqdm bar
    tok = load_tokenizer(TOKENIZER)
    c = IndexedCorpus(out)
    want = [tok.encode(t) + [tok.eos_token_id] for t in texts if t]
    assert c.num_docs == 4 and c.dtype == np.uint16
    assert [c.document(d).tolist() for d in range(4)] == want
    assert not [p for p in os.listdir(tmp_path / "out") if p.endswith(".tmp")]
    # in-process from here (each launch costs an import of paddle)
    main = _tool()
    args = cmd[2:]
    # a rerun over a complete output refuses (one error line, exit 2), --overwrite replaces it
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--overwrite" in err[0]
    assert main(args + ["--overwrite", "--workers", "1", "--no_progress"]) == 0
    assert [IndexedCorpus(out).document(d).tolist() for d in range(4)] == want
    # restartable: an interrupted run's temp files are no output; a rerun replaces them
    stale = str(tmp_path / "out" / "again")
    open(stale + ".bin.tmp", "wb").write(b"half a run")
    assert main(args[:5] + [stale] + args[6:] + ["--no_progress"]) == 0
    assert IndexedCorpus(stale).num_docs == 4 and not os.path.exists(stale + ".bin.tmp")
    # bad input: one error line naming the line, nothing written
    (tmp_path / "bad.jsonl").write_text('{"content": "ok"}\n{"content": 3}\n')
    capsys.readouterr()
    assert main(args[:3] + [str(tmp_path / "bad.jsonl"), "--output_prefix", str(tmp_path / "bad"),
                            "--json_key", "content", "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and not list(tmp_path.glob("bad*"))[1:]   # only bad.jsonl
    assert main(args + ["--split_sentences", "--output_prefix", str(tmp_path / "s")]) == 2
    assert "split_sentences" in capsys.readouterr().err


def _tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("preprocess_data", os.path.join(ROOT, "tools", "preprocess_data.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data"] = mod   # the pool pickles its worker function by module name
    spec.loader.exec_module(mod)
    return mod.main


def test_hand_built_idx_bin_layout(tmp_path):
    """The documented byte layout, packed by hand: 3 sequences (int32) in 2 documents."""
    seqs = [[5, 6, 7], [8], [9, 10]]
    prefix = str(tmp_path / "hand")
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(struct.pack(f"<{len(s)}i", *s))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4))
        f.write(struct.pack("<QQ", 3, 3))
        f.write(struct.pack("<3i", 3, 1, 2))
        f.write(struct.pack("<3q", 0, 12, 16))
        f.write(struct.pack("<3q", 0, 2, 3))
    c = IndexedCorpus(prefix)
    assert c.dtype == np.int32 and c.num_docs == 2
    assert [c.sequence(s).tolist() for s in range(3)] == seqs
    assert c.document(0).tolist() == [5, 6, 7, 8] and c.document(1).tolist() == [9, 10]
    # and our writer produces exactly these bytes
    write_corpus(str(tmp_path / "ours"), [[[5, 6, 7], [8]], [[9, 10]]], dtype=np.int32)
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == open(str(tmp_path / "ours") + ext, "rb").read()
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"NOTMAGIC!")
    with pytest.raises(ValueError, match="not an mmap index"):
        IndexedCorpus(prefix)


def test_old_npy_npz_layout(tmp_path):
    prefix = str(tmp_path / "old")
    np.save(prefix + "_ids.npy", np.array([1, 2, 3, 4, 5, 6], np.int64))
    np.savez(prefix + "_idx.npz", lens=np.array([2, 1, 3]), docs=np.array([0, 2, 3]))
    c = IndexedCorpus(prefix)
    assert c.num_docs == 2 and c.document(0).tolist() == [1, 2, 3] and c.document(1).tolist() == [4, 5, 6]
    np.savez(prefix + "_idx.npz", lens=np.array([2, 1, 3]))   # no "docs": each sequence a document
    c = IndexedCorpus(prefix)
    assert [c.document(d).tolist() for d in range(3)] == [[1, 2], [3], [4, 5, 6]]
    assert parse_input_dir(str(tmp_path)) == [(1.0, prefix)]


def test_split_counts_by_hand():
    assert split_ranges("949,50,1", 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges("8,1,1", 10) == [(0, 8), (8, 9), (9, 10)]
    # 3 docs: round(2.847)=3, round(0.15)=0, round(0.003)=0 -> [0, 3, 3, 3]
    assert split_ranges("949,50,1", 3) == [(0, 3), (3, 3), (3, 3)]
    # 7 docs, "1,1,1": round(2.33)=2 three times -> [0, 2, 4, 6], shifted by -1 -> [0, 3, 5, 7]
    assert split_ranges("1,1,1", 7) == [(0, 3), (3, 5), (5, 7)]
    assert split_ranges("100", 5) == [(0, 5), (5, 5), (5, 5)]
    with pytest.raises(ValueError, match="split"):
        split_ranges("a,b", 5)


# ------------------------------------------------------------------ samples

def _corpus(tmp_path, docs, name="c"):
    return IndexedCorpus(write_corpus(str(tmp_path / name), docs, vocab_size=1000))


def test_samples_cross_documents_and_reset_by_hand(tmp_path):
    # docs of lengths 3, 4, 2 (ids tell document and offset: 10*doc + offset)
    c = _corpus(tmp_path, [[0, 1, 2], [10, 11, 12, 13], [20, 21]])
    ds = PretrainDataset(c, (0, 3), 4, seed=0, reset_position_ids=True, reset_attention_mask=True)
    order = ds.order.tolist()
    stream = np.concatenate([c.document(d) for d in order]).tolist()
    assert len(ds) == 9 // 4 == 2 and sorted(order) == [0, 1, 2]
    for i in range(2):
        assert ds[i]["input_ids"].tolist() == stream[4 * i:4 * i + 4] == ds[i]["labels"].tolist()
    # the worked example of the module docstring: order [0, 1, 2] -> sample 1 = [11 12 13 20]
    ds.order[:] = [0, 1, 2]
    ds.cum[1:] = np.cumsum(c.doc_len[ds.order])
    s = ds[1]
    assert s["input_ids"].tolist() == [11, 12, 13, 20]
    assert s["position_ids"].tolist() == [0, 1, 2, 0] and s["segment_ids"].tolist() == [0, 0, 0, 1]
    s = ds[0]
    assert s["input_ids"].tolist() == [0, 1, 2, 10]
    assert s["position_ids"].tolist() == [0, 1, 2, 0] and s["segment_ids"].tolist() == [0, 0, 0, 1]
    plain = PretrainDataset(c, (0, 3), 4, seed=0)
    assert set(plain[0]) == {"input_ids", "labels"}
    b = pretrain_collate([ds[0], ds[1]])
    assert b["input_ids"].shape == (2, 4) and "attention_mask" not in b
    # the order is a function of the seed (and the same for the same seed)
    assert PretrainDataset(c, (0, 3), 4, seed=0).order.tolist() == order


def test_mixing_weights_give_proportions(tmp_path):
    a = _corpus(tmp_path, [[1] * 40 for _ in range(50)], "a")     # 500 samples of 4
    b = _corpus(tmp_path, [[2] * 40 for _ in range(50)], "b")
    c = _corpus(tmp_path, [[3] * 40 for _ in range(50)], "c")
    train, valid, test = build_pretrain_datasets(f"3 {a.prefix} 1 {b.prefix} 1 {c.prefix}", "8,2,0", 4, seed=1)
    assert isinstance(train, BlendedDataset) and test is None
    n = len(train)
    assert n == 3 * 400
    first = np.array([train[j]["input_ids"][0] for j in range(n)])
    frac = [(first == k).mean() for k in (1, 2, 3)]
    assert np.allclose(frac, [0.6, 0.2, 0.2], atol=1e-3)
    # any prefix of the mix keeps the proportions (within one sample per corpus)
    head = first[:50]
    assert abs((head == 1).sum() - 30) <= 1 and abs((head == 2).sum() - 10) <= 1
    again, _, _ = build_pretrain_datasets(f"3 {a.prefix} 1 {b.prefix} 1 {c.prefix}", "8,2,0", 4, seed=1)
    assert (again.which == train.which).all() and (again.inner == train.inner).all()
    # a directory: every corpus in it, equal weights
    assert [w for w, _ in parse_input_dir(str(tmp_path))] == [1.0, 1.0, 1.0]


def test_flat_memory_over_300mb_bin(tmp_path):
    psutil = pytest.importorskip("psutil")
    prefix = str(tmp_path / "big")
    n_tok, doc = 150_000_000, 1000      # uint16: 300 MB
    ids = np.memmap(prefix + ".bin", mode="w+", dtype=np.uint16, shape=(n_tok,))
    for s in range(0, n_tok, 10_000_000):
        ids[s:s + 10_000_000] = (np.arange(s, min(s + 10_000_000, n_tok)) % 600).astype(np.uint16)
    ids.flush()
    del ids
    n = n_tok // doc
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QB", 1, 8) + struct.pack("<QQ", n, n + 1))
        f.write(np.full(n, doc, "<i4").tobytes())
        f.write((np.arange(n, dtype="<i8") * doc * 2).tobytes())
        f.write(np.arange(n + 1, dtype="<i8").tobytes())
    proc = psutil.Process()
    before = proc.memory_info().rss
    train, valid, _ = build_pretrain_datasets(prefix, "949,50,1", 1024, seed=3, reset_position_ids=True,
                                              reset_attention_mask=True)
    from paddletune.data.collate import BatchPlan

    plan = BatchPlan(len(train), 8, 1, seed=3)
    total = 0
    for step, micro in plan.iterate(0):
        if step == 200:
            break
        batch = pretrain_collate([train[i] for i in micro[0]])
        total += int(batch["input_ids"][:, 0].sum())
    growth = (proc.memory_info().rss - before) / 2 ** 20
    print(f"RSS growth over 200 batches of 8 x 1024 from a 300 MB .bin: {growth:.1f} MB")
    assert len(train) > 130_000 and growth < 100


# ------------------------------------------------------------------ llm/run_pretrain.py

# llm/run_pretrain.py's main with the samples each rank reads recorded (rank R -> reads-rankR.json)
WORKER = r'''
import json, os, sys
sys.path.insert(0, os.environ["PT_ROOT"])
import paddletune.data.pretrain as pt
reads = []
get = pt.PretrainDataset.__getitem__
def traced(self, i):
    reads.append([self.name, int(i)])
    return get(self, i)
pt.PretrainDataset.__getitem__ = traced
out = sys.argv[sys.argv.index("--output_dir") + 1]
rank = os.environ.get("PADDLE_TRAINER_ID", "0")
def dump():
    with open(os.path.join(out, "reads-rank%s.json" % rank), "w") as f:
        json.dump(reads, f)
from paddletune.trainer import Trainer
train = Trainer.train
def train_and_count(self):   # this rank's parameter elements (tensor parallel: its shards)
    local = lambda p: p._local_value() if p.is_dist() else p
    with open(os.path.join(out, "numel-rank%s.json" % rank), "w") as f:
        json.dump(sum(int(local(p).size) for p in self.model.parameters()), f)
    return train(self)
Trainer.train = train_and_count
stop = int(os.environ.get("PT_STOP_AFTER", "0"))   # an interruption: leave right after checkpoint-N
if stop:
    from paddletune.trainer import Trainer
    save = Trainer.save_checkpoint
    def save_then_stop(self):
        r = save(self)
        if self.state["global_step"] == stop:
            dump()
            os._exit(0)
        return r
    Trainer.save_checkpoint = save_then_stop
import importlib.util
spec = importlib.util.spec_from_file_location("run_pretrain", os.path.join(os.environ["PT_ROOT"], "llm", "run_pretrain.py"))
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
code = mod.main(sys.argv[1:])
dump()
sys.exit(code)
'''


def _script(tmp_path):
    p = tmp_path / "worker.py"
    p.write_text(WORKER)
    return str(p)


def _common(out, steps, **kw):
    args = {"output_dir": str(out), "max_steps": steps, "logging_steps": 1, "save_steps": 1000,
            "evaluation_strategy": "no", "do_eval": "false", "warmup_steps": 0, "max_seq_length": 64,
            "per_device_train_batch_size": 4, "learning_rate": 0.003, **kw}
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


def _losses(out):
    return [r["loss"] for r in map(json.loads, open(os.path.join(out, "train_log.jsonl"))) if "loss" in r]


def _train_reads(out, rank=0):
    return [i for name, i in json.load(open(os.path.join(out, f"reads-rank{rank}.json"))) if name == "train"]


ARGFILE = os.path.join(ROOT, "llm", "llama", "pretrain_argument.json")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One process, 6 steps of 4 samples: the reference of the resume and the 2-rank tests."""
    tmp = tmp_path_factory.mktemp("pretrain_full")
    out = tmp / "full"
    r = run([sys.executable, _script(tmp), ARGFILE] + _common(out, 6), env=dict(os.environ, PT_ROOT=ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_resume_continues_at_the_next_sample(tmp_path, uninterrupted):
    env = dict(os.environ, PT_ROOT=ROOT)
    w, full, part = _script(tmp_path), uninterrupted, tmp_path / "part"
    r = run([sys.executable, w, ARGFILE] + _common(part, 6, save_steps=3), env=dict(env, PT_STOP_AFTER="3"))
    assert r.returncode == 0, r.stderr[-3000:]
    first = _train_reads(part)
    assert len(first) == 12 and os.path.isdir(part / "checkpoint-3")
    r = run([sys.executable, w, ARGFILE] + _common(part, 6, save_steps=3), env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checkpoint-3" in r.stdout + r.stderr   # resumed from it
    # the second run read exactly the samples the uninterrupted run read after step 3
    assert first + _train_reads(part) == _train_reads(full)
    np.testing.assert_allclose(_losses(part), _losses(full), rtol=1e-5)
    assert len(_losses(full)) == 6


def test_two_ranks_read_disjoint_samples(tmp_path, uninterrupted):
    from conftest import launch

    env = dict(os.environ, PT_ROOT=ROOT)
    w, single, multi = _script(tmp_path), uninterrupted, tmp_path / "multi"
    r = launch([w, ARGFILE] + _common(multi, 6, per_device_train_batch_size=2), nproc=2, env=env,
               log_dir=tmp_path / "logs")
    assert r.returncode == 0, (r.stderr[-3000:], [open(p).read()[-2000:] for p in (tmp_path / "logs").glob("workerlog*")])
    a, b, s = _train_reads(multi, 0), _train_reads(multi, 1), _train_reads(single)
    assert len(a) == len(b) == 12 and not set(a) & set(b)
    for step in range(6):   # each global batch: the two shares = the one process's batch
        assert sorted(a[2 * step:2 * step + 2] + b[2 * step:2 * step + 2]) == sorted(s[4 * step:4 * step + 4])
    np.testing.assert_allclose(_losses(multi), _losses(single), rtol=1e-5)


def test_tensor_parallel_continued_pretraining_equals_one_process(tmp_path, uninterrupted):
    """continue_training from the reference run's model, tensor_parallel_degree 2, documents
    reset (the packed-rows attention on head shards): losses = one process; each rank holds
    part of the weights."""
    from conftest import launch

    env = dict(os.environ, PT_ROOT=ROOT)
    w = _script(tmp_path)
    kw = dict(model_name_or_path=str(uninterrupted), continue_training="true", reset_position_ids="true",
              reset_attention_mask="true")
    one, tp = tmp_path / "one", tmp_path / "tp"
    r = run([sys.executable, w, ARGFILE] + _common(one, 3, **kw), env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    r = launch([w, ARGFILE] + _common(tp, 3, tensor_parallel_degree=2, **kw), nproc=2, env=env,
               log_dir=tmp_path / "logs")
    assert r.returncode == 0, (r.stderr[-3000:], [open(p).read()[-2000:] for p in (tmp_path / "logs").glob("workerlog*")])
    np.testing.assert_allclose(_losses(tp), _losses(one), rtol=1e-5)
    # continue_training loaded the 6 trained steps: its first loss is below the random init's
    assert _losses(one)[0] < _losses(uninterrupted)[0] - 0.3
    whole = json.load(open(one / "numel-rank0.json"))
    parts = [json.load(open(tp / f"numel-rank{r}.json")) for r in (0, 1)]
    print(f"parameter elements: one process {whole}, tensor-parallel ranks {parts}")
    assert parts[0] == parts[1] < 0.8 * whole
    assert _train_reads(tp, 0) == _train_reads(tp, 1) == _train_reads(one)   # one data-parallel rank


def test_pretraining_beats_half_the_unigram_perplexity(tmp_path):
    """The argument file's tiny Llama, random init, 100 steps of 8 x 128 tokens on the built-in
    stdlib corpus (documents reset: positions and attention): validation perplexity below half
    that of the add-one unigram model fitted on the train split's tokens."""
    from paddletune.data.pretrain import unigram_ppl

    out = tmp_path / "out"
    r = run([sys.executable, "llm/run_pretrain.py", ARGFILE, "--output_dir", str(out), "--max_steps", "100",
             "--warmup_steps", "10", "--logging_steps", "50", "--evaluation_strategy", "no", "--save_steps", "1000",
             "--reset_position_ids", "true", "--reset_attention_mask", "true"])
    assert r.returncode == 0, r.stderr[-3000:]
    conf = json.load(open(ARGFILE))
    train, valid, _ = build_pretrain_datasets(conf["input_dir"], conf["split"], conf["max_seq_length"], seed=conf["seed"])
    base = unigram_ppl(train, valid, 600)
    evals = [e for e in map(json.loads, open(out / "train_log.jsonl")) if "eval_ppl" in e]
    ppl = evals[-1]["eval_ppl"]
    print(f"valid ppl after 100 steps: {ppl:.2f}; unigram baseline {base:.2f} (ratio {ppl / base:.3f})")
    assert evals[-1]["step"] == 100 and ppl < base / 2
    assert os.path.isfile(out / "model.safetensors") and json.load(open(out / "config.json"))["model_type"] == "llama"


def test_bad_arguments_are_one_error_line(tmp_path):
    """Bad input stops before output_dir is written: one `error:` line, exit 2."""
    from paddletune.pretrain_args import parse_args

    out = tmp_path / "o"
    for extra, words in ((["--max_seq_lenght", "64"], "did you mean 'max_seq_length'"),
                         (["--lora", "true"], "not available for pre-training"),
                         (["--max_seq_length", "1"], "must be > 1")):
        with pytest.raises(ValueError, match=words):
            parse_args([ARGFILE, "--output_dir", str(out)] + extra, warn=lambda m: None)
    with pytest.raises(ValueError, match="split"):
        build_pretrain_datasets("paddletune/sample-pretrain", "x,y", 8)
    with pytest.raises(ValueError, match="outside the model's vocabulary of 500"):   # ids up to 599
        build_pretrain_datasets("paddletune/sample-pretrain", "949,50,1", 8, vocab_size=500)
    big = write_corpus(str(tmp_path / "late"), [[1] * 8] * 4 + [[1] * 7 + [900]], vocab_size=1000)
    with pytest.raises(ValueError, match="token id 900"):   # at start (the corpus's first 4M tokens)
        build_pretrain_datasets(big, "1,0,0", 8, vocab_size=600, seed=0)
    train = PretrainDataset(IndexedCorpus(big), (0, 5), 8, vocab_size=600)   # and each sample read
    with pytest.raises(ValueError, match="sample .* holds token id 900"):
        [train[i] for i in range(len(train))]
    for extra, words in ((["--input_dir", str(tmp_path / "none")], "no corpus at"),
                         (["--max_seq_length", "4096"], "positions")):   # checked by the script
        r = run([sys.executable, "llm/run_pretrain.py", ARGFILE, "--output_dir", str(out)] + extra)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and lines[-1].startswith("error:") and words in lines[-1], r.stderr[-2000:]
        assert not out.exists()
    # the fine-tuning script still refuses pre-training files, naming this one
    from paddletune.args import ArgumentError, parse_args as sft_args

    with pytest.raises(ArgumentError, match="its own llm/run_pretrain.py"):
        sft_args([ARGFILE])


@pytest.mark.parametrize("name", ["llama/pretrain_argument.json", "qwen/pretrain_argument.json",
                                  "qwen/pretrain_argument_0p5b.json", "chatglm2/pretrain_argument.json"])
def test_paddlenlp_pretrain_files_parse(tmp_path, name):
    """PaddleNLP's recorded pre-training files (their keys and values; paths, sizes and degrees
    fitted) parse for llm/run_pretrain.py, their GPU-only keys warned, not refused."""
    from test_compat import current_file
    from paddletune.pretrain_args import parse_args

    fit = {"input_dir": "paddletune/sample-pretrain", "max_seq_length": 64}
    if name.startswith("chatglm2"):
        fit["num_hidden_layers"] = 4   # the tiny model's depth (a size)
    path = current_file(tmp_path, name, fit)
    warnings = []
    a = parse_args([path], warn=warnings.append)
    assert a.pretrain.input_dir == "paddletune/sample-pretrain" and a.pretrain.max_seq_length == 64
    assert not any("max_seq_length" in w or "input_dir" in w for w in warnings)
    assert not a.pretrain.continue_training or a.model.model_name_or_path.startswith("paddletune/tiny-")
    if name == "llama/pretrain_argument.json":   # and one runs, as it is: 2 steps (bf16, fused keys warned)
        r = run([sys.executable, "llm/run_pretrain.py", path, "--do_train", "true"])
        assert r.returncode == 0, r.stderr[-3000:]
        log = r.stdout + r.stderr
        assert "'use_fused_rope: true' has no effect" in log and "step=2 " in log
        assert os.path.isfile(os.path.join(a.training.output_dir, "model.safetensors"))
