"""Incremental detokenization with stop strings: a model's output ids -> text pieces, as they come.

``TextDecoder(tokenizer, hidden, stop)`` takes the output in pieces of ids (``feed``) and returns
each time the text that is final: control tokens (``hidden``) are left out, an incomplete UTF-8
character is held back until its last byte arrives, and so is text that may be the start of a stop
string. When a stop string appears the text ends right before it (text before it in the same token
is kept, the stop string and everything after it never come out): ``stopped`` names it, ``taken``
says how many ids of that feed were read up to the one that completed it, and
``tokens_before_stop`` how many of the output's ids lie wholly before it. ``flush`` ends the output
(a partial stop string at the end is text after all).

The engine (``zoo.engine.generator``) runs one per request that asks for text or has stop strings,
so stop strings are matched in one place, the same way on every process of a multi-process engine;
the server renders the text it produced.
"""

from __future__ import annotations

import functools
from typing import Sequence

from zoo.text.reasoning_parser import partial_suffix


@functools.lru_cache(maxsize=64)
def hidden_special_tokens(tokenizer, keep: tuple[str, ...] = ()) -> frozenset[int]:
    """Ids of the tokenizer's special tokens to leave out of the text: all but those whose text is in
    ``keep`` (remembered per tokenizer and ``keep``)."""
    return frozenset(i for i, t in tokenizer.special_tokens().items() if t not in keep)


class TextDecoder:
    """Token ids -> text pieces (see the module doc). ``hidden``: ids left out of the text; ``stop``:
    the stop strings (empty ones are ignored)."""

    def __init__(self, tokenizer, hidden: frozenset[int] = frozenset(), stop: Sequence[str] = ()):
        self._tok = tokenizer
        self._hidden = hidden
        self._ids: list[int] = []           # the visible ids so far
        self._prefix = self._read = 0       # decode window: ids[_prefix:_read] were already turned into text
        self._stop = [s for s in stop if s]
        self._pending = ""                  # decoded text held back (it may start a stop string)
        self.emitted = 0                    # characters returned so far
        self.stopped: str | None = None     # the stop string that ended the text
        self.taken = 0                      # ids of the last ``feed`` read (all, unless a stop string ended it)

    def feed(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens`` (the next output ids) that is final now; "" once stopped."""
        if self.stopped is not None or not tokens:
            self.taken = 0
            return ""
        if len(tokens) > 1 and self._stop:          # find the id that completes a stop string
            pieces = []
            for n, t in enumerate(tokens, 1):
                pieces.append(self._feed([t]))
                if self.stopped is not None:
                    self.taken = n
                    break
            else:
                self.taken = len(tokens)
            return "".join(pieces)
        self.taken = len(tokens)
        return self._feed(tokens)

    def flush(self) -> str:
        """The rest of the text (a partial stop string is no match now); "" once stopped."""
        if self.stopped is not None:
            return ""
        done = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return self._cut(text[len(done):], final=True)

    def tokens_before_stop(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (every id fed, hidden ones included, in order) come before the one
        in which the stop string starts: the longest run whose text ends at or before it."""
        visible = [i for i, t in enumerate(tokens) if t not in self._hidden]
        m = len(visible)
        while m and len(self._decode([tokens[i] for i in visible[:m]])) > self.emitted:
            m -= 1
        return visible[m] if m < len(visible) else len(tokens)

    def _feed(self, tokens: Sequence[int]) -> str:
        self._ids += [t for t in tokens if t not in self._hidden]
        done = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return self._cut(text[len(done):], final=False)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def _cut(self, text: str, final: bool) -> str:
        self._pending += text
        hits = [(i, s) for s in self._stop if (i := self._pending.find(s)) >= 0]
        if hits:
            i, self.stopped = min(hits)
            out, self._pending = self._pending[:i], ""
        else:
            keep = 0 if final else partial_suffix(self._pending, self._stop)
            out, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        self.emitted += len(out)
        return out
