"""Arguments: PaddleNLP's key names and defaults, typed dataclasses, one table of what each key does.

    model_args, data_args, quant_args, gen_args, training_args = parse_args()
    # argv: one positional .json file, then `--key value` (or --key=value) overrides

Every key belongs to exactly one dataclass. Each field's metadata is its row in the table:
  help    one line, printed by --help and in the README table
  status  "implemented"  the key does what PaddleNLP's does
          "no_effect"    accepted; a non-default value warns once that it has no effect here (why)
          "refused"      a non-default value is an error naming the key and what to do (why)
After parsing, `_resolve` fills the derived values (lora_path implies lora, ...; the only step
that changes a value), then `_check_values` applies the value-dependent rules (fp16 on CPU,
parallel degrees, PEFT sizes, ...) without changing anything. Each rule is checked here only:
the library code behind a key relies on it.
Unknown keys fail with the file, the key and the closest valid key; nothing is run before that.
"""
import dataclasses
import difflib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import List, Optional


class ArgumentError(ValueError):
    """Bad user input: the message names the key, the source and the fix."""


def F(default, help, status="implemented", why=None, choices=None):
    meta = {"help": help, "status": status, "why": why, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


NOEFF_PARALLEL = "this launcher has no such switch; the setting is ignored"
NOEFF_FUSED = "paddletune picks its own CPU kernels (paddletune/kernels); results are the same"
NOEFF_PTQ = "post-training quantization is not implemented"


@dataclass
class ModelArgument:
    model_name_or_path: str = F(None, "local HF checkpoint directory (config.json, *.safetensors, tokenizer) or a built-in name: paddletune/tiny-<llama|qwen2|qwen3|chatglm2|gpt2|opt|bloom> (paddletune.models.BUILTIN_MODELS)")
    tokenizer_name_or_path: Optional[str] = F(None, "tokenizer directory when it differs from model_name_or_path")
    use_flash_attention: bool = F(False, "GPU flash attention; on CPU the exact attention kernel is used (warned)")
    use_fast_layer_norm: bool = F(False, "fused layer norm kernel (GPU only)", "no_effect", "no fused norm kernel is used")
    fuse_attention_qkv: bool = F(False, "fuse q/k/v projections", "no_effect", "projections stay separate (HF layout)")
    fuse_attention_ffn: bool = F(False, "fuse gate/up projections", "no_effect", "projections stay separate (HF layout)")
    from_aistudio: bool = F(False, "load from AI Studio", "refused", "there are no downloads here; pass a local directory")
    save_to_aistudio: bool = F(False, "upload to AI Studio", "refused", "there are no uploads here")
    aistudio_repo_id: Optional[str] = F(None, "AI Studio repo id", "refused", "there are no uploads here")
    aistudio_repo_private: bool = F(True, "AI Studio repo visibility", "no_effect", "there are no uploads here")
    aistudio_repo_license: str = F("Apache License 2.0", "AI Studio repo license", "no_effect", "there are no uploads here")
    aistudio_token: Optional[str] = F(None, "AI Studio token", "no_effect", "there are no uploads here")
    # LoRA
    lora: bool = F(False, "train LoRA adapters on the frozen model (HF-PEFT adapter format)")
    lora_path: Optional[str] = F(None, "start from a saved LoRA adapter directory (adapter_config.json + adapter_model.safetensors)")
    lora_rank: int = F(8, "LoRA rank r")
    lora_alpha: int = F(-1, "LoRA alpha; -1 means 2 x lora_rank. Scale = alpha/r (alpha/sqrt(r) with rslora)")
    lora_dropout: float = F(0.0, "dropout on the LoRA input")
    lora_target_modules: Optional[List[str]] = F(None, "regexes over module names to wrap with LoRA; default: every decoder Linear (from the model's ModelSpec)")
    rslora: bool = F(False, "rank-stabilised LoRA: scale alpha/sqrt(r)")
    lora_plus_scale: float = F(1.0, "LoRA+: learning-rate multiplier for the B matrices")
    pissa: bool = F(False, "PiSSA initialisation", "refused", "PiSSA is not implemented; use lora")
    use_quick_lora: bool = F(False, "fused LoRA kernel", "no_effect", "no fused LoRA kernel; the exact path is used")
    # Prefix tuning
    prefix_tuning: bool = F(False, "train learned per-layer key/value prefixes on the frozen model")
    prefix_path: Optional[str] = F(None, "start from a saved prefix directory")
    num_prefix_tokens: int = F(128, "number of prefix tokens")
    prefix_projection: bool = F(False, "reparameterise prefixes through a 2-layer MLP (merged away on save)")
    prefix_projection_hidden_size: int = F(-1, "hidden size of the prefix MLP; -1 means the model's hidden size")
    # Other PEFT methods
    adapter: bool = F(False, "bottleneck adapters after attention and MLP (up-projection zero-init)")
    adapter_size: int = F(64, "adapter bottleneck width")
    lowrank_adapter: bool = F(False, "adapters whose projections are factorised low-rank")
    lowrank_adapter_rank: int = F(4, "rank of the low-rank adapter factors")
    bitfit: bool = F(False, "train biases only (zero-initialised biases are added where the model has none)")
    rdrop: bool = F(False, "R-Drop: two dropout passes, loss = CE + rdrop_alpha x symmetric KL on target positions")
    rdrop_alpha: float = F(1.0, "weight of the R-Drop KL term")
    neftune: bool = F(False, "NEFTune: uniform noise on input embeddings during training")
    neftune_noise_alpha: float = F(5.0, "NEFTune noise scale alpha (noise ~ U(-1,1) * alpha/sqrt(L*d))")
    rslora_plus: bool = F(False, "PaddleNLP's rsLoRA+ preset: rslora true, lora_plus_scale 4, lora_alpha 4")
    use_mora: bool = F(False, "MoRA (high-rank updating)", "refused", "MoRA is not implemented; use lora")
    lora_use_mixer: bool = F(False, "MosLoRA mixer", "refused", "MosLoRA is not implemented; use lora")
    vera: bool = F(False, "VeRA adapters", "refused", "VeRA is not implemented; use lora")
    vera_rank: int = F(8, "VeRA rank", "no_effect", "VeRA is not implemented")
    lokr: bool = F(False, "LoKr adapters", "refused", "LoKr is not implemented; use lora")
    lokr_path: Optional[str] = F(None, "saved LoKr state", "refused", "LoKr is not implemented; use lora")
    lokr_dim: int = F(8, "LoKr dimension", "no_effect", "LoKr is not implemented")
    dislora: bool = F(False, "DisLoRA adapters", "refused", "DisLoRA is not implemented; use lora")
    dislora_rank: int = F(8, "DisLoRA rank", "no_effect", "DisLoRA is not implemented")
    dislora_dropout: float = F(0.0, "DisLoRA dropout", "no_effect", "DisLoRA is not implemented")
    target_modules: Optional[List[str]] = F(None, "DisLoRA's target modules", "refused", "DisLoRA is not implemented; LoRA's targets are lora_target_modules")
    s_tsd: int = F(8, "DisLoRA task-specific directions", "no_effect", "DisLoRA is not implemented")
    ortho_lambda: float = F(1.0, "DisLoRA orthogonality weight", "no_effect", "DisLoRA is not implemented")
    prefer_small_sigma: bool = F(True, "DisLoRA singular-value choice", "no_effect", "DisLoRA is not implemented")
    reft: bool = F(False, "ReFT interventions", "refused", "ReFT is not implemented; use lora")
    ir_qlora: bool = F(False, "IR-QLoRA (information-retention QLoRA)", "refused", "IR-QLoRA is not implemented; use lora with weight_quantize_algo nf4 (QLoRA)")
    hqlora_quantize_cfg: Optional[str] = F(None, "HQ-LoRA quantization config", "refused", "HQ-LoRA is not implemented; use lora with weight_quantize_algo nf4 (QLoRA)")
    lqlora_quantize_cfg: Optional[str] = F(None, "LQ-LoRA quantization config", "refused", "LQ-LoRA is not implemented; use lora with weight_quantize_algo nf4 (QLoRA)")
    lqlora_state_dict: Optional[str] = F(None, "LQ-LoRA initial state", "refused", "LQ-LoRA is not implemented; use lora with weight_quantize_algo nf4 (QLoRA)")
    use_shift_sparse_attention: bool = F(False, "LongLoRA's shifted sparse attention (S2-Attn)", "refused", "shifted sparse attention is not implemented; train LoRA with full attention (drop the key)")
    continue_training: bool = F(True, "PaddleNLP flag for loading pretrained weights", "no_effect", "weights are always loaded from model_name_or_path")
    hidden_dropout_prob: Optional[float] = F(None, "override the model's hidden dropout", "no_effect", "dropout comes from the checkpoint's config.json")
    attention_probs_dropout_prob: Optional[float] = F(None, "override the model's attention dropout", "no_effect", "dropout comes from the checkpoint's config.json")
    flash_mask: bool = F(False, "FlashMask: sparse masks inside GPU flash attention", "no_effect", "a GPU flash-attention kernel; packed rows (zero_padding) get exact block-diagonal attention here")
    use_fused_rms_norm: bool = F(False, "fused RMSNorm kernel (GPU)", "no_effect", NOEFF_FUSED)
    use_fused_rope: bool = F(False, "fused rotary-embedding kernel (GPU)", "no_effect", NOEFF_FUSED)
    use_fused_linear: bool = F(False, "fused Linear kernels (GPU)", "no_effect", NOEFF_FUSED)
    use_fused_head_and_loss_fn: bool = F(False, "fuse the LM head with the loss", "no_effect", "the LM head and the loss are always computed together in chunks (models/linear_ce.py)")
    use_sparse_head_and_loss_fn: bool = F(False, "LM head and loss at labelled positions only", "no_effect", "logits are always computed at labelled positions only")
    use_fused_linear_cross_entropy: bool = F(False, "fused linear + cross-entropy (GPU)", "no_effect", "the LM head and the loss are always computed together in chunks (models/linear_ce.py)")
    use_long_sequence_strategies: bool = F(False, "PaddleNLP's long-sequence strategies (rope scaling chosen by strategy_name)", "refused", "long-sequence strategies are not built here; set rope_scaling in the checkpoint's config.json (linear, dynamic, llama3)")
    strategy_type: Optional[str] = F(None, "long-sequence strategy family (embedding_strategies)", "no_effect", "read only with use_long_sequence_strategies")
    strategy_name: Optional[str] = F(None, "long-sequence strategy (e.g. YaRNScalingRotaryEmbedding)", "no_effect", "read only with use_long_sequence_strategies")
    rope_scaling_type: Optional[str] = F(None, "rope scaling type of the long-sequence strategy", "no_effect", "read only with use_long_sequence_strategies")
    rope_scaling_factor: float = F(1.0, "rope scaling factor of the long-sequence strategy", "no_effect", "read only with use_long_sequence_strategies")


@dataclass
class DataArgument:
    dataset_name_or_path: str = F(None, "directory with train.json/dev.json (or .jsonl, or train/*.json, dev/*.json) JSON lines {src, tgt} or {messages}, one such .json / .jsonl file (train and dev both), or the built-in paddletune/sample-sft")
    task_name: Optional[str] = F(None, "sub-task of a dataset collection", "no_effect", "datasets are read from dataset_name_or_path")
    src_length: int = F(1024, "max tokens of the source (prompt); cut from the left")
    max_length: int = F(2048, "max tokens of source + target; the target is cut from the right")
    zero_padding: bool = F(False, "pack examples into max_length rows (block-diagonal attention, no pads)")
    greedy_zero_padding: bool = F(False, "greedy packing (implies zero_padding): each example goes to the open pack with most room, within buffers of 500")
    intokens: bool = F(False, "old name of zero_padding")
    pad_to_multiple_of: Optional[int] = F(None, "pad batch length up to a multiple of this")
    pad_to_max_length: bool = F(False, "pad every batch to max_length")
    lazy: bool = F(False, "stream the train JSON lines without loading them (file order, needs max_steps; dev data is loaded)")
    lazy_check: bool = F(True, "lazy data: check every train line before training (a streaming pass by rank 0, bounded memory; the other ranks wait); false for very large corpora: training starts at once and rank 0 checks every line in a background pass, a bad line ending the job at the next step")
    skip_invalid_lines: bool = F(False, "skip (and log, with a count) data lines that are not valid JSON or not a usable example, instead of stopping; for large streamed (lazy) files")
    chat_template: Optional[str] = F(None, "chat template: a PaddleNLP chat_template.json, a jinja file, a built-in name, or 'none'")
    eval_with_do_generation: bool = F(False, "evaluate by generating answers and scoring BLEU-4/ROUGE")
    save_generation_output: bool = F(False, "write generated_output.json during generation eval")
    autoregressive: bool = F(False, "train on the whole sequence (labels on source too)")
    use_pose_convert: bool = F(False, "PoSE position conversion", "refused", "PoSE is not implemented")
    dataset_type: str = F("json", "dataset file format", choices=["json"])


@dataclass
class QuantArgument:
    weight_quantize_algo: Optional[str] = F(None, "quantize the frozen backbone: weight_only_int8, weight_only_int4, nf4, fp4", choices=[None, "weight_only_int8", "weight_only_int4", "nf4", "fp4"])
    weight_blocksize: int = F(64, "block size of the 4-bit algorithms")
    weight_double_quant: bool = F(False, "quantize the block scales to 8 bits")
    weight_double_quant_block_size: int = F(256, "block size of the double-quantised scales")
    quant_skip_modules: Optional[List[str]] = F(None, "regexes of Linear modules kept in full precision (default: embeddings and LM head)")
    quant_type: str = F("a8w8", "PTQ/QAT quantisation type", "no_effect", "PTQ/QAT is not implemented; only weight_quantize_algo applies")
    do_ptq: bool = F(False, "post-training quantisation", "refused", "PTQ is not implemented")
    do_qat: bool = F(False, "quantisation-aware training", "refused", "QAT is not implemented")
    do_gptq: bool = F(False, "GPTQ", "refused", "GPTQ is not implemented")
    do_awq: bool = F(False, "AWQ", "refused", "AWQ is not implemented")
    ptq_step: int = F(32, "PTQ steps", "no_effect", "PTQ is not implemented")
    shift: bool = F(False, "PTQ shift", "no_effect", "PTQ is not implemented")
    smooth: bool = F(False, "PTQ smooth", "no_effect", "PTQ is not implemented")
    smooth_step: int = F(32, "PTQ smooth sample steps", "no_effect", NOEFF_PTQ)
    smooth_all_linears: bool = F(False, "PTQ: smooth every Linear", "no_effect", NOEFF_PTQ)
    smooth_piecewise_search: bool = F(False, "PTQ: piecewise search for smoothing", "no_effect", NOEFF_PTQ)
    smooth_k_piece: int = F(3, "PTQ: pieces of the piecewise search", "no_effect", NOEFF_PTQ)
    smooth_search_piece: bool = F(False, "PTQ: search the piece count", "no_effect", NOEFF_PTQ)
    weight_quant_method: str = F("abs_max_channel_wise", "PTQ weight quantization method", "no_effect", NOEFF_PTQ)
    act_quant_method: str = F("avg", "PTQ activation quantization method", "no_effect", NOEFF_PTQ)
    cachekv_quant_method: str = F("avg_headwise", "PTQ KV-cache quantization method", "no_effect", NOEFF_PTQ)
    fp8_type: List[str] = F(["e4m3", "e4m3"], "FP8 PTQ types (activation, weight)", "no_effect", NOEFF_PTQ)
    use_fp8: str = F("", "FP8 PTQ of weights and/or activations", "refused", "FP8 quantization is not implemented")
    gptq_step: int = F(8, "GPTQ steps", "no_effect", "GPTQ is not implemented")
    auto_clip: bool = F(False, "AWQ auto-clip", "no_effect", "AWQ is not implemented")
    autoclip_step: int = F(8, "AWQ auto-clip steps", "no_effect", "AWQ is not implemented")
    do_foem: bool = F(False, "FOEM (GPTQ variant)", "refused", "FOEM is not implemented")
    load_quant_model: bool = F(False, "load a PaddleNLP PTQ-quantized model", "refused", "PaddleNLP's PTQ model format is not read here")
    do_ceval: bool = F(False, "C-Eval evaluation of a quantized model", "refused", "C-Eval evaluation is not built here")
    ceval_data_path: Optional[str] = F(None, "C-Eval data directory", "no_effect", "C-Eval evaluation is not built here")


@dataclass
class GenerateArgument:
    top_k: int = F(1, "sampling: keep the k most likely tokens (0 = no limit, 1 = greedy)")
    top_p: float = F(1.0, "sampling: keep the smallest set of tokens whose probability reaches top_p")
    temperature: float = F(1.0, "sampling: divide logits by this (> 0)")
    repetition_penalty: float = F(1.0, "penalise tokens already in prompt or output: positive logits / p, negative x p (1 = off)")
    max_new_tokens: int = F(128, "tokens generated per example in generation eval")
    decode_strategy: str = F("greedy_search", "greedy_search or sampling", choices=["greedy_search", "sampling"])


@dataclass
class TrainingArguments:
    output_dir: str = F(None, "where checkpoints, logs and the final model go")
    overwrite_output_dir: bool = F(False, "allow writing into a non-empty output_dir without resuming")
    do_train: bool = F(False, "run training")
    do_eval: bool = F(False, "run evaluation on the dev set")
    do_predict: bool = F(False, "run prediction", "no_effect", "use llm/predictor.py")
    evaluation_strategy: str = F("no", "when to evaluate: no, steps, epoch", choices=["no", "steps", "epoch"])
    eval_steps: Optional[int] = F(None, "evaluate every N steps (evaluation_strategy=steps); default logging_steps")
    per_device_train_batch_size: int = F(8, "examples per micro-batch per data-parallel rank")
    per_device_eval_batch_size: int = F(8, "examples per eval batch per rank")
    gradient_accumulation_steps: int = F(1, "micro-batches per optimizer step")
    eval_accumulation_steps: Optional[int] = F(None, "move eval outputs to CPU every N steps", "no_effect", "eval metrics are accumulated as running sums")
    learning_rate: float = F(5e-5, "peak learning rate (AdamW)")
    weight_decay: float = F(0.0, "AdamW decoupled weight decay (not applied to norms and biases)")
    adam_beta1: float = F(0.9, "AdamW beta1")
    adam_beta2: float = F(0.999, "AdamW beta2")
    adam_epsilon: float = F(1e-8, "AdamW epsilon")
    max_grad_norm: float = F(1.0, "clip gradients to this global L2 norm (0 disables)")
    num_train_epochs: float = F(3.0, "epochs to train when max_steps <= 0")
    max_steps: int = F(-1, "optimizer steps to train; overrides num_train_epochs when > 0")
    lr_scheduler_type: str = F("linear", "linear, cosine or constant (after warmup)", choices=["linear", "cosine", "constant", "constant_with_warmup"])
    warmup_ratio: float = F(0.0, "warmup as a fraction of total steps")
    warmup_steps: int = F(0, "warmup steps (overrides warmup_ratio)")
    min_lr: float = F(0.0, "final learning rate of the linear/cosine decay")
    logging_steps: int = F(500, "log every N optimizer steps")
    logging_first_step: bool = F(False, "also log the first step")
    logging_dir: Optional[str] = F(None, "where report_to writes its event files (VisualDL, TensorBoard); default output_dir/runs/<Mon DD_HH-MM-SS>_<host> (PaddleNLP's)")
    report_to: Optional[List[str]] = F(None, "curves (train/loss, train/lr, train/grad_norm, train/tokens_per_sec, eval/...) to logging_dir: visualdl, tensorboard, all (those installed) or none; a comma list or a JSON list. Unset: none (PaddleNLP's default is visualdl; here the libraries are extras: pip install -e '.[visualdl]' / '.[tensorboard]')")
    save_strategy: str = F("steps", "when to write checkpoint-N: no, steps, epoch", choices=["no", "steps", "epoch"])
    save_steps: int = F(500, "write a checkpoint every N steps (save_strategy=steps)")
    save_total_limit: Optional[int] = F(None, "keep at most N checkpoints (the best one is kept too)")
    load_best_model_at_end: bool = F(False, "at the end, load the checkpoint with the best metric_for_best_model")
    metric_for_best_model: Optional[str] = F(None, "loss, ppl, accuracy (or bleu4, rouge1, rouge2, rougel with generation eval)")
    greater_is_better: Optional[bool] = F(None, "default: False for loss/ppl, True otherwise")
    resume_from_checkpoint: Optional[str] = F(None, "a checkpoint-N directory, or true for the latest complete one in output_dir")
    ignore_data_skip: bool = F(False, "on resume, do not skip the batches already seen")
    seed: int = F(42, "random seed (init, dropout, data order)")
    data_seed: Optional[int] = F(None, "seed of the data order (default: seed)")
    fp16: bool = F(False, "float16 AMP on GPU; float32 on CPU (warned)")
    bf16: bool = F(False, "bfloat16 AMP on GPU; float32 on CPU (warned)")
    fp16_opt_level: str = F("O1", "AMP level O0, O1 or O2 (GPU)", choices=["O0", "O1", "O2"])
    amp_master_grad: bool = F(False, "float32 gradients under O2 (GPU: paddle.amp.decorate's master_grad; CPU trains float32)")
    scale_loss: float = F(32768.0, "initial fp16 loss scale (GPU; paddle.amp.GradScaler's init_loss_scaling)")
    amp_incr_ratio: float = F(2.0, "fp16 loss scaling: multiply the scale by this after amp_incr_every_n_steps finite steps in a row (GradScaler's incr_ratio; PaddleNLP exposes scale_loss only)")
    amp_decr_ratio: float = F(0.5, "fp16 loss scaling: multiply the scale by this after amp_decr_every_n_nan_or_inf overflowed steps (GradScaler's decr_ratio)")
    amp_incr_every_n_steps: int = F(1000, "fp16 loss scaling: finite steps in a row before the scale grows (GradScaler's incr_every_n_steps)")
    amp_decr_every_n_nan_or_inf: int = F(2, "fp16 loss scaling: overflowed steps before the scale shrinks (GradScaler's decr_every_n_nan_or_inf)")
    amp_skip_limit: int = F(20, "fp16: stop the run after this many consecutive skipped (overflowed) steps; it also stops when the loss scale falls below 1")
    recompute: bool = F(False, "recompute activations in backward (less memory, ~1/3 more compute)")
    recompute_granularity: str = F("full", "what recompute recomputes: full (whole decoder layers), full_attn (each attention sub-layer, projections included), core_attn (softmax(q k^T) v only)", choices=["full", "full_attn", "core_attn"])
    disable_tqdm: bool = F(False, "no progress bar")
    dataloader_drop_last: bool = F(False, "drop the last incomplete global batch of each epoch")
    dataloader_num_workers: int = F(0, "data loader worker processes", "no_effect", "batches are built in the training process")
    remove_unused_columns: bool = F(True, "HF dataset column pruning", "no_effect", "datasets are built with the needed columns only")
    label_names: Optional[List[str]] = F(None, "names of label columns", "no_effect", "the label column is always labels")
    tensor_parallel_degree: int = F(-1, "tensor-parallel ranks (-1 or 1 = off)")
    pipeline_parallel_degree: int = F(-1, "pipeline stages (-1 or 1 = off)")
    sharding_parallel_degree: int = F(-1, "sharding ranks (-1 = all data-parallel ranks when sharding is set)")
    expert_parallel_degree: int = F(-1, "expert-parallel ranks for Mixture-of-Experts models (-1 or 1 = off): carved out of the data-parallel ranks; each holds num_experts / degree experts of every sparse layer")
    sharding: str = F("", "sharding stage: stage1, stage2 or stage3 (optionally several, space-separated)")
    sep_parallel_degree: int = F(-1, "sequence parallel", "refused", "sequence parallelism is not implemented")
    tensor_parallel_config: str = F("", "PaddleNLP TP tuning flags", "no_effect", NOEFF_PARALLEL)
    pipeline_parallel_config: str = F("", "PaddleNLP's pipeline flags, space-separated: disable_p2p_cache_shape is what this pipeline always does (each micro-batch's shape is sent with it); the others warn that they have no effect")
    virtual_pp_degree: int = F(1, "virtual pipeline stages per rank: fleet's interleaved 1F1B (PipelineParallelWithInterleave) under paddle's rules: pipeline_parallel_degree >= 3, decoder blocks divisible by pipeline_parallel_degree x virtual_pp_degree, gradient_accumulation_steps >= pipeline_parallel_degree")
    sharding_parallel_config: str = F("", "PaddleNLP sharding flags, space-separated: split_param runs stage 1 as fleet's DygraphShardingOptimizerV2 (flat 1/S slices of one fused buffer per rank; not with tensor parallel, where V1 runs); the others warn that they have no effect")
    export_format: str = F("hf", "the final model's layout: hf (the model family's own Hugging Face layout), or glm (ChatGLM2/3 as transformers' native GlmForCausalLM; full models and LoRA adapters)", choices=["hf", "glm"])
    unified_checkpoint: bool = F(False, "also write every checkpoint-N as a Hugging Face model / HF-PEFT adapter (the resumable slices stay beside it)")
    unified_checkpoint_config: str = F("", "PaddleNLP unified checkpoint flags", "no_effect", "checkpoints are always one layout-independent format")
    optim: str = F("adamw", "optimizer", choices=["adamw"])
    device: str = F("auto", "auto, cpu or gpu", choices=["auto", "cpu", "gpu"])
    skip_memory_metrics: bool = F(True, "memory metrics", "no_effect", "peak RSS is logged at the end")
    save_on_each_node: bool = F(False, "save on every node", "no_effect", "rank 0 writes")
    flatten_param_grads: bool = F(False, "flatten gradients", "no_effect", "no flattened gradient buffer")
    use_sparse_mask: bool = F(False, "sparse attention mask of PaddleNLP's flash attention", "no_effect", "zero padding builds its own attention structure")
    benchmark: bool = F(False, "PaddleNLP's benchmark mode: train only (no evaluation, no checkpoints, output_dir overwritten)")
    log_on_each_node: bool = F(True, "log on every node", "no_effect", "rank 0 logs")
    tensor_parallel_output: bool = F(True, "keep the logits split over tensor-parallel ranks for the loss", "no_effect", "under tensor parallelism the loss always runs on vocabulary shards (the logits are never gathered)")
    sequence_parallel: bool = F(False, "Megatron sequence parallelism (activations split along the sequence)", "no_effect", "not built: activations are not split along the sequence (same results, more memory per rank)")
    autotuner_benchmark: bool = F(False, "PaddleNLP's autotuner benchmark mode: benchmark mode for 5 steps")
    release_grads: bool = F(False, "free gradients after each step", "no_effect", "gradients are cleared after every step already")
    amp_custom_black_list: Optional[str] = F(None, "ops kept in float32 under AMP, comma- or space-separated paddle op names (GPU; CPU trains float32)")
    amp_custom_white_list: Optional[str] = F(None, "ops forced to the compute dtype under AMP, comma- or space-separated paddle op names (GPU; CPU trains float32)")
    recompute_use_reentrant: bool = F(False, "reentrant recompute (PaddleNLP)", "no_effect", "recompute has one implementation here")
    distributed_dataloader: bool = F(False, "read data on one rank and broadcast", "no_effect", "every data-parallel rank reads its own share")
    skip_profile_timer: bool = F(True, "false: time each optimizer step's phases (data, forward, backward, communication, optimizer) as PaddleNLP's timers do: logged every logging_steps, every step in output_dir/profile_breakdown.jsonl")
    profiler: bool = F(False, "trace the steps of profiler_steps with paddle.profiler (chrome traces in output_dir/profiler/, CPU and GPU) and time each step's phases (as skip_profile_timer: false)")
    profiler_steps: str = F("2,4", "the window of profiler: START,END traces steps START..END-1, counting this run's steps from 0 (2,4: the 3rd and 4th)")
    profiler_options: Optional[str] = F(None, "PaddleNLP's profiler string, e.g. 'batch_range=[10,20];profile_path=./profiler_log': traces steps 10..19 (from 0) into profile_path (default output_dir/profiler) and times each step's phases; timer_only=true: the phase times only")
    max_evaluate_steps: int = F(-1, "cap the number of eval batches (-1 = all)")


CLASSES = (ModelArgument, DataArgument, QuantArgument, GenerateArgument, TrainingArguments)
TABLE = {f.name: (cls, f) for cls in CLASSES for f in dataclasses.fields(cls)}
REQUIRED = ("model_name_or_path", "dataset_name_or_path", "output_dir")
ALIASES = {"intokens": "zero_padding", "eval_strategy": "evaluation_strategy",
           "min_learning_rate": "min_lr"}
# values of implemented keys that name a feature not built here (key, value) -> why
REFUSED_VALUES = {("weight_quantize_algo", "lqlora"): "LQ-LoRA is not implemented; use lora with "
                  "weight_quantize_algo nf4 (QLoRA)"}
# parallel degrees: values above 1 are refused until the parallel issues land (_check_parallel);
# (all parallel degrees are built now; kept for the next mode that lands in parts)
PARALLEL_NOT_YET = {}


def _type_of(f):
    t = str(f.type)
    if "List" in t:
        return list
    for name, typ in (("bool", bool), ("int", int), ("float", float)):
        if t in (f"<class '{name}'>", f"typing.Optional[{name}]"):
            return typ
    return str


def _convert(key, value, f, source):
    """Coerce a JSON or CLI value to the field's type; errors name the key and source."""
    typ = _type_of(f)
    # "none" resets a string key only where None is one of its choices (weight_quantize_algo);
    # elsewhere it may be a real value (chat_template: none = no template)
    nullable = None in (f.metadata.get("choices") or ())
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null")
                         and (typ is not str or nullable)):
        return None
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, (int, float)) and value in (0, 1):
                return bool(value)
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            raise ValueError
        if typ is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError
                return int(value)
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is list:
            if isinstance(value, str):
                value = json.loads(value) if value.strip().startswith("[") else [
                    v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list):
                raise ValueError
            return [str(v) for v in value]
        if key == "resume_from_checkpoint" and isinstance(value, bool):
            return "true" if value else None
        if isinstance(value, (dict, list)):
            raise ValueError
        return str(value)
    except (ValueError, TypeError, json.JSONDecodeError):
        raise ArgumentError(f"{source}: '{key}' must be {typ.__name__}, got {value!r}") from None


