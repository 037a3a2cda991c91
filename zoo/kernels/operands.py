"""Quantized weights as kernel operands (backend-neutral; ``zoo.kernels.tpu`` and
``zoo.kernels.dequant_matvec_gpu`` read them)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from zoo.formats.ggml import BLOCK_LAYOUTS
from zoo.kernels.tile_decoders import Format, format_of
from zoo.kernels.tiles import Tiling, input_order, tiling_for


@dataclass(frozen=True)
class Weight:
    """A QArray (``[*lead, in, out]``, lead = () or (E,)) prepared for a kernel: its tile decoder,
    the tiling of its input axis, its planes as ``uint32 [E, n_words, out]`` (a matrix is one
    expert) in layout field order, and the activation order that matches its plane order."""

    fmt: Format
    tiling: Tiling
    names: tuple[str, ...]
    planes: tuple[jax.Array, ...]
    order: np.ndarray

    @classmethod
    def of(cls, q, max_inputs: int | None = 2048, power_of_two: bool = False) -> "Weight":
        fmt = format_of(q.qtype)
        tiling = tiling_for(q.qtype, q.n_blocks, q.in_splits, max_inputs, power_of_two)
        if fmt is None or tiling is None:
            raise NotImplementedError(f"no kernel tiling of {q} (power_of_two={power_of_two})")
        names = tuple(f.name for f in BLOCK_LAYOUTS[q.qtype].fields)
        planes = tuple(q.planes[n] if q.ndim == 3 else q.planes[n][None] for n in names)
        return cls(fmt, tiling, names, planes, input_order(tiling, fmt.in_block, q.in_order))

    @property
    def d_out(self) -> int:
        return self.planes[0].shape[-1]


def plane_inputs(x: jax.Array, weights: list[Weight]) -> tuple[list[jax.Array], list[int]]:
    """``x [..., in]`` in each weight's plane order (each distinct order once), and the index of the
    one each weight takes."""
    orders, x_of = [], []
    for w in weights:
        match = next((i for i, o in enumerate(orders) if np.array_equal(o, w.order)), None)
        if match is None:
            orders.append(w.order)
            match = len(orders) - 1
        x_of.append(match)
    return [x[..., o] for o in orders], x_of


def split_refs(refs, counts: list[int]) -> list[list]:
    """Cut a kernel's flat tuple of refs into consecutive groups of the given sizes."""
    groups, at = [], 0
    for n in counts:
        groups.append(list(refs[at:at + n]))
        at += n
    return groups
