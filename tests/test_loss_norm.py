"""Loss normalisation invariant to accumulation and data parallelism (issue: transformers PR #34191).

Reference: the same 4 global batches of 4 variable-length examples as batch 4 x GA 1 (single
process). batch 1 x GA 4 and DP 2 x batch 2 (two real processes) must log the same losses and end
with the same weights (1e-5); the DP ranks must read disjoint shares covering each global batch."""
import json
import os

import numpy as np
import pytest

from conftest import ROOT, hf_checkpoint, launch, lm_loss, rel_err, run_script
from paddletune.models.hf import SafetensorsFile

WORKER = os.path.join(ROOT, "tests", "dp_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("lossnorm")
    ck, _ = hf_checkpoint(base / "ck", "llama")
    out = {}
    for name, micro, accum in (("b4", 4, 1), ("b1ga4", 1, 4)):
        r = run_script([WORKER, ck, str(base / name), str(micro), str(accum), "4"])
        assert r.returncode == 0, r.stderr[-3000:]
        out[name] = base / name
    r = launch([WORKER, ck, str(base / "dp2"), "2", "1", "4"], nproc=2, log_dir=base / "dplog")
    assert r.returncode == 0, (r.stdout[-2000:], open(base / "dplog" / "workerlog.0").read()[-3000:])
    out["dp2"] = base / "dp2"
    return out


def load(run):
    losses = json.load(open(run / "losses.json"))
    st = SafetensorsFile(str(run / "weights.safetensors"))
    return np.array(losses), {k: st.get(k) for k in st.keys()}


@pytest.mark.parametrize("other", ["b1ga4", "dp2"])
def test_same_losses_and_weights(runs, other):
    ref_l, ref_w = load(runs["b4"])
    l, w = load(runs[other])
    assert len(l) == 4
    np.testing.assert_allclose(l, ref_l, rtol=1e-5, atol=0)
    # all weights together, max|d| / max|ref| <= 1e-5; per tensor 1e-4, because AdamW divides by
    # sqrt(v): elements whose gradient nearly cancels (|g| ~ eps) turn float32 summation-order noise
    # into ~1e-3 relative update noise. The gradients themselves agree per tensor to 1e-5 (below).
    flat = lambda d: np.concatenate([d[k].ravel() for k in sorted(d)])  # noqa: E731
    assert rel_err(flat(w), flat(ref_w)) <= 1e-5
    assert max(rel_err(w[k], ref_w[k]) for k in ref_w) <= 1e-4
    # training really moved the weights (the comparison is not between two untouched copies)
    assert any(np.abs(w[k] - ref_w0).max() > 1e-4 for k, ref_w0 in _initial(runs).items())


def _initial(runs):
    st = SafetensorsFile(str(runs["b4"].parent / "ck" / "model.safetensors"))
    from paddletune.models.hf import to_paddle_layout
    from paddletune.models import get_spec

    spec = get_spec("llama")
    return {k: to_paddle_layout(spec, k, st.get(k)) for k in st.keys()}


def test_dp_ranks_read_disjoint_shares_of_each_global_batch(runs):
    r0 = json.load(open(runs["dp2"] / "ids-rank0.json"))
    r1 = json.load(open(runs["dp2"] / "ids-rank1.json"))
    ref = json.load(open(runs["b4"] / "ids-rank0.json"))
    assert len(r0) == len(r1) == len(ref) == 4
    for a, b, g in zip(r0, r1, ref):
        a, b = sum(a, []), sum(b, [])
        assert len(a) == len(b) == 2 and not set(a) & set(b)
        assert sorted(a + b) == sorted(sum(g, []))
    assert not os.path.exists(runs["dp2"] / "losses-rank1.json")


def _torch_first_step(runs, ids):
    """Per example of the first global batch, at the initial weights, by transformers (torch) on
    the checkpoint every run starts from -- independent of our model and loss:
    {id: (sum of target-token CE, target count, {HF name: d(CE sum)/d(param)})}."""
    import sys

    import torch
    import transformers

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dp_worker import variable_length_data

    data = variable_length_data()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(runs["b4"].parent / "ck")).eval()
    params = dict(ref.named_parameters())
    out = {}
    for i in ids:
        logits = ref(torch.tensor(data[i]["input_ids"][None])).logits[0, :-1]
        labels = torch.tensor(data[i]["labels"][1:])
        keep = labels != -100
        ce = torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum")
        grads = torch.autograd.grad(ce, list(params.values()))
        out[i] = (float(ce.detach()), int(keep.sum()),
                  {n: g.double().numpy() for n, g in zip(params, grads)})
    return out