def suggestion(key):
    """The valid key `key` was probably meant to be, or None. Only close matches count: a typo
    (similarity >= 0.8: lerning_rate -> learning_rate) or a shortened name (model_name ->
    model_name_or_path); a loose match misleads more than it helps (flash_mask -> lora_rank)."""
    names = list(TABLE) + list(ALIASES)
    m = difflib.get_close_matches(key, names, n=1, cutoff=0.8)
    if m:
        return m[0]
    longer = [n for n in names if len(key) >= 5 and n.startswith(key)]
    return min(longer, key=len) if longer else None


def closest(key):
    m = suggestion(key)
    return f"; did you mean '{m}'?" if m else "; run with --help for the valid keys"


def unknown_keys_error(keys, sources):
    """One message for every unknown key (grouped by where each came from)."""
    by_src = {}
    for k in keys:
        by_src.setdefault(sources.get(k, "arguments"), []).append(k)
    parts = []
    for src, ks in by_src.items():
        if len(ks) == 1:
            parts.append(f"{src}: unknown key '{ks[0]}'{closest(ks[0])}")
            continue
        named = ", ".join(f"'{k}'" + (f" (did you mean '{suggestion(k)}'?)" if suggestion(k) else "")
                          for k in ks)
        parts.append(f"{src}: {len(ks)} unknown keys: {named}; run with --help for the valid keys")
    return ArgumentError("\n".join(parts))


