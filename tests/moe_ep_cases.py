"""Training cases for the expert-parallel tests (tests/test_moe_ep.py), run by tests/launch_cases.py
on launched ranks and in the test process for the one-process reference (same function, world 1).

A case trains a built-in tiny MoE (output_router_logits true: the load-balancing loss is in the
loss) on copy data whose target counts differ per rank, with clipping active, and returns per
rank: losses, grad norms, the aux loss, the experts this rank holds (ids and numel), the example
ids it read, and what the expert group communicated. The final model is written by the Trainer's
export (full HF layout, or the LoRA adapter) to out_dir.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import paddletune  # noqa: E402,F401  (CPU threads before paddle)


def copy_data(n=16, seed=0, vocab=500):
    """Copy examples with wildly different target lengths (1..20 tokens)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s, t = int(rng.integers(1, 10)), int(rng.integers(1, 21))
        src, tgt = rng.integers(3, vocab, size=s).tolist(), rng.integers(3, vocab, size=t).tolist()
        out.append({"input_ids": np.array([1] + src + tgt, np.int64),
                    "labels": np.array([-100] * (1 + s) + tgt, np.int64), "id": i})
    return out


def _expert_ids(model):
    ids = set()
    for n, _ in model.named_parameters():
        if ".experts." in n:
            ids.add(int(n.split(".experts.")[1].split(".")[0]))
    return sorted(ids)


def train_case(ckpt, out_dir, ep=1, micro=4, accum=1, steps=3, lora=False, save_steps=0, resume=None,
               max_grad_norm=0.05, lr=1e-2, global_router=True, alltoall=False, recompute=False,
               recompute_granularity="full", quant=None):
    import paddle

    from conftest import training_args
    from paddletune import parallel, peft, runtime
    from paddletune.args import ModelArgument
    from paddletune.models import hf
    from paddletune.loading import load_model
    from paddletune.quant import QuantConfig
    from paddletune.trainer import Trainer

    args = training_args(out_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                         max_steps=steps, logging_steps=1, learning_rate=lr, max_grad_norm=max_grad_norm,
                         expert_parallel_degree=ep, adam_epsilon=1e-4, seed=0,
                         save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                         resume_from_checkpoint=resume, per_device_eval_batch_size=4,
                         recompute=recompute, recompute_granularity=recompute_granularity)
    topo = parallel.init(args)
    runtime.set_seed(0)
    read = []   # every tensor name the load reads from the safetensors files
    real = hf.read_slice, hf.read_torch_linear   # (the second: the weights a quantized layer reads)
    hf.read_slice = lambda reader, spec, name, *a, **k: read.append(name) or real[0](reader, spec, name, *a, **k)
    hf.read_torch_linear = lambda reader, spec, name, *a, **k: read.append(name) or real[1](reader, spec, name, *a, **k)
    try:
        model = load_model(ckpt, topology=topo, quant=QuantConfig(quant, 64, True) if quant else None)
    finally:
        hf.read_slice, hf.read_torch_linear = real
    # LoRA: + the router; QLoRA: attention and experts only (the routers stay float, unadapted)
    targets = list(model.spec.lora_targets) + [r".*\.gate$"] if lora and not quant else None
    setup = peft.apply(model, ModelArgument(model_name_or_path=ckpt, lora=lora, lora_rank=4,
                                            lora_target_modules=targets))
    epg = getattr(model, "expert_parallel", None)
    if epg is not None:
        epg.log = []
        # the NCCL all-to-all dispatch, through cpu_compat's all-gather emulation of alltoall_single
        epg.use_alltoall = alltoall
    held, tokens, targets, marks = [], [], [], []

    def step_done(tr, info):
        held.append([int(i) for mb in info["micro_batches"] for i in mb["example_ids"].tolist()])
        tokens.append([int(mb["input_ids"].size) for mb in info["micro_batches"]])
        targets.append(sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in info["micro_batches"]))
        marks.append(len(epg.log) if epg is not None and epg.log is not None else 0)
    export = _with_dequantized_experts(model, setup.export_fn) if quant else setup.export_fn
    trainer = Trainer(model, args, train_dataset=copy_data(), eval_dataset=copy_data(6, 1),
                      trainable=setup.trainable, export_fn=export, topology=topo,
                      callbacks=[step_done])
    if not global_router:   # negative control: each rank's aux over its own tokens only
        model.expert_parallel = trainer.par.ep = None
    trainer.train()
    metrics = trainer.evaluate()
    hist = trainer.state["log_history"]
    comm, widths = {}, set()   # what the training steps communicated (not eval / export)
    for op, shape, nbytes in (epg.log[:marks[-1]] if epg is not None and epg.log else []):
        comm[op] = comm.get(op, 0) + nbytes
        widths.add(shape[-1])
    expert_numel = sum(int(paddle.numel(p)) for n, p in model.named_parameters() if ".experts." in n)
    routers = [type(m).__name__ for n, m in model.named_sublayers() if n.endswith(".gate")]
    quant_expert = sum(m.nbytes() for n, m in model.named_sublayers()
                       if ".experts." in n and hasattr(m, "state_arrays"))   # codes + scales held
    trainable_expert = sum(int(paddle.numel(p)) for n, p in trainer.trainable.items() if ".experts." in n)
    return {"losses": [r["loss"] for r in hist if "loss" in r],
            "grad_norms": [r["grad_norm"] for r in hist if "grad_norm" in r],
            "aux": [r.get("aux_loss") for r in hist if "loss" in r], "eval_loss": metrics["loss"],
            "experts": _expert_ids(model), "read_experts": sorted({int(n.split(".experts.")[1].split(".")[0])
                                                                   for n in read if ".experts." in n}),
            "read_count": len(read), "expert_numel": expert_numel,
            "trainable_expert_numel": trainable_expert, "quant_expert_bytes": quant_expert,
            "routers": routers, "ids": held, "comm": comm,
            "widths": sorted(widths), "tokens": tokens, "targets": targets,
            "rank": topo.rank, "ep_rank": epg.rank if epg is not None else 0}


