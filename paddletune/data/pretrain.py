"""Pre-training data: pre-tokenised corpora (Megatron / PaddleNLP indexed format), splits, windows.

    write_corpus(prefix, docs, vocab_size)        # docs: iterable of token-id arrays -> PREFIX.bin/.idx
    c = IndexedCorpus(prefix)                     # PREFIX.bin + PREFIX.idx, or PREFIX_ids.npy + PREFIX_idx.npz
    c.document(d)                                 # np array (read from the .bin on demand)
    train, valid, test = build_pretrain_datasets(input_dir, "949,50,1", max_seq_length, seed)
    train[i] -> {"input_ids", "labels"[, "position_ids", "segment_ids"]}  (int64 [max_seq_length])

File layout (Megatron-LM `MMapIndexedDataset`, also what PaddleNLP's create_pretraining_data.py
writes with --data_impl mmap), all little-endian:
    PREFIX.bin  the token ids of every sequence, back to back, one dtype
    PREFIX.idx  b"MMIDIDX\\x00\\x00" | uint64 version (1) | uint8 dtype code | uint64 n (sequences) |
                uint64 m (doc_idx entries) | int32 sizes[n] | int64 pointers[n] (byte offsets into
                .bin) | int64 doc_idx[m] (the sequence where each document starts; m = docs + 1,
                doc_idx[0] = 0, doc_idx[-1] = n)
    dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float32, 7 float64, 8 uint16
    (6 / 7 as gpt-neox reads them; old Megatron reads both as float64, megatron-core's DType has
    6 float64 and 7 float32. Token ids are integers: the writer uses uint16 or int32 only.)
PaddleNLP's older layout: PREFIX_ids.npy (1-D token ids) + PREFIX_idx.npz with "lens" (sequence
lengths) and optionally "docs" (doc_idx as above; without it every sequence is a document).

Split (PaddleNLP / Megatron get_train_valid_test_split_): "949,50,1" over n documents ->
fractions f_i = w_i / sum(w); index[0] = 0, index[i+1] = index[i] + round(f_i * n), then every
index after the first is shifted so that the last equals n. Contiguous document ranges.
    n = 10, "8,1,1" -> [0, 8, 9, 10]: train docs 0-7, valid 8, test 9

Samples (PretrainDataset): the documents of a split in a seeded order are concatenated and cut
into windows of max_seq_length tokens (the remainder is dropped), so a sample crosses document
boundaries. labels = input_ids (the loss shifts inside, models/loss.py). Worked example: docs of
lengths 3, 4, 2 in order [0, 1, 2], L = 4 -> stream d0 d0 d0 d1 | d1 d1 d1 d2 ; sample 1 =
[d1 d1 d1 d2]; with reset_position_ids its position_ids are [0, 1, 2, 0] (positions restart at the
window's start and at each document start in it, as Megatron's reset_position_ids), with
reset_attention_mask segment_ids [0, 0, 0, 1] (the model's packed-rows attention: no attention
across a document start).
Memory: the tokens stay in the file (each window is read with os.pread: see _FileTokens for why
not a memory map); the index and the dataset keep int64 arrays per sequence / document (sizes,
order, cumulative lengths), never per-token Python objects.

Mixing (several corpora, weights w): sample j of the mix comes from the corpus whose weight is
most behind: argmax_d (w_d * (j + 1) - count_d) (Megatron's blending rule, deterministic); a
corpus that runs out starts again from its first sample. The mix has sum of the corpora's
sample counts samples.
"""
import array
import glob
import math
import os
import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float32,
          7: np.float64, 8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


class CorpusError(ValueError):
    """A corpus file that cannot be read as the documented layout (the message names it)."""


