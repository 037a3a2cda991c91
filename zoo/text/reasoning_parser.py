"""Reasoning ("thinking") text: split a model's output into reasoning and answer, incrementally.

Qwen3.x and GLM-5 write their reasoning between ``<think>`` and ``</think>`` at the start of the
assistant turn; a chat template may open the block itself, so the prompt ends inside it
(``prompt_opens_reasoning``). ``ReasoningParser.feed(text)`` takes the decoded output in pieces
split anywhere (even inside a marker) and returns ``Reasoning`` / ``Text`` events; ``flush()`` ends
the output. Newlines right after a marker and right before ``</think>`` are layout, not content:
they are dropped, the same way whether the output arrives at once or a character at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Reasoning:
    """A piece of the model's reasoning."""
    text: str


@dataclass(frozen=True)
class Text:
    """A piece of the answer (content outside reasoning and tool calls)."""
    text: str


def partial_suffix(text: str, markers) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def prompt_opens_reasoning(prompt: str) -> bool:
    """True if the rendered prompt ends inside a ``<think>`` block (the template opened it)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


class ReasoningParser:
    """Incremental ``<think>...</think>`` splitter (see the module doc).

    A ``<think>`` is recognised only at the start of the output (after whitespace); later ones,
    and everything after ``</think>``, are answer text.
    """

    MARKERS = (OPEN, CLOSE)

    def __init__(self, in_reasoning: bool = False):
        self._state = "reasoning" if in_reasoning else "start"    # start | reasoning | content
        self._buf = ""
        self._skip_newlines = in_reasoning    # drop newlines right after an opening/closing marker

    def feed(self, text: str) -> list[Reasoning | Text]:
        self._buf += text
        out: list[Reasoning | Text] = []
        while self._buf:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(OPEN):
                    self._buf, self._state, self._skip_newlines = head[len(OPEN):], "reasoning", True
                elif not head or OPEN.startswith(head):
                    break                                 # whitespace or a partial marker: wait
                else:
                    self._state = "content"
            elif self._skip_newlines:
                self._buf = self._buf.lstrip("\n")
                self._skip_newlines = not self._buf
            elif self._state == "reasoning":
                end = self._buf.find(CLOSE)
                if end >= 0:
                    self._add(out, Reasoning, self._buf[:end].rstrip("\n"))
                    self._buf, self._state, self._skip_newlines = self._buf[end + len(CLOSE):], "content", True
                    continue
                # hold back a partial "</think>" and trailing newlines (they may precede it)
                keep = len(self._buf) - partial_suffix(self._buf, (CLOSE,))
                safe = self._buf[:keep].rstrip("\n")
                self._add(out, Reasoning, safe)
                self._buf = self._buf[len(safe):]
                break
            else:
                self._add(out, Text, self._buf)
                self._buf = ""
        return out

    def flush(self) -> list[Reasoning | Text]:
        """End of output: whatever is held back is emitted (a cut-off reasoning stays reasoning)."""
        buf, self._buf = self._buf, ""
        out: list[Reasoning | Text] = []
        if self._state == "reasoning":
            self._add(out, Reasoning, buf.rstrip("\n"))
        elif self._state == "content" and self._skip_newlines:
            self._add(out, Text, buf.lstrip("\n"))
        else:
            self._add(out, Text, buf)
        return out

    @staticmethod
    def _add(out: list, kind, text: str) -> None:
        if text:
            out.append(kind(text))
