"""How much prefill a step may run while other rows decode: a budget in time, from measured costs.

A running stream waits, between two of its tokens, for the step's prefill pieces and then its decode
step. ``PrefillPace`` keeps that wait within ``ratio`` times a decode step: the pieces a step runs
while rows decode are estimated to take at most ``(ratio - 1) x`` the decode step's running time, so
a stream's inter-token gap is bounded by ``ratio`` decode steps, not by a chunk's time (on a CPU a
1024-token chunk of the tiny models takes ~100 decode steps; on a TPU ~25). Each piece is one of the
compiled widths (``zoo.engine.fill``): the wide one (the chunk) where its estimate fits, else the
small one; a step's first piece always runs, at the small width if nothing fits, so a long prompt
always progresses.

    pace = PrefillPace(ratio=3.0)
    pace.decode_took(seconds)            each decode step's time (a program's first run excluded)
    pace.piece_took(width, seconds)      each prefill piece's time, by width
    table = pace.snapshot()              the estimates one step decides from (fixed for the step)
    pace.choose(table, spent_s, wide, small, first) -> width or None (stop prefilling this step)

Estimates are exponential running means. A width never timed is estimated from the nearest timed
width's time per token, scaled by the widths (a per-token cost that does not fall with the width:
an over-estimate on accelerators, which run wide pieces at a better rate). Nothing timed yet: no
limit but the token budget (the chunk), as before any step was timed.

Processes that run one engine in lockstep (``zoo.engine.replica``) must decide alike: the leader
publishes its table with each step's plan (``export``) and every process ``load``s it; a lockstep
generator with no table loaded decides by the token budget alone (``shared``).
"""

from __future__ import annotations

DECAY = 0.25            # weight of the newest timing in a running mean
INTERLEAVE_RATIO = 3.0  # the default: a stream waits at most ~3 decode steps while a prompt fills


class PrefillPace:
    """The time budget of a step's prefill pieces while rows decode (module docstring)."""

    def __init__(self, ratio: float | None = INTERLEAVE_RATIO, lockstep: bool = False):
        if ratio is not None and not ratio >= 1.0:
            raise ValueError(f"the interleave ratio must be >= 1 (a decode step and its prefill pieces, in "
                             f"decode steps), or None for the token budget alone; got {ratio}")
        self.ratio = ratio
        self.lockstep = lockstep
        self.shared = False                          # a table was loaded (``load``): processes decide alike
        self.decode_s: float | None = None
        self.piece_s: dict[int, float] = {}

    @staticmethod
    def _mean(old: float | None, new: float) -> float:
        return new if old is None else (1 - DECAY) * old + DECAY * new

    def decode_took(self, seconds: float) -> None:
        self.decode_s = self._mean(self.decode_s, float(seconds))

    def piece_took(self, width: int, seconds: float) -> None:
        self.piece_s[int(width)] = self._mean(self.piece_s.get(int(width)), float(seconds))

    def snapshot(self) -> dict:
        """The estimates this step decides from: ``{"decode": s | None, "pieces": {width: s}}``."""
        return {"decode": self.decode_s, "pieces": dict(self.piece_s)}

    export = snapshot

    def load(self, table: dict) -> None:
        """Take the leader's table (``export``, through JSON: widths come back as strings)."""
        self.decode_s = table["decode"]
        self.piece_s = {int(w): float(s) for w, s in table["pieces"].items()}
        self.shared = True

    @staticmethod
    def estimate(table: dict, width: int) -> float | None:
        """Seconds of a piece of ``width``: its running mean, or the nearest timed width's scaled by
        ``width / that width``; None when no width was timed."""
        pieces = table["pieces"]
        if width in pieces:
            return pieces[width]
        if not pieces:
            return None
        near = min(pieces, key=lambda w: abs(w - width))
        return pieces[near] * width / near

    def allowance(self, table: dict) -> float | None:
        """Seconds of prefill a step may run while rows decode; None: no time limit (no ratio, no
        decode step timed yet, or processes in lockstep without a shared table)."""
        if self.ratio is None or table["decode"] is None or (self.lockstep and not self.shared):
            return None
        return (self.ratio - 1.0) * table["decode"]

    def choose(self, table: dict, spent_s: float, wide: int, small: int, first: bool) -> int | None:
        """The width of the step's next piece: ``wide`` if its estimate fits what is left of the
        allowance after ``spent_s``, else ``small`` if that fits; else ``small`` for the step's
        ``first`` piece (progress) and None after it (the step's prefill ends)."""
        allow = self.allowance(table)
        if allow is None:
            return wide
        for width in dict.fromkeys((wide, small)):
            est = self.estimate(table, width)
            if est is not None and spent_s + est <= allow:
                return width
        if first:
            return small
        return None
