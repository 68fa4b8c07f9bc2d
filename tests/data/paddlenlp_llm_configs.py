"""Key sets of PaddleNLP's current llm/config/{llama,chatglm2,qwen} argument files (develop
branch, read in 2026; the top-level *.json of each folder, plus llama/flashmask/*.json), written
down as data: per file, its keys and the values that decide what the file does (flags, strategies,
algorithms, parallel degrees). Numbers such as learning rates, batch sizes and lengths are left
out: tests fill them in to fit a tiny model. Used by tests/test_compat.py.
"""

# key groups that many files share (names only)
_RUN = ("model_name_or_path dataset_name_or_path output_dir per_device_train_batch_size "
        "gradient_accumulation_steps per_device_eval_batch_size num_train_epochs learning_rate "
        "warmup_steps logging_steps evaluation_strategy save_strategy max_length fp16_opt_level "
        "do_train do_eval disable_tqdm load_best_model_at_end eval_with_do_generation recompute "
        "save_total_limit")
_RUN_NO_EVAL_BATCH = _RUN.replace(" per_device_eval_batch_size", "")
_SFT = _RUN + (" eval_accumulation_steps src_length metric_for_best_model tensor_parallel_degree "
               "pipeline_parallel_degree zero_padding use_flash_attention")
_EVAL_SETS = _SFT + " logging_dir save_steps eval_steps max_steps pipeline_parallel_config sharding unified_checkpoint"
_PREF = ("model_name_or_path train_dataset_path dev_dataset_path output_dir per_device_train_batch_size "
         "gradient_accumulation_steps per_device_eval_batch_size num_train_epochs max_steps learning_rate "
         "warmup_steps logging_steps evaluation_strategy save_strategy eval_steps save_steps max_seq_len "
         "max_prompt_len fp16_opt_level do_train do_eval disable_tqdm load_best_model_at_end "
         "tensor_parallel_degree sharding use_flash_attention recompute recompute_granularity benchmark "
         "unified_checkpoint autotuner_benchmark")
_QUANT = ("model_name_or_path per_device_train_batch_size per_device_eval_batch_size eval_accumulation_steps "
          "src_length max_length fp16_opt_level dataset_name_or_path output_dir do_eval "
          "eval_with_do_generation unified_checkpoint")
_SMOOTH = "smooth smooth_step smooth_all_linears smooth_piecewise_search smooth_k_piece smooth_search_piece"
_PRETRAIN = ("model_name_or_path tokenizer_name_or_path input_dir output_dir per_device_train_batch_size "
             "gradient_accumulation_steps per_device_eval_batch_size tensor_parallel_degree "
             "pipeline_parallel_degree sharding virtual_pp_degree sequence_parallel use_flash_attention "
             "max_seq_length learning_rate warmup_steps logging_steps max_steps save_steps eval_steps "
             "fp16_opt_level warmup_ratio max_grad_norm dataloader_num_workers continue_training do_train "
             "do_eval disable_tqdm recompute recompute_granularity unified_checkpoint save_total_limit")
_RL = ("logging_steps logging_dir train_datasets eval_datasets actor_model_name_or_path "
       "reward_model_name_or_path output_dir max_length use_flash_attention max_dec_len min_dec_len top_p "
       "temperature repetition_penalty num_train_epochs max_steps update_iters per_device_prompt_batch_size "
       "per_device_train_batch_size gradient_accumulation_steps learning_rate min_learning_rate weight_decay "
       "lr_scheduler_type warmup_ratio recompute recompute_granularity recompute_use_reentrant "
       "normalize_reward normalize_advantage clip_range_ratio clip_range_score clip_range_value ptx_coeff "
       "evaluation_strategy per_device_eval_batch_size eval_steps save_strategy save_steps save_total_limit "
       "bf16 fp16_opt_level do_train do_eval disable_tqdm sharding_parallel_degree sharding "
       "tensor_parallel_degree tensor_parallel_output pipeline_parallel_degree pipeline_parallel_config "
       "sequence_parallel max_grad_norm adam_beta1 adam_beta2 dataloader_drop_last eval_mode offload_level "
       "release_grads seed use_fused_head_and_loss_fn fused_linear use_fusemt")