# ------------------------------------------------------------------ other PaddleNLP jobs
# Keys that only argument files of another PaddleNLP job use (its own dataclasses), with the
# script PaddleNLP runs them with and what paddletune has for that job. A file holding them gets
# one message naming the job, never "unknown key". Checked in this order (the first match wins:
# RLHF files also carry preference-data keys).
JOBS = (
    ("RLHF (PPO / GRPO / REINFORCE++)", "llm/alignment/ppo/run_ppo.py (or llm/alignment/rl/run_rl.py)",
     "paddletune has no RLHF script",
     ("actor_model_name_or_path", "reward_model_name_or_path", "rl_algorithm", "rollout_n",
      "kl_coeff", "kl_loss_coeff", "ptx_coeff", "ptx_datasets", "critic_learning_rate",
      "use_rm_server", "reward_server", "update_iters", "per_device_prompt_batch_size",
      "clip_range_ratio", "clip_range_score", "clip_range_value", "normalize_reward",
      "normalize_advantage", "max_dec_len", "min_dec_len", "num_return_sequences", "use_fusemt")),
    ("process reward model (PRM) training", "llm/alignment/rm/flashmask/run_reward.py",
     "paddletune has no reward-model script", ("process_reward", "placeholder_token", "reward_tokens")),
    ("reward model training", "llm/alignment/rm/run_reward.py", "paddletune has no reward-model script",
     ("normalize_score_during_training", "normalizer_type", "normalizer_momentum", "regularization",
      "train_datasets", "eval_datasets")),
    ("DPO / SimPO preference alignment", "llm/alignment/dpo/run_dpo.py",
     "paddletune runs them with its own llm/alignment/dpo/run_dpo.py",
     ("beta", "simpo_gamma", "loss_type", "label_smoothing", "reference_free", "ref_model_update_steps",
      "train_dataset_path", "dev_dataset_path", "max_seq_len", "max_prompt_len")),
    ("pre-training", "llm/run_pretrain.py", "paddletune runs them with its own llm/run_pretrain.py",
     ("input_dir", "max_seq_length", "split", "data_impl", "share_folder", "skip_warmup",
      "data_cache", "num_hidden_layers")),
    ("embedding training", "llm/run_embedding.py", "paddletune has no embedding-training script",
     ("max_query_len", "max_passage_len", "group_size", "query_template", "passage_template",
      "embedding_temperature")),
)
# the same preference-data keys serve PaddleNLP's KTO and flash-mask reward-model scripts; the
# file's name tells them apart (kto_argument.json, rm_flashmask_argument.json, flashmask/rm.json)
KTO_JOB = ("KTO preference alignment", "llm/alignment/kto/run_kto.py",
           "paddletune runs them with its own llm/alignment/kto/run_kto.py")
