"""Zero padding: packing rules, packed rows, and exactness against the unpacked batch (loss and
every gradient), isolation between packed examples, the trainer's loss normalisation, learning."""
import numpy as np
import paddle
import pytest

from conftest import ROOT, copy_pairs, lm_loss, rel_err, run_script, token_accuracy, training_args
from paddletune.data.collate import pad_batch
from paddletune.data.packing import (PackedSource, collate_packed, pack_greedy, pack_sequential,
                                     packing_stats)
from paddletune.models import build_model, layers
from paddletune.models.loss import causal_lm_loss

CFG = dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def examples(lengths, seed=0, vocab=300):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = rng.integers(3, vocab, n)
        labels = ids.copy()
        labels[:max(1, n // 3)] = -100        # a prompt, then targets
        out.append({"input_ids": ids, "labels": labels, "id": i})
    return out


def test_packing_rules_worked_example():
    assert pack_sequential([5, 4, 3, 2], 8) == [[0], [1, 2], [3]]
    assert pack_greedy([5, 4, 3, 2], 8) == [[0, 3], [1, 2]]
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 100, 1234).tolist()
    for packs in (pack_sequential(lengths, 128), pack_greedy(lengths, 128), pack_greedy(lengths, 128, buffer=50)):
        assert sorted(i for p in packs for i in p) == list(range(len(lengths)))   # none dropped
        assert all(sum(lengths[i] for i in p) <= 128 for p in packs)
    assert pack_greedy(lengths, 128) == pack_greedy(lengths, 128)                  # deterministic
    assert all(len({i // 50 for i in p}) == 1 for p in pack_greedy(lengths, 128, buffer=50))
    stats = packing_stats(lengths, pack_greedy(lengths, 128), 128, micro_batch=8)
    assert stats["packed_efficiency"] > 0.95 > stats["padded_efficiency"]
    with pytest.raises(ValueError, match="example 1 has 9 tokens, more than max_length=8"):
        pack_sequential([3, 9], 8)


def test_collate_packed_hand_worked():
    a = {"input_ids": np.array([1, 5, 6]), "labels": np.array([1, 5, 6]), "id": 7}      # labelled at 0
    b = {"input_ids": np.array([1, 8]), "labels": np.array([-100, 8]), "id": 9}
    out = collate_packed([[a, b], [b]], pad_id=0)
    np.testing.assert_array_equal(out["input_ids"], [[1, 5, 6, 1, 8], [1, 8, 0, 0, 0]])
    np.testing.assert_array_equal(out["labels"], [[-100, 5, 6, -100, 8], [-100, 8, -100, -100, -100]])
    np.testing.assert_array_equal(out["position_ids"], [[0, 1, 2, 0, 1], [0, 1, 0, 0, 0]])
    np.testing.assert_array_equal(out["segment_ids"], [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(out["attention_mask"], [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    assert out["example_ids"].tolist() == [7, 9, 9]


def _loss_and_grads(model, batch, n):
    for p in model.parameters():
        p.clear_gradient()
    inp = {k: paddle.to_tensor(v) for k, v in batch.items()
           if k in ("input_ids", "labels", "position_ids", "segment_ids")}
    out = causal_lm_loss(model, inp)
    (out.loss_sum / n).backward()
    return float(out.loss_sum) / n, {k: p.grad.numpy().copy() for k, p in model.named_parameters()}


@pytest.mark.parametrize("block,recompute", [(256, False), (16, False), (16, True)])
def test_packed_equals_unpacked_loss_and_gradients(block, recompute, monkeypatch):
    """One global batch of variable-length examples: the packed rows give the same loss and the
    same gradient for every parameter as the right-padded batch (1e-5)."""
    monkeypatch.setattr(layers.PackedRows, "BLOCK", block)
    model = build_model(CFG, seed=0)
    model.recompute = recompute
    model.train()
    exs = examples([5, 40, 7, 12, 3, 60, 9, 20, 33, 8, 2, 17])
    n = sum(int((e["labels"][1:] != -100).sum()) for e in exs)
    loss_u, grads_u = _loss_and_grads(model, pad_batch(exs, 0), n)
    packs = pack_greedy([len(e["input_ids"]) for e in exs], 64)
    assert max(len(p) for p in packs) >= 3
    loss_p, grads_p = _loss_and_grads(model, collate_packed([[exs[i] for i in p] for p in packs], 0), n)
    assert abs(loss_p - loss_u) / loss_u < 1e-5
    for k in grads_u:
        assert rel_err(grads_p[k], grads_u[k]) < 1e-5, k


def test_isolation_second_example_cannot_see_the_first():
    """Packed [A, B]: B's loss equals B alone. The same row without segment ids (plain causal
    attention, positions still restarting) changes B's loss, so the check can fail."""
    model = build_model(dict(CFG, initializer_range=0.2), seed=0)   # sharp attention
    model.eval()
    a, b = examples([30, 12], seed=3)
    a = dict(a, labels=np.full(30, -100))          # loss only on B
    alone = float(lm_loss(model, b["input_ids"][None], b["labels"][None]).loss_sum)
    row = collate_packed([[a, b]], 0)
    t = {k: paddle.to_tensor(v) for k, v in row.items() if k in ("input_ids", "labels", "position_ids", "segment_ids")}
    packed = float(causal_lm_loss(model, t).loss_sum)
    leaky = float(causal_lm_loss(model, {k: v for k, v in t.items() if k != "segment_ids"}).loss_sum)
    assert abs(packed - alone) / alone < 1e-5
    assert abs(leaky - alone) / alone > 1e-2


def test_trainer_step_loss_packed_equals_unpacked(tmp_path):
    """Trainer.training_step normalises by the global target count: the same examples give the
    same loss packed (2 micro-batches of rows) and padded."""
    from paddletune.trainer import Trainer

    exs = examples([5, 40, 7, 12, 3, 60, 9, 20], seed=2)
    model = build_model(CFG, seed=0)
    tr = Trainer(model, training_args(tmp_path, learning_rate=0.0, max_grad_norm=0), train_dataset=exs,
                 export_fn=lambda d: None)
    packs = pack_sequential([len(e["input_ids"]) for e in exs], 64)
    packed = [collate_packed([[exs[i] for i in p] for p in packs[:2]], 0),
              collate_packed([[exs[i] for i in p] for p in packs[2:]], 0)]
    padded = [pad_batch(exs[:3], 0), pad_batch(exs[3:], 0)]
    lp, np_, tp, _ = tr.training_step(packed, 0.0)
    lu, nu, tu, _ = tr.training_step(padded, 0.0)
    assert tp == tu and abs(float(lp) - float(lu)) / float(lu) < 1e-5 and abs(float(np_) - float(nu)) / float(nu) < 1e-5


def test_zero_padding_learns_copy_task(tmp_path):
    from paddletune.trainer import Trainer

    pairs = copy_pairs(16, length=6, vocab=300) + copy_pairs(8, length=14, vocab=300, seed=1)
    for i, e in enumerate(pairs):
        e["id"] = i
    model = build_model(CFG, seed=0)
    source = PackedSource(pairs, 64, 8, 1, greedy=True)
    assert source.stats["packs"] < len(pairs)
    Trainer(model, training_args(tmp_path, max_steps=100, learning_rate=1e-2), train_dataset=pairs,
            train_source=source, export_fn=lambda d: None).train()
    assert token_accuracy(model, pairs) == 1.0


def test_data_parallel_ranks_take_their_own_packs():
    exs = examples(list(np.random.default_rng(5).integers(2, 60, 50)))
    full = PackedSource(exs, 128, 4, 1, dp_world=1)
    r0, r1 = (PackedSource(exs, 128, 2, 1, dp_world=2, dp_rank=r) for r in (0, 1))
    for (_, m), (_, a), (_, b) in zip(full.iterate(0), r0.iterate(0), r1.iterate(0)):
        ids = lambda ms: sorted(i for x in ms for i in x["example_ids"].tolist())  # noqa: E731
        assert sorted(ids(a) + ids(b)) == ids(m) and not set(ids(a)) & set(ids(b)) and ids(a) and ids(b)


def test_arguments():
    from paddletune.args import ArgumentError, build

    base = {"model_name_or_path": "m", "dataset_name_or_path": "d", "output_dir": "o"}
    _, data, *_ = build(dict(base, greedy_zero_padding=True))
    assert data.zero_padding
    with pytest.raises(ArgumentError, match="'lazy' needs max_steps"):
        build(dict(base, lazy=True, do_train=True))
    build(dict(base, lazy=True, do_train=True, max_steps=5))
    seen = []   # PaddleNLP's long-context files do this: nothing happens before the end (warned)
    build(dict(base, lazy=True, do_train=True, max_steps=5, save_strategy="epoch"), warn=seen.append)
    assert any("'save_strategy: epoch' has no effect with lazy data" in w for w in seen)


def test_benchmark_smoke():
    r = run_script(["benchmarks/packing.py", "--smoke"], cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| packed |" in r.stdout and "| padded |" in r.stdout and "python benchmarks/packing.py" in r.stdout
