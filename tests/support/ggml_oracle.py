"""GGML test data and oracles with no dependency beyond numpy and gguf (``bench/gpu_kernels.py`` runs
them on a machine without flax): random GGUF blocks with controlled scales, and the routed-expert
layer in float64 numpy (``gguf.quants.dequantize`` first)."""

from __future__ import annotations

import numpy as np
from gguf import quants as gq

from zoo.formats.ggml import BLOCK_LAYOUTS, F16, QType


def blocks(qtype: QType, lead: tuple[int, ...], rows: int, n_blocks: int, seed: int, rms: float = 0.05,
           probe_rows: int | None = None) -> np.ndarray:
    """uint8 ``[*lead, rows, n_blocks * type_size]``: random blocks whose f16 fields are random signs
    times powers of two near the scale that gives weights of RMS ``rms``. With activations that are
    small multiples of 1/4 (:func:`activations`) every product and partial sum of a first projection
    is then exact in float32, so only the float32 rounding of later stages is measured.
    ``probe_rows``: the scale is measured on that many rows of one expert (large banks), not all."""
    layout = BLOCK_LAYOUTS[qtype]
    shape = (*lead, rows, n_blocks)

    def draw(exponent, shape=shape):
        rng = np.random.default_rng(seed)
        data = rng.integers(0, 256, size=(*shape, layout.type_size), dtype=np.uint8)
        for f in layout.fields:
            if f.dtype == F16:
                powers = exponent + rng.integers(-1, 2, size=(*shape, f.count))
                values = (rng.choice([-1.0, 1.0], size=powers.shape) * np.exp2(powers)).astype(np.float16)
                data[..., f.offset:f.end] = values.view(np.uint8)
        return data.reshape(*shape[:-1], n_blocks * layout.type_size)

    probe_shape = shape if probe_rows is None else (min(rows, probe_rows), n_blocks)
    probe = gq.dequantize(draw(-7, probe_shape), qtype).astype(np.float64)
    return draw(-7 + int(np.round(np.log2(rms / np.sqrt(np.mean(probe ** 2))))))


def moe_oracle(x, weights, ids, gate, up, down, limit) -> np.ndarray:
    """float64 routed experts: ``sum_k w * down(silu(min(gate, L)) * clip(up, -L, L))``."""
    x = np.asarray(x, np.float64)
    out = np.zeros((x.shape[0], down.shape[-1]))
    for n, (row_ids, row_w) in enumerate(zip(np.asarray(ids), np.asarray(weights, np.float64))):
        for e, w in zip(row_ids, row_w):
            g = np.minimum(x[n] @ gate[e], limit)
            u = np.clip(x[n] @ up[e], -limit, limit)
            out[n] += w * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out