RM_JOB = ("reward model training", "llm/alignment/rm/flashmask/run_reward.py",
          "paddletune has no reward-model script")


def job_of(keys, sources):
    """(job, PaddleNLP script, paddletune status, the keys that show it) of another PaddleNLP job
    whose keys appear in `keys`, else None."""
    for job, script, status, signature in JOBS:
        found = [k for k in keys if k in signature]
        if not found:
            continue
        if script == "llm/alignment/dpo/run_dpo.py":
            name = os.path.basename(str(sources.get(found[0], ""))).lower()
            words = set(name.replace("-", "_").replace(".", "_").split("_"))
            if "kto" in words:
                job, script, status = KTO_JOB
            elif "rm" in words and "beta" not in keys:
                job, script, status = RM_JOB
        return job, script, status, found
    return None


def job_error(found, sources):
    job, script, status, keys = found
    src = sources.get(keys[0], "arguments")
    shown = ", ".join(f"'{k}'" for k in keys[:6]) + (", ..." if len(keys) > 6 else "")
    return ArgumentError(
        f"{src} is an argument file for PaddleNLP's {job} (keys {shown}), which PaddleNLP runs with "
        f"{script}; {status}. llm/finetune_generation.py runs supervised fine-tuning: full, LoRA, "
        "prefix tuning, adapters, BitFit and QLoRA")


