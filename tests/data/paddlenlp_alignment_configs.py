"""PaddleNLP's DPO and KTO argument files, written down as test data (facts only): every key and
value of llm/config/{llama,chatglm2,qwen}/{dpo,dpo_lora,kto,kto_lora}_argument.json in
PaddlePaddle/PaddleNLP (develop, as stored in 2026; blob commits noted per file). Used by
tests/test_dpo.py, which changes only paths, sizes and parallel degrees before running them.
"""

_COMMON = {
    "model_name_or_path": None, "train_dataset_path": "./data/train.jsonl",
    "dev_dataset_path": "./data/dev.jsonl", "output_dir": "./checkpoints/dpo_ckpts",
    "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8, "per_device_eval_batch_size": 1,
    "num_train_epochs": 1, "max_steps": 100, "learning_rate": 1e-06, "warmup_steps": 10,
    "logging_steps": 1, "evaluation_strategy": "steps", "save_strategy": "steps", "eval_steps": 100,
    "save_steps": 500, "max_seq_len": 4096, "max_prompt_len": 2048, "bf16": True, "fp16_opt_level": "O2",
    "do_train": True, "do_eval": True, "disable_tqdm": True, "load_best_model_at_end": True,
    "tensor_parallel_degree": 8, "sharding": "stage1", "use_flash_attention": True, "flash_mask": True,
    "recompute": False, "recompute_granularity": "full", "beta": 0.1, "benchmark": False,
    "loss_type": "sigmoid", "label_smoothing": 0.0, "unified_checkpoint": True,
    "autotuner_benchmark": False, "lazy": False, "seed": 42,
}
_LORA = {"learning_rate": 1e-05, "tensor_parallel_degree": 1, "lora": True, "lora_rank": 64, "rslora_plus": True}
_KTO = {"output_dir": "./checkpoints/kto_ckpts", "learning_rate": 2e-06}


def _file(base, drop=(), **changes):
    d = {k: v for k, v in base.items() if k not in drop}
    d.update(changes)
    return d


def _kto(model, **changes):
    return _file(_COMMON, ("loss_type", "label_smoothing"), model_name_or_path=model, **{**_KTO, **changes})


LLAMA, GLM, QWEN = "meta-llama/Meta-Llama-3-8B", "THUDM/chatglm2-6b", "Qwen/Qwen2-7B"
CONFIGS = {
    # llama: 136516b (dpo), 119d4f5 (dpo_lora), 863ff0b (kto), e006472 (kto_lora)
    "llama/dpo_argument.json": _file(_COMMON, model_name_or_path=LLAMA),
    "llama/dpo_lora_argument.json": _file(_COMMON, model_name_or_path=LLAMA, **_LORA),
    "llama/kto_argument.json": _kto(LLAMA),
    "llama/kto_lora_argument.json": _kto(LLAMA, learning_rate=2e-05, lora=True),
    # chatglm2: 5598973 (dpo), 136516b (dpo_lora), 8b4762c (kto), 5cfe930 (kto_lora); no flash_mask
    "chatglm2/dpo_argument.json": _file(_COMMON, ("flash_mask",), model_name_or_path=GLM,
                                        gradient_accumulation_steps=1, tensor_parallel_degree=1,
                                        sharding_parallel_degree=8, sharding="stage2", recompute=True),
    "chatglm2/dpo_lora_argument.json": _file(_COMMON, ("flash_mask",), model_name_or_path=GLM, **_LORA),
    "chatglm2/kto_argument.json": _file(_kto(GLM), ("flash_mask",)),
    "chatglm2/kto_lora_argument.json": _file(_kto(GLM, learning_rate=2e-05, lora=True), ("flash_mask",)),
    # qwen: 136516b (dpo: no lazy / seed keys), bc55104 (dpo_lora: no flash_mask), 5cfe930 (kto, kto_lora)
    "qwen/dpo_argument.json": _file(_COMMON, ("lazy", "seed"), model_name_or_path=QWEN,
                                    tensor_parallel_degree=4, flash_mask=False),
    "qwen/dpo_lora_argument.json": _file(_COMMON, ("flash_mask",), model_name_or_path=QWEN, **_LORA),
    "qwen/kto_argument.json": _kto(QWEN),
    "qwen/kto_lora_argument.json": _kto(QWEN, learning_rate=2e-05, lora=True),
}
TINY = {"llama": "paddletune/tiny-llama", "chatglm2": "paddletune/tiny-chatglm2", "qwen": "paddletune/tiny-qwen2"}
