"""Check paddletune's single-GPU path on this machine: one command, no download, a few minutes.

    python tools/gpu_check.py [--steps 4] [--seq 512] [--batch 4] [--no-1b] [--peak-tflops T]

What it runs (bfloat16 weights, paddle's fused ops through the op table's gpu column):
  1. Built-in tiny models (Llama, Qwen2, ChatGLM2, Mixtral): SFT (all parameters), LoRA, and nf4
     QLoRA steps; each loss finite; step-1 bf16 loss within 2e-2 (relative) of the float32 run's.
  2. Fused vs dense attention: the same bf16 model's logits through the gpu column (flash
     attention / sdpa / fused RMSNorm / fused rope / F.swiglu) and through plain paddle ops,
     on a causal, a padded and a packed batch: within bf16 tolerance.
     Every parameter gradient of the float32 loss through the gpu column vs plain ops (the
     fused ops' backward kernels), causal and padded batches: within 1e-2 (TF32 room).
  3. The table's GPU choices actually taken (models.ops.TAKEN): flash_attention,
     scaled_dot_product_attention, flashmask_attention, fused_rms_norm,
     fused_rotary_position_embedding, swiglu.
  4. Mixed precision through the Trainer (check_precision): bf16 / fp16 at O1 / O2 vs float32,
     O2's 16-bit weights with float32 norms and float32 master weights, an fp16 overflow skipped.
  5. A random-initialised 1B-shaped Llama (TinyLlama-1.1B's shape) SFT / LoRA / nf4 QLoRA steps:
     tokens/s, MFU (6 * parameters * tokens/s over the device's dense bf16 peak) and peak GPU memory.
Prints one PASS / FAIL line per check and a table; exit 1 when a check fails.
On a CPU build of paddle (or without a GPU) it says it needs a GPU and exits 0: nothing to check.
"""
import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TINY = ("paddletune/tiny-llama", "paddletune/tiny-qwen2", "paddletune/tiny-chatglm2", "paddletune/tiny-mixtral")
# dense bf16 peak, TFLOP/s (vendor sheets, no sparsity), matched against the device name
PEAKS = (("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("A100", 312.0), ("A800", 312.0),
         ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A10", 125.0), ("4090", 165.0), ("3090", 71.0))
ONE_B = dict(model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, vocab_size=32000, rms_norm_eps=1e-5,
             max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.02)


def gpu_missing():
    """None when paddle is a CUDA build that sees a GPU, else the reason."""
    import paddle

    if not paddle.is_compiled_with_cuda():
        return f"paddle {paddle.__version__} is a CPU build"
    if paddle.device.cuda.device_count() == 0:
        return "paddle sees no CUDA device"
    return None


class Report:
    def __init__(self):
        self.failed = 0

    def check(self, name, ok, detail=""):
        self.failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
        return ok


def batch(vocab, B, S, seed=0, kind="causal"):
    """Random tokens, every one labelled; `padded`: row 0 right-padded by S/4; `packed`: two
    examples per row (segment ids)."""
    import numpy as np
    import paddle

    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (B, S))
    out = {"input_ids": paddle.to_tensor(ids), "labels": paddle.to_tensor(ids)}
    if kind == "padded":
        mask = np.ones((B, S), np.int64)
        mask[0, S - S // 4:] = 0
        labels = np.where(mask == 1, ids, -100)
        out.update(attention_mask=paddle.to_tensor(mask), labels=paddle.to_tensor(labels))
    if kind == "packed":
        out["segment_ids"] = paddle.to_tensor(np.repeat([[0] * (S // 3) + [1] * (S - S // 3)], B, 0))
    return out


def make_model(source, dtype, mode):
    """(model, trainable parameters): source a built-in name or a config dict (random init on
    the GPU); mode sft / lora / qlora (nf4 backbone + LoRA)."""
    import paddle

    from paddletune import peft
    from paddletune.args import ModelArgument
    from paddletune.loading import load_model
    from paddletune.models import build_model
    from paddletune.quant import QuantConfig

    quant = QuantConfig(algo="nf4") if mode == "qlora" else None
    if isinstance(source, dict):
        model = build_model(dict(source), dtype=dtype)
        if quant is not None:
            from paddletune.quant import quantize_model_lazily

            quantize_model_lazily(model, quant)
        paddle.seed(0)
        for name, p in model.named_parameters():
            p.set_value(paddle.ones(p.shape, dtype) if len(p.shape) == 1 else
                        (paddle.randn(p.shape, "float32") * 0.02).astype(dtype))
        for m in model.sublayers():   # quantized linears take their weight [out, in] at once
            if getattr(m, "weight_name", None) and hasattr(m, "set_weight"):
                m.set_weight((paddle.randn([m.out_features, m.in_features]) * 0.02).numpy())
    else:
        model = load_model(source, quant=quant, dtype=dtype)
    model.train()
    if mode == "sft":
        return model, [p for p in model.parameters() if not p.stop_gradient]
    setup = peft.apply(model, ModelArgument(model_name_or_path="unused", lora=True, lora_rank=8))
    params = dict(model.named_parameters())
    return model, [params[n] for n in setup.trainable]


def _sync():
    import paddle

    if paddle.is_compiled_with_cuda():
        paddle.device.synchronize()


def train_steps(model, params, data, steps):
    """(losses, seconds per step after the first): AdamW with float32 master weights."""
    import paddle

    from paddletune.models.loss import causal_lm_loss

    opt = paddle.optimizer.AdamW(1e-4, parameters=params, multi_precision=True)
    losses, times = [], []
    for _ in range(steps):
        _sync()
        t0 = time.time()
        out = causal_lm_loss(model, data)
        loss = out.loss_sum / out.num_tokens.astype(out.loss_sum.dtype)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
        _sync()
        times.append(time.time() - t0)
    return losses, (sum(times[1:]) / max(len(times) - 1, 1))


def check_tiny(rep, steps):
    import numpy as np

    for name in TINY:
        for mode in ("sft", "lora", "qlora"):
            model, params = make_model(name, "bfloat16", mode)
            data = batch(model.config.vocab_size if hasattr(model.config, "vocab_size")
                         else model.config.padded_vocab_size, 4, 128)
            l16, _ = train_steps(model, params, data, steps)
            ref_model, ref_params = make_model(name, "float32", mode)
            l32, _ = train_steps(ref_model, ref_params, data, 1)
            ok = all(map(math.isfinite, l16)) and abs(l16[0] - l32[0]) <= 2e-2 * abs(l32[0])
            rep.check(f"{name} {mode}: bf16 losses finite, step 1 vs float32", ok,
                      f"bf16 {np.round(l16, 4).tolist()} float32 {l32[0]:.4f}")


def check_fused_vs_dense(rep, dtype="bfloat16"):
    """Logits of the gpu column vs plain paddle ops (the cpu column, whose CPU kernels are off
    on a CUDA build), three batch layouts; and the table's choices taken."""
    import paddle

    from paddletune.loading import load_model
    from paddletune.models import ops

    model = load_model("paddletune/tiny-llama", dtype=dtype)
    ops.TAKEN.clear()
    for kind in ("causal", "padded", "packed"):
        data = batch(model.config.vocab_size, 2, 256, seed=1, kind=kind)
        inputs = {k: v for k, v in data.items() if k != "labels"}
        with paddle.no_grad():
            with ops.use("gpu"):
                fused = model(**inputs).logits.astype("float32")
            with ops.use("cpu"):
                dense = model(**inputs).logits.astype("float32")
        if "attention_mask" in inputs:   # padded query rows carry no loss: compare real ones
            keep = inputs["attention_mask"].astype("bool")
            fused, dense = fused[keep], dense[keep]
        err = float((fused - dense).abs().max() / dense.abs().max())
        rep.check(f"fused vs dense attention logits ({kind})", err <= 3e-2, f"max|d|/max|ref| {err:.2e}")
    want = {"flash_attention", "scaled_dot_product_attention", "flashmask_attention", "fused_rms_norm",
            "fused_rotary_position_embedding", "swiglu"}
    rep.check("op table: GPU choices taken", want <= ops.TAKEN, f"missing {sorted(want - ops.TAKEN)}")


def check_fused_vs_dense_grads(rep, tol=1e-2):
    """Every parameter gradient of the float32 loss through the gpu column (sdpa, fused RMSNorm,
    fused rope, F.swiglu: the fused ops' backward kernels) vs plain paddle ops, causal and padded
    batches: max|d| / max|ref| per tensor <= tol (float32; tol leaves room for TF32 matmuls)."""
    import paddle

    from paddletune.loading import load_model
    from paddletune.models import ops
    from paddletune.models.loss import causal_lm_loss

    model = load_model("paddletune/tiny-llama", dtype="float32")
    model.train()
    params = dict(model.named_parameters())
    for kind in ("causal", "padded"):
        data = batch(model.config.vocab_size, 2, 128, seed=2, kind=kind)
        grads = {}
        for col in ("gpu", "cpu"):
            model.clear_gradients()
            with ops.use(col):
                out = causal_lm_loss(model, data)
                (out.loss_sum / out.num_tokens.astype(out.loss_sum.dtype)).backward()
            grads[col] = {n: p.grad.astype("float32").numpy() for n, p in params.items()}   # copies
        errs = {n: float(abs(grads["gpu"][n] - g).max() / max(abs(g).max(), 1e-30))
                for n, g in grads["cpu"].items()}
        worst = max(errs, key=errs.get)
        rep.check(f"fused vs dense gradients, every parameter ({kind})", errs[worst] <= tol,
                  f"worst {worst} {errs[worst]:.2e}")


def amp_trainer(key, level, steps, **keys):
    """(Trainer after `steps` steps, its logged losses): tiny-llama loaded float32 (as the script
    loads it), trained through the Trainer with `key` (bf16 / fp16 / None) at `level`."""
    import tempfile

    import numpy as np
    import paddle

    from paddletune.args import TrainingArguments
    from paddletune.loading import load_model
    from paddletune.trainer import Trainer

    paddle.seed(0)
    model = load_model("paddletune/tiny-llama")
    rng = np.random.default_rng(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in rng.integers(3, 500, (16, 64)).tolist()]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=steps, logging_steps=1,
                             save_strategy="no", disable_tqdm=True, learning_rate=1e-4, seed=0,
                             per_device_train_batch_size=4, lr_scheduler_type="constant",
                             fp16_opt_level=level, **({key: True} if key else {}), **keys)
    t = Trainer(model, args, train_dataset=rows, export_fn=lambda d: None)
    t.train()
    return t, [r["loss"] for r in t.state["log_history"] if "loss" in r]


def check_precision(rep, steps):
    """AMP through the Trainer (trainer/amp.py): O1 / O2 in bf16 and fp16 vs float32 (step-1
    loss within 2e-2 relative, all finite); under O2 the weights 16-bit but the float32 islands
    and float32 master weights; an overflow injected under fp16 (scale_loss 2^127) is skipped and
    the scale lowered (to 2^15, amp_decr_ratio 2^-112), the run going on."""
    import paddle

    _, ref = amp_trainer(None, "O1", steps)
    for key in ("bf16", "fp16"):
        for level in ("O1", "O2"):
            t, losses = amp_trainer(key, level, steps)
            ok = len(losses) == steps and all(map(math.isfinite, losses)) and abs(losses[0] - ref[0]) <= 2e-2 * abs(ref[0])
            rep.check(f"AMP {key} {level}: losses finite, step 1 vs float32", ok,
                      f"{[round(x, 4) for x in losses]} float32 {[round(x, 4) for x in ref]}")
            if level == "O2":
                params = dict(t.model.named_parameters())
                low = {n for n, p in params.items() if p.dtype in (paddle.bfloat16, paddle.float16)}
                norms = {n for n in params if n.endswith("norm.weight")}
                masters = t.optimizer.masters()
                rep.check(f"AMP {key} O2: norms float32, the rest 16-bit, float32 masters",
                          low == set(params) - norms and set(masters) == low
                          and all(m.dtype == paddle.float32 for m in masters.values()),
                          f"{len(low)} 16-bit, {len(norms)} norms, {len(masters)} masters")
    t, losses = amp_trainer("fp16", "O2", steps, scale_loss=2.0 ** 127, amp_decr_ratio=2.0 ** -112,
                            amp_decr_every_n_nan_or_inf=1)
    scales = [r.get("loss_scale") for r in t.state["log_history"]]
    rep.check("AMP fp16: injected overflow skipped, scale lowered", t.state.get("skipped_steps") == 1
              and scales[0] == 2.0 ** 15 and t.optimizer.t == steps - 1, f"scales {scales}")


def peak_tflops(given):
    import paddle

    if given:
        return given
    name = paddle.device.cuda.get_device_name()
    return next((p for key, p in PEAKS if key in name), None)


def check_1b(rep, steps, seq, B, peak):
    import paddle

    rows = []
    for mode in ("sft", "lora", "qlora"):
        paddle.device.cuda.empty_cache()
        paddle.device.cuda.reset_max_memory_allocated()
        model, params = make_model(ONE_B, "bfloat16", mode)
        n = sum(int(math.prod(p.shape)) for p in model.parameters())
        n += sum(m.in_features * m.out_features for m in model.sublayers()
                 if getattr(m, "weight_name", None) and hasattr(m, "set_weight"))
        losses, sec = train_steps(model, params, batch(ONE_B["vocab_size"], B, seq), steps)
        tps = B * seq / sec
        mfu = 6 * n * tps / (peak * 1e12) if peak else None
        mem = paddle.device.cuda.max_memory_allocated() / 2**30
        rep.check(f"1B-shaped Llama {mode}: losses finite", all(map(math.isfinite, losses)),
                  f"{[round(x, 4) for x in losses]}")
        rows.append((mode, tps, mfu, mem))
        del model, params
    print(f"\n1B-shaped Llama ({ONE_B['num_hidden_layers']} layers, hidden {ONE_B['hidden_size']}), "
          f"batch {B} x seq {seq}, bf16, device {paddle.device.cuda.get_device_name()}, "
          f"bf16 peak {peak or 'unknown (--peak-tflops)'} TFLOP/s")
    print("| mode | tokens/s | MFU | peak GPU memory (GiB) |\n|---|---|---|---|")
    for mode, tps, mfu, mem in rows:
        print(f"| {mode} | {tps:.0f} | {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | {mem:.1f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--no-1b", action="store_true", help="skip the 1B-shaped Llama")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    a = ap.parse_args(argv)
    why = gpu_missing()
    if why:
        print(f"gpu_check: needs a GPU ({why}); nothing to check on this machine. Run it where "
              "`python -c 'import paddle; paddle.utils.run_check()'` reports a GPU.")
        return 0
    import paddle

    paddle.set_device("gpu")
    from paddletune.models import ops

    rep = Report()
    rep.check("op table chose the gpu column", ops.column() == "gpu", ops.column())
    check_fused_vs_dense(rep)
    check_fused_vs_dense_grads(rep)
    check_tiny(rep, a.steps)
    check_precision(rep, a.steps)
    if not a.no_1b:
        check_1b(rep, a.steps, a.seq, a.batch, peak_tflops(a.peak_tflops))
    print(f"\n{rep.failed} check(s) failed" if rep.failed else "\nall checks passed")
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