def best_dtype(vocab_size):
    """The smallest dtype holding ids < vocab_size (Megatron's rule: uint16 below 65500)."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


# ------------------------------------------------------------------ writing

class CorpusWriter:
    """Streams documents into PREFIX.bin / PREFIX.idx through temp files renamed at close():
    an interrupted run leaves no complete-looking output."""

    def __init__(self, prefix, dtype=np.int32):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"dtype {self.dtype} has no code in the index format")
        d = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(d, exist_ok=True)
        self._bin_tmp, self._idx_tmp = prefix + ".bin.tmp", prefix + ".idx.tmp"
        self._bin = open(self._bin_tmp, "wb")
        # per sequence / per document (never per token), as compact C arrays: 4 / 8 bytes each
        self.sizes, self.doc_idx = array.array("i"), array.array("q", [0])
        self.tokens = 0

    def add_document(self, sequences):
        """One document: a list of token-id sequences (sentences), or one sequence."""
        if len(sequences) and np.ndim(sequences[0]) == 0:
            sequences = [sequences]
        for seq in sequences:
            arr = np.asarray(seq, dtype=self.dtype)
            self._bin.write(arr.tobytes(order="C"))
            self.sizes.append(len(arr))
            self.tokens += len(arr)
        self.doc_idx.append(len(self.sizes))

    def close(self):
        self._bin.close()
        sizes = np.frombuffer(self.sizes, np.int32) if len(self.sizes) else np.zeros(0, np.int32)
        pointers = np.zeros(len(sizes), np.int64)
        if len(sizes):
            pointers[1:] = np.cumsum(sizes[:-1], dtype=np.int64) * self.dtype.itemsize
        doc_idx = np.frombuffer(self.doc_idx, np.int64)
        with open(self._idx_tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", 1) + struct.pack("<B", CODES[self.dtype]))
            f.write(struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx)))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(self._idx_tmp, self.prefix + ".idx")

    def abort(self):
        self._bin.close()
        for p in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(p):
                os.remove(p)


def write_corpus(prefix, docs, vocab_size=None, dtype=None):
    w = CorpusWriter(prefix, dtype or best_dtype(vocab_size))
    try:
        for d in docs:
            w.add_document(d)
    except BaseException:
        w.abort()
        raise
    w.close()
    return prefix


# ------------------------------------------------------------------ reading

def corpus_files(prefix):
    """The files of corpus `prefix` in either layout, or None."""
    if os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin"):
        return ("mmap", prefix + ".bin", prefix + ".idx")
    if os.path.isfile(prefix + "_ids.npy") and os.path.isfile(prefix + "_idx.npz"):
        return ("npy", prefix + "_ids.npy", prefix + "_idx.npz")
    return None


class IndexedCorpus:
    """One corpus: the index in memory (per-sequence arrays), the token ids read from the file
    on demand (_FileTokens). seq_start[s] = token offset of sequence s; doc_idx as in the
    file; doc_start / doc_len per document (documents are contiguous runs of sequences)."""

    def __init__(self, prefix):
        files = corpus_files(prefix)
        if files is None:
            raise CorpusError(f"no corpus at {prefix}: expected {prefix}.bin + {prefix}.idx or "
                              f"{prefix}_ids.npy + {prefix}_idx.npz (tools/preprocess_data.py writes them)")
        self.prefix, self.layout = prefix, files[0]
        if self.layout == "mmap":
            self._read_mmap(files[1], files[2])
        else:
            self._read_npy(files[1], files[2])
        d = self.doc_idx
        if len(d) < 1 or d[0] != 0 or d[-1] != len(self.sizes) or np.any(np.diff(d) < 0):
            raise CorpusError(f"{files[2]}: doc_idx must rise from 0 to the number of sequences "
                              f"({len(self.sizes)}), got {d[:3].tolist()}...{d[-2:].tolist()}")
        starts = np.append(self.seq_start, self.seq_start[-1] + self.sizes[-1] if len(self.sizes) else 0)
        self.doc_start = starts[d[:-1]]
        self.doc_len = starts[d[1:]] - self.doc_start
        self._check_agrees(files, starts)

    def _check_agrees(self, files, starts):
        """The index must describe this token file exactly: its sequences laid end to end
        (pointer s = the bytes of sequences before s) covering every token of the file, and a
        file size that is a whole number of tokens of the index's dtype. An index of another
        corpus beside a .bin (or one written for another dtype) fails here, naming both files."""
        total = int(starts[-1]) if len(starts) else 0
        size = os.path.getsize(files[1]) - self.tokens.offset
        item = self.dtype.itemsize
        fix = ("the .idx is not the index of this .bin (another corpus, or another dtype?); "
               "write both again with tools/preprocess_data.py")
        if self.layout == "mmap" and size % item:
            raise CorpusError(f"{files[1]}: {size} bytes is not a whole number of {self.dtype} tokens, "
                              f"the dtype {files[2]} names: {fix}")
        if len(self.tokens) != total:
            raise CorpusError(f"{files[1]}: holds {len(self.tokens)} tokens, the index {files[2]} "
                              f"names {total}: {fix}")
        expect = np.zeros(len(self.sizes), np.int64)
        expect[1:] = np.cumsum(self.sizes[:-1])
        if np.any(self.sizes < 0) or not np.array_equal(self.seq_start, expect):
            bad = int(np.argmax(self.seq_start != expect)) if len(expect) else 0
            raise CorpusError(f"{files[2]}: sequence {bad} starts at token {int(self.seq_start[bad])}, "
                              f"after the sequences before it it must start at {int(expect[bad])}: {fix}")

    def _read_mmap(self, bin_path, idx_path):
        with open(idx_path, "rb") as f:
            head = f.read(len(MAGIC) + 8 + 1 + 8 + 8)
        if len(head) < 34 or head[:9] != MAGIC:
            raise CorpusError(f"{idx_path}: not an mmap index file (magic {head[:9]!r}, expected {MAGIC!r})")
        version, = struct.unpack("<Q", head[9:17])
        if version != 1:
            raise CorpusError(f"{idx_path}: index version {version}; only version 1 is known")
        code = head[17]
        if code not in DTYPES:
            raise CorpusError(f"{idx_path}: unknown dtype code {code}")
        n, m = struct.unpack("<QQ", head[18:34])
        idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        need = 34 + 4 * n + 8 * n + 8 * m
        if len(idx) < need:
            raise CorpusError(f"{idx_path}: truncated ({len(idx)} bytes, the header names {need})")
        self.dtype = np.dtype(DTYPES[code])
        self.sizes = np.frombuffer(idx, "<i4", n, 34).astype(np.int64)
        pointers = np.frombuffer(idx, "<i8", n, 34 + 4 * n)
        self.doc_idx = np.frombuffer(idx, "<i8", m, 34 + 12 * n).astype(np.int64)
        self.seq_start = pointers // self.dtype.itemsize
        self.tokens = _FileTokens(bin_path, self.dtype)

    def _read_npy(self, ids_path, idx_path):
        ids = np.load(ids_path, mmap_mode="r", allow_pickle=False)   # header: dtype, shape, offset
        if ids.ndim != 1:
            raise CorpusError(f"{ids_path}: token ids must be 1-D, got shape {ids.shape}")
        if not ids.dtype.isnative and ids.dtype.itemsize > 1:
            raise CorpusError(f"{ids_path}: big-endian token ids ({ids.dtype}) are not read; re-save as little-endian")
        self.dtype = ids.dtype
        self.tokens = _FileTokens(ids_path, ids.dtype, ids.offset, len(ids))
        del ids
        with np.load(idx_path, allow_pickle=False) as z:
            if "lens" not in z:
                raise CorpusError(f"{idx_path}: has no 'lens' array (found {sorted(z.files)})")
            self.sizes = np.asarray(z["lens"], np.int64)
            self.doc_idx = (np.asarray(z["docs"], np.int64) if "docs" in z
                            else np.arange(len(self.sizes) + 1, dtype=np.int64))
        self.seq_start = np.zeros(len(self.sizes), np.int64)
        self.seq_start[1:] = np.cumsum(self.sizes[:-1])

    @property
    def num_docs(self):
        return len(self.doc_idx) - 1

    def document(self, d):
        s = self.doc_start[d]
        return self.tokens[s:s + self.doc_len[d]]

    def sequence(self, s):
        return self.tokens[self.seq_start[s]:self.seq_start[s] + self.sizes[s]]


class _FileTokens:
    """Token ids of a file read with os.pread: a window costs its own bytes and nothing more.
    (A memory map of the .bin would do the same reads, but the kernel maps whole page-cache folios
    and read-ahead windows into the process: measured ~150 KB of resident size per 2 KB sample on
    this machine, 250 MB after 200 batches of a 300 MB file, and MADV_RANDOM did not change it.)"""

    def __init__(self, path, dtype, offset=0, count=None):
        self.path, self.dtype, self.offset = path, np.dtype(dtype), offset
        size = os.path.getsize(path) - offset
        self.n = size // self.dtype.itemsize if count is None else count
        self.fd = None

    def __len__(self):
        return self.n

    def __getitem__(self, sl):
        start, stop, _ = sl.indices(self.n)
        if self.fd is None or self._pid != os.getpid():   # opened lazily, again after a fork
            self.fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        k = max(0, stop - start)
        buf = os.pread(self.fd, k * self.dtype.itemsize, self.offset + start * self.dtype.itemsize)
        return np.frombuffer(buf, self.dtype, k)

    def __getstate__(self):
        return {**self.__dict__, "fd": None}

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass


# ------------------------------------------------------------------ corpora, splits

BUILTIN_CORPUS = "paddletune/sample-pretrain"   # paddletune/assets/sample-pretrain (tools/make_sample_corpus.py)


def parse_input_dir(input_dir):
    """PaddleNLP's input_dir -> [(weight, prefix)]: a directory (every *.idx / *_idx.npz in it,
    equal weights), one prefix, "w1 prefix1 w2 prefix2 ...", or the built-in
    paddletune/sample-pretrain (docstrings of Python's standard library, tiny-tokenizer ids)."""
    if not input_dir or not str(input_dir).strip():
        raise CorpusError("input_dir is empty: give a directory of corpora, a prefix, or 'w1 prefix1 w2 prefix2'")
    text = str(input_dir).strip()
    if text == BUILTIN_CORPUS:
        text = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "sample-pretrain")
    if os.path.isdir(text):
        prefixes = sorted({p[:-4] for p in glob.glob(os.path.join(text, "*.idx"))} |
                          {p[:-8] for p in glob.glob(os.path.join(text, "*_idx.npz"))})
        prefixes = [p for p in prefixes if corpus_files(p)]
        if not prefixes:
            raise CorpusError(f"input_dir {text}: no corpus in it (no PREFIX.idx + PREFIX.bin or "
                              "PREFIX_ids.npy + PREFIX_idx.npz); run tools/preprocess_data.py")
        return [(1.0, p) for p in prefixes]
    parts = text.split()
    if len(parts) == 1:
        return [(1.0, parts[0])]
    if len(parts) % 2:
        raise CorpusError(f"input_dir {text!r}: expected pairs 'weight prefix', got {len(parts)} words")
    out = []
    for w, p in zip(parts[::2], parts[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise CorpusError(f"input_dir {text!r}: {w!r} is not a weight (expected 'w1 prefix1 w2 prefix2')") from None
        if not math.isfinite(weight) or weight <= 0:
            raise CorpusError(f"input_dir {text!r}: the weight {w!r} of {p} must be a finite number "
                              "above 0 (a corpus with weight 0 or NaN would be dropped without a word); "
                              "leave out a corpus you do not want")
        out.append((weight, p))
    if sum(w for w, _ in out) <= 0:
        raise CorpusError(f"input_dir {text!r}: the weights sum to 0")
    return out


def split_ranges(split, n_docs):
    """[(start, end)] document ranges of train / valid / test (module docstring)."""
    try:
        parts = [float(s) for s in str(split).replace("/", ",").split(",") if s.strip()]
    except ValueError:
        parts = []
    if not parts or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise CorpusError(f"split {split!r}: expected non-negative weights like '949,50,1'")
    parts = (parts + [0.0, 0.0, 0.0])[:3]
    total = sum(parts)
    index = [0]
    for p in parts:
        index.append(index[-1] + int(round(p / total * float(n_docs))))
    diff = index[-1] - n_docs
    index = [index[0]] + [i - diff for i in index[1:]]
    return [(index[i], index[i + 1]) for i in range(3)]


class PretrainDataset:
    """Fixed-length windows over the documents [start, end) of one corpus (module docstring)."""

    def __init__(self, corpus, doc_range, max_seq_length, seed=1234, reset_position_ids=False,
                 reset_attention_mask=False, name="train", vocab_size=None):
        self.corpus, self.L, self.vocab_size = corpus, int(max_seq_length), vocab_size
        self.reset_pos, self.reset_attn = reset_position_ids, reset_attention_mask
        start, end = doc_range
        rng = np.random.default_rng([seed, start, end])
        self.order = start + rng.permutation(end - start).astype(np.int64)   # documents, seeded
        lens = corpus.doc_len[self.order]
        self.cum = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=self.cum[1:])
        self.num_tokens = int(self.cum[-1])
        self.n = self.num_tokens // self.L
        self.name = name

    def __len__(self):
        return self.n

    def pieces(self, i):
        """[(document, offset in it, length)] of sample i, in order."""
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} of {self.n}")
        pos, left, out = i * self.L, self.L, []
        k = int(np.searchsorted(self.cum, pos, side="right")) - 1
        while left > 0:
            off = pos - int(self.cum[k])
            take = min(left, int(self.cum[k + 1]) - pos)
            if take > 0:
                out.append((int(self.order[k]), off, take))
            pos, left, k = pos + take, left - take, k + 1
        return out

    def __getitem__(self, i):
        pieces = self.pieces(int(i))
        ids = np.concatenate([np.asarray(self.corpus.document(d)[o:o + t]) for d, o, t in pieces]).astype(np.int64)
        if self.vocab_size is not None and (ids.max() >= self.vocab_size or ids.min() < 0):
            raise CorpusError(f"{self.corpus.prefix}: {self.name} sample {i} holds token id {int(ids.max())} "
                              f"outside the model's vocabulary of {self.vocab_size}: the corpus was "
                              "tokenised for another model (rerun tools/preprocess_data.py with this one)")
        ex = {"input_ids": ids, "labels": ids.copy()}
        if self.reset_pos:
            ex["position_ids"] = np.concatenate([np.arange(t) for _, _, t in pieces]).astype(np.int64)
        if self.reset_attn:
            ex["segment_ids"] = np.repeat(np.arange(len(pieces)), [t for _, _, t in pieces]).astype(np.int64)
        return ex


