"""Chat templates: one renderer for training data and for inference prompts.

A template turns a conversation (list of {"role": system|user|assistant, "content": str}) into
text. Two kinds:
- `JinjaTemplate`: Hugging Face semantics (the checkpoint's `chat_template`, a .jinja file, or a
  built-in). Rendered with `messages`, `add_generation_prompt`, `bos_token`, `eos_token`,
  `unk_token`, `pad_token`, `raise_exception`, `strftime_now`, `tojson`; trim_blocks and
  lstrip_blocks on, in a sandbox, so the text equals transformers' apply_chat_template.
- `RoundTemplate`: PaddleNLP's chat_template.json {"system", "conversation": [user, bot],
  "query"} with variables {{system}}, {{user}}, {{bot}}, {{query}} and {{index}} (0-based round);
  each piece is rendered on its own, keeping a trailing newline.

Segments (how loss masks are found without guessing): a conversation is cut into alternating
prompt and assistant pieces. For Jinja templates the cuts come from rendering growing prefixes,
    P_a = render(messages[:a], add_generation_prompt=True)   # what inference feeds the model
    Q_a = render(messages[:a+1])                              # ... after assistant message a
so the assistant piece is Q_a minus P_a: exactly the text a model must generate after the
prompt that inference builds. Each cut must be a prefix of the next ("prefix-stable"); a
template that rewrites earlier turns is refused with the turn number.

Tokens (`encode_segments`): every piece is encoded on its own (add_special_tokens=False) and
the ids concatenated, for training *and* for `Tokenizer.apply_chat_template(tokenize=True)`, so
a prompt at inference has exactly the ids it had in training. Labels cover each assistant piece
up to and including its end-of-turn token: the first special token after the message content
(<|im_end|>, <|eot_id|>, </s>, ...); text after it (a newline) is not labelled. A template that
emits no special token after the content (chatglm2, chatglm3) gets the tokenizer's EOS inserted
there, labelled, in training and inference alike. The tokenizer's own leading specials
(BOS, or [gMASK]sop for ChatGLM2/3) are put in front when the rendered text does not start with
them. A tokenizer whose specials close the prompt instead (`Tokenizer.specials_after_prompt`:
ChatGLM-6B's prompt, [gMASK], <sop>, answer, <eop>) gets them before the last answer, which is
the row's only labelled one (earlier turns become prompt), or at the end of a generation prompt.

Worked example (chatml, one turn): segments
    ["<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n", "yo<|im_end|>\\n"]
labels: -100 on the first piece, ids of "yo<|im_end|>" on the second, -100 on the final "\\n".
"""
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

IGNORE = -100
ROLES = ("system", "user", "assistant", "tool")


_WARNED = set()


def _warn_once(msg):
    if msg not in _WARNED:
        _WARNED.add(msg)
        logging.getLogger("paddletune").warning(msg)


class ChatTemplateError(ValueError):
    """A template that cannot be loaded or used; names the source and the fix."""


# ----------------------------------------------------------------------------- built-in templates
# Written for this project; each reproduces the model family's published prompt format.
_LLAMA2 = (
    "{% if messages and messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set msgs = messages[1:] %}{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('llama2 template: roles must alternate user/assistant after an optional system') }}"
    "{% endif %}"
    "{% if m['role'] == 'user' %}{{ bos_token }}[INST] "
    "{% if loop.first and sys %}<<SYS>>\n{{ sys }}\n<</SYS>>\n\n{% endif %}"
    "{{ m['content'] | trim }} [/INST]"
    "{% else %} {{ m['content'] | trim }} {{ eos_token }}{% endif %}"
    "{% endfor %}")
_LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# ChatGLM2: "[Round 1]\n\n问：Q\n\n答：A\n\n[Round 2]\n\n问：...". The separator is written before
# the next round so the answer ends at its content (EOS is then the end-of-turn token). Newlines
# right after a {% tag %} are eaten by trim_blocks, hence the '\n\n' string expression.
_CHATGLM2 = (
    "{% set ns = namespace(i=0, text=false) %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}{% set ns.text = true %}"
    "{% elif m['role'] == 'user' %}{% set ns.i = ns.i + 1 %}{% if ns.text %}{{ '\\n\\n' }}{% endif %}"
    "[Round {{ ns.i }}]\n\n问：{{ m['content'] }}\n\n答：{% set ns.text = true %}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
_CHATGLM3 = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n {{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
_BAICHUAN2 = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<reserved_106>{{ m['content'] }}"
    "{% else %}<reserved_107>{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<reserved_107>{% endif %}")
# ChatGLM-6B (v1): "[Round 0]\n问：Q\n答：A\n[Round 1]\n问：...", rounds from 0, the separator
# written before the next round (as chatglm2 above; EOS is then the end-of-turn token)
_CHATGLM = (
    "{% set ns = namespace(i=0, text=false) %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}{% set ns.text = true %}"
    "{% elif m['role'] == 'user' %}{% if ns.text %}{{ '\\n' }}{% endif %}"
    "[Round {{ ns.i }}]\n问：{{ m['content'] }}\n答：{% set ns.i = ns.i + 1 %}{% set ns.text = true %}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
# plain: the turns' texts one after another (a system text followed by a blank line). The
# tokenizer's leading specials (BOS) go in front and EOS after each answer (the rules above), so a
# {src, tgt} row renders [BOS] src tgt [EOS]: token for token what PaddleNLP's rule without a
# template gives (data/sft.py). The built-in tiny models and the base models without a published
# chat format (GPT-2 / GPT-3, OPT, Bloom) carry it, so the sample run's data is unchanged and --chat works.
_PLAIN = (
    "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'system' %}{{ '\\n\\n' }}{% endif %}"
    "{% endfor %}")
BUILTIN_TEMPLATES = {"llama2": _LLAMA2, "llama3": _LLAMA3, "chatml": _CHATML, "qwen": _CHATML,
                     "chatglm": _CHATGLM, "chatglm2": _CHATGLM2, "chatglm3": _CHATGLM3,
                     "baichuan2": _BAICHUAN2, "plain": _PLAIN}


# ----------------------------------------------------------------------------- jinja environment
def _raise(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


# What one render may use (a template is untrusted input, from a downloaded checkpoint): CPU
# seconds, characters of output, items of all range() calls together (jinja's sandbox bounds
# each range on its own, not two nested ones), and the size of a `*` / `**` result. Real chat
# templates render a conversation in milliseconds, with no ranges beyond the message count.
RENDER_CPU_S = 10.0
RENDER_CHARS = 16 << 20
RANGE_ITEMS = 1_000_000
_BUDGET = threading.local()


class BudgetExceeded(ChatTemplateError):
    pass


def _charge(items=0):
    """Count `items` against this render's range budget and check its CPU deadline."""
    b = getattr(_BUDGET, "state", None)
    if b is None:
        return
    b[1] += items
    if b[1] > RANGE_ITEMS:
        raise BudgetExceeded(f"its loops take more than {RANGE_ITEMS} range() items in one render")
    if time.process_time() > b[0]:
        raise BudgetExceeded(f"one render takes more than {RENDER_CPU_S:.0f} s of CPU time")


def _budget_range(*args):
    from jinja2.sandbox import safe_range

    r = safe_range(*args)
    _charge(len(r))
    return r


def _sandbox_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Budgeted(ImmutableSandboxedEnvironment):
        """The sandbox with every call and every `*` / `**` charged to the render's budget."""
        intercepted_binops = frozenset(["*", "**"])

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            _charge()
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context, operator, left, right):
            _charge()
            if operator == "**" and isinstance(right, int) and abs(right) > 64 and not isinstance(left, float):
                raise BudgetExceeded(f"a power {left!r} ** {right} is too large")
            if operator == "*":
                n = right if isinstance(left, (str, list, tuple)) else left
                seq = left if isinstance(left, (str, list, tuple)) else right
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > RENDER_CHARS:
                    raise BudgetExceeded(f"a repetition makes {len(seq) * n} items, more than {RENDER_CHARS}")
            return super().call_binop(context, operator, left, right)

    return Budgeted


@lru_cache(maxsize=None)
def _environment(hf_semantics=True):
    """Sandboxed jinja environment (with the render budget above); with hf_semantics, the
    settings transformers uses."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    ImmutableSandboxedEnvironment = _sandbox_class()

    class Generation(Extension):
        """{% generation %}...{% endgeneration %} (HF assistant-mask marker): renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    if not hf_semantics:  # chat_template.json pieces: a trailing "\n" in a piece is meant literally
        env = ImmutableSandboxedEnvironment(keep_trailing_newline=True)
        env.globals["range"] = _budget_range
        return env
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["range"] = _budget_range
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _compile(source, where, hf_semantics=True):
    import jinja2

    try:
        return _environment(hf_semantics).from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{where}: chat template is not valid jinja (line {e.lineno}: {e.message})") from None


def budgeted_render(compiled, where, **variables):
    """compiled.render(**variables) under the render budget (RENDER_CPU_S of CPU, RENDER_CHARS
    of output, RANGE_ITEMS of range()); any failure is a ChatTemplateError naming `where`."""
    import jinja2

    outer = getattr(_BUDGET, "state", None)
    if outer is None:
        _BUDGET.state = [time.process_time() + RENDER_CPU_S, 0]
    try:
        out, size = [], 0
        for piece in compiled.generate(**variables):
            size += len(piece)
            if size > RENDER_CHARS:
                raise BudgetExceeded(f"it renders more than {RENDER_CHARS} characters")
            out.append(piece)
            _charge()
        return "".join(out)
    except BudgetExceeded as e:
        raise ChatTemplateError(f"{where}: the chat template exceeds the render budget: {e}; a chat "
                                "template must render a conversation quickly (use a built-in: "
                                + ", ".join(BUILTIN_TEMPLATES) + ")") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"{where}: rendering failed: {e}") from None
    except RecursionError:
        raise ChatTemplateError(f"{where}: the chat template recurses without end (a macro that "
                                "calls itself): rendering failed") from None
    except (OverflowError, MemoryError, TypeError, ValueError, ArithmeticError, LookupError) as e:
        if isinstance(e, ChatTemplateError):
            raise
        raise ChatTemplateError(f"{where}: rendering failed: {type(e).__name__}: {e}") from None
    finally:
        if outer is None:
            _BUDGET.state = None


@dataclass
class Segment:
    """A piece of rendered text; `message` is the assistant message it holds (None for prompt)."""
    text: str
    message: dict = None

    @property
    def is_assistant(self):
        return self.message is not None


class JinjaTemplate:
    def __init__(self, source, where="chat_template"):
        self.source, self.where = source, where
        self.compiled = _compile(source, where)

    def render(self, messages, add_generation_prompt=False, **context):
        return budgeted_render(self.compiled, self.where, messages=messages,
                               add_generation_prompt=add_generation_prompt, **context)

    def segments(self, messages, add_generation_prompt=False, **context):
        """Prompt/assistant pieces whose concatenation is render(messages, add_generation_prompt)."""
        cuts = []   # (text, assistant message ending here or None, number of messages rendered)
        for a, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            after_assistant = a > 0 and messages[a - 1]["role"] == "assistant"
            prompt = self.render(messages[:a], not after_assistant, **context)
            full = self.render(messages[:a + 1], False, **context)
            if not full.startswith(prompt):
                # the generation prompt differs from how assistant turns start: cut before it,
                # so the assistant header is learned as part of the answer
                _warn_once(f"{self.where}: the generation prompt does not start the rendered assistant "
                           "turn; the assistant header is trained as part of each answer")
                prompt = self.render(messages[:a], False, **context)
            cuts.append((prompt, None, a))
            cuts.append((full, m, a + 1))
        cuts.append((self.render(messages, add_generation_prompt, **context), None, len(messages)))
        out, done = [], ""
        for text, msg, n in cuts:
            if not text.startswith(done):
                raise ChatTemplateError(
                    f"{self.where}: the template is not prefix-stable at message {n}: rendering a longer "
                    "conversation changes the text of earlier turns, so training pieces and inference "
                    "prompts would differ. Use a template that renders earlier turns the same whatever "
                    "follows (e.g. a built-in: " + ", ".join(BUILTIN_TEMPLATES) + ")")
            if len(text) > len(done) or msg is not None:
                out.append(Segment(text[len(done):], msg))
            done = text
        return out


class RoundTemplate:
    """PaddleNLP chat_template.json: system + rounds of conversation[0](user) conversation[1](bot),
    the last unanswered user rendered with `query` when a generation prompt is asked for."""

    def __init__(self, spec, where="chat_template.json"):
        conv = spec.get("conversation")
        if not (isinstance(conv, list) and len(conv) == 2 and all(isinstance(c, str) for c in conv)):
            raise ChatTemplateError(f"{where}: 'conversation' must be a list of two strings "
                                    "[user template with {{user}}, bot template with {{bot}}]")
        self.where, self.spec = where, dict(spec)
        comp = lambda s: _compile(s, where, hf_semantics=False) if s is not None else None  # noqa: E731
        # without "query", the last round's user text is rendered with the conversation template
        self.system, self.query = comp(spec.get("system")), comp(spec.get("query", conv[0]))
        self.user, self.bot = comp(conv[0]), comp(conv[1])
        self.system_uses_var = spec.get("system") is not None and "system" in _variables(spec["system"])

    def render(self, messages, add_generation_prompt=False, **context):
        return "".join(s.text for s in self.segments(messages, add_generation_prompt, **context))

    def segments(self, messages, add_generation_prompt=False, **context):
        sys = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        rest = messages[1:] if sys is not None else messages
        if sys is not None and not self.system_uses_var:
            raise ChatTemplateError(f"{self.where}: the conversation has a system message but the "
                                    "template's 'system' has no {{system}} placeholder to put it in")
        for i, m in enumerate(rest):
            if m["role"] != ("user" if i % 2 == 0 else "assistant"):
                raise ChatTemplateError(f"{self.where}: PaddleNLP templates need user/assistant turns "
                                        f"alternating after an optional system message; message "
                                        f"{i + 1 + (sys is not None)} is {m['role']!r}")
        head = budgeted_render(self.system, self.where, system=sys or "", **context) if self.system is not None else ""
        out, prompt = [], head
        for i in range(0, len(rest), 2):
            user, index = rest[i]["content"], i // 2
            if i + 1 < len(rest):
                out.append(Segment(prompt + budgeted_render(self.user, self.where, user=user, index=index, **context)))
                out.append(Segment(budgeted_render(self.bot, self.where, bot=rest[i + 1]["content"], index=index, **context), rest[i + 1]))
                prompt = ""
            else:
                fmt = self.query if add_generation_prompt else self.user
                prompt += budgeted_render(fmt, self.where, query=user, user=user, index=index, **context)
        if prompt:
            out.append(Segment(prompt))
        return out


def _variables(source):
    from jinja2 import meta

    return meta.find_undeclared_variables(_environment(False).parse(source))


# ----------------------------------------------------------------------------- loading
def load_template(source, where="chat_template"):
    """JinjaTemplate / RoundTemplate from a built-in name, a file path (.json: PaddleNLP
    {system, conversation, query} or {"chat_template": str}; anything else: jinja text), or
    jinja text itself. None or "none" -> None (no template)."""
    if source is None or (isinstance(source, str) and source.strip().lower() == "none"):
        return None
    if isinstance(source, dict):
        return _from_json(source, where)
    if not isinstance(source, str):
        raise ChatTemplateError(f"{where}: expected a name, a path or template text, got {type(source).__name__}")
    if source in BUILTIN_TEMPLATES:
        return JinjaTemplate(BUILTIN_TEMPLATES[source], f"built-in chat template {source!r}")
    if os.path.lexists(source) and not os.path.isdir(source):
        from ..io import TEMPLATE_CAP, read_text

        text = read_text(source, TEMPLATE_CAP, "chat template")
        if source.endswith(".json"):
            try:
                return _from_json(json.loads(text), source)
            except json.JSONDecodeError as e:
                raise ChatTemplateError(f"{source}: not valid JSON ({e.msg}, line {e.lineno})") from None
        return JinjaTemplate(text, source)
    if "{{" in source or "{%" in source:
        return JinjaTemplate(source, where)
    raise ChatTemplateError(
        f"{where}={source!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}), nor an "
        f"existing file (working directory {os.getcwd()}), nor jinja text; use 'none' for no template")


def _from_json(spec, where):
    if isinstance(spec, dict) and isinstance(spec.get("chat_template"), str):
        return JinjaTemplate(spec["chat_template"], where)
    if isinstance(spec, dict) and "conversation" in spec:
        return RoundTemplate(spec, where)
    raise ChatTemplateError(f"{where}: expected PaddleNLP keys {{system, conversation, query}} or "
                            f"{{\"chat_template\": \"<jinja>\"}}, got keys {sorted(spec) if isinstance(spec, dict) else spec!r}")


def template_for(tok, source=None):
    """The template in effect: `source` (the chat_template argument) when given, else the
    checkpoint's (tokenizer_config.json / chat_template.jinja / PaddleNLP chat_template.json)."""
    if source is not None:
        return load_template(source)
    return tok.template


# ----------------------------------------------------------------------------- conversations
def normalize_conversation(conversation, where="conversation"):
    """A list of {"role", "content"} from messages, PaddleNLP pairs [[user, bot], ..., [query]]
    or a single query string. Raises ChatTemplateError naming what is wrong."""
    if isinstance(conversation, str):
        return [{"role": "user", "content": conversation}]
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ChatTemplateError(f"{where}: expected a non-empty list of messages, got {conversation!r:.80}")
    if all(isinstance(x, (list, tuple)) for x in conversation):
        msgs = []
        for pair in conversation:
            for role, text in zip(("user", "assistant"), pair):
                if text is not None:
                    msgs.append({"role": role, "content": text})
        conversation = msgs
    out = []
    for i, m in enumerate(conversation):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatTemplateError(f"{where}: message {i + 1} must be an object with \"role\" and "
                                    f"\"content\", got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ChatTemplateError(f"{where}: message {i + 1} has role {m['role']!r}; use one of {list(ROLES)}")
        if not isinstance(m["content"], str):
            raise ChatTemplateError(f"{where}: message {i + 1} content must be a string, got "
                                    f"{type(m['content']).__name__}")
        out.append(dict(m))
    first = next((m["role"] for m in out if m["role"] != "system"), None)
    if first == "assistant":
        raise ChatTemplateError(f"{where}: the first non-system message must be from the user")
    return out


def template_context(tok):
    return {"bos_token": tok.bos_token or "", "eos_token": tok.eos_token or "",
            "unk_token": tok.unk_token or "", "pad_token": tok.pad_token or ""}


def _label_split(text, content, pattern):
    """(labelled, tail, found): labelled = text up to and including the first special token
    after the message content; found=False when there is none (then everything is labelled)."""
    start = 0
    for c in (content, content.strip()):
        if c and text.find(c) >= 0:
            start = text.find(c) + len(c)
            break
    m = pattern.search(text, start) if pattern is not None else None
    if m is None:
        return text, "", False
    return text[:m.end()], text[m.end():], True


def _encode_answer(tok, seg, pattern, eos):
    """(ids, labels, True) of an assistant piece: labelled up to its end-of-turn token."""
    labelled, tail, found = _label_split(seg.text, seg.message["content"], pattern)
    ids = tok.encode(labelled, add_special_tokens=False) if labelled else []
    if not found and eos is not None:
        ids = ids + [eos]
    tail_ids = tok.encode(tail, add_special_tokens=False) if tail else []
    return ids + tail_ids, ids + [IGNORE] * len(tail_ids), True


def encode_segments(tok, segments, answer_last=True):
    """[(ids, labels, is_assistant)] per segment, following the module docstring's rules.
    `answer_last`=False: the conversation ends in a prompt to be answered (a generation prompt),
    which only matters for a tokenizer with specials_after_prompt."""
    pattern, eos = tok.special_token_pattern, tok.eos_token_id
    if getattr(tok, "specials_after_prompt", False):
        return _encode_after_prompt(tok, segments, pattern, eos, answer_last)
    out = []
    for seg in segments:
        if not seg.is_assistant:
            ids = tok.encode(seg.text, add_special_tokens=False) if seg.text else []
            out.append((ids, [IGNORE] * len(ids), False))
            continue
        out.append(_encode_answer(tok, seg, pattern, eos))
    prefix = tok.special_tokens_around()[0]
    first = next((ids for ids, _, _ in out if ids), [])
    if prefix and first[:len(prefix)] != prefix:
        out.insert(0, (list(prefix), [IGNORE] * len(prefix), False))
    return out


def _encode_after_prompt(tok, segments, pattern, eos, answer_last=True):
    """A tokenizer whose specials close the prompt (ChatGLM-6B: prompt, [gMASK], <sop>, answer,
    <eop>) has one answer per row: the last assistant piece. Everything before it, earlier
    answers too (unlabelled, no EOS added: as PaddleNLP folds earlier rounds into the prompt), is
    prompt, and the specials (special_tokens_around()[1]) end the piece right before the answer;
    without an answer (a generation prompt) they end the ids. One piece per segment, as above;
    prompt pieces after the first are encoded as a continuation where the tokenizer can
    (`encode_continuation`: no dummy "▁"), so the prompt's ids are those of its whole text
    encoded at once (THUDM's chat) wherever the pieces meet at a "\n"; the answer is encoded on
    its own (PaddleNLP and THUDM's fine-tuning code encode the target separately)."""
    suffix = list(tok.special_tokens_around()[1])
    last = max((i for i, s in enumerate(segments) if s.is_assistant), default=None) \
        if answer_last else None
    cont = getattr(tok, "encode_continuation", None)
    out = []
    for i, seg in enumerate(segments):
        if i == last:
            out.append(_encode_answer(tok, seg, pattern, eos))
            continue
        if not seg.text:
            ids = []
        elif cont is not None and any(p[0] for p in out):
            ids = cont(seg.text)
        else:
            ids = tok.encode(seg.text, add_special_tokens=False)
        out.append((ids, [IGNORE] * len(ids), False))
    at = (last if last is not None else len(out)) - 1
    if at < 0:
        out.insert(0, ([], [], False))
        at = 0
    ids, labels, _ = out[at]
    out[at] = (ids + suffix, labels + [IGNORE] * len(suffix), False)
    return out


def stop_token_ids(tok, chat_template=None):
    """Ids that end an assistant turn under the template (for generation): the end-of-turn
    token found after a rendered answer (e.g. <|im_end|>, <|eot_id|>), plus EOS."""
    template = template_for(tok, chat_template)
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if template is None:
        return ids
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    seg = next(s for s in template.segments(msgs, False, **template_context(tok)) if s.is_assistant)
    labelled, _, found = _label_split(seg.text, "a", tok.special_token_pattern)
    if found:
        end = tok.encode(labelled, add_special_tokens=False)[-1]
        ids = [end] + [i for i in ids if i != end]
    return ids


def apply_chat_template(tok, conversation, add_generation_prompt=False, tokenize=True,
                        chat_template=None, **context):
    """Text (tokenize=False) or token ids of a conversation, as training renders it."""
    template = template_for(tok, chat_template)
    if template is None:
        raise ChatTemplateError(
            f"{tok.path}: this tokenizer has no chat template; pass chat_template= a built-in name "
            f"({', '.join(BUILTIN_TEMPLATES)}), a jinja file or a PaddleNLP chat_template.json")
    messages = normalize_conversation(conversation)
    ctx = dict(template_context(tok), **context)
    if not tokenize:
        return template.render(messages, add_generation_prompt, **ctx)
    answer_last = messages[-1]["role"] == "assistant" and not add_generation_prompt
    pieces = encode_segments(tok, template.segments(messages, add_generation_prompt, **ctx), answer_last)
    return [i for ids, _, _ in pieces for i in ids]
