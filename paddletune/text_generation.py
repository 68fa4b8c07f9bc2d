"""Prompts in, text out: chat-aware prompt encoding and the `pipeline("text-generation")` API,
on top of generation.generate.

    pipe = paddletune.pipeline("text-generation", model=dir, max_new_tokens=32)
    pipe("Hello")                                      # [{"generated_text": "Hello ..."}]
    pipe([{"role": "user", "content": "Hi"}])          # chat template, answer appended as a message
"""
from .generation import GenerationConfig, checkpoint_defaults, generate
from .loading import load_for_generation


def _split_messages(conversation):
    """(system messages, [rounds]) where each round starts at a user message."""
    from .data.chat_template import normalize_conversation

    msgs = normalize_conversation(conversation)
    system = [m for m in msgs[:1] if m["role"] == "system"]
    rounds = []
    for m in msgs[len(system):]:
        if not rounds or m["role"] == "user":
            rounds.append([])
        rounds[-1].append(m)
    return system, rounds


def encode_prompt(tokenizer, conversation, use_template=True, src_length=None):
    """Prompt ids, at most `src_length` long.

    With the tokenizer's chat template (`use_template`): `conversation` is a string (one user
    turn), PaddleNLP pairs [[q1, a1], ..., [q]] or messages ending with a user turn; it is
    rendered with add_generation_prompt, tokenised as in training (Tokenizer.apply_chat_template).
    Too long: the oldest rounds are dropped (a system message stays), then the last user text
    is cut from the left inside the template, and as a last resort the ids from the left.
    Without: the string is encoded with the tokenizer's specials (BOS ...), and its text tokens
    are cut from the left (the specials stay), as in training without a template."""
    if not use_template:
        if not isinstance(conversation, str):
            raise ValueError("a conversation (several rounds or messages) needs a chat template; "
                             "set chat_template")
        ids = tokenizer.encode(conversation)
        if src_length and len(ids) > src_length:
            pre, post = tokenizer.special_tokens_around()
            text = tokenizer.encode(conversation, add_special_tokens=False)
            keep = max(src_length - len(pre) - len(post), 0)
            ids = pre + (text[len(text) - keep:] if keep else []) + post
        return ids
    system, rounds = _split_messages(conversation)
    if rounds[-1][-1]["role"] != "user":
        raise ValueError("the conversation must end with a user message to generate the answer")

    def render(rs):
        return tokenizer.apply_chat_template(system + [m for r in rs for m in r], add_generation_prompt=True)

    ids = render(rounds)
    while src_length and len(ids) > src_length and len(rounds) > 1:
        rounds = rounds[1:]
        ids = render(rounds)
    last = rounds[-1][-1]
    for _ in range(4):   # cut the user text; re-encoding may shift a token, so re-check
        if not src_length or len(ids) <= src_length:
            break
        text = tokenizer.encode(last["content"], add_special_tokens=False)
        keep = max(len(text) - (len(ids) - src_length), 0)
        last = dict(last, content=tokenizer.decode(text[len(text) - keep:]) if keep else "")
        ids = render(rounds[:-1] + [rounds[-1][:-1] + [last]])
    return ids[len(ids) - src_length:] if src_length and len(ids) > src_length else ids


class TextGenerationPipeline:
    """pipe(inputs, **generation overrides), as transformers' text-generation pipeline:
    - a string (or a list of strings) is fed as raw text (the tokenizer's BOS rule applies) ->
      [{"generated_text": prompt + completion}] (completion only with return_full_text=False);
    - messages [{"role", "content"}, ...] (or a list of such) are rendered with the chat
      template -> [{"generated_text": messages + [{"role": "assistant", "content": answer}]}].
    Inputs are batched `batch_size` at a time with left padding."""

    def __init__(self, model, tokenizer, config, batch_size=8):
        self.model, self.tokenizer, self.config, self.batch_size = model, tokenizer, config, batch_size

    def __call__(self, inputs, return_full_text=True, **kwargs):
        is_chat = lambda x: isinstance(x, list) and bool(x) and all(isinstance(m, dict) for m in x)  # noqa: E731
        single = isinstance(inputs, str) or is_chat(inputs)
        items = [inputs] if single else list(inputs)
        if not items or not all(isinstance(x, str) or is_chat(x) for x in items):
            raise TypeError("text-generation inputs: a string, a list of messages, or a non-empty "
                            "list of those")
        cfg = GenerationConfig.from_kwargs(self.config, **kwargs)
        results = []
        for i in range(0, len(items), self.batch_size):
            chunk = items[i:i + self.batch_size]
            prompts = [encode_prompt(self.tokenizer, x, not isinstance(x, str), cfg.src_length)
                       for x in chunk]
            out = generate(self.model, prompts, cfg, tokenizer=self.tokenizer)
            for x, gen in zip(chunk, out.texts):
                if not isinstance(x, str):
                    full = list(x) + [{"role": "assistant", "content": gen}]
                    results.append([{"generated_text": full if return_full_text else gen}])
                else:
                    results.append([{"generated_text": (x + gen) if return_full_text else gen}])
        return results[0] if single else results


def pipeline(task, model=None, tokenizer=None, lora=None, prefix=None, batch_size=8,
             merge_lora=True, **kwargs):
    """paddletune.pipeline("text-generation", model=dir_or_model, lora=adapter_dir,
    prefix=prefix_dir, max_new_tokens=..., decode_strategy=..., ...) -> TextGenerationPipeline.
    Generation keywords are GenerationConfig fields; they become the pipeline's defaults.
    `merge_lora=False` keeps the LoRA layers unmerged (same outputs, slower)."""
    if task != "text-generation":
        raise ValueError(f"task {task!r} is not supported; use 'text-generation'")
    if model is None:
        raise ValueError("pipeline('text-generation') needs model= (a checkpoint directory, a "
                         "built-in name such as paddletune/tiny-llama, or a loaded model)")
    base = GenerationConfig.from_kwargs(**kwargs)   # bad keys fail before the model is loaded
    model, tokenizer, path = load_for_generation(model, tokenizer, lora, prefix, merge_lora)
    defaults = checkpoint_defaults(path, tokenizer)
    for key in ("eos_token_id", "pad_token_id"):
        if key not in kwargs:
            setattr(base, key, defaults[key])
    return TextGenerationPipeline(model, tokenizer, base, batch_size)