def refused_error(refused, sources):
    """One message for every refused key of a file: the features it asks for that are not built."""
    parts = [f"'{key}: {json.dumps(value)}' ({why})" for key, value, why in refused]
    src = sources.get(refused[0][0], "arguments")
    what = "a feature that is" if len(refused) == 1 else "features that are"
    return ArgumentError(f"{src}: asks for {what} not built here: " + "; ".join(parts))


def help_text():
    lines = ["usage: python llm/finetune_generation.py ARGS.json|ARGS.yaml [--key value | key=value ...]", "",
             "One JSON or YAML argument file (PaddleNLP key names), then overrides. Keys:"]
    for cls in CLASSES:
        lines.append(f"\n{cls.__name__}:")
        for f in dataclasses.fields(cls):
            m = f.metadata
            tag = {"implemented": "", "no_effect": " [accepted, no effect here]",
                   "refused": " [refused]"}[m["status"]]
            tag = f" [{_not_yet(f.name)}]" if _not_yet(f.name) else tag
            lines.append(f"  --{f.name} ({_type_of(f).__name__}, default {f.default if f.default is not dataclasses.MISSING else '[]'}){tag}")
            lines.append(f"      {m['help']}" + (f" ({m['why']})" if m["why"] and m["status"] != "implemented" else ""))
    lines.append("\nKeys of other PaddleNLP jobs (a file holding them is refused, naming the job):")
    for job, script, status, keys in JOBS:
        lines.append(f"  {job} ({script}; {status}): {', '.join(keys)}")
    return "\n".join(lines)


def _not_yet(name):
    """The table's status of a parallel key whose feature is not built yet, else None."""
    if name in PARALLEL_NOT_YET:
        return f"refused above 1 until the {PARALLEL_NOT_YET[name]}"
    if name == "sharding" and "sharding_parallel_degree" in PARALLEL_NOT_YET:
        return (f"refused over more than one rank until the "
                f"{PARALLEL_NOT_YET['sharding_parallel_degree']} (warns with one)")
    return None


def markdown_table():
    """The argument table for the README (generated, so it cannot drift)."""
    rows = ["| key | group | default | status | meaning |", "|---|---|---|---|---|"]
    for name, (cls, f) in TABLE.items():
        m = f.metadata
        status = _not_yet(name) or {"implemented": "implemented",
                                    "no_effect": "accepted, warns: " + (m["why"] or ""),
                                    "refused": "refused: " + (m["why"] or "")}[m["status"]]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append(f"| `{name}` | {cls.__name__} | `{default}` | {status} | {m['help']} |")
    for job, script, status, keys in JOBS:   # keys of other PaddleNLP jobs: refused by job name
        rows.append(f"| {', '.join(f'`{k}`' for k in keys)} | another job | - | refused, naming the "
                    f"job: PaddleNLP's {job} ({script}); {status} | keys of PaddleNLP's {job} files |")
    return "\n".join(rows)