class BlendedDataset:
    """Corpora mixed by weight (module docstring); index arrays only."""

    def __init__(self, datasets, weights):
        self.datasets = list(datasets)
        w = np.asarray(weights, np.float64)
        w = w / w.sum()
        self.n = int(sum(len(d) for d in self.datasets))
        self.which = np.zeros(self.n, np.int16)
        self.inner = np.zeros(self.n, np.int64)
        counts = np.zeros(len(w), np.int64)
        sizes = np.asarray([len(d) for d in self.datasets], np.int64)
        usable = sizes > 0
        for j in range(self.n):
            err = np.where(usable, w * (j + 1) - counts, -np.inf)
            d = int(np.argmax(err))
            self.which[j], self.inner[j] = d, counts[d] % sizes[d]
            counts[d] += 1
        self.counts = counts

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        return self.datasets[self.which[j]][int(self.inner[j])]


def check_vocab(corpus, vocab_size, head=1 << 22):
    """Fail at start when the first `head` tokens hold an id >= vocab_size (every sample read is
    checked as well: a full scan of a large corpus would cost minutes at every start)."""
    n = min(head, len(corpus.tokens))
    if n and vocab_size is not None:
        top = int(np.max(corpus.tokens[0:n]))
        if top >= vocab_size:
            raise CorpusError(f"{corpus.prefix}: token id {top} is outside the model's vocabulary of "
                              f"{vocab_size}: the corpus was tokenised for another model (rerun "
                              "tools/preprocess_data.py with this model's tokenizer)")


