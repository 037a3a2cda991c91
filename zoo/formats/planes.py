"""GGUF blocks <-> the kernel plane layout (docs/reference.md section 4), layout version 1.

A quantized matrix is stored by GGUF as rows of blocks, ``uint8 [*lead, rows, n_blocks *
type_size]`` (``rows`` = output features, the blocks run along the input features; ``lead`` =
experts). The plane layout splits every block field (``zoo.formats.ggml.BLOCK_LAYOUTS``) into its own
dense ``uint32`` array with the **matrix row on the minor (lane) axis** and the packed code words
on the second-minor axis::

    plane[field] : uint32 [*lead, n_words, rows]
    plane[field][..., g * w + j, r] = little-endian word j of the field bytes of blocks
                                      g*k .. g*k+k-1 of row r concatenated

where ``k = 4 // gcd(field bytes, 4)`` blocks share a word group (1 for fields of whole words, 2
for the f16 ``d`` / u16 ``scales_h``, 4 for MXFP4's one-byte ``e``) and ``w = k * field bytes / 4``.
A row whose block count is not a multiple of ``k`` is padded with zero bytes, so storage equals the
GGUF payload except for that padding (``plane_nbytes``).

``in_splits`` S > 1 packs the row's blocks as S equal parts, each on its own, concatenated along the
word axis (``[*lead, S * n_words(part), rows]``): a matrix split by input blocks over S devices
(docs/reference.md section 4, ``down`` split by input blocks) then gives every device whole word groups
of its own blocks, padded per part like a matrix of ``n_blocks / S`` blocks.

``to_planes`` runs on the host (numpy, at load); ``from_planes`` is jnp and works inside ``jit``
(the on-the-fly dequantizing matmul rebuilds blocks from planes and reuses ``zoo.formats.dequant``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from zoo.formats.ggml import BLOCK_LAYOUTS, Field, QType
from zoo.formats.host_arrays import aligned_empty

LAYOUT_VERSION = 1


def blocks_per_word_group(field: Field) -> int:
    """How many consecutive blocks share one group of words in the field's plane."""
    return 4 // math.gcd(field.nbytes, 4)


