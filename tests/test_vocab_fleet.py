"""The vocabulary cross-entropy's CUDA route (issue 28, deliverable 6): fleet's
c_softmax_with_cross_entropy (ParallelCrossEntropy's op) over row blocks with the padded
vocabulary columns masked, checked on gloo (its CPU kernel is a stub) with a stand-in for the op
(tests/vocab_fleet_cases.py) against the CPU path on the same 2 ranks (to 1e-6) and a dense
numpy log-softmax over the real vocabulary. V = 601 at TP 2: rank 1's last column is padding."""
import numpy as np
import pytest

from conftest import launch_cases

VOCAB, HIDDEN, N, ROWS = 601, 16, 37, 8


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vocab_fleet")
    return launch_cases([("ce", "vocab_fleet_cases:fleet_ce_case",
                          {"vocab": VOCAB, "hidden": HIDDEN, "n": N, "rows": ROWS})], tmp, nproc=2)["ce"]


def _dense(pad_columns=0):
    """Summed CE of the case's data over the whole head (numpy, float64); with `pad_columns`
    zero columns appended, what an unmasked padded vocabulary would give."""
    rng = np.random.RandomState(0)
    vl = -(-VOCAB // 2)
    w = np.zeros([2 * vl, HIDDEN], np.float32)
    w[:VOCAB] = rng.randn(VOCAB, HIDDEN) * 0.1
    h = rng.randn(N, HIDDEN).astype(np.float32)
    t = rng.randint(0, VOCAB, size=N)
    t[:3] = [VOCAB - 1, 0, vl]
    z = h.astype(np.float64) @ w[:VOCAB + pad_columns].T.astype(np.float64)
    m = z.max(-1, keepdims=True)
    lse = np.log(np.exp(z - m).sum(-1)) + m[:, 0]
    return float((lse - z[np.arange(N), t]).sum())


def test_cuda_route_equals_the_cpu_path_and_the_dense_loss(two):
    dense, unmasked = _dense(), _dense(pad_columns=1)
    assert abs(unmasked - dense) > 1e-4 * abs(dense)     # a missing mask would show (10x tol)
    for res in two:
        assert res["route"] is True and res["route_after"] is False
        assert set(res["fleet"]) == {"head_blocks", "head_kept", "tied_blocks", "tied_kept"}
        for key, fleet in res["fleet"].items():
            cpu = res["cpu"][key]
            np.testing.assert_allclose(fleet["loss"], cpu["loss"], rtol=1e-6, err_msg=key)
            np.testing.assert_allclose(fleet["loss"], dense, rtol=1e-5, err_msg=key)
            for g in ("dh", "dw"):
                np.testing.assert_allclose(fleet[g], cpu[g], rtol=1e-6, atol=1e-6, err_msg=f"{key} {g}")


def test_cuda_route_calls_fleets_op_by_row_blocks_with_its_exact_arguments(two):
    for res in two:
        assert res["vl"] == 301
        for key, calls in res["calls"].items():
            blocks = key.endswith("_blocks")
            # training: blocks of ROWS rows (BLOCK_ELEMENTS / 4 / Vl); kept logits: one call
            assert [c["rows"] for c in calls] == ([8, 8, 8, 8, 5] if blocks else [N]), key
            for c in calls:
                assert c["width"] == 301 and c["group_is_mp"] and c["return_softmax"] is True
                assert c["ignore_index"] == -100 and c["label_shape"] == [c["rows"]]
                # no earlier block's logits or softmax is alive when the next block starts
                assert c["alive_before"] == 0, key
                # the same bound arguments passed paddle's own checks and reached its CPU stub
                # (when paddle gains a CPU kernel this says "ran": the stand-in can go)
                assert c["real"].startswith("RuntimeError") and \
                    "Do not support c_softmax_with_cross_entropy for cpu kernel" in c["real"], c["real"]