def _first_micro_batches(runs):
    """Example ids of the first step's micro-batches: b4 [[4]], b1ga4 [[1]] x 4, dp2 one [2] per rank."""
    return {"b4": json.load(open(runs["b4"] / "ids-rank0.json"))[0],
            "b1ga4": json.load(open(runs["b1ga4"] / "ids-rank0.json"))[0],
            "dp2": [json.load(open(runs["dp2"] / f"ids-rank{r}.json"))[0][0] for r in (0, 1)]}


def test_mean_of_micro_batch_means_would_differ(runs):
    """Sensitivity check on the data of the first step (torch as the oracle): every run logs the
    token-weighted mean (sum of CE / target tokens of the global batch), while the naive mean of
    micro-batch means -- for batch 1 x GA 4 and for DP 2 x batch 2 -- is clearly different, in the
    loss and far more in the gradient, so the equalities above are not an accident of equal
    lengths. (At random init every token's CE is near ln(vocab), so the loss moves only ~1e-4;
    the gradient weights examples 1/n_m instead of 1/N and moves by several percent.)"""
    micro = _first_micro_batches(runs)
    assert [len(m) for m in micro["b1ga4"]] == [1, 1, 1, 1] and [len(m) for m in micro["dp2"]] == [2, 2]
    ids = sum(micro["b4"], [])
    ref = _torch_first_step(runs, ids)
    counts = [ref[i][1] for i in ids]
    assert len(set(counts)) > 1   # target lengths really differ within the global batch
    total = sum(counts)
    correct = sum(ref[i][0] for i in ids) / total
    flat = lambda g: np.concatenate([g[k].ravel() for k in sorted(g)])  # noqa: E731
    g_correct = sum(flat(ref[i][2]) for i in ids) / total
    for name in ("b4", "b1ga4", "dp2"):
        assert sorted(sum(micro[name], [])) == sorted(ids)      # the same global batch
        logged = json.load(open(runs[name] / "losses.json"))[0]
        assert abs(logged - correct) <= 1e-5 * correct, name
    for name in ("b1ga4", "dp2"):
        parts = micro[name]
        naive = float(np.mean([sum(ref[i][0] for i in m) / sum(ref[i][1] for i in m) for m in parts]))
        g_naive = sum(sum(flat(ref[i][2]) for i in m) / sum(ref[i][1] for i in m) for m in parts) / len(parts)
        assert abs(naive - correct) > 5e-5 * correct, (name, naive, correct)   # 5x the loss rtol above
        assert rel_err(g_naive, g_correct) > 1e-2, name    # 10^3 x the gradient tolerance below


def _loss_sum(model, batch):
    """Sum of target-token CE of one padded batch by our model (the one place the model is
    called with labels here)."""
    return lm_loss(model, batch["input_ids"], batch["labels"]).loss_sum


def test_first_step_gradients_equal_per_tensor(runs):
    """The quantity being normalised: gradients of one global batch as batch 4 and as 4 x batch 1
    (loss_sum / global target count per micro-batch) agree per tensor to 1e-5, and both equal
    transformers' gradient of the token-mean loss over the global batch (torch, per tensor, 1e-5)."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dp_worker import variable_length_data
    from paddletune.data.collate import pad_batch
    from paddletune.models import get_spec
    from paddletune.loading import load_model
    from paddletune.models.hf import to_paddle_layout

    data = variable_length_data()
    ids = json.load(open(runs["b4"] / "ids-rank0.json"))[0][0]
    n = sum(int((data[i]["labels"][1:] != -100).sum()) for i in ids)

    def grads(micro):
        model = load_model(str(runs["b4"].parent / "ck"))
        model.train()
        for k in range(0, len(ids), micro):
            b = pad_batch([data[i] for i in ids[k:k + micro]], 0)
            (_loss_sum(model, b) / n).backward()
        return {k: p.grad.numpy() for k, p in model.named_parameters()}

    a, b = grads(4), grads(1)
    assert max(rel_err(b[k], a[k]) for k in a) <= 1e-5
    ref = _torch_first_step(runs, ids)
    spec = get_spec("llama")
    want = {k: to_paddle_layout(spec, k, sum(ref[i][2][k] for i in ids) / n) for k in ref[ids[0]][2]}
    assert set(want) == set(a)
    assert max(rel_err(a[k], want[k]) for k in want) <= 1e-5
