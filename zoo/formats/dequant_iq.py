"""jnp dequantizers for the codebook ("i-quant") types IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
IQ3_XXS and IQ3_S.

These types store, per group of 4 or 8 weights, an index into a fixed codebook grid plus sign
bits, and per sub-block a small integer scale applied to the f16 super-block scale ``d``.

Every function takes ``uint8[..., n_blocks, type_size]`` and returns
``float32[..., n_blocks * 256]``, bit-identical to ``gguf.quants.dequantize``: it follows the
same float32 operations in the same order (see ``dequant.py`` for why that is also robust to
XLA's FMA contraction).

The codebooks are module-level numpy constants decoded by ``gguf.quants`` itself from its packed
tables (``init_grid``), so nothing is retyped here:

* ``IQ2XXS_GRID`` float32[256, 8], ``IQ2XS_GRID`` [512, 8], ``IQ2S_GRID`` [1024, 8]: ggml's
  ``iq2*_grid`` bytes (8, 25 or 43) as floats;
* ``IQ3XXS_GRID`` float32[256, 4], ``IQ3S_GRID`` [512, 4]: ggml's ``iq3*_grid`` bytes;
* ``IQ1S_GRID`` float32[2048, 8]: ggml's ``iq1s_grid`` as -1 / 0 / +1 (shared by IQ1_M);
* ``KSIGNS`` uint8[128]: ggml's ``ksigns_iq2xs`` (7 sign bits plus an even-parity 8th), and
  ``KSIGNS_VALUES`` float32[128, 8], the same as +1 / -1 per bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from gguf import quants as gq

from .ggml import BLOCK_LAYOUTS, BlockLayout, QType

F32 = jnp.float32


def _gguf_grid(quant_class: type) -> np.ndarray:
    """A gguf quant class's codebook as float32[n_entries, entry_len] (decoded by gguf's own code)."""
    quant_class.init_grid()
    return np.asarray(quant_class.grid, dtype=np.float32).reshape(quant_class.grid_shape)


def _sign_values(sign_bytes: np.ndarray) -> np.ndarray:
    """float32[..., 8]: +1 where a bit of the byte is clear, -1 where it is set (bit 0 first)."""
    bits = (sign_bytes[..., None] >> np.arange(8, dtype=np.uint8)) & 1
    return np.where(bits == 0, np.float32(1), np.float32(-1))


IQ2XXS_GRID = _gguf_grid(gq.IQ2_XXS)
IQ2XS_GRID = _gguf_grid(gq.IQ2_XS)
IQ2S_GRID = _gguf_grid(gq.IQ2_S)
IQ3XXS_GRID = _gguf_grid(gq.IQ3_XXS)
IQ3S_GRID = _gguf_grid(gq.IQ3_S)
IQ1S_GRID = _gguf_grid(gq.IQ1_S)
KSIGNS = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).copy()
KSIGNS_VALUES = _sign_values(KSIGNS)
IQ1_DELTA = np.float32(gq.IQ1_S.delta)

_IQ2_XXS = BLOCK_LAYOUTS[QType.IQ2_XXS]
_IQ2_XS = BLOCK_LAYOUTS[QType.IQ2_XS]
_IQ2_S = BLOCK_LAYOUTS[QType.IQ2_S]
_IQ3_XXS = BLOCK_LAYOUTS[QType.IQ3_XXS]
_IQ3_S = BLOCK_LAYOUTS[QType.IQ3_S]
_IQ1_S = BLOCK_LAYOUTS[QType.IQ1_S]
_IQ1_M = BLOCK_LAYOUTS[QType.IQ1_M]


def table_lookup(table: np.ndarray, indices: jax.Array) -> jax.Array:
    """``table[indices]`` (rows of a constant table); indices are in range by construction."""
    return jnp.asarray(table).at[indices.astype(jnp.int32)].get(mode="promise_in_bounds")


def _bit_fields(x: jax.Array, shifts: tuple[int, ...], mask: int) -> jax.Array:
    """``(x >> s) & mask`` for each shift ``s``, on a new last axis: ``x[..., n] -> [..., n, len(shifts)]``."""
    return (x[..., None] >> jnp.asarray(shifts, x.dtype)) & jnp.asarray(mask, x.dtype)


def _flat_bit_fields(x: jax.Array, shifts: tuple[int, ...], mask: int) -> jax.Array:
    """:func:`_bit_fields` with the two last axes merged: ``[..., n * len(shifts)]``."""
    fields = _bit_fields(x, shifts, mask)
    return fields.reshape(*x.shape[:-1], x.shape[-1] * len(shifts))


def _sign_bits(sign_bytes: jax.Array) -> jax.Array:
    """float32[..., n, 8]: +1 / -1 from the 8 bits of each sign byte (bit 0 first)."""
    return jnp.where(_bit_fields(sign_bytes, tuple(range(8)), 1) == 0, F32(1), F32(-1))


def _nibble_scales(scales: jax.Array) -> jax.Array:
    """uint8[..., n] -> uint8[..., 2n]: low then high nibble of each byte (gguf's order)."""
    return _flat_bit_fields(scales, (0, 4), 0x0F)


def _ksign_groups(words: jax.Array) -> jax.Array:
    """float32[..., n, 4, 8]: the four 7-bit ksigns indices in bits 0..27 of each uint32 word."""
    return table_lookup(KSIGNS_VALUES, _bit_fields(words, (0, 7, 14, 21), 0x7F))


def _super_scale(layout: BlockLayout, blocks: jax.Array) -> jax.Array:
    """The f16 super-block scale ``d`` as float32[..., n_blocks, 1]."""
    return layout.read(blocks, "d").astype(F32)


def dequantize_iq2_xxs(blocks: jax.Array) -> jax.Array:
    """IQ2_XXS: per 32 weights, 4 byte indices into ``IQ2XXS_GRID`` and a uint32 of 4x7 ksigns
    indices plus a 4-bit scale: ``d * (0.5 + s) * 0.25 * grid * sign``."""
    d = _super_scale(_IQ2_XXS, blocks)
    groups = _IQ2_XXS.read(blocks, "qs", np.uint8).reshape(*blocks.shape[:-1], 8, 8)
    grid_indices = groups[..., :4]
    aux = jax.lax.bitcast_convert_type(groups[..., 4:], jnp.uint32)
    db = d * (F32(0.5) + (aux >> 28).astype(F32)) * F32(0.25)
    grid = table_lookup(IQ2XXS_GRID, grid_indices)
    return _IQ2_XXS.to_rows(db[..., None, None] * grid * _ksign_groups(aux), blocks)


def dequantize_iq2_xs(blocks: jax.Array) -> jax.Array:
    """IQ2_XS: uint16 per 8 weights (9-bit index into ``IQ2XS_GRID``, 7-bit ksigns index) and a
    4-bit scale per 16 weights: ``d * (0.5 + s) * 0.25 * grid * sign``."""
    lead = blocks.shape[:-1]
    d = _super_scale(_IQ2_XS, blocks)
    qs = _IQ2_XS.read(blocks, "qs")
    db = d * (F32(0.5) + _nibble_scales(_IQ2_XS.read(blocks, "scales")).astype(F32)) * F32(0.25)
    signs = table_lookup(KSIGNS_VALUES, qs >> 9).reshape(*lead, 16, 2, 8)
    grid = table_lookup(IQ2XS_GRID, qs & 511).reshape(*lead, 16, 2, 8)
    return _IQ2_XS.to_rows(db[..., None, None] * grid * signs, blocks)


def dequantize_iq2_s(blocks: jax.Array) -> jax.Array:
    """IQ2_S: 10-bit indices into ``IQ2S_GRID`` (8 low bits in ``qs``, 2 high in ``qh``), one
    explicit sign bit per weight, a 4-bit scale per 16 weights."""
    lead = blocks.shape[:-1]
    d = _super_scale(_IQ2_S, blocks)
    db = d * (F32(0.5) + _nibble_scales(_IQ2_S.read(blocks, "scales")).astype(F32)) * F32(0.25)
    signs = _sign_bits(_IQ2_S.read(blocks, "signs")).reshape(*lead, 16, 2, 8)
    high = _flat_bit_fields(_IQ2_S.read(blocks, "qh"), (0, 2, 4, 6), 0x03).astype(jnp.uint16)
    indices = _IQ2_S.read(blocks, "qs").astype(jnp.uint16) | (high << 8)
    grid = table_lookup(IQ2S_GRID, indices).reshape(*lead, 16, 2, 8)
    return _IQ2_S.to_rows(db[..., None, None] * grid * signs, blocks)


def dequantize_iq3_xxs(blocks: jax.Array) -> jax.Array:
    """IQ3_XXS: byte indices into ``IQ3XXS_GRID`` (4 weights each) and, per 32 weights, a uint32 of
    4x7 ksigns indices plus a 4-bit scale: ``d * (0.5 + s) * 0.5 * grid * sign``."""
    lead = blocks.shape[:-1]
    d = _super_scale(_IQ3_XXS, blocks)
    aux = _IQ3_XXS.read(blocks, "scales_and_signs")
    db = d * (F32(0.5) + (aux >> 28).astype(F32)) * F32(0.5)
    grid = table_lookup(IQ3XXS_GRID, _IQ3_XXS.read(blocks, "qs")).reshape(*lead, 8, 4, 8)
    return _IQ3_XXS.to_rows(db[..., None, None] * grid * _ksign_groups(aux), blocks)


def dequantize_iq3_s(blocks: jax.Array) -> jax.Array:
    """IQ3_S: 9-bit indices into ``IQ3S_GRID`` (8 low bits in ``qs``, 1 high in ``qh``), one sign
    bit per weight, a 4-bit scale per 32 weights: ``d * (1 + 2 s) * grid * sign``."""
    lead = blocks.shape[:-1]
    d = _super_scale(_IQ3_S, blocks)
    db = d * (1 + 2 * _nibble_scales(_IQ3_S.read(blocks, "scales"))).astype(F32)
    signs = _sign_bits(_IQ3_S.read(blocks, "signs")).reshape(*lead, 8, 4, 8)
    high = _flat_bit_fields(_IQ3_S.read(blocks, "qh"), tuple(range(8)), 0x01).astype(jnp.uint16)
    indices = _IQ3_S.read(blocks, "qs").astype(jnp.uint16) | (high << 8)
    grid = table_lookup(IQ3S_GRID, indices).reshape(*lead, 8, 4, 8)
    return _IQ3_S.to_rows(db[..., None, None] * grid * signs, blocks)


def _iq1_delta(negative: jax.Array) -> jax.Array:
    return jnp.where(negative, -IQ1_DELTA, IQ1_DELTA)


def dequantize_iq1_s(blocks: jax.Array) -> jax.Array:
    """IQ1_S: 11-bit indices into ``IQ1S_GRID``; per 32 weights a uint16 holding the 3 high index
    bits of its 4 groups, a 3-bit scale and the delta's sign: ``d * (2 s + 1) * (grid +- 1/8)``."""
    lead = blocks.shape[:-1]
    d = _super_scale(_IQ1_S, blocks)
    qh = _IQ1_S.read(blocks, "qh")
    dl = d * (2 * ((qh >> 12) & 7) + 1).astype(F32)
    delta = _iq1_delta((qh & 0x8000) != 0)
    high = _flat_bit_fields(qh, (0, 3, 6, 9), 0x07)
    indices = _IQ1_S.read(blocks, "qs").astype(jnp.uint16) | (high << 8)
    grid = table_lookup(IQ1S_GRID, indices).reshape(*lead, 8, 4, 8)
    return _IQ1_S.to_rows(dl[..., None, None] * (grid + delta[..., None, None]), blocks)


def _iq1_m_super_scale(scales: jax.Array) -> jax.Array:
    """IQ1_M's f16 scale, stored in the top nibbles of its four uint16 ``scales``, as float32[..., 1]."""
    nibbles = (scales & 0xF000) >> jnp.asarray((12, 8, 4, 0), jnp.uint16)
    bits = nibbles[..., 0] | nibbles[..., 1] | nibbles[..., 2] | nibbles[..., 3]
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(F32)[..., None]


def dequantize_iq1_m(blocks: jax.Array) -> jax.Array:
    """IQ1_M: 11-bit indices into ``IQ1S_GRID`` (high 3 bits and the delta sign in a nibble of
    ``qh`` per 8 weights), a 3-bit scale per 16 weights: ``d * (2 s + 1) * (grid +- 1/8)``."""
    lead = blocks.shape[:-1]
    scales = _IQ1_M.read(blocks, "scales")
    d = _iq1_m_super_scale(scales)
    dl = d * (2 * _flat_bit_fields(scales, (0, 3, 6, 9), 0x07) + 1).astype(F32)
    qh = _flat_bit_fields(_IQ1_M.read(blocks, "qh"), (0, 4), 0x0F)
    indices = _IQ1_M.read(blocks, "qs").astype(jnp.uint16) | ((qh & 0x07).astype(jnp.uint16) << 8)
    delta = _iq1_delta((qh & 0x08) != 0).reshape(*lead, 8, 2, 2, 1)
    grid = table_lookup(IQ1S_GRID, indices).reshape(*lead, 8, 2, 2, 8)
    return _IQ1_M.to_rows(dl.reshape(*lead, 8, 2, 1, 1) * (grid + delta), blocks)