def _f(keys, **values):
    return {"keys": sorted(set(keys.split()) | set(values)), "values": values}


_EPOCHS = dict(evaluation_strategy="epoch", save_strategy="epoch", do_train=True, do_eval=True,
               load_best_model_at_end=True, eval_with_do_generation=False, metric_for_best_model="accuracy",
               fp16_opt_level="O2", disable_tqdm=True, zero_padding=False)
_STEPS_EVAL = dict(evaluation_strategy="steps", save_strategy="steps", save_steps=500, eval_steps=500,
                   do_train=True, do_eval=True, load_best_model_at_end=False, eval_with_do_generation=False,
                   metric_for_best_model="accuracy", fp16_opt_level="O2", bf16=True, tensor_parallel_degree=8,
                   pipeline_parallel_config="disable_p2p_cache_shape", sharding="stage2",
                   unified_checkpoint=True, use_flash_attention=True, logging_dir="../checkpoints/arc-e")
_DPO = dict(evaluation_strategy="steps", save_strategy="steps", eval_steps=100, save_steps=500, do_train=True,
            do_eval=True, load_best_model_at_end=True, bf16=True, fp16_opt_level="O2", sharding="stage1",
            use_flash_attention=True, recompute_granularity="full", unified_checkpoint=True)
_PTQ = dict(do_eval=True, eval_with_do_generation=False, fp16_opt_level="O2", unified_checkpoint=True)

