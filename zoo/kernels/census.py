"""The Pallas kernel calls of a program, counted while it is traced (``zoo compile``'s roofline).

    with kernel_census() as calls:
        jax.jit(step).lower(*args)          # every pallas_call the trace emits is recorded
    calls -> [KernelCall(kernel, steps, step_bytes, weight_bytes, slots, block, stride), ...]

Counts are per device: under ``shard_map`` a kernel is traced with its shard shapes. A program
traces each layer (and each MTP draft) separately, so the list is one entry per call per step.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelCall:
    """``kernel``: which kernel ("moe_matvec.project", ...); ``steps``: its grid steps (each costs a
    fixed overhead, live or skipped); ``step_bytes``: the weight bytes one step brings in (all its
    experts' blocks); ``weight_bytes``: the weight bytes the call moves at most (blocks re-used by
    consecutive steps are not moved again); ``slots``, ``block``: for a kernel over a slot cache, the
    slots of a row it may read and the slots a step brings in (:meth:`bytes_at`); ``stride``: the
    cache share holds every ``stride``-th slot of a row (interleaved over that many chips), else 1."""

    kernel: str
    steps: int
    step_bytes: int
    weight_bytes: int
    slots: int = 0
    block: int = 0
    stride: int = 1

    def bytes_at(self, fill: int | None) -> int:
        """The bytes the call moves with rows filled to ``fill`` tokens (None: ``weight_bytes``). A
        call over a cache (``slots`` > 0: the attention kernel, ``weight_bytes`` its keys and values
        over ``slots`` slots a row in blocks of ``block``) reads the blocks up to the fill, at least
        one (of an interleaved share: its ``fill / stride`` slots); a weight kernel the same at every
        fill. Its steps stay: the skipped ones still pay their overhead."""
        if fill is None or not self.slots:
            return self.weight_bytes
        total = -(-self.slots // self.block)
        here = -(-fill // self.stride)
        return self.weight_bytes * max(1, -(-min(here, self.slots) // self.block)) // total


_CENSUS: contextvars.ContextVar[list | None] = contextvars.ContextVar("zoo_kernel_census", default=None)


@contextlib.contextmanager
def kernel_census():
    """Record the kernel calls traced inside the ``with`` block into the yielded list."""
    calls: list[KernelCall] = []
    token = _CENSUS.set(calls)
    try:
        yield calls
    finally:
        _CENSUS.reset(token)


def record(kernel: str, steps: int, step_bytes: int, weight_bytes: int, slots: int = 0, block: int = 0,
           stride: int = 1) -> None:
    """Called by a kernel wrapper at trace time (a no-op outside :func:`kernel_census`)."""
    calls = _CENSUS.get()
    if calls is not None:
        calls.append(KernelCall(kernel, int(steps), int(step_bytes), int(weight_bytes), int(slots), int(block),
                                int(stride)))
