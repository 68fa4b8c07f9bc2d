"""Incremental detokenization for streaming: text pieces whose concatenation is the text of
the whole answer, sent as soon as they are final.

Two things make "decode the new token alone" wrong:
- byte-level / byte-fallback tokens: a CJK character or an emoji is 3-4 UTF-8 bytes, often one
  token each; until the last byte arrives the decoded text ends in U+FFFD. That piece is held
  back until the character is complete.
- SentencePiece's leading-space marker "▁": decoding a token alone drops the space it stands
  for (the decoder strips a leading space), so "▁world" alone gives "world", not " world".
So each step decodes a short window that starts a few tokens back (`prefix_offset`) and sends
what the window decodes to beyond the text it already decoded to (the window's first token
loses its space in both decodes alike). Example (SentencePiece): ids of "▁Hello", "▁world":
step 1 window [Hello] -> "Hello"; step 2 window [Hello, world] -> "Hello world", already sent
"Hello" -> send " world".

`StreamText` adds stop strings: the tail that could still become a stop string is held back,
and the end is cut before the stop string, as generation.decode_output cuts the full text.
"""

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """add(token_id) -> new text (maybe ""); flush() -> whatever is still held back."""

    def __init__(self, tokenizer, skip_ids=()):
        self.tok, self.skip = tokenizer, set(skip_ids)
        self.ids, self.prefix_offset, self.read_offset = [], 0, 0

    def _decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    def add(self, token_id):
        if token_id in self.skip:
            return ""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        now = self._decode(self.ids[self.prefix_offset:])
        if len(now) > len(before) and not now.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self):
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        now = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return now[len(before):]


class StreamText:
    """Pieces of an answer for a stream, honouring stop strings.

    push(token_id) -> text safe to send now; finish() -> the rest. `text` is everything sent."""

    def __init__(self, tokenizer, skip_ids=(), stops=()):
        self.detok = IncrementalDetokenizer(tokenizer, skip_ids)
        self.stops = [s for s in stops if s]
        self.pending, self.text, self.stopped = "", "", False

    def _held(self, s):
        """Length of the longest tail of s that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(s)), best, -1):
                if s.endswith(stop[:k]):
                    best = k
                    break
        return best

    def _release(self, final):
        s = self.pending
        cuts = [s.find(stop) for stop in self.stops if stop in s]
        if cuts:
            out, self.pending, self.stopped = s[:min(cuts)], "", True
        else:
            keep = 0 if final else self._held(s)
            out, self.pending = s[:len(s) - keep], s[len(s) - keep:]
        self.text += out
        return out

    def push(self, token_id):
        if self.stopped:
            return ""
        self.pending += self.detok.add(token_id)
        return self._release(False)

    def finish(self):
        if self.stopped:
            return ""
        self.pending += self.detok.flush()
        return self._release(True)