def _with_dequantized_experts(model, export_adapter):
    """The adapter export, plus every expert's quantized base weight dequantized
    (experts_dequantized.safetensors, keyed by QuantizedLinear.weight_name): under EP the export
    runs inside parallel.expert.full_experts, so this shows what the gather gave rank 0."""
    def export(out_dir):
        from safetensors.numpy import save_file

        export_adapter(out_dir)
        save_file({m.weight_name: m.dequantize().numpy() for n, m in model.named_sublayers()
                   if ".experts." in n and hasattr(m, "dequantize")},
                  os.path.join(out_dir, "experts_dequantized.safetensors"))
    return export


def quant_full_export_case(ckpt, out_dir):
    """A quantized backbone (nf4) under EP=2 with the Trainer's default (full-model) export:
    every rank must refuse before its first step."""
    from conftest import training_args
    from paddletune import parallel
    from paddletune.loading import load_model
    from paddletune.quant import QuantConfig
    from paddletune.trainer import Trainer

    args = training_args(out_dir, per_device_train_batch_size=4, max_steps=1, expert_parallel_degree=2)
    topo = parallel.init(args)
    model = load_model(ckpt, topology=topo, quant=QuantConfig("nf4", 64, True))
    params = dict(model.named_parameters())
    trainer = Trainer(model, args, train_dataset=copy_data(), topology=topo,
                      trainable={n: p for n, p in params.items() if "norm" in n})
    try:
        trainer.train()
    except ValueError as e:
        return {"error_message": str(e), "steps": trainer.state["global_step"]}
    return {"error_message": None, "steps": trainer.state["global_step"]}


def uneven_case(ckpt, out_dir):
    """9 examples at a global batch of 8 under EP=2: step 2 gives rank 0 one example and rank 1
    none. Every rank must raise the same clear error (no rank left in a collective)."""
    from conftest import training_args
    from paddletune import parallel
    from paddletune.loading import load_model
    from paddletune.trainer import Trainer

    args = training_args(out_dir, per_device_train_batch_size=4, max_steps=2, logging_steps=1,
                         expert_parallel_degree=2)
    topo = parallel.init(args)
    model = load_model(ckpt, topology=topo)
    trainer = Trainer(model, args, train_dataset=copy_data(9), export_fn=lambda d: None, topology=topo)
    try:
        trainer.train()
    except ValueError as e:
        return {"error_message": str(e), "steps": trainer.state["global_step"]}
    return {"error_message": None, "steps": trainer.state["global_step"]}