FILES = {
    # ------------------------------------------------------------------ llama
    "llama/sft_argument.json": _f(_SFT + " pipeline_parallel_config sharding unified_checkpoint", **_EPOCHS,
                                  bf16=True, recompute=False, pipeline_parallel_config="disable_p2p_cache_shape",
                                  sharding="stage2", unified_checkpoint=True, use_flash_attention=False),
    "llama/lora_argument.json": _f(_SFT + " save_steps sharding unified_checkpoint pissa lora",
                                   evaluation_strategy="steps", save_strategy="steps", save_steps=1, do_train=True,
                                   do_eval=False, load_best_model_at_end=True, eval_with_do_generation=False,
                                   metric_for_best_model="accuracy", bf16=True, fp16_opt_level="O2", recompute=True,
                                   sharding="stage1", lora=True, zero_padding=False, use_flash_attention=True,
                                   unified_checkpoint=True, pissa=False),
    "llama/pt_argument.json": _f(_SFT + " prefix_tuning", **_EPOCHS, bf16=True, recompute=True, prefix_tuning=True,
                                 use_flash_attention=True),
    "llama/qlora_argument.json": _f(_SFT + " lora unified_checkpoint weight_quantize_algo", **_EPOCHS, bf16=True,
                                    recompute=True, lora=True, unified_checkpoint=True, weight_quantize_algo="nf4",
                                    use_flash_attention=False),
    "llama/wint8_lora_argument.json": _f(_SFT + " lora unified_checkpoint weight_quantize_algo", **_EPOCHS, bf16=True,
                                         recompute=True, lora=True, unified_checkpoint=True,
                                         weight_quantize_algo="weight_only_int8", use_flash_attention=False),
    "llama/sft_long_argument.json": _f(
        _SFT + " max_steps recompute_granularity pipeline_parallel_config sharding lazy unified_checkpoint flash_mask "
        "use_fused_head_and_loss_fn use_sparse_head_and_loss_fn autotuner_benchmark", **_EPOCHS, max_steps=10,
        bf16=True, recompute=True, recompute_granularity="full", tensor_parallel_degree=8,
        pipeline_parallel_config="disable_p2p_cache_shape", sharding="stage2", lazy=True,
        unified_checkpoint=True, use_flash_attention=True, flash_mask=True, use_fused_head_and_loss_fn=True,
        use_sparse_head_and_loss_fn=True, autotuner_benchmark=False),
    "llama/longlora.json": _f(_SFT + " sharding lora unified_checkpoint pissa use_mora", **_EPOCHS, bf16=True,
                              recompute=True, sharding="stage1", lora=True, use_flash_attention=True,
                              unified_checkpoint=True, pissa=False, use_mora=False),
    "llama/ssa_argument.json": _f(_RUN + " eval_accumulation_steps metric_for_best_model tensor_parallel_degree "
                                  "pipeline_parallel_degree sharding lora zero_padding use_flash_attention "
                                  "unified_checkpoint pissa", evaluation_strategy="no", save_strategy="no",
                                  do_train=True, do_eval=False, load_best_model_at_end=True, bf16=True,
                                  metric_for_best_model="accuracy", sharding="stage1", lora=True, recompute=True,
                                  unified_checkpoint=True, pissa=False),
    "llama/longlora_argument.json": _f(_RUN + " eval_accumulation_steps metric_for_best_model tensor_parallel_degree "
                                       "pipeline_parallel_degree sharding lora zero_padding use_flash_attention "
                                       "unified_checkpoint pissa use_shift_sparse_attention",
                                       evaluation_strategy="no", save_strategy="no", do_train=True, do_eval=False,
                                       load_best_model_at_end=True, bf16=True, sharding="stage1", lora=True,
                                       pissa=False, use_shift_sparse_attention=True),
    "llama/ARC-Challenge.json": _f(_EVAL_SETS, **_STEPS_EVAL, zero_padding=False),
    "llama/ARC-Easy.json": _f(_EVAL_SETS, **_STEPS_EVAL, zero_padding=False),
    "llama/boolq.json": _f(_EVAL_SETS, **_STEPS_EVAL, zero_padding=False),
    "llama/data_slim.json": _f(_EVAL_SETS, **_STEPS_EVAL, zero_padding=True),
    "llama/piqa.json": _f(_EVAL_SETS, **_STEPS_EVAL, zero_padding=True),
    "llama/winogrande.json": _f(_EVAL_SETS, **_STEPS_EVAL, zero_padding=True),
    "llama/winogrande_1.json": _f(_EVAL_SETS, **_STEPS_EVAL, zero_padding=True),
    "llama/pose_yarn.json": _f(
        "model_name_or_path dataset_name_or_path output_dir overwrite_output_dir num_train_epochs src_length "
        "max_length use_long_sequence_strategies rope_scaling_type rope_scaling_factor strategy_type strategy_name "
        "use_pose_convert per_device_train_batch_size gradient_accumulation_steps per_device_eval_batch_size "
        "do_train do_eval learning_rate warmup_steps logging_steps save_strategy save_steps evaluation_strategy "
        "eval_steps fp16 fp16_opt_level disable_tqdm load_best_model_at_end eval_with_do_generation recompute "
        "save_total_limit tensor_parallel_degree pipeline_parallel_degree zero_padding use_flash_attention",
        overwrite_output_dir=True, use_long_sequence_strategies=True, rope_scaling_type="yarn", rope_scaling_factor=8,
        strategy_type="embedding_strategies", strategy_name="YaRNScalingRotaryEmbedding", use_pose_convert=True,
        do_train=True, do_eval=False, save_strategy="steps", save_steps=1000, evaluation_strategy="no", eval_steps=50,
        fp16=True, fp16_opt_level="O2", load_best_model_at_end=False, tensor_parallel_degree=4),
    "llama/hqlora_argument.json": _f(_SFT + " lora weight_quantize_algo hqlora_quantize_cfg", **_EPOCHS, fp16=True,
                                     lora=True, weight_quantize_algo="nf4",
                                     hqlora_quantize_cfg="llm/tools/hqlora_quantize_cfg"),
    "llama/irqlora_argument.json": _f(_SFT + " lora unified_checkpoint weight_quantize_algo ir_qlora", **_EPOCHS,
                                      bf16=True, lora=True, unified_checkpoint=True, weight_quantize_algo="nf4",
                                      ir_qlora=True),
    "llama/lqlora_argument.json": _f(_SFT + " lora weight_quantize_algo lqlora_quantize_cfg lqlora_state_dict",
                                     **_EPOCHS, fp16=True, lora=True, weight_quantize_algo="lqlora",
                                     lqlora_quantize_cfg="path of lqlora quantize config",
                                     lqlora_state_dict="path of lqlora state dict"),
    "llama/vera_argument.json": _f(_SFT + " vera", **_EPOCHS, fp16=True, vera=True),
    "llama/lokr_argument.json": _f(
        _RUN_NO_EVAL_BATCH + " lokr lr_scheduler_type attention_probs_dropout_prob hidden_dropout_prob save_steps src_length "
        "metric_for_best_model sharding zero_padding use_flash_attention unified_checkpoint", lokr=True,
        attention_probs_dropout_prob=0, hidden_dropout_prob=0, evaluation_strategy="no", save_strategy="steps",
        do_train=True, do_eval=False, bf16=True, sharding="stage2", unified_checkpoint=True),
    "llama/dislora_argument.json": _f(
        _RUN_NO_EVAL_BATCH + " dislora lr_scheduler_type save_steps src_length sharding zero_padding use_flash_attention "
        "unified_checkpoint dislora_rank dislora_dropout target_modules s_tsd ortho_lambda prefer_small_sigma",
        dislora=True, evaluation_strategy="no", save_strategy="steps", do_train=True, do_eval=False, bf16=True,
        sharding="stage3", target_modules=[".*q_proj.*", ".*v_proj.*", ".*k_proj.*", ".*o_proj.*"],
        prefer_small_sigma=True),
    "llama/reft_argument.json": _f(
        "model_name_or_path dataset_name_or_path output_dir per_device_train_batch_size gradient_accumulation_steps "
        "per_device_eval_batch_size eval_accumulation_steps num_train_epochs learning_rate warmup_ratio logging_steps "
        "remove_unused_columns evaluation_strategy metric_for_best_model save_strategy src_length max_length "
        "fp16_opt_level do_train do_eval disable_tqdm load_best_model_at_end eval_with_do_generation "
        "save_total_limit tensor_parallel_degree pipeline_parallel_degree zero_padding recompute reft",
        remove_unused_columns=False, evaluation_strategy="no", metric_for_best_model="no", save_strategy="epoch",
        bf16=True, do_train=True, do_eval=False, reft=True),
    "llama/ptq_argument.json": _f(_QUANT + " do_ptq ptq_step " + _SMOOTH, **_PTQ, bf16=True, do_ptq=True,
                                  smooth=True, smooth_all_linears=True, smooth_piecewise_search=True,
                                  smooth_search_piece=True),
    "llama/ptq_c8_argument.json": _f(_QUANT + " quant_type do_ptq ptq_step act_quant_method cachekv_quant_method "
                                     + _SMOOTH, **dict(_PTQ, unified_checkpoint=False), fp16=True,
                                     quant_type="a8w8c8", do_ptq=True, smooth=True, act_quant_method="avg",
                                     cachekv_quant_method="avg_headwise"),
    "llama/fp8_ptq_argument.json": _f(_QUANT + " quant_type use_fp8 fp8_type do_ptq ptq_step smooth "
                                      "weight_quant_method act_quant_method cachekv_quant_method",
                                      **dict(_PTQ, unified_checkpoint=False), fp16=True, quant_type="W8A8",
                                      use_fp8="WA", fp8_type=["e4m3", "e4m3"], do_ptq=True, smooth=False,
                                      weight_quant_method="abs_max", act_quant_method="abs_max",
                                      cachekv_quant_method="abs_max"),
    "llama/ceval_ptq_argument.json": _f(_QUANT + " do_ptq ptq_step load_quant_model do_ceval ceval_data_path "
                                        + _SMOOTH, **dict(_PTQ, unified_checkpoint=False), bf16=True, do_ptq=False,
                                        smooth=True, load_quant_model=True, do_ceval=True,
                                        ceval_data_path="../dataset/ceval"),
    "llama/gptq_argument.json": _f(_QUANT + " do_gptq gptq_step", **_PTQ, bf16=True, do_gptq=True),
    "llama/awq_argument.json": _f(_QUANT + " do_ptq quant_type weight_quant_method ptq_step smooth auto_clip "
                                  "autoclip_step do_awq", **_PTQ, bf16=True, do_ptq=True,
                                  quant_type="weight_only_int4", weight_quant_method="groupwise", smooth=True,
                                  auto_clip=True, do_awq=True),
    "llama/foem_argument.json": _f(_QUANT + " do_gptq do_foem gptq_step", **dict(_PTQ, fp16_opt_level="O0"),
                                   bf16=False, do_gptq=True, do_foem=True),
    "llama/dpo_argument.json": _f(_PREF + " flash_mask beta loss_type label_smoothing lazy seed", **_DPO,
                                  tensor_parallel_degree=8, flash_mask=True, loss_type="sigmoid"),
    "llama/dpo_lora_argument.json": _f(_PREF + " flash_mask beta loss_type label_smoothing lazy seed lora lora_rank "
                                       "rslora_plus", **_DPO, flash_mask=True, loss_type="sigmoid", lora=True,
                                       rslora_plus=True),
    "llama/simpo_argument.json": _f(_PREF + " flash_mask beta simpo_gamma loss_type label_smoothing lazy seed",
                                    **_DPO, tensor_parallel_degree=8, flash_mask=True, loss_type="simpo"),
    "llama/kto_argument.json": _f(_PREF + " flash_mask beta lazy seed", **_DPO, tensor_parallel_degree=8,
                                  flash_mask=True),
    "llama/kto_lora_argument.json": _f(_PREF + " flash_mask beta lazy seed lora", **_DPO, tensor_parallel_degree=8,
                                       flash_mask=True, lora=True),
    "llama/rm_flashmask_argument.json": _f(_PREF + " sharding_parallel_degree flash_mask", **_DPO,
                                           tensor_parallel_degree=8, flash_mask=False),
    "llama/prm_flashmask_argument.json": _f(_PREF + " process_reward placeholder_token reward_tokens zero_padding "
                                            "save_total_limit sharding_parallel_degree flash_mask", **_DPO,
                                            process_reward=True, reward_tokens="+,-", tensor_parallel_degree=4),
    "llama/rm.json": _f(
        "model_name_or_path train_datasets eval_datasets output_dir per_device_train_batch_size "
        "gradient_accumulation_steps per_device_eval_batch_size eval_accumulation_steps num_train_epochs "
        "logging_steps evaluation_strategy eval_steps save_strategy save_steps max_length bf16 fp16_opt_level "
        "do_train do_eval disable_tqdm load_best_model_at_end metric_for_best_model recompute save_total_limit "
        "sharding_parallel_degree sharding weight_decay max_grad_norm adam_beta1 adam_beta2 lr_scheduler_type "
        "learning_rate warmup_ratio normalize_score_during_training normalizer_type normalizer_momentum "
        "loss_type regularization", evaluation_strategy="epoch", save_strategy="epoch", loss_type="sequence-wise",
        normalizer_type="ExponentialMovingAverage", sharding_parallel_degree=4, sharding="stage2"),
    "llama/pretrain_argument.json": _f(_PRETRAIN + " use_fused_rms_norm use_fused_rope min_learning_rate weight_decay "
                                       "do_predict distributed_dataloader bf16", bf16=True,
                                       tensor_parallel_degree=2, sharding="stage2", use_flash_attention=True,
                                       use_fused_rms_norm=True, use_fused_rope=True, do_predict=True),
    "llama/ppo_argument.json": _f(_RL + " ptx_datasets rollout_n critic_learning_rate critic_min_learning_rate "
                                  "critic_weight_decay critic_lr_scheduler_type critic_warmup_ratio critic_recompute "
                                  "critic_recompute_granularity kl_coeff fp16 autotuner_benchmark skip_profile_timer",
                                  tensor_parallel_degree=8),
    "llama/grpo_argument.json": _f(_RL + " prompt_key response_key use_rm_server reward_server rl_algorithm "
                                   "ignore_save_lr_and_optim kl_loss_coeff max_prompt_len rollout_n",
                                   rl_algorithm="grpo", tensor_parallel_degree=8),
    "llama/flashmask/sft.json": _f(
        _SFT + " eval_accumulation_steps max_steps warmup_ratio pipeline_parallel_config sharding unified_checkpoint "
        "tensor_parallel_output greedy_zero_padding lazy flash_mask", evaluation_strategy="no", save_strategy="no",
        do_train=True, do_eval=False, load_best_model_at_end=True, bf16=True, tensor_parallel_degree=2,
        sharding="stage2", zero_padding=True, greedy_zero_padding=True, lazy=True, unified_checkpoint=True,
        tensor_parallel_output=True, use_flash_attention=True, flash_mask=True,
        pipeline_parallel_config="disable_p2p_cache_shape"),
    "llama/flashmask/lora.json": _f(
        _SFT + " eval_accumulation_steps max_steps warmup_ratio pipeline_parallel_config sharding unified_checkpoint "
        "tensor_parallel_output greedy_zero_padding lazy flash_mask benchmark lora", evaluation_strategy="no",
        save_strategy="no", do_train=True, do_eval=False, load_best_model_at_end=True, bf16=True,
        tensor_parallel_degree=2, sharding="stage1", zero_padding=True, greedy_zero_padding=True, lazy=True,
        unified_checkpoint=True, tensor_parallel_output=True, use_flash_attention=True, flash_mask=True,
        benchmark=True, lora=True, pipeline_parallel_config="disable_p2p_cache_shape"),
    "llama/flashmask/dpo.json": _f(_PREF.replace("dev_dataset_path ", "") + " warmup_ratio greedy_zero_padding "
                                   "flash_mask lazy", evaluation_strategy="no", save_strategy="no",
                                   greedy_zero_padding=True, flash_mask=True, lazy=True),
    "llama/flashmask/rm.json": _f(_PREF + " warmup_ratio greedy_zero_padding flash_mask lazy",
                                  evaluation_strategy="no", save_strategy="no", benchmark=True,
                                  greedy_zero_padding=True, flash_mask=True, lazy=True),
    # ------------------------------------------------------------------ chatglm2
    "chatglm2/sft_argument.json": _f(_RUN + " eval_accumulation_steps src_length metric_for_best_model "
                                     "sharding_parallel_degree sharding zero_padding unified_checkpoint "
                                     "use_flash_attention", **_EPOCHS, fp16=True, recompute=True,
                                     sharding_parallel_degree=8, sharding="stage1", unified_checkpoint=True,
                                     use_flash_attention=False),
    "chatglm2/lora_argument.json": _f(_SFT + " lora unified_checkpoint", **_EPOCHS, fp16=True, recompute=True,
                                      lora=True, unified_checkpoint=True, use_flash_attention=False),
    "chatglm2/pt_argument.json": _f(_SFT + " prefix_tuning", **_EPOCHS, fp16=True, recompute=True,
                                    prefix_tuning=True, use_flash_attention=False),
    "chatglm2/pretrain_argument.json": _f(_PRETRAIN + " eval_accumulation_steps num_train_epochs num_hidden_layers "
                                          "evaluation_strategy save_strategy fp16 load_best_model_at_end "
                                          "metric_for_best_model sharding_parallel_degree",
                                          evaluation_strategy="epoch", save_strategy="epoch", fp16=True,
                                          load_best_model_at_end=True, tensor_parallel_degree=8, sharding="stage2"),
    "chatglm2/dpo_argument.json": _f(_PREF + " sharding_parallel_degree beta loss_type label_smoothing lazy seed",
                                     **dict(_DPO, sharding="stage2"), sharding_parallel_degree=8, recompute=True,
                                     loss_type="sigmoid"),
    "chatglm2/dpo_lora_argument.json": _f(_PREF + " beta loss_type label_smoothing lazy seed lora lora_rank "
                                          "rslora_plus", **_DPO, loss_type="sigmoid", lora=True, rslora_plus=True),
    "chatglm2/kto_argument.json": _f(_PREF + " beta lazy seed", **_DPO, tensor_parallel_degree=8),
    "chatglm2/kto_lora_argument.json": _f(_PREF + " beta lazy seed lora", **_DPO, tensor_parallel_degree=8, lora=True),
    "chatglm2/gptq_argument.json": _f(_QUANT + " fp16 do_gptq gptq_step", **_PTQ, fp16=True, do_gptq=True),
    "chatglm2/ptq_argument.json": _f(_QUANT + " fp16 do_ptq ptq_step " + _SMOOTH, **_PTQ, fp16=True, do_ptq=True,
                                     smooth=True, smooth_all_linears=True, smooth_piecewise_search=True,
                                     smooth_search_piece=True),
    # ------------------------------------------------------------------ qwen
    "qwen/sft_argument.json": _f(_SFT + " sharding unified_checkpoint", **_EPOCHS, bf16=True, recompute=True,
                                 sharding="stage2", unified_checkpoint=True, use_flash_attention=True),
    "qwen/sft_argument_0p5b.json": _f(_SFT + " sharding unified_checkpoint", **_EPOCHS, fp16=True, recompute=True,
                                      sharding="stage2", unified_checkpoint=True, use_flash_attention=False),
    "qwen/sft_argument_0p5b_best.json": _f(
        _RUN.replace(" recompute", "") + " eval_accumulation_steps src_length metric_for_best_model "
        "tensor_parallel_degree pipeline_parallel_degree sharding zero_padding unified_checkpoint fuse_attention_qkv "
        "fuse_attention_ffn use_fused_rms_norm use_fused_rope use_fused_linear_cross_entropy use_flash_attention",
        **dict(_EPOCHS, zero_padding=True), fp16=True, sharding="stage2", unified_checkpoint=True,
        fuse_attention_qkv=True, fuse_attention_ffn=True, use_fused_rms_norm=True, use_fused_rope=True,
        use_fused_linear_cross_entropy=True, use_flash_attention=True),
    "qwen/lora_argument.json": _f(_SFT + " lora unified_checkpoint pissa", **_EPOCHS, bf16=True, recompute=True,
                                  tensor_parallel_degree=4, lora=True, unified_checkpoint=True,
                                  use_flash_attention=True, pissa=False),
    "qwen/lora_argument_0p5b.json": _f(_SFT + " lora unified_checkpoint pissa", **_EPOCHS, fp16=True, recompute=True,
                                       lora=True, unified_checkpoint=True, use_flash_attention=False, pissa=False),
    "qwen/pt_argument.json": _f(_SFT.replace(" zero_padding", "") + " prefix_tuning",
                                **{k: v for k, v in _EPOCHS.items() if k != "zero_padding"}, bf16=True,
                                recompute=True, prefix_tuning=True, use_flash_attention=True),
    "qwen/pt_argument_0p5b.json": _f(_SFT.replace(" zero_padding", "") + " prefix_tuning",
                                     **{k: v for k, v in _EPOCHS.items() if k != "zero_padding"}, fp16=True,
                                     recompute=True, prefix_tuning=True, use_flash_attention=False),
    "qwen/ssa_argument.json": _f(_RUN + " eval_accumulation_steps metric_for_best_model tensor_parallel_degree "
                                 "pipeline_parallel_degree lora unified_checkpoint zero_padding use_flash_attention pissa",
                                 evaluation_strategy="no", save_strategy="no", do_train=True, do_eval=False,
                                 load_best_model_at_end=True, eval_with_do_generation=True, bf16=True, lora=True,
                                 recompute=True, unified_checkpoint=True, pissa=False),
    "qwen/longlora_argument.json": _f(_RUN + " eval_accumulation_steps metric_for_best_model tensor_parallel_degree "
                                      "pipeline_parallel_degree lora unified_checkpoint zero_padding "
                                      "use_flash_attention pissa use_shift_sparse_attention",
                                      evaluation_strategy="no", save_strategy="no", do_train=True, do_eval=False,
                                      load_best_model_at_end=True, eval_with_do_generation=True, bf16=True, lora=True,
                                      pissa=False, use_shift_sparse_attention=True),
    "qwen/dislora_argument.json": _f(
        _RUN_NO_EVAL_BATCH + " dislora lr_scheduler_type save_steps src_length sharding zero_padding use_flash_attention "
        "unified_checkpoint dislora_rank dislora_dropout s_tsd ortho_lambda prefer_small_sigma", dislora=True,
        evaluation_strategy="no", save_strategy="steps", do_train=True, do_eval=False, bf16=True,
        sharding="stage3", prefer_small_sigma=True),
    "qwen/emb_argument.json": _f(
        "model_name_or_path dataset_name_or_path output_dir per_device_train_batch_size gradient_accumulation_steps "
        "per_device_eval_batch_size eval_accumulation_steps max_steps learning_rate warmup_steps logging_steps "
        "evaluation_strategy save_strategy max_query_len max_passage_len group_size bf16 fp16_opt_level do_train "
        "do_eval disable_tqdm load_best_model_at_end eval_with_do_generation metric_for_best_model recompute "
        "save_total_limit tensor_parallel_degree pipeline_parallel_degree sharding zero_padding unified_checkpoint "
        "use_flash_attention amp_custom_black_list release_grads", evaluation_strategy="no", save_strategy="epoch",
        amp_custom_black_list="elementwise_div", release_grads=True),
    "qwen/dpo_argument.json": _f(_PREF + " flash_mask beta loss_type label_smoothing", **_DPO,
                                 tensor_parallel_degree=4, flash_mask=False, loss_type="sigmoid"),
    "qwen/dpo_argument_0p5b.json": _f(_PREF + " flash_mask beta loss_type greedy_zero_padding label_smoothing",
                                      **dict(_DPO, bf16=False), fp16=True, recompute=True, flash_mask=False,
                                      loss_type="sigmoid", greedy_zero_padding=False),
    "qwen/dpo_lora_argument.json": _f(_PREF + " beta loss_type label_smoothing lazy seed lora lora_rank rslora_plus",
                                      **_DPO, loss_type="sigmoid", lora=True, rslora_plus=True),
    "qwen/kto_argument.json": _f(_PREF + " flash_mask beta lazy seed", **_DPO, tensor_parallel_degree=8,
                                 flash_mask=True),
    "qwen/kto_lora_argument.json": _f(_PREF + " flash_mask beta lazy seed lora", **_DPO, tensor_parallel_degree=8,
                                      flash_mask=True, lora=True),
    "qwen/pretrain_argument.json": _f(_PRETRAIN + " use_fused_rms_norm min_learning_rate weight_decay bf16 "
                                      "do_predict distributed_dataloader", bf16=True, sharding="stage2",
                                      use_flash_attention=True, use_fused_rms_norm=True, do_predict=True),
    "qwen/pretrain_argument_0p5b.json": _f(_PRETRAIN + " use_fused_rms_norm min_learning_rate weight_decay fp16 "
                                           "do_predict distributed_dataloader", fp16=True, sharding="stage2",
                                           do_predict=True),
    "qwen/grpo_argument.json": _f(_RL + " use_rm_server reward_server rl_algorithm ignore_save_lr_and_optim "
                                  "kl_loss_coeff max_prompt_len num_return_sequences", rl_algorithm="grpo",
                                  sharding_parallel_degree=2, tensor_parallel_degree=4),
}
