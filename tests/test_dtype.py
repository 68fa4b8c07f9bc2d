"""Weights in the compute dtype: the loader reads bf16 / fp16 as 16-bit words straight into
parameters of that dtype, and a float64 model trains end to end in float64 (every parameter and
activation), with the float32 run's losses. Under TP=2 and PP=2 every rank loads its part in the
dtype (float64 equal to one process, bf16 word for word), and the TP predictor runs in it."""
import json
import os

import numpy as np
import paddle
import pytest

from paddletune.loading import load_model
from paddletune.models import build_model, get_spec, hf, save_pretrained
from paddletune.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("ck") / "llama"), "llama", seed=0)


def test_bf16_checkpoint_loads_word_for_word(tmp_path, tiny):
    """A bf16 export read with dtype bfloat16: every parameter is bfloat16 and holds exactly the
    file's 16-bit words (compared with the raw bytes, not through float32)."""
    model = load_model(tiny)
    save_pretrained(model, str(tmp_path / "bf16"), dtype="bfloat16")
    m16 = load_model(str(tmp_path / "bf16"), dtype="bfloat16")
    reader = hf.CheckpointReader(str(tmp_path / "bf16"))
    spec = m16.spec
    params = dict(m16.named_parameters())
    assert params and all(p.dtype == paddle.bfloat16 for p in params.values())
    for name, p in params.items():
        view, code = reader.files[name]._raw(reader.stored_name(name))
        assert code == "BF16"
        words = hf.to_paddle_layout(spec, name, np.array(view))
        assert np.array_equal(p.numpy().view(np.uint16), words), name
    # float16 from the same bf16 file: numpy's conversion of the exact values
    m_half = load_model(str(tmp_path / "bf16"), dtype="float16")
    name = next(iter(params))
    want = hf.to_paddle_layout(spec, name, hf.bf16_to_f32(np.array(reader.files[name]._raw(name)[0])))
    got = dict(m_half.named_parameters())[name]
    assert got.dtype == paddle.float16 and np.array_equal(got.numpy(), want.astype(np.float16))


def test_unsupported_dtype_is_refused(tiny):
    with pytest.raises(ValueError, match="int8"):
        load_model(tiny, dtype="int8")


def _train(path, dtype, steps=4):
    """Full fine-tuning, SGD-free plain AdamW steps through the Trainer; returns (losses, model,
    activation dtypes seen)."""
    from conftest import copy_pairs, training_args
    from paddletune.trainer import Trainer

    paddle.seed(0)
    model = load_model(path, dtype=dtype)
    seen = set()

    def hook(layer, inputs, output):
        outs = output if isinstance(output, (tuple, list)) else [output]
        for o in outs:
            if isinstance(o, paddle.Tensor) and o.dtype.name.lower().startswith(("float", "bfloat")):
                seen.add((type(layer).__name__, str(o.dtype)))
            elif hasattr(o, "logits") and o.logits is not None:
                seen.add((type(layer).__name__, str(o.logits.dtype)))
    for layer in model.sublayers(include_self=True):
        layer.register_forward_post_hook(hook)
    trainer = Trainer(model, training_args(os.path.dirname(path) + f"/out_{dtype}", max_steps=steps,
                                           logging_steps=1, learning_rate=1e-3, per_device_train_batch_size=4),
                      train_dataset=copy_pairs(n=8), export_fn=lambda d: None)
    trainer.train()
    losses = [r["loss"] for r in trainer.state["log_history"] if "loss" in r]
    return losses, model, seen


@pytest.mark.parametrize("column", ["cpu", "gpu"])
def test_float64_training_stays_float64_and_matches_float32(tiny, column):
    """In both op-table columns (the gpu one on paddle's CPU kernels of sdpa / flash / swiglu)."""
    from paddletune.models import ops

    ops.TAKEN.clear()
    with ops.use(column):
        l32, _, _ = _train(tiny, "float32")
        l64, model, seen = _train(tiny, "float64")
    assert (column == "gpu") == ({"flash_attention", "swiglu"} <= ops.TAKEN), ops.TAKEN
    assert len(l64) == 4 and len(l32) == 4
    assert {str(p.dtype) for p in model.parameters()} == {"paddle.float64"}
    assert seen and {d for _, d in seen} == {"paddle.float64"}, sorted(seen)
    np.testing.assert_allclose(l64, l32, rtol=1e-6, atol=0)
    from conftest import copy_pairs, lm_loss   # the loss itself runs in float64 (no float32 hop)

    model.train()
    ex = copy_pairs(n=2)[0]
    out = lm_loss(model, [ex["input_ids"]], [ex["labels"]])
    assert out.loss_sum.dtype == paddle.float64
    out.loss_sum.backward()
    assert {str(p.grad.dtype) for p in model.parameters()} == {"paddle.float64"}


# ------------------------------------------------------------------ TP / PP loading in the dtype

