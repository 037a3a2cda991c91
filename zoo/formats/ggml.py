"""The ggml block layouts, as data.

Every ggml tensor type stores a row as a sequence of fixed-size *blocks*; a block holds
``block_size`` weights in ``type_size`` bytes, split into named fields (scales, packed quants,
sign bits...). This module describes each block as a :class:`BlockLayout` of :class:`Field`s,
following the C structs of ``ggml-common.h`` and checked at import against
``gguf.constants.GGML_QUANT_SIZES`` (the source of the block sizes).

Where a C struct keeps two logical arrays in one (``block_iq2_s.qs`` holds the grid indices then
the sign bytes; ``block_iq3_xxs.qs`` the grid indices then the packed scales and signs) the two
parts are listed as separate fields, because that is how they are decoded.

Helpers:

* :func:`qtype_of` turns a ``GGMLQuantizationType``, its int value or its (case-insensitive)
  name into the enum, raising ``ValueError`` for anything unknown.
* :func:`row_bytes` / :func:`tensor_nbytes` give storage sizes, raising ``ValueError`` when a row
  is not a whole number of blocks.
* :meth:`BlockLayout.read` slices one field out of a jnp array of blocks and bit-casts it;
  :meth:`BlockLayout.to_rows` flattens decoded blocks back into rows (used by the dequantizers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import jax
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

QType = GGMLQuantizationType

F16 = np.dtype(np.float16)
BF16_BITS = np.dtype(np.uint16)  # bfloat16 has no numpy dtype: its raw 16 bits
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
U8 = np.dtype(np.uint8)
I8 = np.dtype(np.int8)
U16 = np.dtype(np.uint16)
I16 = np.dtype(np.int16)
U32 = np.dtype(np.uint32)
I32 = np.dtype(np.int32)
I64 = np.dtype(np.int64)


@dataclass(frozen=True)
class Field:
    """One named field of a block: ``count`` elements of ``dtype`` at byte ``offset``."""

    name: str
    offset: int
    nbytes: int
    dtype: np.dtype

    @property
    def count(self) -> int:
        return self.nbytes // self.dtype.itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class BlockLayout:
    """A ggml type's block: ``block_size`` weights stored in ``type_size`` bytes as ``fields``."""

    qtype: QType
    block_size: int
    type_size: int
    fields: tuple[Field, ...]

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.qtype.name} blocks have no field {name!r} (fields: {[f.name for f in self.fields]})")

    def read(self, blocks: jax.Array, name: str, dtype: np.dtype | None = None) -> jax.Array:
        """Field ``name`` of every block, bit-cast (host byte order, as numpy's ``view``) to ``dtype``.

        ``blocks`` is ``uint8[..., type_size]``; the result is ``dtype[..., nbytes // itemsize]``
        (``dtype`` defaults to the field's own; f16 stays f16, callers convert).
        """
        f = self.field(name)
        raw = blocks[..., f.offset : f.end]
        dtype = np.dtype(dtype or f.dtype)
        if dtype.itemsize == 1:
            return raw if dtype == U8 else jax.lax.bitcast_convert_type(raw, dtype)
        words = raw.reshape(*raw.shape[:-1], f.nbytes // dtype.itemsize, dtype.itemsize)
        return jax.lax.bitcast_convert_type(words, dtype)

    def to_rows(self, values: jax.Array, blocks: jax.Array) -> jax.Array:
        """Flatten per-block ``values[..., n_blocks, *inner]`` (decoded from ``blocks``,
        ``uint8[..., n_blocks, type_size]``) into rows ``[..., n_blocks * block_size]``."""
        *lead, n_blocks, _ = blocks.shape
        return values.reshape(*lead, n_blocks * self.block_size)


def _layout(qtype: QType, block_size: int, *parts: tuple[str, int, np.dtype]) -> BlockLayout:
    """Build a layout from consecutive ``(name, element count, dtype)`` parts."""
    fields, offset = [], 0
    for name, count, dtype in parts:
        fields.append(Field(name, offset, count * dtype.itemsize, dtype))
        offset += count * dtype.itemsize
    return BlockLayout(qtype, block_size, offset, tuple(fields))


def _scalar(qtype: QType, dtype: np.dtype) -> BlockLayout:
    return _layout(qtype, 1, ("value", 1, dtype))


BLOCK_LAYOUTS: dict[QType, BlockLayout] = {
    layout.qtype: layout
    for layout in (
        _scalar(QType.F32, F32),
        _scalar(QType.F16, F16),
        _scalar(QType.BF16, BF16_BITS),
        _scalar(QType.F64, F64),
        _scalar(QType.I8, I8),
        _scalar(QType.I16, I16),
        _scalar(QType.I32, I32),
        _scalar(QType.I64, I64),
        _layout(QType.Q4_0, 32, ("d", 1, F16), ("qs", 16, U8)),
        _layout(QType.Q4_1, 32, ("d", 1, F16), ("m", 1, F16), ("qs", 16, U8)),
        _layout(QType.Q5_0, 32, ("d", 1, F16), ("qh", 1, U32), ("qs", 16, U8)),
        _layout(QType.Q5_1, 32, ("d", 1, F16), ("m", 1, F16), ("qh", 1, U32), ("qs", 16, U8)),
        _layout(QType.Q8_0, 32, ("d", 1, F16), ("qs", 32, I8)),
        # gguf sizes Q8_1 as the original struct {float d; float s; int8_t qs[32]} (40 bytes);
        # current ggml packs d and s as two halves (36 bytes). We follow gguf.
        _layout(QType.Q8_1, 32, ("d", 1, F32), ("s", 1, F32), ("qs", 32, I8)),
        _layout(QType.Q2_K, QK_K, ("scales", QK_K // 16, U8), ("qs", QK_K // 4, U8), ("d", 1, F16), ("dmin", 1, F16)),
        _layout(QType.Q3_K, QK_K, ("hmask", QK_K // 8, U8), ("qs", QK_K // 4, U8), ("scales", 12, U8), ("d", 1, F16)),
        _layout(QType.Q4_K, QK_K, ("d", 1, F16), ("dmin", 1, F16), ("scales", 12, U8), ("qs", QK_K // 2, U8)),
        _layout(
            QType.Q5_K, QK_K,
            ("d", 1, F16), ("dmin", 1, F16), ("scales", 12, U8), ("qh", QK_K // 8, U8), ("qs", QK_K // 2, U8),
        ),
        _layout(
            QType.Q6_K, QK_K, ("ql", QK_K // 2, U8), ("qh", QK_K // 4, U8), ("scales", QK_K // 16, I8), ("d", 1, F16),
        ),
        _layout(QType.Q8_K, QK_K, ("d", 1, F32), ("qs", QK_K, I8), ("bsums", QK_K // 16, I16)),
        _layout(QType.IQ2_XXS, QK_K, ("d", 1, F16), ("qs", QK_K // 8, U16)),
        _layout(QType.IQ2_XS, QK_K, ("d", 1, F16), ("qs", QK_K // 8, U16), ("scales", QK_K // 32, U8)),
        _layout(
            QType.IQ2_S, QK_K,
            ("d", 1, F16), ("qs", QK_K // 8, U8), ("signs", QK_K // 8, U8), ("qh", QK_K // 32, U8),
            ("scales", QK_K // 32, U8),
        ),
        _layout(QType.IQ3_XXS, QK_K, ("d", 1, F16), ("qs", QK_K // 4, U8), ("scales_and_signs", QK_K // 32, U32)),
        _layout(
            QType.IQ3_S, QK_K,
            ("d", 1, F16), ("qs", QK_K // 4, U8), ("qh", QK_K // 32, U8), ("signs", QK_K // 8, U8),
            ("scales", QK_K // 64, U8),
        ),
        _layout(QType.IQ1_S, QK_K, ("d", 1, F16), ("qs", QK_K // 8, U8), ("qh", QK_K // 32, U16)),
        # IQ1_M has no separate scale: the f16 super-block scale is spread over the top nibbles
        # of the four uint16 `scales`.
        _layout(QType.IQ1_M, QK_K, ("qs", QK_K // 8, U8), ("qh", QK_K // 16, U8), ("scales", QK_K // 64, U16)),
        _layout(QType.IQ4_NL, 32, ("d", 1, F16), ("qs", 16, U8)),
        _layout(
            QType.IQ4_XS, QK_K,
            ("d", 1, F16), ("scales_h", 1, U16), ("scales_l", QK_K // 64, U8), ("qs", QK_K // 2, U8),
        ),
        _layout(QType.TQ1_0, QK_K, ("qs", (QK_K - 4 * QK_K // 64) // 5, U8), ("qh", QK_K // 64, U8), ("d", 1, F16)),
        _layout(QType.TQ2_0, QK_K, ("qs", QK_K // 4, U8), ("d", 1, F16)),
        # e: an E8M0 exponent byte; qs: 4-bit E2M1 codes
        _layout(QType.MXFP4, 32, ("e", 1, U8), ("qs", 16, U8)),
        # d: four UE4M3 scale bytes, one per 16 weights; qs: 4-bit E2M1 codes
        _layout(QType.NVFP4, 64, ("d", 4, U8), ("qs", 32, U8)),
        _layout(QType.Q1_0, 128, ("d", 1, F16), ("qs", 16, U8)),
    )
}


def _check_layouts() -> None:
    """Fail loudly if a layout disagrees with gguf's sizes or has gaps/overlaps."""
    missing = set(GGML_QUANT_SIZES) - set(BLOCK_LAYOUTS)
    if missing:
        raise RuntimeError(f"no block layout for ggml types {sorted(t.name for t in missing)}")
    for qtype, layout in BLOCK_LAYOUTS.items():
        expected = GGML_QUANT_SIZES[qtype]
        if (layout.block_size, layout.type_size) != expected:
            raise RuntimeError(
                f"{qtype.name}: layout says (block_size, type_size) = {(layout.block_size, layout.type_size)},"
                f" gguf says {expected}"
            )
        ends = [0] + [f.end for f in layout.fields]
        if any(f.offset != end for f, end in zip(layout.fields, ends)) or ends[-1] != layout.type_size:
            raise RuntimeError(f"{qtype.name}: fields do not tile the block exactly")


_check_layouts()


def qtype_of(qtype: QType | int | str) -> QType:
    """Normalise a ggml type given as the enum, its int value or its name ("iq2_s", "IQ2_S")."""
    if isinstance(qtype, QType):
        return qtype
    if isinstance(qtype, str):
        try:
            return QType[qtype.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown ggml type name {qtype!r}; known: {[t.name for t in QType]}") from None
    if isinstance(qtype, (int, np.integer)) and not isinstance(qtype, bool):
        try:
            return QType(int(qtype))
        except ValueError:
            raise ValueError(f"unknown ggml type id {int(qtype)}") from None
    raise ValueError(f"unknown ggml type {qtype!r}: expected a GGMLQuantizationType, its int value or its name")


def block_layout(qtype: QType | int | str) -> BlockLayout:
    """The :class:`BlockLayout` of a type (any form accepted by :func:`qtype_of`)."""
    return BLOCK_LAYOUTS[qtype_of(qtype)]


def row_bytes(qtype: QType | int | str, n_elements: int) -> int:
    """Bytes needed to store one row of ``n_elements`` weights; it must be a whole number of blocks."""
    layout = block_layout(qtype)
    if n_elements % layout.block_size:
        raise ValueError(
            f"row of {n_elements} elements is not a multiple of the {layout.qtype.name} block size"
            f" ({layout.block_size})"
        )
    return n_elements // layout.block_size * layout.type_size


def tensor_nbytes(qtype: QType | int | str, shape: Sequence[int]) -> int:
    """Bytes needed for a tensor of ``shape`` (rows along the last axis) stored as ``qtype``."""
    if len(shape) == 0:
        raise ValueError("a ggml tensor needs at least one dimension")
    return math.prod(shape[:-1]) * row_bytes(qtype, shape[-1])
