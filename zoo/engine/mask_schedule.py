"""When the host's token bitmasks are computed, and how long a step waits for them.

A constrained row's next mask depends only on the tokens it has emitted, so it is started as soon as
they are known (``prefetch``: at the end of the step that delivered them), on a thread pool
(llguidance drops the GIL while it computes a mask), and runs while the host does the rest of its
work. Before the next step, ``late`` waits for the masks still computing, at most ``share`` of a
recent step's time (an average of the last steps' device time); a row whose mask is still not
ready then sits the step out (it is not decoded, nothing of it changes) and takes the next one
its mask is ready for. So one row under a slow grammar costs the other rows at most that share
per step, and the slow row goes at its masks' own speed. The outputs do not depend on it: a row
that sits out emits the same tokens a step later.

Under MTP the masks of the verify positions after the first depend on the step's drafts: they are
computed while the verify forward runs, one thread per row, until the same budget has passed;
a row whose masks stop at position j takes at most j tokens this step (its ``cap``).

``share`` None waits for every mask (a multi-process engine: each process must decide the same, and
a timing is not the same on two processes).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

import numpy as np

from zoo.engine.constraint import Constraint

MASK_SHARE = 0.25        # a step waits for late masks at most this share of a step's time
FIRST_STEP_S = 0.01      # the step time assumed before one was measured
ALL_LATE_POLL_S = 0.05   # when every decoding row waits for its mask: how often the engine looks up


class MaskSchedule:
    """The masks' thread pool, the step-time average and the waiting rule (see the module doc).
    ``waits``: row-steps sat out waiting for a mask, in all."""

    def __init__(self, share: float | None = MASK_SHARE):
        self.share = share
        self.step_s = FIRST_STEP_S
        self.waits = 0
        self._pool: cf.ThreadPoolExecutor | None = None

    @property
    def pool(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(max_workers=max(2, min(16, os.cpu_count() or 2)),
                                               thread_name_prefix="zoo-masks")
        return self._pool

    def budget(self) -> float | None:
        """Seconds a step may wait for late masks (None: no limit)."""
        return None if self.share is None else self.share * self.step_s

    def timed(self, seconds: float) -> None:
        """A decode step took ``seconds`` from its dispatch to its tokens on the host."""
        self.step_s = 0.8 * self.step_s + 0.2 * seconds

    def prefetch(self, constraints) -> None:
        """Start the next mask of each of ``constraints`` (one already started is left as it is)."""
        for c in constraints:
            c.prefetch(self.pool)

    def late(self, rows: dict[int, Constraint], others: bool) -> list[int]:
        """The rows of ``rows`` (row -> its constraint, decoding this step) whose next mask is not
        ready after the wait (see the module doc; masks not started yet are started here).
        ``others``: some decoding row has no mask to wait for; without one, the wait is for the
        first mask to finish (at most ``ALL_LATE_POLL_S``: the engine then looks at cancellations)."""
        self.prefetch(rows.values())
        pending = {r: c.pending for r, c in rows.items() if c.pending is not None and not c.pending.done()}
        if not pending:
            return []
        budget = self.budget()
        if budget is None:
            cf.wait(pending.values())
        elif others:
            cf.wait(pending.values(), timeout=budget)
        else:
            cf.wait(pending.values(), timeout=ALL_LATE_POLL_S, return_when=cf.FIRST_COMPLETED)
        late = [r for r, f in pending.items() if not f.done()]
        self.waits += len(late)
        return late

    def fill(self, masks: np.ndarray, rows: dict[int, Constraint], drafts: np.ndarray | None = None,
             cap: np.ndarray | None = None) -> None:
        """Each of ``rows``' masks into ``masks`` [B, T, W] (the other rows stay as they are): the
        first position's (ready), and with ``drafts`` [B, k] those of the verify positions after
        it, within the budget; ``cap`` [B] lowered where a row's masks stopped early."""
        if drafts is None:
            for r, c in rows.items():
                c.fill(masks[r])
            return
        budget = self.budget()
        deadline = None if budget is None else time.perf_counter() + budget
        if len(rows) == 1:
            (r, c), = rows.items()
            cap[r] = min(cap[r], c.fill(masks[r], drafts[r], deadline))
            return
        jobs = {r: self.pool.submit(c.fill, masks[r], drafts[r], deadline) for r, c in rows.items()}
        for r, job in jobs.items():
            cap[r] = min(cap[r], job.result())
