"""PaddleFormers peer: the shared HF checkpoint loaded with convert_from_hf, (LoRA via
paddleformers.peft), and a plain training step as PaddleFormers' Trainer does it:

    loss = model(input_ids, labels=shifted labels, attention_mask)[0]
    loss.backward(); AdamW(grad_clip=ClipGradByGlobalNorm).step(); clear_grad()

    python benchmarks/peers/paddleformers_train.py SPEC.json   (run by its own venv's python)

PaddleFormers' loss does not shift: its data pipeline stores labels[t] = the token after t, so
the shared (unshifted) labels are shifted here: labels[:, 1:] + one -100 column (the same
targets as the other peers). `fuse_rms_norm=False` because the fused kernel is GPU-only.
Padding is PaddleFormers' default (max_seq_len unset: each batch padded to its longest row).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main():
    spec = common.read_spec()
    if spec["layout"] != "padded":
        common.not_available("not measured: the issue compares PaddleFormers with its default padding")
    import numpy as np
    import paddle
    import paddleformers
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    rss_import = common.rss_mb()
    paddle.seed(spec["seed"])
    cfg = LlamaConfig.from_pretrained(spec["checkpoint"])
    cfg.fuse_rms_norm = False
    model = LlamaForCausalLM.from_pretrained(spec["checkpoint"], config=cfg, convert_from_hf=True, dtype="float32")
    if spec["method"] == "lora":
        from paddleformers.peft import LoRAConfig, LoRAModel

        lcfg = LoRAConfig(target_modules=[rf".*\.{n}$" for n in spec["lora_targets"]], r=spec["lora_rank"],
                          lora_alpha=spec["lora_alpha"], lora_dropout=0.0, dtype="float32")
        model = LoRAModel(model, lcfg)
        model.mark_only_lora_as_trainable()
    model.train()
    params = [p for p in model.parameters() if not p.stop_gradient]
    clip = paddle.nn.ClipGradByGlobalNorm(spec["max_grad_norm"]) if spec["max_grad_norm"] else None
    opt = paddle.optimizer.AdamW(learning_rate=spec["lr"], parameters=params, beta1=0.9, beta2=0.999, epsilon=1e-8,
                                 weight_decay=0.0, grad_clip=clip)
    batches = common.load_batches(spec["data"])

    def prepare(b):
        shifted = np.concatenate([b["labels"][:, 1:], np.full((b["labels"].shape[0], 1), -100, np.int64)], 1)
        return {"input_ids": paddle.to_tensor(b["input_ids"]), "labels": paddle.to_tensor(shifted),
                "attention_mask": paddle.to_tensor(b["attention_mask"])}

    def step(b):
        loss = model(input_ids=b["input_ids"], labels=b["labels"], attention_mask=b["attention_mask"])[0]
        loss.backward()
        opt.step()
        opt.clear_grad()
        return float(loss)

    result = common.time_steps(step, batches, spec, prepared=[prepare(b) for b in batches])
    result.update(rss_after_import_mb=rss_import, trainable_params=common.count_params(params),
                  versions={"paddleformers": paddleformers.__version__, "paddle": paddle.__version__},
                  threads="paddle: OMP/MKL from the environment")
    common.emit(result)


if __name__ == "__main__":
    main()