def parse_args(argv=None, warn=None):
    """argv (default sys.argv[1:]) -> (ModelArgument, DataArgument, QuantArgument,
    GenerateArgument, TrainingArguments). Raises ArgumentError on any bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        raise SystemExit(0)
    values, sources = read_argv(argv, _is_bool_key)
    return build(values, sources, warn)


def read_argv(argv, is_bool_key):
    """({key: raw value}, {key: where it came from}) from [ARGS.json | ARGS.yaml] [--key value |
    --key=value | key=value | --flag ...]; the command line overrides the file. Used by every script
    of this project. key=value splits on the first '=' only (a value may hold '=')."""
    argv = list(argv)
    values, sources = {}, {}
    if argv and not argv[0].startswith("--") and "=" not in argv[0]:
        path = argv.pop(0)
        if not path.endswith((".json", ".yaml", ".yml")):
            raise ArgumentError(f"the first argument must be a .json or .yaml argument file, got {path!r}")
        if not os.path.isfile(path):
            raise ArgumentError(f"argument file not found: {path} (working directory {os.getcwd()})")
        data = read_yaml(path, is_bool_key) if path.endswith((".yaml", ".yml")) else _read_json(path)
        for k, v in data.items():
            values[k], sources[k] = v, path
    i = 0
    while i < len(argv):
        a = argv[i]
        if not a.startswith("--") and "=" in a:   # key=value (split on the first '=' only)
            k, v = a.split("=", 1)
            values[k], sources[k] = v, "command line"
            i += 1
            continue
        if not a.startswith("--"):
            raise ArgumentError(f"command line: expected --key value or key=value, got {a!r}")
        if "=" in a:
            k, v = a[2:].split("=", 1)
            i += 1
        else:
            k = a[2:]
            if i + 1 >= len(argv) or (argv[i + 1].startswith("--") and is_bool_key(k)):
                v = "true"   # bare --flag (a non-bool key then fails its type check, by name)
                i += 1
            else:
                v = argv[i + 1]
                i += 2
        values[k], sources[k] = v, "command line"
    return values, sources


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh, object_pairs_hook=_no_duplicate_keys(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArgumentError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ArgumentError(f"{path}: must hold one JSON object of key: value pairs")
    return data


# YAML 1.1 (PyYAML) reads a plain 010 as octal 8 (and 0o10, 0x10 as 8, 16): the digits a reader sees
# are not the value; refused by key instead of silently changed
_YAML_RADIX = re.compile(r"[-+]?(0[0-7_]+|0o[0-7_]+|0x[0-9a-fA-F_]+|0b[01_]+)")


def read_yaml(path, is_bool_key):
    """{key: value} of a YAML argument file with the keys of the JSON ones. Values then go through
    the same typed parser as JSON; PyYAML's YAML 1.1 surprises are settled here, by key:
    `1e-5` (no dot) stays the string "1e-5", which a float key accepts; a plain yes/no/on/off
    (a boolean to YAML 1.1) in a key that is not boolean, and 010 / 0x10 (octal / hex to YAML),
    are errors naming the key and how to write it; a key given twice is an error."""
    try:
        import yaml
    except ImportError:
        raise ArgumentError(f"{path}: YAML argument files need PyYAML: pip install pyyaml") from None
    try:
        with open(path, encoding="utf-8") as fh:
            loader = yaml.SafeLoader(fh.read())
        root = loader.get_single_node()
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ArgumentError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(root, yaml.MappingNode):
        raise ArgumentError(f"{path}: must hold one YAML mapping of key: value pairs")
    out = {}
    for key_node, node in root.value:
        k = loader.construct_object(key_node, deep=True)
        if k in out:
            raise ArgumentError(f"{path}: key '{k}' is given twice; keep one")
        plain = isinstance(node, yaml.ScalarNode) and node.style is None
        if plain and node.tag.endswith(":bool") and not is_bool_key(k):
            raise ArgumentError(f"{path}: '{k}: {node.value}' is the boolean "
                                f"{node.value.lower() in ('yes', 'y', 'true', 'on')} to YAML, but '{k}' "
                                f"is not a true/false key; quote the value ('{node.value}') if it is text")
        if plain and node.tag.endswith(":int") and _YAML_RADIX.fullmatch(node.value):
            raise ArgumentError(f"{path}: '{k}: {node.value}' is read by YAML as the number "
                                f"{loader.construct_object(node)} (octal / hex); write it without the "
                                f"leading zero, or quote it ('{node.value}') if it is text")
        out[k] = loader.construct_object(node, deep=True)
    return out


def _no_duplicate_keys(path):
    """json object_pairs_hook: a key given twice in one object is an error (json keeps the last
    silently, so the first line a reader sees would not be the value used)."""
    def hook(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise ArgumentError(f"{path}: key '{k}' is given twice ({json.dumps(seen[k])} and "
                                    f"{json.dumps(v)}); keep one")
            seen[k] = v
        return seen
    return hook


def _is_bool_key(k):
    k = ALIASES.get(k, k)
    return k in TABLE and _type_of(TABLE[k][1]) is bool


def build(values, sources=None, warn=None):
    """Typed argument objects from a {key: value} dict (as read from JSON)."""
    sources = sources or {}
    warn = warn or (lambda msg: print("WARNING: " + msg, file=sys.stderr))
    kwargs = {cls: {} for cls in CLASSES}
    unknown = [k for k in values if ALIASES.get(k, k) not in TABLE]
    other_job = job_of(list(values), sources)
    if other_job:
        raise job_error(other_job, sources)
    if unknown:
        raise unknown_keys_error(unknown, sources)
    refused, notes = [], []
    for key, value in values.items():
        src = sources.get(key, "arguments")
        name = ALIASES.get(key, key)
        cls, f = TABLE[name]
        feature = REFUSED_VALUES.get((name, value if isinstance(value, str) else None))
        if feature:
            refused.append((key, value, feature))
            continue
        v = _convert(name, value, f, src)
        if name == "zero_padding" and key == "intokens" and not v:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        status = f.metadata["status"]
        if v != default and status == "refused":
            refused.append((key, value, f.metadata["why"]))
            continue
        choices = f.metadata["choices"]
        if choices and v not in choices:
            raise ArgumentError(f"{src}: '{key}' must be one of {[c for c in choices if c is not None]}, got {v!r}")
        if v != default and status == "no_effect":
            notes.append(f"'{key}: {json.dumps(value)}' has no effect here: {f.metadata['why']}")
        kwargs[cls][name] = v
    if refused:
        raise refused_error(refused, sources)
    for note in notes:
        warn(note)
    for key in REQUIRED:
        cls, f = TABLE[key]
        if kwargs[cls].get(key) in (None, ""):
            raise ArgumentError(f"'{key}' is required ({f.metadata['help']})")
    objs = tuple(cls(**kwargs[cls]) for cls in CLASSES)
    _paddlenlp_post_init(objs[-1], sources, warn)
    _resolve(*objs)
    _check_values(*objs, sources=sources, warn=warn)
    from . import stopping

    stopping.job_dir(objs[-1].output_dir)   # a failed rank's marker goes there (stopping.py)
    return objs


def _world():
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))


PEFT_METHODS = ("lora", "prefix_tuning", "adapter", "lowrank_adapter", "bitfit")
METRICS = ("loss", "ppl", "accuracy", "bleu4", "rouge1", "rouge2", "rougel")
GENERATION_METRICS = METRICS[3:]   # need eval_with_do_generation
LOWER_IS_BETTER = ("loss", "ppl")


# ------------------------------------------------------------------ PaddleNLP's TrainingArguments rules

def _paddlenlp_post_init(args, sources, warn):
    """What PaddleNLP's TrainingArguments.__post_init__ (and its llm TrainingArguments) do to the
    parsed values, in the same order, so a PaddleNLP file means the same here:
      evaluation_strategy != no            sets do_eval: true
      do_eval: true with strategy no       evaluation_strategy becomes steps (warned)
      strategy steps without eval_steps    eval_steps = logging_steps
      load_best_model_at_end               needs save_strategy == evaluation_strategy and, with
                                           steps, save_steps a multiple of eval_steps (errors);
                                           no metric_for_best_model means loss
      fp16 and bf16 together               error
      benchmark / autotuner_benchmark      train only: do_eval false, no evaluation, no
                                           checkpoints, no best model, output_dir overwritten
                                           (autotuner_benchmark: also max_steps 5)
    load_best_model_at_end with no evaluation (both strategies no, as PaddleNLP's long-context
    LoRA files have) is accepted and loads nothing."""
    def err(key, msg):
        raise ArgumentError(f"{sources.get(key, 'arguments')}: '{key}' {msg}")

    if not args.do_eval and args.evaluation_strategy != "no":
        args.do_eval = True
    if args.do_eval and args.evaluation_strategy == "no":
        warn("do_eval: true with evaluation_strategy 'no': evaluation_strategy set to 'steps' "
             "(PaddleNLP's rule; set evaluation_strategy: epoch to evaluate once per epoch)")
        args.evaluation_strategy = "steps"
    if args.evaluation_strategy == "steps" and args.eval_steps is None:   # 0 is refused below
        args.eval_steps = args.logging_steps
    if args.load_best_model_at_end:
        if args.evaluation_strategy != args.save_strategy:
            err("load_best_model_at_end", f"needs save_strategy ({args.save_strategy}) equal to "
                f"evaluation_strategy ({args.evaluation_strategy}) so every evaluated step has a checkpoint")
        if (args.evaluation_strategy == "steps" and args.eval_steps and args.eval_steps > 0
                and args.save_steps % args.eval_steps):
            err("load_best_model_at_end", f"needs save_steps ({args.save_steps}) to be a multiple "
                f"of eval_steps ({args.eval_steps})")
        if args.metric_for_best_model is None:
            args.metric_for_best_model = "loss"
    if args.fp16 and args.bf16:
        err("bf16", "cannot be combined with fp16: choose one")
    if args.benchmark or args.autotuner_benchmark:
        args.do_train, args.do_eval, args.overwrite_output_dir = True, False, True
        args.load_best_model_at_end = False
        args.save_strategy = args.evaluation_strategy = "no"
        if args.autotuner_benchmark:
            args.max_steps = 5


# ------------------------------------------------------------------ derived values

def _resolve(model_args, data_args, quant_args, gen_args, args):
    """Derived values: the one step that changes a parsed value, run before the checks (which
    then only check). Each rule is a PaddleNLP habit:
      lora_path                     implies lora: true (continue training a saved adapter)
      rslora_plus                   rslora: true, lora_plus_scale 4, lora_alpha 4
      prefix_path                   implies prefix_tuning: true
      intokens, greedy_zero_padding imply zero_padding: true
      metric_for_best_model         'eval_loss' (the logged name) means 'loss'
      greater_is_better             unset: False for loss/ppl, True for any other metric
    """
    if model_args.lora_path:
        model_args.lora = True
    if model_args.rslora_plus:
        model_args.rslora, model_args.lora_plus_scale, model_args.lora_alpha = True, 4.0, 4
    if model_args.prefix_path:
        model_args.prefix_tuning = True
    if data_args.intokens or data_args.greedy_zero_padding:
        data_args.zero_padding = True
    metric = args.metric_for_best_model
    if metric is not None and metric.startswith("eval_") and metric[5:] in METRICS:
        args.metric_for_best_model = metric = metric[5:]
    if args.greater_is_better is None and metric in METRICS:
        args.greater_is_better = metric not in LOWER_IS_BETTER


# ------------------------------------------------------------------ checks (no rewrites)

def _check_values(model_args, data_args, quant_args, gen_args, args, sources, warn):
    """Value-dependent rules over resolved arguments, in a fixed order (the first error wins)."""
    def err(key, msg):
        raise ArgumentError(f"{sources.get(key, 'arguments')}: '{key}' {msg}")

    _check_numbers((model_args, data_args, quant_args, gen_args, args), err)
    _check_training(model_args, data_args, args, err)
    _check_optimizer(args, err)
    _check_peft(model_args, err)
    _check_best_model(data_args, args, err)
    _check_device(model_args, args, err, warn)
    _check_quant(model_args, quant_args, args, err)
    _check_parallel(args, err, warn)
    _check_tensor_parallel(model_args, data_args, args, err)
    _check_pipeline_config(args, warn)
    _check_sharding_config(args, warn)
    _check_virtual_pp(data_args, args, err)
    _check_generation(data_args, gen_args, args, err, warn)
    _check_data(model_args, data_args, args, err, warn)
    _check_observe(args, err, warn)


def _check_numbers(objs, err):
    """null where a value is needed (a key whose default is not null) and NaN / Infinity (JSON
    allows neither, python's parser takes both) are refused for every key."""
    import math

    for obj in objs:
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if v is None and f.default is not None and f.default is not dataclasses.MISSING \
                    and "Optional" not in str(f.type):
                err(f.name, f"must be {_type_of(f).__name__}, got null (remove the key for the "
                    f"default, {json.dumps(f.default)})")
            if isinstance(v, float) and not math.isfinite(v):
                err(f.name, f"must be a finite number, got {v}")


def _check_optimizer(args, err):
    """AdamW and schedule settings that are accepted by no optimizer: each would train silently
    wrong (beta >= 1 never forgets, a negative norm clips everything, ...)."""
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, key) < 1:
            err(key, f"must be in [0, 1), got {getattr(args, key)}")
    for key, ok, rule in (("adam_epsilon", args.adam_epsilon > 0, "> 0"),
                          ("weight_decay", args.weight_decay >= 0, ">= 0"),
                          ("warmup_steps", args.warmup_steps >= 0, ">= 0"),
                          ("max_grad_norm", args.max_grad_norm >= 0, ">= 0 (0 disables clipping)"),
                          ("min_lr", args.min_lr >= 0, ">= 0")):
        if not ok:
            err(key, f"must be {rule}, got {getattr(args, key)}")
    if args.eval_steps is not None and args.eval_steps <= 0:
        err("eval_steps", f"must be positive (or unset: logging_steps), got {args.eval_steps}")
    if args.save_total_limit is not None and args.save_total_limit < 0:
        err("save_total_limit", f"must be >= 0 (or unset: keep all), got {args.save_total_limit}")
    if args.max_steps < -1:
        err("max_steps", f"must be > 0 (that many steps) or -1 (train num_train_epochs), got "
            f"{args.max_steps}")
    if args.do_train and args.max_steps <= 0 and args.num_train_epochs <= 0:
        err("num_train_epochs", f"must be > 0 when max_steps is not set, got {args.num_train_epochs}: "
            "nothing would be trained (set max_steps or num_train_epochs)")


