"""The Pallas kernel calls of a program, counted while it is traced (``zoo compile``'s roofline).

    with kernel_census() as calls:
        jax.jit(step).lower(*args)          # every pallas_call the trace emits is recorded
    calls -> [KernelCall(kernel, steps, step_bytes, weight_bytes), ...]

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
    consecutive steps are not moved again)."""

    kernel: str
    steps: int
    step_bytes: int
    weight_bytes: int


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


def record(kernel: str, steps: int, step_bytes: int, weight_bytes: int) -> None:
    """Called by a kernel wrapper at trace time (a no-op outside :func:`kernel_census`)."""
    calls = _CENSUS.get()
    if calls is not None:
        calls.append(KernelCall(kernel, int(steps), int(step_bytes), int(weight_bytes)))
