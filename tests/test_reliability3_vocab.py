"""Issue 33 item 1, the files not covered by test_reliability3's HOSTILE table: our own adapter
files (adapter_config.json, adapter_model.safetensors), Qwen's tiktoken vocabulary and
ChatGLM-6B's sentencepiece vocabulary. Each is replaced by a FIFO, a symlink to /dev/zero and a
huge file; the real CLI (llm/finetune_generation.py) must exit 2 with one `error:` line naming
the file, under a 2 GB address-space limit (RLIMIT_AS) so that no case passes by having memory to
spare. The subprocess timeout is a hang guard (a FIFO read blocks forever), not a speed claim.
Controls: the undamaged adapter / models are read without error by the same code."""
import json
import os
import shutil

import numpy as np
import pytest

from test_reliability3 import finish_cli, start_cli

HUGE_VOCAB = 200 << 20          # sparse: above the 128 MB TOKENIZER_CAP, no disk used
HUGE_CONFIG = 64 << 20          # sparse: above the 4 MB CONFIG_CAP
R, H = 8, 128                   # LoRA rank; tiny-llama's hidden size (q_proj is [H, H])


def _adapter(d):
    """An HF-PEFT LoRA adapter on q_proj of the built-in tiny-llama (4 layers)."""
    from paddletune.models.hf import write_safetensors

    d.mkdir()
    json.dump({"peft_type": "LORA", "r": R, "lora_alpha": 16, "target_modules": ["q_proj"],
               "base_model_name_or_path": "paddletune/tiny-llama"}, open(d / "adapter_config.json", "w"))
    rng = np.random.default_rng(0)
    p = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
    write_safetensors(str(d / "adapter_model.safetensors"),
                      {p.format(i, x): rng.standard_normal((R, H) if x == "A" else (H, R)).astype(np.float32)
                       for i in range(4) for x in "AB"})
    return d


def _declared_huge(path):
    """adapter_model.safetensors whose header declares lora_A [8, 2**30] (32 GiB) over a sparse
    file: consistent as a file, refused by its shapes before any tensor is read."""
    import struct

    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    a = R * (1 << 30) * 4
    header = {name.format("A"): {"dtype": "F32", "shape": [R, 1 << 30], "data_offsets": [0, a]},
              name.format("B"): {"dtype": "F32", "shape": [H, R], "data_offsets": [a, a + H * R * 4]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + a + H * R * 4)


def _fifo(path):
    os.unlink(path)
    os.mkfifo(path)


def _zero(path):
    os.unlink(path)
    os.symlink("/dev/zero", path)


def _sparse(size):
    def make(path):
        with open(path, "r+b") as f:
            f.truncate(size)
    return make


def _model(name):
    from paddletune.models import resolve_model_path

    return resolve_model_path(name)


# file: (which directory it is in, how it is damaged, words the error line must hold)
TARGETS = {
    "adapter_config.json": ("adapter", {"fifo": (_fifo, "is a FIFO"), "zero": (_zero, "is a device"),
                                        "huge": (_sparse(HUGE_CONFIG), "larger than 4 MB")}),
    "adapter_model.safetensors": ("adapter", {"fifo": (_fifo, "is a FIFO"), "zero": (_zero, "is a device"),
                                              "huge": (_declared_huge, "in=1073741824")}),
    "qwen.tiktoken": ("paddletune/tiny-qwen", {"fifo": (_fifo, "is a FIFO"), "zero": (_zero, "is a device"),
                                               "huge": (_sparse(HUGE_VOCAB), "larger than 128 MB")}),
    "ice_text.model": ("paddletune/tiny-chatglm6b", {"fifo": (_fifo, "is a FIFO"), "zero": (_zero, "is a device"),
                                                     "huge": (_sparse(HUGE_VOCAB), "larger than 128 MB")}),
}


def _case(tmp_path, fname, where, kind):
    """(model dir, extra CLI args, the damaged file) of one case, built under tmp_path."""
    root = tmp_path / f"{fname}-{kind}"
    root.mkdir()
    if where == "adapter":
        d = _adapter(root / "adapter")
        return _model("paddletune/tiny-llama"), ["--lora", "true", "--lora_path", str(d)], d / fname
    d = root / "model"
    shutil.copytree(_model(where), d)
    return d, [], d / fname


def test_hostile_vocab_and_adapter_files_one_error_each(tmp_path):
    """12 cases (4 files x FIFO, /dev/zero, huge) at once, each its own process: exit 2, one error
    line naming the damaged file; the undamaged adapter and vocabularies read fine (controls)."""
    from paddletune.loading import load_tokenizer
    from paddletune.models import build_model, load_config
    from paddletune.peft import lora

    _, cfg = load_config(_model("paddletune/tiny-llama"))
    conf, modules, raw = lora.read(str(_adapter(tmp_path / "control")), build_model(cfg))
    assert len(modules) == 4 and raw[next(iter(raw))].shape == (R, H)
    assert load_tokenizer(_model("paddletune/tiny-qwen")).encode("hello")
    assert load_tokenizer(_model("paddletune/tiny-chatglm6b")).encode("hello")
    from paddletune.loading import adapter_base   # an adapter directory given as the model

    fifo = _adapter(tmp_path / "fifo-as-model")
    _fifo(fifo / "adapter_config.json")
    with pytest.raises(ValueError, match=f"{fifo}/adapter_config.json is a FIFO, not a regular file"):
        adapter_base(str(fifo))
    procs = {}
    for fname, (where, kinds) in TARGETS.items():
        for kind, (damage, words) in kinds.items():
            model, extra, path = _case(tmp_path, fname, where, kind)
            damage(path)
            procs[(fname, kind)] = (path, words, start_cli(model, tmp_path / f"out-{fname}-{kind}", *extra))
    for (fname, kind), (path, words, p) in procs.items():
        _, err = finish_cli(p, f"{fname} {kind}", 300)
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert p.returncode == 2 and len(lines) == 1, f"{fname} {kind}: rc {p.returncode}\n{err[-3000:]}"
        assert str(path) in lines[0] and words in lines[0], f"{fname} {kind}: {lines[0]}"
        assert "Traceback" not in err
