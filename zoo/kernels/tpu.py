"""Pallas TPU (Mosaic) plumbing shared by the TPU kernels: the tile decoders
(``zoo.kernels.tile_decoders``) reading VMEM refs, block specs and compiler parameters.

Kernels DMA, per grid step, one expert's planes for a block of :data:`LANES` output columns over
the *whole* input axis (``block_specs``: the word axis is full, so every TPU block is legal), then
decode them chunk by chunk in VMEM (``decode_chunk``: a ``zoo.kernels.operands.Weight``'s tile
decoder over a :class:`RefReader`) and feed the matrix unit (``matvec``). Codebook lookups are lane
gathers (``jnp.take_along_axis`` along the 128 lanes, one per 128-entry slice of the table, selected
by the index's high bits) from small int32 tables passed as inputs (``zoo.kernels.tiles.lane_table``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from zoo.kernels.operands import Weight
from zoo.kernels.tiles import LANES, TABLES, Tiling, lane_table, shr, split_halves, to_int32, words_per_block
from zoo.ops.matmul import precision_for

# --- how much a grid step moves ---------------------------------------------------------------
# A grid step costs a fixed overhead (~0.35 us on TPU) besides its DMA; steps that move a few KiB
# each would spend more on overhead than on bytes. So a step takes a block of ``lanes`` output
# columns (a multiple of 128, up to the whole output axis) of ``group`` experts at once, and the
# kernel walks the block's 128-lane sub-tiles itself (``sub_tiles``, each copied to a 128-lane
# scratch first: ``staging``): the decoded chunks stay [chunk_inputs, 128] whatever the block.
STEP_BYTES = 1 << 20             # weight bytes a step aims to move
MAX_BLOCK = 4 << 20              # weight bytes of one expert's block, at most
MAX_GROUP = 8                    # experts per step, at most


def lane_bytes(weights: list[Weight]) -> int:
    """Plane bytes of one output column of one expert, over all ``weights`` (uint32 words)."""
    return sum(p.shape[1] * p.dtype.itemsize for w in weights for p in w.planes)


def block_lanes(d_out: int, weights: list[Weight], max_bytes: int = MAX_BLOCK, per_lane: int | None = None) -> int:
    """Output columns per block: the whole (128-padded) output axis, or even tiles of it whose
    expert block (``per_lane`` bytes a column, default the planes') stays within ``max_bytes``."""
    total = -(-d_out // LANES)
    cap = max(1, max_bytes // ((per_lane or lane_bytes(weights)) * LANES))
    n = -(-total // cap)
    return -(-total // n) * LANES


def experts_per_step(n_slots: int, block_bytes: int) -> int:
    """Experts a step takes: the largest divisor of ``n_slots`` (no padding slots) up to the count
    that brings a step to :data:`STEP_BYTES`."""
    want = min(MAX_GROUP, n_slots, max(1, -(-STEP_BYTES // max(block_bytes, 1))))
    return max(g for g in range(1, want + 1) if n_slots % g == 0)


def block_specs(weight: Weight, index_map: Callable, lanes: int = LANES) -> list[pl.BlockSpec]:
    """One expert's planes for ``lanes`` output columns over the whole input axis."""
    return [pl.BlockSpec((None, p.shape[1], lanes), index_map) for p in weight.planes]


def sub_tiles(lanes: int, body: Callable) -> None:
    """``body(lane)`` for each 128-lane sub-tile of a ``lanes``-wide block (``lane``: its first column)."""
    def step(t, carry):
        body(pl.multiple_of(t * LANES, LANES))
        return carry

    jax.lax.fori_loop(0, lanes // LANES, step, 0)


def decode_chunk(weight: Weight, refs, tables: dict, q) -> jax.Array:
    """Chunk ``q`` of the input axis decoded from VMEM refs ``[n_words, 128]``: ``float32
    [chunk_inputs, 128]`` in plane order."""
    tile = weight.fmt.decode(RefReader(dict(zip(weight.names, refs)), tables, weight.tiling, q))
    return tile.reshape(-1, tile.shape[-1])                   # [P, tb, m, 128]: leading axes merge


def matvec(weight: Weight, x_ref, refs, tables: dict) -> jax.Array:
    """``x @ W`` for the rows of ``x_ref`` (``[rows, in]`` in plane order) and 128 output columns
    (plane refs ``[n_words, 128]``), float32 ``[rows, 128]``: each chunk decoded once, cast to the
    activation dtype, multiplied with f32 accumulation."""
    t = weight.tiling
    dtype = x_ref.dtype

    def chunk(q, acc):
        w = decode_chunk(weight, refs, tables, q).astype(dtype)
        start = q * t.chunk_inputs if isinstance(q, int) else pl.multiple_of(q * t.chunk_inputs, t.chunk_inputs)
        xs = x_ref[:, pl.ds(start, t.chunk_inputs)]
        return acc + jnp.dot(xs, w, precision=precision_for(dtype), preferred_element_type=jnp.float32)

    acc = jnp.zeros((x_ref.shape[0], LANES), jnp.float32)
    if t.n_chunks == 1 or t.chunk_inputs % LANES == 0:
        return jax.lax.fori_loop(0, t.n_chunks, chunk, acc)
    for q in range(t.n_chunks):          # chunks off the 128-lane grid (parts too small to align): static offsets
        acc = chunk(q, acc)
    return acc


def staging(weights: list[Weight], lanes: int) -> list:
    """VMEM scratch for one 128-lane sub-tile of each plane of ``weights`` (none when a block is
    128 lanes wide): a wider block's sub-tile is copied there before it is decoded, so the decoders
    read refs whose last dimension is 128 (Mosaic's strided loads and unaligned dynamic row offsets
    need that)."""
    return [] if lanes == LANES else [pltpu.VMEM((p.shape[1], LANES), p.dtype) for w in weights for p in w.planes]


def staged(refs: list, scratch: list, lane) -> list:
    """The refs to decode sub-tile ``lane`` from: ``refs`` themselves (128-lane blocks), or their
    sub-tile copied into ``scratch`` (``staging``)."""
    if not scratch:
        return refs
    for ref, copy in zip(refs, scratch):
        copy[...] = ref[:, pl.ds(lane, LANES)]
    return scratch


@dataclass(frozen=True)
class RefReader:
    """``zoo.kernels.tiles.Reader`` over VMEM refs: field refs ``[n_words, 128]`` (one expert, all
    chunks), table refs ``[rows, 128]`` (``lane_table``), chunk ``q`` of ``tiling``."""

    refs: dict
    tables: dict
    tiling: Tiling
    q: jax.Array | int

    @property
    def tb(self) -> int:
        return self.tiling.tb

    def _start(self, name: str, first: int = 0):
        words = self.tiling.chunk_words(name)
        start = self.q * words
        return (pl.multiple_of(start, 8) if words % 8 == 0 and not isinstance(start, int) else start) + first

    def words(self, name: str, first: int = 0, stride: int = 1) -> jax.Array:
        per_block = words_per_block(self.tiling.qtype, name)
        n = self.tb * per_block // stride
        start = self._start(name, first)
        rows = pl.ds(start, n, stride) if stride > 1 else pl.ds(start, n)
        return to_int32(self.refs[name][rows, :]).reshape(self.tb, per_block // stride, LANES)

    def halves(self, name: str) -> jax.Array:
        rows = pl.ds(self._start(name), -(-self.tb // 2))
        return split_halves(to_int32(self.refs[name][rows, :]), self.tb)

    def lookup(self, table: str, idx: jax.Array, word: int = 0) -> jax.Array:
        """Lane gathers: per 128-entry slice of the table, one ``take_along_axis`` over the lanes,
        kept where the index's high bits select that slice."""
        chunks = -(-TABLES[table].shape[1] // LANES)
        flat = idx.reshape(-1, LANES)
        low, high = flat & (LANES - 1), shr(flat, 7)
        out = None
        for c in range(chunks):
            row = self.tables[table][pl.ds(word * chunks + c, 1), :]
            got = jnp.take_along_axis(jnp.broadcast_to(row, flat.shape), low, axis=-1)
            out = got if out is None else jnp.where(high == c, got, out)
        return out.reshape(idx.shape)


DEFAULT_VMEM = 16 << 20          # the smallest default scoped VMEM limit (v5e)
MAX_VMEM = 100 << 20             # of 128 MiB physical on v5e / v6e


def compiler_params(block_bytes: int, scratch_bytes: int = 0, chunk_inputs: int = 0) -> pltpu.CompilerParams:
    """Grid ``(output tile, slot or row block)``: the output-tile axis is independent ("parallel"),
    the second revisits output blocks ("arbitrary"). The VMEM limit is raised past the default when
    the double-buffered blocks, the scratch and a decoded chunk with its temporaries need it."""
    need = 2 * block_bytes + scratch_bytes + 8 * chunk_inputs * LANES * 4
    limit = None if need <= DEFAULT_VMEM * 3 // 4 else min(MAX_VMEM, need * 3 // 2)
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=limit)


def spec_bytes(arrays, specs) -> int:
    """Bytes of one block of each (array, BlockSpec) pair (``None`` dims count as 1)."""
    total = 0
    for a, spec in zip(arrays, specs):
        total += int(np.prod([1 if d is None else d for d in spec.block_shape])) * a.dtype.itemsize
    return total


def table_operands(weights: list[Weight]) -> tuple[tuple[str, ...], list[jax.Array], list[pl.BlockSpec]]:
    """The codebook tables the weights need (each once): names, int32 arrays, whole-array specs."""
    names = tuple(sorted({t for w in weights for t in w.fmt.tables}))
    arrays = [jnp.asarray(lane_table(n)) for n in names]
    return names, arrays, [pl.BlockSpec(a.shape, lambda *_: (0, 0)) for a in arrays]
