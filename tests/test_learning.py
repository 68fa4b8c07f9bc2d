"""Learning on a task with a checkable answer: 16 random-token copy pairs."""
from conftest import copy_pairs, hf_checkpoint, token_accuracy, training_args
from paddletune.loading import load_model
from paddletune.trainer import Trainer


def test_full_finetune_memorises_copy_pairs(tmp_path):
    path, _ = hf_checkpoint(tmp_path / "ck", "llama")
    model = load_model(path)
    data = copy_pairs(n=16, length=8)
    assert token_accuracy(model, data) < 0.2
    trainer = Trainer(model, training_args(tmp_path / "out", max_steps=80), train_dataset=data,
                      export_fn=lambda d: None)
    trainer.train()
    assert token_accuracy(model, data) == 1.0


def test_greedy_generation_reproduces_targets_after_training(tmp_path):
    """Teacher-forced accuracy 1.0 means greedy decoding reproduces each target: checked here
    by decoding greedily token by token with the KV cache."""
    import numpy as np
    import paddle
    from paddletune.models.cache import KVCache

    path, _ = hf_checkpoint(tmp_path / "ck", "qwen2", tie_word_embeddings=True)
    model = load_model(path)
    data = copy_pairs(n=16, length=6, seed=1)
    Trainer(model, training_args(tmp_path / "out", max_steps=80), train_dataset=data,
            export_fn=lambda d: None).train()
    model.eval()
    for ex in data[:4]:
        prompt = ex["input_ids"][:7]
        cache = KVCache.for_model(model, 1, 16)
        logits = model(paddle.to_tensor(prompt[None]), cache=cache).logits
        out = []
        for _ in range(6):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            logits = model(paddle.to_tensor(np.array([[nxt]])), cache=cache).logits
        assert out == ex["input_ids"][7:].tolist()


def test_divergence_stops_with_a_clear_error(tmp_path):
    import pytest

    path, _ = hf_checkpoint(tmp_path / "ck", "llama")
    model = load_model(path)
    trainer = Trainer(model, training_args(tmp_path / "out", max_steps=5, learning_rate=float("inf"), logging_steps=1,
                                           max_grad_norm=0.0),
                      train_dataset=copy_pairs(), export_fn=lambda d: None)
    with pytest.raises(FloatingPointError, match="training diverged at step"):
        trainer.train()
