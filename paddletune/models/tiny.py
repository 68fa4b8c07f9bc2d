"""Tiny checkpoints in real Hugging Face format, produced deterministically (no downloads).

- `train_bpe_tokenizer(out_dir, texts)`: byte-level BPE tokenizer.json + tokenizer_config.json
  (Llama-2 conventions: <unk>=0, <s>=1, </s>=2, BOS added).
- `train_sentencepiece(out_dir, texts)`: tokenizer.model (Llama-2 style, sentencepiece BPE).
- `make_tiny_checkpoint(out_dir, model_type, seed, **config_overrides)`: random N(0, 0.02)
  weights (numpy RNG) + config.json + tokenizer files, saved by models.save_pretrained.
- Built-in names (`paddletune/tiny-llama`, ...) are generated once into $PADDLETUNE_HOME
  (default ~/.cache/paddletune) and reused; they carry the "plain" chat template. Those with
  assets/pretrained/<short name>/model.safetensors (tools/make_pretrained_builtins.py: pre-trained
  on the standard library's docs) get those weights; the others are random N(0, 0.02).
"""
import hashlib
import json
import os
import shutil

from ..io import temp_dir_beside

ASSETS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets")
TINY_TOKENIZER = os.path.join(ASSETS, "tiny-tokenizer")
PRETRAINED = os.path.join(ASSETS, "pretrained")

# built-in name -> (model_type, config overrides); sized so the sample SFT run takes minutes
BUILTIN = {
    "paddletune/tiny-llama": ("llama", dict(hidden_size=128, intermediate_size=352,
                                           num_hidden_layers=4, num_attention_heads=4,
                                           num_key_value_heads=2, max_position_embeddings=1024)),
    "paddletune/tiny-qwen2": ("qwen2", dict(hidden_size=128, intermediate_size=352,
                                           num_hidden_layers=4, num_attention_heads=4,
                                           num_key_value_heads=2, max_position_embeddings=1024)),
    "paddletune/tiny-chatglm2": ("chatglm", dict(num_layers=4, hidden_size=128, ffn_hidden_size=352,
                                                kv_channels=32, num_attention_heads=4,
                                                multi_query_group_num=2, seq_length=1024,
                                                tokenizer="tiny-chatglm-tokenizer")),
    "paddletune/tiny-qwen3": ("qwen3", dict(hidden_size=128, intermediate_size=352, head_dim=32,
                                           num_hidden_layers=4, num_attention_heads=4,
                                           num_key_value_heads=2, max_position_embeddings=1024)),
    "paddletune/tiny-gpt2": ("gpt2", dict(n_embd=128, n_inner=352, n_layer=4, n_head=4,
                                         n_positions=1024)),
    "paddletune/tiny-opt": ("opt", dict(hidden_size=128, word_embed_proj_dim=128, ffn_dim=352,
                                       num_hidden_layers=4, num_attention_heads=4,
                                       max_position_embeddings=1024)),
    "paddletune/tiny-bloom": ("bloom", dict(hidden_size=128, n_layer=4, n_head=4)),
    "paddletune/tiny-baichuan2": ("baichuan", dict(hidden_size=128, intermediate_size=352,
                                                  num_hidden_layers=4, num_attention_heads=4,
                                                  max_position_embeddings=1024)),
    "paddletune/tiny-baichuan2-13b": ("baichuan", dict(hidden_size=128, intermediate_size=352,
                                                      num_hidden_layers=4, num_attention_heads=4,
                                                      position_embedding="alibi")),
    "paddletune/tiny-qwen": ("qwen", dict(hidden_size=128, intermediate_size=704, kv_channels=32,
                                         num_hidden_layers=4, num_attention_heads=4,
                                         tokenizer="tiny-qwen-tokenizer")),
    "paddletune/tiny-chatglm6b": ("chatglm6b", dict(hidden_size=128, num_layers=4, num_attention_heads=4,
                                                   inner_hidden_size=352, max_sequence_length=1024,
                                                   tokenizer="tiny-chatglm6b-tokenizer")),
    # Mixture-of-Experts: 4 experts, top-2, the load-balancing loss on (output_router_logits)
    "paddletune/tiny-mixtral": ("mixtral", dict(hidden_size=128, intermediate_size=176,
                                               num_hidden_layers=4, num_attention_heads=4,
                                               num_key_value_heads=2, max_position_embeddings=1024,
                                               num_local_experts=4, num_experts_per_tok=2)),
    # Qwen2-MoE with its shared expert; layer 0 dense (mlp_only_layers)
    "paddletune/tiny-qwen2moe": ("qwen2_moe", dict(hidden_size=128, intermediate_size=352,
                                                  moe_intermediate_size=96,
                                                  shared_expert_intermediate_size=192,
                                                  num_hidden_layers=4, num_attention_heads=4,
                                                  num_key_value_heads=2, max_position_embeddings=1024,
                                                  num_experts=4, num_experts_per_tok=2,
                                                  mlp_only_layers=[0])),
}

# the built-in models' chat template: "plain" renders a {src, tgt} row as exactly the tokens the
# template-free rule gives, so training on them is unchanged while --chat and
# apply_chat_template work (data/chat_template.py)
BUILTIN_CHAT_TEMPLATE = "plain"


