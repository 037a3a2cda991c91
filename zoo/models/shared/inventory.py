"""A model's tensor inventory, as the planner (``zoo.tools.plan``) reads it: every tensor of the
model in llama.cpp's GGUF names and numpy-order shapes (matrices ``[out, in]``, expert banks
``[E, out, in]``), each with a class (``attention``, ``routed_experts``, ``mtp``, ...).

Each architecture writes its inventory in ``zoo.models.<arch>.inventory``; the tests check it both
against the abstract model through the architecture's GGUF name map (every parameter covered,
element counts equal) and against real GGUF files.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tensor:
    """One tensor of the inventory: llama.cpp name, numpy-order shape, class; ``matmul`` when the
    model consumes it as a matrix (a block type may store it)."""

    name: str
    shape: tuple[int, ...]
    cls: str
    matmul: bool = True
