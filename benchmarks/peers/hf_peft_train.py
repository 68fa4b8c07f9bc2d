"""transformers + peft peer on torch CPU: the shared HF checkpoint, (LoRA via peft), and a plain
training step as the HF Trainer does it (no data loader, no logging):

    loss = model(input_ids, attention_mask, labels).loss    # HF shifts labels inside
    loss.backward(); clip_grad_norm_(trainable, max_grad_norm); AdamW.step(); zero_grad()

    python benchmarks/peers/hf_peft_train.py SPEC.json   (see common.py)

Attention is transformers' default ("sdpa"); logits are computed at every position (HF's way).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main():
    spec = common.read_spec()
    if spec["layout"] != "padded":
        common.not_available("not measured: transformers+peft runs with padding (its default collator)")
    import torch
    import transformers
    from transformers import LlamaForCausalLM

    rss_import = common.rss_mb()
    torch.manual_seed(spec["seed"])
    model = LlamaForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32, attn_implementation="sdpa")
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    if spec.get("recompute"):   # whole decoder layers, as paddletune's recompute_granularity "full"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec["method"] == "lora":
        import peft
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=spec["lora_rank"], lora_alpha=spec["lora_alpha"], lora_dropout=0.0,
                                                 target_modules=list(spec["lora_targets"]), bias="none"))
        versions["peft"] = peft.__version__
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    batches = common.load_batches(spec["data"])
    tensors = [{k: torch.from_numpy(v) for k, v in b.items()} for b in batches]

    def step(b):
        loss = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
        loss.backward()
        if spec["max_grad_norm"]:
            torch.nn.utils.clip_grad_norm_(params, spec["max_grad_norm"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    result = common.time_steps(step, batches, spec, prepared=tensors)
    result.update(rss_after_import_mb=rss_import, trainable_params=common.count_params(params), versions=versions,
                  threads=f"torch.get_num_threads()={torch.get_num_threads()}")
    common.emit(result)


if __name__ == "__main__":
    main()
