"""Thinking budget: close a request's reasoning after a number of tokens so the answer follows.

Reasoning models write ``<think> ... </think>`` before the answer and may think for thousands of
tokens. ``ThinkingBudget`` follows one request's output (token ids, host side) and says when the
engine must force the closing text into that row::

    budget = ThinkingBudget(1024, open=ids("<think>"), close=ids("</think>"), insert=ids("\\n</think>\\n\\n"),
                            opened=prompt_ends_inside_think)
    forced = budget.observe(new_tokens)      # [] or ``insert``, once: the engine then feeds these ids
                                             # one per step, in place of what it would have sampled

Reasoning counts from the start of the output when the prompt opened it (``opened``), else from
the first ``open`` sequence in the output; a ``close`` sequence in the output (the model's own, or
the inserted one) ends it. After ``budget`` reasoning tokens ``insert`` is returned once. A
speculative step delivers up to k+1 tokens; the engine caps a row's step at ``room()`` so the
budget is exact there too.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _find(seq: list[int], pattern: tuple[int, ...], start: int = 0) -> int:
    """Index just past the first occurrence of ``pattern`` in ``seq[start:]`` (-1 if none)."""
    n = len(pattern)
    if n == 0:
        return -1
    for i in range(max(start, 0), len(seq) - n + 1):
        if tuple(seq[i:i + n]) == pattern:
            return i + n
    return -1


@dataclass
class ThinkingBudget:
    budget: int                      # reasoning tokens allowed before ``insert`` is forced (>= 0)
    open: tuple[int, ...]            # ids of the opening marker (e.g. "<think>")
    close: tuple[int, ...]           # ids of the closing marker (e.g. "</think>")
    insert: tuple[int, ...]          # ids forced when the budget is spent (must contain ``close``)
    opened: bool = False             # the prompt ends inside a reasoning block
    output: list[int] = field(default_factory=list)
    start: int | None = None         # index in ``output`` where reasoning starts (None: not yet)
    closed: bool = False
    inserted: bool = False

    def __post_init__(self):
        if self.budget < 0:
            raise ValueError(f"a thinking budget must be >= 0, got {self.budget}")
        if not self.close or _find(list(self.insert), self.close) < 0:
            raise ValueError("the inserted text of a thinking budget must contain the closing marker")
        if self.opened:
            self.start = 0

    @property
    def used(self) -> int:
        """Reasoning tokens so far."""
        return 0 if self.start is None else len(self.output) - self.start

    def room(self) -> int | None:
        """Reasoning tokens left before the insertion (None: not counting: not started, or over)."""
        if self.start is None or self.closed or self.inserted:
            return None
        return self.budget - self.used

    def observe(self, tokens: list[int]) -> list[int]:
        """Take the request's next output tokens; returns the ids to force now ([] or ``insert``)."""
        if self.closed or self.inserted:          # nothing left to watch: stop keeping the output
            return []
        before = len(self.output)
        self.output.extend(tokens)
        if self.start is None:
            end = _find(self.output, self.open, before - len(self.open) + 1)
            if end < 0:
                return []
            self.start = end
        if _find(self.output, self.close, max(self.start, before - len(self.close) + 1)) >= 0:
            self.closed = True
            return []
        if self.used >= self.budget:
            self.inserted = True
            return list(self.insert)
        return []
