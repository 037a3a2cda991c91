"""A prompt being prefilled: its pieces (``plan_pieces``), their host inputs (``piece_inputs``) and the
state carried from one piece to the next (``Fill``).

The generator prefills one prompt at a time into a one-row cache, a piece per program call, and
interleaves those calls with the decode steps of the rows already running: each engine step runs at
most ``prefill_chunk`` tokens of pieces (as many as it takes when no row is decoding), so a
running stream waits at most one chunk between two of its tokens, whatever the prompt's length.
Short prompts share a step's budget: several are prefilled, one after the other, before its decode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from zoo.engine.request import Request


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def plan_pieces(start: int, n: int, chunk: int, small: int, slots: int,
                marks=()) -> list[tuple[int, int, int, bool]]:
    """The prefill pieces of prompt tokens ``start .. n-1``: ``(first, end, width, snapshot)``.

    Snapshot points: every multiple of ``chunk`` (shared by other prompts), each of ``marks``, and
    ``n``. Between two, pieces of width ``chunk`` while more than ``small`` tokens remain (and the
    chunk fits the row's ``slots``), then of width ``small``; each right-padded to its width. So
    only two widths are ever compiled."""
    ends = sorted(set(range(round_up(start + 1, chunk), n, chunk)) | {m for m in marks if start < m < n} | {n})
    pieces, a = [], start
    for end in ends:
        while a < end:
            width = chunk if end - a > small and a + chunk <= slots else small
            e = min(end, a + width)
            pieces.append((a, e, width, e == end))
            a = e
    return pieces


def piece_inputs(prompt: np.ndarray, a: int, e: int, w: int) -> tuple[np.ndarray, ...]:
    """The prefill program's host inputs for tokens ``a .. e-1`` of ``prompt`` (n ids) as one piece
    of width ``w``: ``ids``, ``mask`` (the real tokens first), ``next_ids`` (the token after each
    position, to score) and ``next_mask`` (positions that have one in the prompt), each [1, w]."""
    n = len(prompt)
    ids = np.zeros((1, w), np.int32)
    mask = np.zeros((1, w), bool)
    nxt = np.zeros((1, w), np.int32)
    ids[0, :e - a], mask[0, :e - a] = prompt[a:e], True
    nxt[0, :max(0, min(e, n - 1) - a)] = prompt[a + 1:e + 1]
    nxt_mask = mask & (np.arange(a, a + w) < n - 1)[None]
    return ids, mask, nxt, nxt_mask


@dataclass(eq=False)
class Fill:
    """One prompt's prefill in progress: the choices ``group`` that share it (``group[0]`` holds the
    prompt and options; ``prompt``: its ids as an int32 array, made once), the batch rows ``at``
    they hold meanwhile (not decoded), the ``pieces`` left from ``next``, and what the next piece
    continues from: the one-row ``cache``, the previous piece's last hidden state ``h_prev`` and
    logits, the prompt logprobs ``scored`` so far, the image inputs ``images``."""

    group: list[Request]
    at: list[int]
    pieces: list[tuple[int, int, int, bool]]
    cache: object
    h_prev: object
    start: int                              # prompt tokens restored from the prefix cache
    images: object = None
    logits: object = None
    next: int = 0
    scored: list = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    prompt: np.ndarray = field(init=False)

    def __post_init__(self):
        self.prompt = np.asarray(self.group[0].prompt, np.int32)

    @property
    def request(self) -> Request:
        return self.group[0]

    @property
    def done(self) -> bool:
        return self.next >= len(self.pieces)

    @property
    def live(self) -> bool:
        """Some choice still wants the prompt (the others were cancelled or failed meanwhile)."""
        return any(m.finish_reason is None for m in self.group)
