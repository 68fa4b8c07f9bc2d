"""HF checkpoint I/O: config forms, safetensors dtypes and slices, sharding, refusals."""
import json
import os

import numpy as np
import paddle
import pytest
import torch

from conftest import hf_checkpoint, rel_err
from paddletune.models import hf
from paddletune.loading import load_model


def test_transformers4_config_form(tmp_path):
    """A hand-written 4.x config.json (rope_theta + rope_scaling{"type"}) loads the same weights as
    the 5.x form (rope_parameters) and matches transformers' logits."""
    path, ref_model = hf_checkpoint(tmp_path / "ck", "llama", rope_scaling={"rope_type": "linear", "factor": 2.0},
                                    rope_theta=5000.0)
    conf = json.load(open(os.path.join(path, "config.json")))
    assert "rope_parameters" in conf  # written by transformers 5.x
    old = {k: v for k, v in conf.items() if k != "rope_parameters"}
    old.update(rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0}, transformers_version="4.44.0")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(old, f)
    ids = np.random.RandomState(1).randint(0, 600, (1, 30))
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids)).logits.numpy()
    logits = load_model(path)(paddle.to_tensor(ids)).logits.numpy()
    assert rel_err(logits, ref) <= 1e-4


def test_bf16_and_fp16_safetensors_read_as_float32(tmp_path):
    from safetensors.torch import save_file

    t = torch.randn(4, 6)
    save_file({"a": t.to(torch.bfloat16), "b": t.to(torch.float16), "c": t}, str(tmp_path / "x.safetensors"))
    st = hf.SafetensorsFile(str(tmp_path / "x.safetensors"))
    assert st.dtype("a") == "BF16"
    np.testing.assert_array_equal(st.get("a"), t.to(torch.bfloat16).float().numpy())
    np.testing.assert_array_equal(st.get("b"), t.to(torch.float16).numpy())
    np.testing.assert_array_equal(st.get("c", axis=1, start=2, stop=5), t.numpy()[:, 2:5])


def test_bf16_write_matches_torch_rounding(tmp_path):
    from safetensors.torch import load_file

    x = np.random.RandomState(0).randn(64, 8).astype(np.float32)
    hf.write_safetensors(str(tmp_path / "y.safetensors"), {"w": x}, dtype="bfloat16")
    back = load_file(str(tmp_path / "y.safetensors"))["w"]
    assert back.dtype == torch.bfloat16
    assert torch.equal(back, torch.tensor(x).to(torch.bfloat16))


def test_read_slice_in_paddle_layout(tmp_path):
    path, _ = hf_checkpoint(tmp_path / "ck", "llama")
    model = load_model(path)
    reader = hf.CheckpointReader(path)
    full = model.model.layers[0].self_attn.q_proj.weight.numpy()          # [in, out]
    part = hf.read_slice(reader, model.spec, "model.layers.0.self_attn.q_proj.weight", axis=1, start=8, stop=24)
    np.testing.assert_array_equal(part, full[:, 8:24])


def test_pickle_weights_are_refused_with_the_converter_named(tmp_path):
    os.makedirs(tmp_path / "ck")
    (tmp_path / "ck" / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="convert_checkpoint.py"):
        hf.CheckpointReader(str(tmp_path / "ck"))


def test_shape_mismatch_names_tensor(tmp_path):
    path, _ = hf_checkpoint(tmp_path / "ck", "llama")
    conf = json.load(open(os.path.join(path, "config.json")))
    conf["intermediate_size"] = 128
    json.dump(conf, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="gate_proj.weight has shape"):
        load_model(path)


def test_hub_name_is_refused_without_download():
    with pytest.raises(ValueError, match="does not download"):
        load_model("facebook/llama-7b")


def test_missing_index_shard_is_named(tmp_path):
    path, _ = hf_checkpoint(tmp_path / "ck", "llama", max_shard_size="60KB")
    idx = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    victim = sorted(set(idx["weight_map"].values()))[0]
    os.unlink(os.path.join(path, victim))
    with pytest.raises(FileNotFoundError, match=victim):
        load_model(path)