def _check_training(model_args, data_args, args, err):
    objs = {ModelArgument: model_args, DataArgument: data_args, TrainingArguments: args}
    for key in ("per_device_train_batch_size", "per_device_eval_batch_size",
                "gradient_accumulation_steps", "logging_steps", "src_length", "max_length"):
        val = getattr(objs[TABLE[key][0]], key)
        if val <= 0:
            err(key, f"must be positive, got {val}")
    if data_args.src_length >= data_args.max_length:
        err("src_length", f"({data_args.src_length}) must be smaller than max_length "
            f"({data_args.max_length}) so some target tokens fit")
    if args.save_strategy == "steps" and args.save_steps <= 0:
        err("save_steps", "must be positive with save_strategy=steps")
    if args.learning_rate < 0:
        err("learning_rate", f"must be >= 0, got {args.learning_rate}")
    if not 0 <= args.warmup_ratio < 1:
        err("warmup_ratio", f"must be in [0, 1), got {args.warmup_ratio}")


def _check_peft(m, err):
    """One selection method per run, and its sizes. The PEFT library code relies on these (it
    only asserts them, for programmatic callers)."""
    chosen = [k for k in PEFT_METHODS if getattr(m, k)]
    if len(chosen) > 1:
        err(chosen[1], f"cannot be combined with {chosen[0]} in one run: choose one PEFT method")
    if m.lora and m.lora_rank <= 0:
        err("lora_rank", f"must be positive, got {m.lora_rank}")
    if m.lora and not 0 <= m.lora_dropout < 1:
        err("lora_dropout", f"must be in [0, 1), got {m.lora_dropout}")
    if m.lora and m.lora_plus_scale <= 0:
        err("lora_plus_scale", f"must be positive, got {m.lora_plus_scale}")
    if m.prefix_tuning and m.num_prefix_tokens <= 0:
        err("num_prefix_tokens", f"must be positive with prefix_tuning, got {m.num_prefix_tokens}")
    if (m.adapter or m.lowrank_adapter) and m.adapter_size <= 0:
        err("adapter_size", f"must be positive, got {m.adapter_size}")
    if m.lowrank_adapter and m.lowrank_adapter_rank <= 0:
        err("lowrank_adapter_rank", f"must be positive, got {m.lowrank_adapter_rank}")
    if m.neftune and m.neftune_noise_alpha < 0:
        err("neftune_noise_alpha", f"must be >= 0, got {m.neftune_noise_alpha}")
    if m.rdrop and m.rdrop_alpha < 0:
        err("rdrop_alpha", f"must be >= 0, got {m.rdrop_alpha}")


def _check_best_model(data_args, args, err):
    # load_best_model_at_end: PaddleNLP's rules, in _paddlenlp_post_init
    metric = args.metric_for_best_model
    if metric is not None:
        if metric not in METRICS:
            err("metric_for_best_model", f"must be one of {list(METRICS)}, got {metric!r}")
        if metric in GENERATION_METRICS and not data_args.eval_with_do_generation:
            err("metric_for_best_model", f"'{metric}' needs eval_with_do_generation: true")


def _check_device(model_args, args, err, warn):
    """What this machine can run: AMP and flash attention warn on CPU, device: gpu needs a GPU."""
    from .runtime import amp_cpu_warning, amp_unsupported, device

    for key in ("fp16", "bf16"):
        if getattr(args, key) and device() == "cpu":
            warn(amp_cpu_warning(key))
        elif getattr(args, key):   # a GPU that cannot run it: paddle's decorate would do nothing
            msg = amp_unsupported("float16" if key == "fp16" else "bfloat16")
            if msg:
                raise ArgumentError(msg)
    if args.fp16 and args.amp_skip_limit < 1:
        err("amp_skip_limit", f"must be >= 1, got {args.amp_skip_limit}")
    if args.device == "gpu" and device() != "gpu":
        err("device", "is gpu but paddle sees no GPU (CPU build or no visible device): install "
            "paddlepaddle-gpu (pip install -e .[gpu]) or use device: cpu / auto")
    if model_args.use_flash_attention and device() == "cpu":
        warn("'use_flash_attention: true' has no effect on CPU: the exact attention kernel is used")


def _check_quant(model_args, quant_args, args, err):
    """A quantized backbone is frozen: training needs a PEFT method; block sizes must fit.
    quant/weight_only.py's QuantConfig relies on these (it only asserts them)."""
    if not quant_args.weight_quantize_algo:
        return
    if quant_args.weight_blocksize <= 0 or quant_args.weight_blocksize % 2:
        err("weight_blocksize", f"must be a positive even number (two 4-bit codes per byte), "
            f"got {quant_args.weight_blocksize}")
    if quant_args.weight_double_quant_block_size <= 0:
        err("weight_double_quant_block_size",
            f"must be positive, got {quant_args.weight_double_quant_block_size}")
    if model_args.bitfit:
        err("bitfit", f"cannot be combined with weight_quantize_algo={quant_args.weight_quantize_algo}: "
            "BitFit adds biases to nn.Linear layers, and the decoder Linears are quantized; use "
            "lora: true (QLoRA), or drop weight_quantize_algo")
    if args.do_train and not any(getattr(model_args, k) for k in PEFT_METHODS):
        err("weight_quantize_algo", f"= {quant_args.weight_quantize_algo} freezes the quantized "
            "Linear weights, so training needs a PEFT method on top: set lora: true (QLoRA), or "
            "one of prefix_tuning / adapter / lowrank_adapter")


def _check_parallel(args, err, warn):
    """Degrees above 1 of the parallel modes not built yet are refused (PARALLEL_NOT_YET)."""
    for key, where in PARALLEL_NOT_YET.items():
        if getattr(args, key) > 1:
            err(key, f"= {getattr(args, key)} is not available yet ({where}); set it to 1")
    if args.expert_parallel_degree > 1 and args.recompute and args.recompute_granularity == "full":
        from .parallel.expert import RECOMPUTE_REFUSAL

        err("recompute_granularity", RECOMPUTE_REFUSAL.format(args.expert_parallel_degree))
    _check_sharding(args, err, warn)


