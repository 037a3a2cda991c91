"""A prompt being prefilled: its pieces (``snapshot_points``, ``piece_at``; ``plan_pieces`` when none is
narrowed), their host inputs (``piece_inputs``) and the state carried from one piece to the next (``Fill``).

The generator prefills one prompt at a time into a one-row cache, a piece per program call, and
interleaves those calls with the decode steps of the rows already running: each engine step runs at
most ``prefill_chunk`` tokens of pieces (as many as it takes when no row is decoding), so a
running stream waits at most one chunk between two of its tokens, whatever the prompt's length;
and within a time budget (``zoo.engine.prefill_pace``): pieces narrowed to the small width where a
chunk would keep the stream waiting longer than ``ratio`` decode steps.
Short prompts share a step's budget: several are prefilled, one after the other, before its decode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax
import numpy as np

from zoo.engine.request import Request

SMALL_PER_CHUNK = 16         # the small width where a piece's cost is its weights' read: chunk / 16
SMALL_PER_CHUNK_CPU = 64     # on one CPU device, where a piece's cost is its tokens': chunk / 64


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def small_width(chunk: int, least: int, mesh=None) -> int:
    """The small prefill width for a chunk of ``chunk`` tokens (at least ``least``): the piece a step
    runs while rows decode when a chunk would keep them waiting too long (``zoo.engine.prefill_pace``).

    On one CPU device (no mesh, or a mesh of one CPU device: ``zoo compile``'s CPU target) a piece
    costs what its tokens cost. Measured on qwen38-tiny (bfloat16) with 3-4k tokens filled, in the
    engine's running estimates: a 64-token piece 19-28 ms, a 16-token one 3.1-3.7 ms (5.2-6.8 ms
    while the chunked delta rule padded it to a chunk of 64), a decode step 1-1.4 ms. There the
    small width is ``chunk / 64``, so that the stream's wait stays within a few decode steps.
    Elsewhere a piece's cost is mostly reading the weights, as a decode step's is, and a narrower
    piece would only slow the prompt: ``chunk / 16``."""
    if mesh is None:
        cpu = jax.default_backend() == "cpu"
    else:
        cpu = mesh.devices.size == 1 and mesh.devices.flat[0].platform == "cpu"
    return max(least, chunk // (SMALL_PER_CHUNK_CPU if cpu else SMALL_PER_CHUNK))


def snapshot_points(start: int, n: int, chunk: int, marks=()) -> list[int]:
    """Where the pieces of prompt tokens ``start .. n-1`` end with a snapshot: every multiple of
    ``chunk`` (shared by other prompts), each of ``marks``, and ``n``; ascending."""
    return sorted(set(range(round_up(start + 1, chunk), n, chunk)) | {m for m in marks if start < m < n} | {n})


def piece_at(a: int, end: int, chunk: int, small: int, slots: int, narrow: bool = False) -> tuple[int, int]:
    """``(e, width)`` of the piece from token ``a`` towards the snapshot point ``end``: the chunk's
    width while more than ``small`` tokens remain (and the chunk fits the row's ``slots``), else
    ``small``; ``narrow``: ``small`` whatever remains (a step's prefill time is short,
    ``zoo.engine.prefill_pace``). Right-padded to its width, so only two widths are ever compiled."""
    width = chunk if not narrow and end - a > small and a + chunk <= slots else small
    return min(end, a + width), width


def plan_pieces(start: int, n: int, chunk: int, small: int, slots: int,
                marks=()) -> list[tuple[int, int, int, bool]]:
    """The prefill pieces of prompt tokens ``start .. n-1`` when no piece is narrowed:
    ``(first, end, width, snapshot)``, ending at each of the ``snapshot_points``."""
    pieces, a = [], start
    for end in snapshot_points(start, n, chunk, marks):
        while a < end:
            e, width = piece_at(a, end, chunk, small, slots)
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
    they hold meanwhile (not decoded), its snapshot points ``ends`` (``snapshot_points``) and the
    next token to prefill ``pos``, and what the next piece continues from: the one-row ``cache``,
    the previous piece's last hidden state ``h_prev`` and logits, the prompt logprobs ``scored`` so
    far, the image inputs ``images``. Each piece's width is chosen when it runs (``piece``)."""

    group: list[Request]
    at: list[int]
    ends: list[int]
    cache: object
    h_prev: object
    start: int                              # prompt tokens restored from the prefix cache
    images: object = None
    logits: object = None
    scored: list = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    prompt: np.ndarray = field(init=False)
    pos: int = field(init=False)

    def __post_init__(self):
        self.prompt = np.asarray(self.group[0].prompt, np.int32)
        self.pos = self.start

    def piece(self, chunk: int, small: int, slots: int, narrow: bool = False) -> tuple[int, int, int, bool]:
        """The next piece ``(first, end, width, snapshot)`` (``piece_at``); ``pos`` moves on when it ran."""
        end = next(x for x in self.ends if x > self.pos)
        e, width = piece_at(self.pos, end, chunk, small, slots, narrow)
        return self.pos, e, width, e == end

    @property
    def request(self) -> Request:
        return self.group[0]

    @property
    def done(self) -> bool:
        return self.pos >= self.ends[-1]

    @property
    def live(self) -> bool:
        """Some choice still wants the prompt (the others were cancelled or failed meanwhile)."""
        return any(m.finish_reason is None for m in self.group)