@pytest.fixture(scope="module")
def parallel_loads(tmp_path_factory, tiny):
    """A float64 checkpoint whose values need float64 (each weight moved by ~2^-40 relative:
    a float32 hop would round it away) and a bf16 export, each loaded in its dtype under TP=2 and
    under PP=2 (one launch per layout, tests/dtype_cases.py)."""
    from conftest import launch_cases, write_jsonl
    from dtype_cases import predictor_case
    from paddletune.loading import load_tokenizer

    base = tmp_path_factory.mktemp("dtype_par")
    m64 = load_model(tiny, dtype="float64")
    rng = np.random.RandomState(0)
    for p in m64.parameters():
        a = p.numpy()
        p.set_value(a * (1 + 2.0 ** -40 * rng.standard_normal(a.shape)))
    tok = load_tokenizer(tiny)
    cks = {"float64": save_pretrained(m64, str(base / "f64"), tok, dtype="float64"),
           "bfloat16": save_pretrained(load_model(tiny), str(base / "bf16"), dtype="bfloat16")}
    got = {}
    for layout, degrees in (("tp", dict(tp=2)), ("pp", dict(pp=2))):
        cases = [(f"{layout}_{d}", "dtype_cases:load_case",
                  dict(ckpt=ck, dtype=d, out_dir=str(base / f"{layout}_{d}"), **degrees))
                 for d, ck in cks.items()]
        if layout == "tp":   # llm/predictor.py in float64 under TP (and alone, the reference)
            data = write_jsonl(str(base / "dev.json"), [{"src": "hi"}, {"src": "Sort: 3 1 2"}])
            pred = ["--model_name_or_path", cks["float64"], "--data_file", data, "--batch_size", "2",
                    "--max_length", "6", "--chat_template", "none", "--dtype", "float64",
                    "--decode_strategy", "greedy_search"]
            got["pred_one"] = predictor_case(pred + ["--output_file", str(base / "pred_one.json")])
            cases.append(("pred_tp", "dtype_cases:predictor_case",
                          dict(argv=pred + ["--output_file", str(base / "pred_tp.json"),
                                            "--tensor_parallel_degree", "2"])))
        got.update(launch_cases(cases, base / layout, nproc=2, timeout=600))
    return base, cks, got


def _expected(ck, dtype):
    """{name: the one-process load in `dtype` (float64 values; bfloat16: the file's words)}."""
    if dtype == "float64":
        return {n: p.numpy() for n, p in load_model(ck, dtype="float64").named_parameters()}
    reader, spec = hf.CheckpointReader(ck), get_spec("llama")
    return {n: hf.to_paddle_layout(spec, n, np.array(reader.files[n]._raw(reader.stored_name(n))[0]))
            for n in reader.keys()}


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_tp2_and_pp2_load_in_the_compute_dtype(parallel_loads, layout, dtype):
    """Every parameter a rank loads is `dtype`, and equals (exactly) the one-process float64
    load's values — its slice under TP — or, for bf16, the checkpoint's 16-bit words."""
    from paddletune.models import load_config
    from paddletune.parallel.plan import param_split, slice_array

    base, cks, got = parallel_loads
    want = _expected(cks[dtype], dtype)
    if dtype == "float64":   # the values need float64: a float32 hop would change them
        assert all(not np.array_equal(r, r.astype(np.float32)) for r in want.values())
    cfg = load_config(cks[dtype])[1]
    spec = get_spec("llama")
    loaded = set()
    for rank, res in enumerate(got[f"{layout}_{dtype}"]):
        assert res["dtypes"] and set(res["dtypes"].values()) == {f"paddle.{dtype}"}, res["dtypes"]
        for name in res["dtypes"]:
            arr = np.load(str(base / f"{layout}_{dtype}" / f"rank{rank}" / f"{name}.npy"))
            ref = want[name]
            if layout == "tp":
                ref = slice_array(ref, param_split(spec, cfg, name, list(ref.shape)), rank, 2)
            assert arr.dtype == ref.dtype and np.array_equal(arr, ref), (rank, name)
        loaded |= set(res["dtypes"])
    assert loaded == set(want)   # PP: the two stages together hold every tensor


def test_tp2_float64_forward_stays_float64(parallel_loads):
    """The TP-loaded float64 model computes in float64: each rank's logits (its vocabulary
    columns) are float64 and equal the one-process float64 model's to 1e-12."""
    from dtype_cases import IDS

    base, cks, got = parallel_loads
    with paddle.no_grad():
        ref = load_model(cks["float64"], dtype="float64")(input_ids=paddle.to_tensor(IDS)).logits.numpy()
    for rank, res in enumerate(got["tp_float64"]):
        assert res["logits_dtype"] == "paddle.float64"
        arr = np.load(str(base / "tp_float64" / f"rank{rank}" / "logits.npy"))
        w = arr.shape[-1]
        cols = ref[..., rank * w:(rank + 1) * w] if w < ref.shape[-1] else ref
        assert np.abs(arr - cols).max() <= 1e-12 * np.abs(ref).max(), rank


def test_tp2_predictor_runs_in_the_dtype(parallel_loads):
    """llm/predictor.py --dtype float64 --tensor_parallel_degree 2 loads float64 slices on both
    ranks and writes the one-process float64 run's file."""
    base, cks, got = parallel_loads
    assert got["pred_one"] == {"rc": 0, "dtypes": [["paddle.float64"]]}
    assert got["pred_tp"] == [{"rc": 0, "dtypes": [["paddle.float64"]]}] * 2
    one, tp = (open(str(base / f"pred_{k}.json")).read() for k in ("one", "tp"))
    assert one.count("\n") == 2 and tp == one
