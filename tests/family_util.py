"""Tiny random checkpoints of the families transformers has (the oracle), saved by transformers."""
import os
import shutil

from conftest import TINY_TOKENIZER

VOCAB = 600

# kind -> (config class, model class, tiny config); vocabulary 600 = the built-in BPE tokenizer's
HF_FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, tie_word_embeddings=True,
        rms_norm_eps=1e-6)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(
        n_embd=64, n_layer=2, n_head=4, n_positions=128, n_inner=None, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(
        hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(
        hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0)),
    # Mixture-of-Experts (test_moe.py); initializer_range 0.1: routers with clear top-k choices
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_local_experts=4,
        num_experts_per_tok=2, initializer_range=0.1, router_aux_loss_coef=0.02,
        output_router_logits=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=80, initializer_range=0.1,
        router_aux_loss_coef=0.05, output_router_logits=True)),
}


def hf_family(path, kind, seed=0, tokenizer_dir=TINY_TOKENIZER, **config):
    """Save a random tiny `kind` model with transformers; returns (path, torch model in eval)."""
    import torch
    import transformers

    cfg_cls, model_cls, base = HF_FAMILIES[kind]
    base = dict(base, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    base.update(config)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**base)).eval()
    with torch.no_grad():   # non-trivial norms and biases (HF initialises them at 1 / 0)
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    if tokenizer_dir:
        for name in os.listdir(tokenizer_dir):
            shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(str(path), name))
    return str(path), model