def build_pretrain_datasets(input_dir, split, max_seq_length, seed=1234, reset_position_ids=False,
                            reset_attention_mask=False, vocab_size=None):
    """(train, valid, test) datasets (None where a split has no full sample) over the corpora of
    input_dir, each split mixing the corpora's same split by the weights. With vocab_size, ids
    outside the vocabulary are refused (check_vocab at start, then per sample)."""
    corpora = [(w, IndexedCorpus(p)) for w, p in parse_input_dir(input_dir)]
    for _, c in corpora:
        check_vocab(c, vocab_size)
    out = []
    for s, name in enumerate(("train", "valid", "test")):
        parts, weights = [], []
        for w, c in corpora:
            rng = split_ranges(split, c.num_docs)[s]
            ds = PretrainDataset(c, rng, max_seq_length, seed, reset_position_ids, reset_attention_mask, name,
                                 vocab_size)
            if len(ds) and w > 0:
                parts.append(ds)
                weights.append(w)
        if not parts:
            out.append(None)
        elif len(parts) == 1:
            out.append(parts[0])
        else:
            out.append(BlendedDataset(parts, weights))
    return tuple(out)


def pretrain_collate(examples):
    """Stack equal-length samples into [B, L] int64 arrays (no attention_mask: with segment_ids
    the model takes its packed-rows attention path, as for zero padding)."""
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def unigram_ppl(train, valid, vocab_size):
    """Perplexity on `valid`'s predicted tokens (all but each sample's first) of the add-one
    unigram model fitted on `train`'s tokens: the baseline a pre-trained model must beat."""
    counts = np.ones(vocab_size, np.float64)
    for i in range(len(train)):
        counts += np.bincount(train[i]["input_ids"], minlength=vocab_size)[:vocab_size]
    logp = np.log(counts / counts.sum())
    nll, n = 0.0, 0
    for i in range(len(valid)):
        ids = valid[i]["input_ids"][1:]
        nll -= float(logp[ids].sum())
        n += len(ids)
    return float(np.exp(nll / max(n, 1)))