def train_bpe_tokenizer(out_dir, texts, vocab_size=600, chat_template=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True,
            "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
            "pad_token": "<unk>", "model_max_length": 1024, "clean_up_tokenization_spaces": False}
    if chat_template:
        conf["chat_template"] = chat_template
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    return out_dir


def train_sentencepiece(out_dir, texts, vocab_size=600):
    """Llama-2 style sentencepiece BPE model (tokenizer.model) with byte fallback."""
    import sentencepiece as spm

    os.makedirs(out_dir, exist_ok=True)
    corpus = os.path.join(out_dir, ".corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("\n".join(texts))
    spm.SentencePieceTrainer.train(
        input=corpus, model_prefix=os.path.join(out_dir, "tokenizer"), vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, add_dummy_prefix=True, num_threads=1, minloglevel=2,
        split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity")
    os.unlink(corpus)
    os.unlink(os.path.join(out_dir, "tokenizer.vocab"))
    conf = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
            "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    return out_dir


def make_tiny_checkpoint(out_dir, model_type="llama", seed=0, tokenizer_dir=TINY_TOKENIZER,
                         chat_template=None, **overrides):
    """Write a random tiny model of `model_type` with the tokenizer from `tokenizer_dir` (and
    `chat_template`, a built-in template name, in its tokenizer_config.json)."""
    from . import build_model, get_spec, save_pretrained
    from ..tokenizer import Tokenizer
    from .spec import tokenizer_class_of

    spec = get_spec(model_type)
    tok = (tokenizer_class_of(tokenizer_dir) or Tokenizer)(tokenizer_dir)
    if chat_template:
        tok.set_chat_template(chat_template)
    config = dict(spec.tiny_config)
    config.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if "pad_token_id" in spec.tiny_config or tok.pad_token_id is not None:
        config["pad_token_id"] = tok.pad_token_id
    if hasattr(tok, "config_token_ids"):   # ids a family's tokenizer fixes (ChatGLM-6B's [gMASK], ...)
        config.update(tok.config_token_ids())
    config.update(overrides)
    model = build_model(config, seed=seed)
    save_pretrained(model, out_dir, tokenizer=tok, dtype="float32")
    return out_dir


def builtin_model_dir(name):
    """Directory of built-in model `name`, generating it on first use (atomic rename)."""
    model_type, overrides = BUILTIN[name]
    overrides = dict(overrides)
    tok_dir = os.path.join(ASSETS, overrides.pop("tokenizer", "tiny-tokenizer"))
    weights = pretrained_weights(name)
    key = json.dumps([model_type, overrides, _tokenizer_digest(tok_dir), BUILTIN_CHAT_TEMPLATE]
                     + ([_weights_digest(weights)] if weights else []), sort_keys=True)
    tag = hashlib.sha1(key.encode()).hexdigest()[:10]
    home = os.environ.get("PADDLETUNE_HOME", os.path.join(os.path.expanduser("~"), ".cache", "paddletune"))
    path = os.path.join(home, f"{name.split('/')[-1]}-{tag}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tmp = temp_dir_beside(path)
    try:
        make_tiny_checkpoint(tmp, model_type, seed=0, tokenizer_dir=tok_dir,
                             chat_template=BUILTIN_CHAT_TEMPLATE, **overrides)
        if weights:
            _use_weights(tmp, weights)
        try:
            os.rename(tmp, path)
        except OSError:  # another process finished first; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def pretrained_weights(name):
    """assets/pretrained/<short name>/model.safetensors of built-in `name`, or None (random)."""
    path = os.path.join(PRETRAINED, name.split("/")[-1], "model.safetensors")
    return path if os.path.isfile(path) else None


def _use_weights(model_dir, weights):
    """Replace the random model.safetensors of `model_dir` by `weights`: same tensor names,
    shapes and dtypes, or an error naming the first difference (the asset is stale)."""
    from safetensors import safe_open

    def layout(path):
        with safe_open(path, "np") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}

    target = os.path.join(model_dir, "model.safetensors")
    want, have = layout(target), layout(weights)
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()), key=str)[:1]
        raise ValueError(f"{weights} does not fit the built-in configuration (first difference: {diff}); "
                         "rebuild it with tools/make_pretrained_builtins.py")
    shutil.copyfile(weights, target)


def _file_digest(path):
    with open(path, "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()[:10]


def _weights_digest(weights):
    """The sha256 the recipe recorded in pretrained.json beside `weights` (no 4 MB read on every
    resolve of a built-in name); the file's own digest when the record is missing."""
    record = os.path.join(os.path.dirname(weights), "pretrained.json")
    if os.path.isfile(record):
        with open(record) as f:
            return json.load(f)["sha256"][:10]
    return _file_digest(weights)


def _tokenizer_digest(tok_dir=TINY_TOKENIZER):
    name = next((n for n in ("tokenizer.json", "tokenizer.model", "qwen.tiktoken", "ice_text.model")
                 if os.path.exists(os.path.join(tok_dir, n))), "tokenizer.model")
    return _file_digest(os.path.join(tok_dir, name))


if __name__ == "__main__":  # regenerate the shipped tokenizer from the sample dataset
    from ..data.builtin import generate

    train, dev = generate()
    texts = [r["src"] + "\n" + r["tgt"] for r in train + dev]
    train_bpe_tokenizer(TINY_TOKENIZER, texts)
