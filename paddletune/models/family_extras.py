"""Per-family facts that ModelSpec (spec.py) does not hold yet, keyed by name here in models/, so
code outside models/ asks this module instead of testing a family name:

    tokenizer_class_for("ChatGLMTokenizer")       # -> chatglm_tokenizer.ChatGLMTokenizer (else None)
    conversion_fixups(src_dir, config, overrides)  # -> {config key: value} a converted config needs

They are meant to move into ModelSpec (a `tokenizer_classes` map and a `conversion_fixups`
callable per model type); until then this is their one place.
"""
import importlib
import os

# tokenizer_config.json "tokenizer_class" -> (module of paddletune.models, class). Imported when
# asked: those modules import paddletune.tokenizer, which asks here while loading a tokenizer.
TOKENIZER_CLASSES = {"ChatGLMTokenizer": ("chatglm_tokenizer", "ChatGLMTokenizer")}


def tokenizer_class_for(name):
    """The Tokenizer subclass a checkpoint whose tokenizer_config.json names `name` needs, or None
    when the plain Tokenizer reads it (ChatGLM numbers its special tokens after the sentencepiece
    vocabulary, so it has its own)."""
    entry = TOKENIZER_CLASSES.get(name)
    if entry is None:
        return None
    return getattr(importlib.import_module(f".{entry[0]}", __package__), entry[1])


def chatglm_rope_ratio_mode(src_dir, config, overrides):
    """ChatGLM's rope_ratio scales the rope base (ChatGLM3/GLM-4) or the positions (ChatGLM2-32K);
    paddletune's config.json records which as rope_ratio_mode. Taken from `overrides`, the config,
    or the checkpoint's modeling_chatglm.py, in that order."""
    if float(config.get("rope_ratio", 1) or 1) == 1:
        return {}
    mode = overrides.get("rope_ratio_mode") or config.get("rope_ratio_mode")
    code = os.path.join(src_dir, "modeling_chatglm.py")
    if not mode and os.path.exists(code):
        with open(code, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if "base = base * self.rope_ratio" in text:
            mode = "base"
        elif "/ self.rope_ratio" in text:
            mode = "position"
    if not mode:
        raise ValueError(f"{src_dir}/config.json has rope_ratio={config['rope_ratio']} and no "
                         "modeling_chatglm.py to tell its meaning; pass --rope_ratio_mode base "
                         "(ChatGLM3/GLM-4) or position (ChatGLM2-6B-32K)")
    return {"rope_ratio_mode": mode}


# config.json model_type (HF's, or PaddleNLP's before renaming) -> fixup
CONVERSION_FIXUPS = {"chatglm": chatglm_rope_ratio_mode, "chatglm_v2": chatglm_rope_ratio_mode}


def conversion_fixups(src_dir, config, overrides=None):
    """Config keys a checkpoint converted from `src_dir` must gain, {key: value} ({} for most
    families). `config` is the source config.json (a dict); `overrides` holds the converter's
    command-line answers ({key: value or None}) for facts the files may not state. Raises
    ValueError naming the file and the option to pass when a needed fact cannot be found."""
    fix = CONVERSION_FIXUPS.get(config.get("model_type"))
    return fix(src_dir, config, overrides or {}) if fix else {}