def _check_sharding(args, err, warn):
    """`sharding`: stage1 / stage2 / stage3, optionally with offload (PaddleNLP's spelling,
    space-separated); one sharding rank (e.g. -1 in a one-process run) warns that it is off."""
    words = (args.sharding or "").split()
    bad = [w for w in words if w not in ("stage1", "stage2", "stage3", "offload")]
    if bad:
        err("sharding", f"unknown value '{bad[0]}': use stage1, stage2 or stage3 (optionally with "
            "offload, space-separated), or leave it empty")
    if words == ["offload"]:
        err("sharding", "'offload' needs a stage: write 'stage3 offload' (paddle's offload) or drop it")
    if not words:
        if args.sharding_parallel_degree > 1:
            warn(f"sharding_parallel_degree {args.sharding_parallel_degree} without 'sharding' "
                 "(stage1/2/3): its ranks are plain data-parallel ranks")
        return
    inner = max(args.tensor_parallel_degree, 1) * max(args.pipeline_parallel_degree, 1)
    degree = (_world() // inner if args.sharding_parallel_degree in (-1, 0)
              else args.sharding_parallel_degree)
    if degree <= 1:
        warn(f"'sharding: {args.sharding}' has no effect with one sharding rank")
    elif args.pipeline_parallel_degree > 1 and ("stage2" in words or "stage3" in words):
        err("sharding", PP_STAGE23.format(stage=2 if "stage2" in words else 3))
    elif "offload" in words:   # a CUDA build: refused where paddle's stage has no usable offload
        from .parallel.sharding import offload_refusal, stage_of

        msg = offload_refusal(stage_of(args.sharding), {
            "sharding": degree, "tp": max(args.tensor_parallel_degree, 1),
            "pp": max(args.pipeline_parallel_degree, 1)}, max(args.expert_parallel_degree, 1))
        if msg:
            err("sharding", msg[len("sharding "):])   # "'stageN offload': why; the fix"


PP_STAGE23 = ("sharding stage{stage} with pipeline_parallel_degree > 1: fleet has no pipeline path for "
              "sharding stages 2 / 3 (its PipelineParallel steps through HybridParallelOptimizer, "
              "which shards stage 1 only); use sharding stage1 or pipeline_parallel_degree 1")


SHARDING_FLAGS_HONOURED = ("split_param",)   # stage 1 on fleet's DygraphShardingOptimizerV2 (data.py)


def _check_sharding_config(args, warn):
    """sharding_parallel_config flags: split_param honoured for stage 1 (warned for stages 2 /
    3, which have no V2), every other flag warned once."""
    flags = (args.sharding_parallel_config or "").split()
    for flag in flags:
        if flag not in SHARDING_FLAGS_HONOURED:
            warn(f"'sharding_parallel_config: {flag}' has no effect here (stage 1 runs fleet's "
                 "sharding optimizer without fusion / overlap; only split_param applies)")
    words = (args.sharding or "").split()
    if "split_param" in flags and words and "stage1" not in words:
        warn("'sharding_parallel_config: split_param' has no effect with sharding "
             f"'{args.sharding}' (it is stage 1's DygraphShardingOptimizerV2)")


PP_FLAGS_HONOURED = ("disable_p2p_cache_shape",)   # fleet runs without its shape cache, always (pipeline.py)


def _check_pipeline_config(args, warn):
    """pipeline_parallel_config flags: the honoured ones silently, every other one warned once."""
    for flag in (args.pipeline_parallel_config or "").split():
        if flag not in PP_FLAGS_HONOURED:
            warn(f"'pipeline_parallel_config: {flag}' has no effect here (fleet's pipeline runs with "
                 "the settings parallel/pipeline.py picks; only disable_p2p_cache_shape applies, always)")


def _check_virtual_pp(data_args, args, err):
    """virtual_pp_degree > 1 under paddle's own rules for its interleaved schedule (the block
    count rule needs the model: parallel/pipeline.check_stages at load)."""
    v, pp = args.virtual_pp_degree, max(args.pipeline_parallel_degree, 1)
    if v < 1:
        err("virtual_pp_degree", f"must be >= 1, got {v}")
    if v == 1:
        return
    if pp < 3:
        err("virtual_pp_degree", f"{v} needs pipeline_parallel_degree >= 3 (paddle's interleaved "
            f"schedule, PipelineParallelWithInterleave, asserts pp degree > 2); got {pp}: set "
            "virtual_pp_degree to 1 or use 3+ pipeline stages")
    if args.gradient_accumulation_steps < pp:
        err("virtual_pp_degree", f"{v} needs gradient_accumulation_steps >= pipeline_parallel_degree "
            f"({pp}; fleet.distributed_model refuses fewer for the interleaved schedule); got "
            f"{args.gradient_accumulation_steps}")
    # the interleaved schedule keeps fleet's p2p shape cache (pipeline.py): one batch shape
    if not data_args.pad_to_max_length:
        err("virtual_pp_degree", f"{v} needs pad_to_max_length: true (fleet's interleaved schedule "
            "asserts its p2p shape cache, so every micro-batch must have one shape)")
    most = args.per_device_train_batch_size * args.gradient_accumulation_steps
    if args.per_device_eval_batch_size > most:
        err("virtual_pp_degree", f"{v}: per_device_eval_batch_size {args.per_device_eval_batch_size} "
            f"must be <= per_device_train_batch_size x gradient_accumulation_steps ({most}): "
            "evaluation runs as one training step's micro-batches")


def _check_tensor_parallel(model_args, data_args, args, err):
    """What has no tensor-parallel form yet is refused by name when tensor_parallel_degree > 1."""
    if args.tensor_parallel_degree <= 1:
        return
    for key, on, why in (
            ("prefix_projection", model_args.prefix_projection and model_args.prefix_tuning,
             "the prefix MLP's output would be split by key/value heads; train without it"),
):
        if on:
            err(key, f"cannot be used with tensor_parallel_degree {args.tensor_parallel_degree}: "
                f"{why}; set {key}: false or tensor_parallel_degree: 1")


def _check_generation(data_args, gen_args, args, err, warn):
    if data_args.save_generation_output and not data_args.eval_with_do_generation:
        err("save_generation_output", "needs eval_with_do_generation: true (it saves the generated answers)")
    if data_args.eval_with_do_generation and not args.do_eval:   # PaddleNLP: simply unused
        warn("'eval_with_do_generation: true' has no effect without evaluation (do_eval false, "
             "evaluation_strategy no)")
    for key, ok, rule in (("max_new_tokens", gen_args.max_new_tokens > 0, "> 0"),
                          ("temperature", gen_args.temperature > 0, "> 0"),
                          ("top_k", gen_args.top_k >= 0, ">= 0"),
                          ("top_p", 0 < gen_args.top_p <= 1, "in (0, 1]"),
                          ("repetition_penalty", gen_args.repetition_penalty > 0, "> 0")):
        if not ok:
            err(key, f"must be {rule}, got {getattr(gen_args, key)}")


def _check_data(model_args, data_args, args, err, warn):
    if data_args.lazy and args.do_train and args.max_steps <= 0:
        err("lazy", "needs max_steps > 0: the number of steps in a streamed file is unknown")
    for key in ("save_strategy", "evaluation_strategy"):   # PaddleNLP's long-context files do this
        if data_args.lazy and args.do_train and getattr(args, key) == "epoch":
            warn(f"'{key}: epoch' has no effect with lazy data: a stream has no epochs, so nothing "
                 "happens before the end of training; use 'steps'")
    if data_args.zero_padding and data_args.eval_with_do_generation:
        warn("zero_padding packs the training data only: generation eval uses unpacked dev data")
    if model_args.prefix_tuning and (data_args.zero_padding or data_args.greedy_zero_padding):
        key = "zero_padding" if data_args.zero_padding else "greedy_zero_padding"
        err(key, "cannot be used with prefix_tuning: the examples packed into one row would share "
            "one prefix ambiguously (their positions no longer start right after it); set "
            f"{key}: false")


def _check_observe(args, err, warn):
    """report_to names known integrations whose libraries import (else the pip command); the
    profiler keys parse (paddletune/observe.py). Checked before any work."""
    from . import observe

    try:
        targets = observe.report_targets(args.report_to)
    except ValueError as e:
        err("report_to", str(e))
    if args.report_to and any(n.strip().lower() == "all" for x in args.report_to for n in x.split(",")) \
            and not targets:
        warn("'report_to: all' found neither visualdl nor tensorboard installed: no event files are "
             "written (pip install -e '.[visualdl]')")
    try:
        observe.check_libraries(targets)
    except ValueError as e:
        err("report_to", str(e))
    try:
        observe.parse_window(args.profiler_steps)
    except ValueError as e:
        err("profiler_steps", str(e))
    try:
        observe.profile_plan(args)
    except ValueError as e:
        err("profiler_options", str(e))
    if args.profiler_options and observe.parse_profiler_options(args.profiler_options).get("exit_on_finished"):
        warn("'profiler_options: exit_on_finished=true' has no effect here: training continues to "
             "the end after the traced steps")