def plane_words(field: Field, n_blocks: int) -> int:
    """Second-minor extent of the field's plane for rows of ``n_blocks`` blocks."""
    k = blocks_per_word_group(field)
    return -(-n_blocks // k) * (k * field.nbytes // 4)


def _part_blocks(n_blocks: int, in_splits: int) -> int:
    if in_splits < 1 or n_blocks % in_splits:
        raise ValueError(f"{n_blocks} blocks per row cannot be packed as {in_splits} equal parts")
    return n_blocks // in_splits


def plane_shapes(qtype: QType, lead: tuple[int, ...], rows: int, n_blocks: int,
                 in_splits: int = 1) -> dict[str, tuple[int, ...]]:
    """{field: plane shape} for ``lead`` x ``rows`` rows of ``n_blocks`` blocks of ``qtype``, packed
    as ``in_splits`` parts."""
    part = _part_blocks(n_blocks, in_splits)
    return {f.name: (*lead, in_splits * plane_words(f, part), rows) for f in BLOCK_LAYOUTS[qtype].fields}


def plane_nbytes(qtype: QType, rows: int, n_blocks: int) -> int:
    """Bytes of all planes of one ``rows x n_blocks`` matrix (GGUF payload + packing padding)."""
    return 4 * rows * sum(plane_words(f, n_blocks) for f in BLOCK_LAYOUTS[qtype].fields)


def to_planes(data: np.ndarray, qtype: QType, in_splits: int = 1) -> dict[str, np.ndarray]:
    """GGUF rows of blocks ``uint8 [*lead, rows, row_bytes]`` -> {field: ``uint32 [*lead, n_words, rows]``}
    (``in_splits`` parts of the row packed one by one, see the module docstring)."""
    layout = BLOCK_LAYOUTS[qtype]
    if in_splits != 1:
        part_bytes = _part_blocks(data.shape[-1] // layout.type_size, in_splits) * layout.type_size
        parts = [to_planes(data[..., i * part_bytes:(i + 1) * part_bytes], qtype) for i in range(in_splits)]
        return {f.name: np.concatenate([p[f.name] for p in parts], axis=-2) for f in layout.fields}
    *lead, rows, row_bytes = data.shape
    if data.dtype != np.uint8 or row_bytes % layout.type_size:
        raise ValueError(f"{qtype.name}: expected uint8 rows of whole {layout.type_size}-byte blocks, got "
                         f"{data.dtype} rows of {row_bytes} bytes")
    n_blocks = row_bytes // layout.type_size
    data = np.ascontiguousarray(data)
    blocks = data.reshape(*lead, rows, n_blocks, layout.type_size)
    planes = {}
    for f in layout.fields:
        k = blocks_per_word_group(f)
        raw = blocks[..., f.offset:f.end]                          # [*lead, rows, n_blocks, nbytes]
        if k == 1 and f.nbytes % 4 == 0:                           # whole words per block: one copy
            words = raw.view("<u4")                                # [*lead, rows, n_blocks, words/block]
            out = aligned_empty((*lead, n_blocks * words.shape[-1], rows), np.uint32)
            n = len(lead)
            _transpose_into(out.reshape(*lead, n_blocks, words.shape[-1], rows),
                            words.transpose(*range(n), n + 1, n + 2, n))
            planes[f.name] = out
            continue
        pad = -n_blocks % k
        if pad:
            raw = np.concatenate([raw, np.zeros((*lead, rows, pad, f.nbytes), np.uint8)], axis=-2)
        words = np.ascontiguousarray(raw).reshape(*lead, rows, -1).view("<u4")   # [*lead, rows, n_words]
        out = aligned_empty((*lead, words.shape[-1], rows), np.uint32)
        _transpose_into(out, np.swapaxes(words, -1, -2))
        planes[f.name] = out
    return planes


TRANSPOSE_ROWS = 256            # matrix rows per copy of ``_transpose_into`` (the writes stay in cache lines)


def _transpose_into(out: np.ndarray, view: np.ndarray) -> None:
    """``out[...] = view`` where ``view``'s last axis (the matrix rows) is its slowest in memory: copied a
    band of ``TRANSPOSE_ROWS`` rows at a time, so each band's reads and writes stay in cache (1.5-2x
    a single strided copy on large matrices)."""
    rows = out.shape[-1]
    for start in range(0, rows, TRANSPOSE_ROWS):
        np.copyto(out[..., start:start + TRANSPOSE_ROWS], view[..., start:start + TRANSPOSE_ROWS])


def from_planes(planes: dict[str, jax.Array], qtype: QType, n_blocks: int, in_splits: int = 1) -> jax.Array:
    """Inverse of ``to_planes`` (jnp): planes -> ``uint8 [*lead, rows, n_blocks * type_size]``."""
    layout = BLOCK_LAYOUTS[qtype]
    if in_splits != 1:                 # the parts as one more lead axis, then rows of parts side by side
        part = _part_blocks(n_blocks, in_splits)
        split = {k: p.reshape(*p.shape[:-2], in_splits, p.shape[-2] // in_splits, p.shape[-1])
                 for k, p in planes.items()}
        rows = jnp.moveaxis(from_planes(split, qtype, part), -3, -2)      # [*lead, rows, S, part bytes]
        return rows.reshape(*rows.shape[:-2], n_blocks * layout.type_size)
    parts = []
    for f in layout.fields:
        words = jnp.swapaxes(planes[f.name], -1, -2)               # [*lead, rows, n_words]
        raw = jax.lax.bitcast_convert_type(words, jnp.uint8)       # [*lead, rows, n_words, 4]
        *lead, rows, n_words, _ = raw.shape
        parts.append(raw.reshape(*lead, rows, n_words * 4 // f.nbytes, f.nbytes)[..., :n_blocks, :])
    return jnp.concatenate(parts, axis=-1).reshape(*lead, rows, n_blocks * layout.type_size)
