"""Bit-exact jnp dequantizers for ggml tensor types.

Public entry points:

* :func:`dequantize` ``(data, qtype) -> np.ndarray``: same contract as
  ``gguf.quants.dequantize``. ``data`` holds whole rows of blocks along its last axis (bytes;
  any dtype is reinterpreted as its bytes), any leading shape; the result is float32 with the
  last axis ``n_bytes // type_size * block_size``. Compiled once per (type, total block count).
* :func:`dequantize_jnp` ``(data, qtype) -> jax.Array``: the same on a ``uint8`` jax array,
  usable inside ``jax.jit`` with ``qtype`` static. A ``uint8[..., n_blocks, type_size]`` array of
  blocks gives ``float32[..., n_blocks, block_size]``.

Each type family has a function ``uint8[..., n_blocks, type_size] -> float32[..., n_blocks *
block_size]``; :data:`DEQUANTIZERS` maps each ``GGMLQuantizationType`` to its function. The
codebook types (IQ1/IQ2/IQ3) live in :mod:`zoo.formats.dequant_iq`.

Bit-exactness against ``gguf.quants`` (numpy) rests on three points:

1. Every function repeats gguf's float32 operations in gguf's order (f16 -> f32 first, then e.g.
   ``d * sc`` and ``dl * q - ml``), with the same integer dtypes for the bit-twiddling.
2. XLA:CPU compiles with FMA contraction allowed and may reassociate ``(d * a) * b``. Neither can
   change a result here: every product is of a float32 with at most 11 significant bits (an f16
   scale) and small integers (at most 12 more bits), so all products are exact in float32 and only
   a final ``+ m`` / ``- dm`` rounds, once, as in numpy. Inf/NaN scales give NaN/Inf in the same
   places (NaN payloads may differ; compare with ``equal_nan``).
3. XLA:CPU flushes subnormal float32 inputs and outputs to zero (numpy does not). The only
   subnormal operands are MXFP4's E8M0 scales 0 and 1 (2**-128, 2**-127), so MXFP4 looks its
   values up in a table computed by numpy with gguf's formula instead of multiplying (f16
   subnormals become normal float32 before any arithmetic, so f16-scaled types are unaffected).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from gguf import quants as gq

from .dequant_iq import (
    dequantize_iq1_m,
    dequantize_iq1_s,
    dequantize_iq2_s,
    dequantize_iq2_xs,
    dequantize_iq2_xxs,
    dequantize_iq3_s,
    dequantize_iq3_xxs,
    table_lookup,
)
from .ggml import BLOCK_LAYOUTS, BlockLayout, QType, qtype_of

F32 = jnp.float32

# ggml's kvalues_iq4nl (int8[16]), the non-linear 4-bit levels of IQ4_NL / IQ4_XS.
KVALUES_IQ4NL = np.array(gq.IQ4_NL.kvalues, dtype=np.int8)
# MXFP4's E2M1 levels, doubled (ggml's kvalues_mxfp4), int8[16]; NVFP4 uses the same.
KVALUES_MXFP4 = np.array(gq.MXFP4.kvalues, dtype=np.int8)


def _mxfp4_values() -> np.ndarray:
    """float32[256, 16]: ``e8m0_to_fp32_half(e) * KVALUES_MXFP4[code]`` by gguf's own e8m0 decoder
    (e = 255 overflows to +-inf for the larger codes, as in gguf)."""
    scales = gq.MXFP4.e8m0_to_fp32_half(np.arange(256, dtype=np.uint8))
    with np.errstate(over="ignore"):
        return scales[:, None] * KVALUES_MXFP4.astype(np.float32)


# Every MXFP4 weight value, indexed [e8m0 exponent, code] (see point 3 of the module docstring).
MXFP4_VALUES = _mxfp4_values()
# NVFP4's UE4M3 scale byte -> float32 (with the 0.5 of the doubled kvalues), from gguf's decoder, float32[256].
NVFP4_SCALES = np.asarray(gq.NVFP4.ue4m3_to_fp32(np.arange(256, dtype=np.uint8)), dtype=np.float32)

Dequantizer = Callable[[jax.Array], jax.Array]


# --- helpers ----------------------------------------------------------------------------------


def _planes(x: jax.Array, shifts: tuple[int, ...], mask: int) -> jax.Array:
    """``(x >> s) & mask`` for each shift ``s`` on a new second-to-last axis: ``[..., n] -> [..., len(shifts), n]``."""
    s = jnp.asarray(shifts, x.dtype)[:, None]
    return (x[..., None, :] >> s) & jnp.asarray(mask, x.dtype)


def _flat_planes(x: jax.Array, shifts: tuple[int, ...], mask: int) -> jax.Array:
    """:func:`_planes` with the two last axes merged: ``[..., len(shifts) * n]``."""
    return _planes(x, shifts, mask).reshape(*x.shape[:-1], len(shifts) * x.shape[-1])


def _f32(layout: BlockLayout, blocks: jax.Array, name: str) -> jax.Array:
    """A (f16 or f32) field converted to float32, ``[..., n_blocks, count]``."""
    return layout.read(blocks, name).astype(F32)


# --- plain floats ----------------------------------------------------------------------------


def dequantize_f32(blocks: jax.Array) -> jax.Array:
    """F32: the bytes reinterpreted."""
    return BLOCK_LAYOUTS[QType.F32].to_rows(BLOCK_LAYOUTS[QType.F32].read(blocks, "value"), blocks)


def dequantize_f16(blocks: jax.Array) -> jax.Array:
    """F16: reinterpreted, converted to float32."""
    return BLOCK_LAYOUTS[QType.F16].to_rows(_f32(BLOCK_LAYOUTS[QType.F16], blocks, "value"), blocks)


def dequantize_bf16(blocks: jax.Array) -> jax.Array:
    """BF16: the 16 bits become the high half of a float32."""
    layout = BLOCK_LAYOUTS[QType.BF16]
    bits = layout.read(blocks, "value").astype(jnp.uint32) << 16
    return layout.to_rows(jax.lax.bitcast_convert_type(bits, F32), blocks)


# --- legacy 32-weight blocks -----------------------------------------------------------------


def _low_then_high_nibbles(qs: jax.Array) -> jax.Array:
    """uint8[..., 16] -> uint8[..., 32]: weights 0..15 in the low nibbles, 16..31 in the high ones."""
    return _flat_planes(qs, (0, 4), 0x0F)


def _fifth_bits(qh_word: jax.Array) -> jax.Array:
    """uint32[..., 1] -> uint8[..., 32]: bit i of the word is weight i's fifth bit."""
    return ((qh_word >> jnp.arange(32, dtype=jnp.uint32)) & 1).astype(jnp.uint8)


def dequantize_q4_0(blocks: jax.Array) -> jax.Array:
    """Q4_0: ``d * (q - 8)``, q 4 bits."""
    layout = BLOCK_LAYOUTS[QType.Q4_0]
    q = _low_then_high_nibbles(layout.read(blocks, "qs")).astype(jnp.int8) - 8
    return layout.to_rows(_f32(layout, blocks, "d") * q.astype(F32), blocks)


def dequantize_q4_1(blocks: jax.Array) -> jax.Array:
    """Q4_1: ``d * q + m``, q 4 bits."""
    layout = BLOCK_LAYOUTS[QType.Q4_1]
    q = _low_then_high_nibbles(layout.read(blocks, "qs")).astype(F32)
    return layout.to_rows(_f32(layout, blocks, "d") * q + _f32(layout, blocks, "m"), blocks)


def _five_bit_quants(layout: BlockLayout, blocks: jax.Array) -> jax.Array:
    low = _low_then_high_nibbles(layout.read(blocks, "qs"))
    return low | (_fifth_bits(layout.read(blocks, "qh")) << 4)


def dequantize_q5_0(blocks: jax.Array) -> jax.Array:
    """Q5_0: ``d * (q - 16)``, q 5 bits (the fifth in ``qh``)."""
    layout = BLOCK_LAYOUTS[QType.Q5_0]
    q = _five_bit_quants(layout, blocks).astype(jnp.int8) - 16
    return layout.to_rows(_f32(layout, blocks, "d") * q.astype(F32), blocks)


def dequantize_q5_1(blocks: jax.Array) -> jax.Array:
    """Q5_1: ``d * q + m``, q 5 bits (the fifth in ``qh``)."""
    layout = BLOCK_LAYOUTS[QType.Q5_1]
    q = _five_bit_quants(layout, blocks).astype(F32)
    return layout.to_rows(_f32(layout, blocks, "d") * q + _f32(layout, blocks, "m"), blocks)


def dequantize_q8_0(blocks: jax.Array) -> jax.Array:
    """Q8_0: ``q * d``, q int8."""
    layout = BLOCK_LAYOUTS[QType.Q8_0]
    return layout.to_rows(layout.read(blocks, "qs").astype(F32) * _f32(layout, blocks, "d"), blocks)


# --- k-quants (256-weight super-blocks) ------------------------------------------------------


def dequantize_q2_k(blocks: jax.Array) -> jax.Array:
    """Q2_K: per 16 weights a 4-bit scale and 4-bit min: ``(d * sc) * q - (dmin * m)``, q 2 bits."""
    layout = BLOCK_LAYOUTS[QType.Q2_K]
    lead = blocks.shape[:-1]
    scales = layout.read(blocks, "scales")
    dl = (_f32(layout, blocks, "d") * (scales & 0x0F).astype(F32))[..., None]
    ml = (_f32(layout, blocks, "dmin") * (scales >> 4).astype(F32))[..., None]
    qs = layout.read(blocks, "qs").reshape(*lead, 2, 32)
    q = _planes(qs, (0, 2, 4, 6), 0x03).reshape(*lead, 16, 16).astype(F32)
    return layout.to_rows(dl * q - ml, blocks)


def _q3_k_scales(scales: jax.Array) -> jax.Array:
    """Q3_K's 16 signed 6-bit scales (low 4 bits in bytes 0..7, high 2 in bytes 8..11) as float32."""
    low = _flat_planes(scales[..., :8], (0, 4), 0x0F)
    high = _flat_planes(scales[..., 8:], (0, 2, 4, 6), 0x03)
    return ((low | (high << 4)).astype(jnp.int8) - 32).astype(F32)


def dequantize_q3_k(blocks: jax.Array) -> jax.Array:
    """Q3_K: ``(d * sc) * q``, sc signed 6 bits per 16 weights, q 3 bits (2 in ``qs``, the third
    inverted in ``hmask``: a clear bit subtracts 4)."""
    layout = BLOCK_LAYOUTS[QType.Q3_K]
    lead = blocks.shape[:-1]
    dl = (_f32(layout, blocks, "d") * _q3_k_scales(layout.read(blocks, "scales")))[..., None]
    qs = layout.read(blocks, "qs").reshape(*lead, 2, 32)
    low = _planes(qs, (0, 2, 4, 6), 0x03).reshape(*lead, 16, 16)
    high = _planes(layout.read(blocks, "hmask"), tuple(range(8)), 0x01).reshape(*lead, 16, 16) ^ 1
    q = (low.astype(jnp.int8) - (high << 2).astype(jnp.int8)).astype(F32)
    return layout.to_rows(dl * q, blocks)


def _k_scale_min(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K / Q5_K's 8 (scale, min) pairs of 6 bits packed in 12 bytes, as two uint8[..., 8]."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_scales_and_mins(layout: BlockLayout, blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(d * sc, dmin * m)``, each float32[..., n_blocks, 8, 1]."""
    sc, mn = _k_scale_min(layout.read(blocks, "scales"))
    dl = _f32(layout, blocks, "d") * sc.astype(F32)
    ml = _f32(layout, blocks, "dmin") * mn.astype(F32)
    return dl[..., None], ml[..., None]


def _k_nibbles(layout: BlockLayout, blocks: jax.Array) -> jax.Array:
    """uint8[..., n_blocks, 8, 32]: per 64 weights, 32 bytes' low nibbles then their high nibbles."""
    qs = layout.read(blocks, "qs").reshape(*blocks.shape[:-1], 4, 32)
    return _planes(qs, (0, 4), 0x0F).reshape(*blocks.shape[:-1], 8, 32)


def dequantize_q4_k(blocks: jax.Array) -> jax.Array:
    """Q4_K: ``(d * sc) * q - (dmin * m)``, 6-bit sc / m per 32 weights, q 4 bits."""
    layout = BLOCK_LAYOUTS[QType.Q4_K]
    dl, ml = _k_scales_and_mins(layout, blocks)
    q = _k_nibbles(layout, blocks).astype(F32)
    return layout.to_rows(dl * q - ml, blocks)


def dequantize_q5_k(blocks: jax.Array) -> jax.Array:
    """Q5_K: as Q4_K with a fifth bit per weight in ``qh`` (bit j of byte i: weight i of sub-block j)."""
    layout = BLOCK_LAYOUTS[QType.Q5_K]
    dl, ml = _k_scales_and_mins(layout, blocks)
    high = _planes(layout.read(blocks, "qh"), tuple(range(8)), 0x01)
    q = (_k_nibbles(layout, blocks) | (high << 4)).astype(F32)
    return layout.to_rows(dl * q - ml, blocks)


def dequantize_q6_k(blocks: jax.Array) -> jax.Array:
    """Q6_K: ``(d * sc) * (q - 32)``, sc int8 per 16 weights, q 6 bits (4 in ``ql``, 2 in ``qh``)."""
    layout = BLOCK_LAYOUTS[QType.Q6_K]
    lead = blocks.shape[:-1]
    dl = (_f32(layout, blocks, "d") * layout.read(blocks, "scales").astype(F32))[..., None]
    ql = _planes(layout.read(blocks, "ql").reshape(*lead, 2, 64), (0, 4), 0x0F).reshape(*lead, 8, 32)
    qh = _planes(layout.read(blocks, "qh").reshape(*lead, 2, 32), (0, 2, 4, 6), 0x03).reshape(*lead, 8, 32)
    q = ((ql | (qh << 4)).astype(jnp.int8) - 32).reshape(*lead, 16, 16).astype(F32)
    return layout.to_rows(dl * q, blocks)


# --- ternary ---------------------------------------------------------------------------------


def _base3_digits(qs: jax.Array, powers: tuple[int, ...]) -> jax.Array:
    """TQ1_0's packed trits: ``byte * 3**k`` (uint8, wrapping) for each power on a new
    second-to-last axis, merged to ``[..., len(powers) * n]``; ``(x * 3) >> 8`` then gives digit k."""
    products = qs[..., None, :] * jnp.asarray(powers, jnp.uint8)[:, None]
    return products.reshape(*qs.shape[:-1], len(powers) * qs.shape[-1])


def dequantize_tq1_0(blocks: jax.Array) -> jax.Array:
    """TQ1_0: ``d * t``, t in {-1, 0, 1} packed 5 (``qs``) or 4 (``qh``) per byte in base 3."""
    layout = BLOCK_LAYOUTS[QType.TQ1_0]
    qs = layout.read(blocks, "qs")
    powers = (1, 3, 9, 27, 81)
    packed = jnp.concatenate(
        [
            _base3_digits(qs[..., :32], powers),
            _base3_digits(qs[..., 32:], powers),
            _base3_digits(layout.read(blocks, "qh"), powers[:4]),
        ],
        axis=-1,
    )
    t = ((packed.astype(jnp.uint16) * 3) >> 8).astype(jnp.int8) - 1
    return layout.to_rows(_f32(layout, blocks, "d") * t.astype(F32), blocks)


def dequantize_tq2_0(blocks: jax.Array) -> jax.Array:
    """TQ2_0: ``d * (q - 1)``, q 2 bits."""
    layout = BLOCK_LAYOUTS[QType.TQ2_0]
    qs = layout.read(blocks, "qs").reshape(*blocks.shape[:-1], 2, 32)
    q = _planes(qs, (0, 2, 4, 6), 0x03).reshape(*blocks.shape[:-1], 256).astype(jnp.int8) - 1
    return layout.to_rows(_f32(layout, blocks, "d") * q.astype(F32), blocks)


# --- microscaling fp4 ------------------------------------------------------------------------


def dequantize_mxfp4(blocks: jax.Array) -> jax.Array:
    """MXFP4: E2M1 codes times an E8M0 power of two, read from :data:`MXFP4_VALUES`."""
    layout = BLOCK_LAYOUTS[QType.MXFP4]
    codes = _low_then_high_nibbles(layout.read(blocks, "qs")).astype(jnp.int32)
    exponent = layout.read(blocks, "e").astype(jnp.int32)
    return layout.to_rows(table_lookup(MXFP4_VALUES.reshape(-1), exponent * 16 + codes), blocks)


def dequantize_nvfp4(blocks: jax.Array) -> jax.Array:
    """NVFP4: ``d * kvalue``, an UE4M3 scale ``d`` per 16 E2M1 codes (per 8 bytes: low nibbles, then high)."""
    layout = BLOCK_LAYOUTS[QType.NVFP4]
    lead = blocks.shape[:-1]
    d = table_lookup(NVFP4_SCALES, layout.read(blocks, "d"))[..., None]
    qs = layout.read(blocks, "qs").reshape(*lead, 4, 8)
    codes = jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    values = table_lookup(KVALUES_MXFP4.astype(np.float32), codes)
    return layout.to_rows(d * values, blocks)


# --- non-linear 4-bit ------------------------------------------------------------------------


def dequantize_iq4_nl(blocks: jax.Array) -> jax.Array:
    """IQ4_NL: ``d * kvalues_iq4nl[q]``, q 4 bits."""
    layout = BLOCK_LAYOUTS[QType.IQ4_NL]
    q = table_lookup(KVALUES_IQ4NL.astype(np.float32), _low_then_high_nibbles(layout.read(blocks, "qs")))
    return layout.to_rows(_f32(layout, blocks, "d") * q, blocks)


def _iq4_xs_scales(layout: BlockLayout, blocks: jax.Array) -> jax.Array:
    """IQ4_XS's 8 signed 6-bit scales (low 4 bits in ``scales_l`` nibbles, high 2 in ``scales_h``), float32."""
    low = layout.read(blocks, "scales_l")
    low = ((low[..., :, None] >> jnp.asarray((0, 4), jnp.uint8)) & 0x0F).reshape(*low.shape[:-1], 8)
    high = (layout.read(blocks, "scales_h") >> jnp.arange(0, 16, 2, dtype=jnp.uint16)).astype(jnp.uint8) & 0x03
    return ((low | (high << 4)).astype(jnp.int8) - 32).astype(F32)


def dequantize_iq4_xs(blocks: jax.Array) -> jax.Array:
    """IQ4_XS: ``(d * sc) * kvalues_iq4nl[q]``, sc signed 6 bits per 32 weights, q 4 bits."""
    layout = BLOCK_LAYOUTS[QType.IQ4_XS]
    lead = blocks.shape[:-1]
    dl = (_f32(layout, blocks, "d") * _iq4_xs_scales(layout, blocks))[..., None]
    qs = layout.read(blocks, "qs").reshape(*lead, 8, 16)
    q = table_lookup(KVALUES_IQ4NL.astype(np.float32), _planes(qs, (0, 4), 0x0F).reshape(*lead, 8, 32))
    return layout.to_rows(dl * q, blocks)


# --- dispatch --------------------------------------------------------------------------------

DEQUANTIZERS: dict[QType, Dequantizer] = {
    QType.F32: dequantize_f32,
    QType.F16: dequantize_f16,
    QType.BF16: dequantize_bf16,
    QType.Q4_0: dequantize_q4_0,
    QType.Q4_1: dequantize_q4_1,
    QType.Q5_0: dequantize_q5_0,
    QType.Q5_1: dequantize_q5_1,
    QType.Q8_0: dequantize_q8_0,
    QType.Q2_K: dequantize_q2_k,
    QType.Q3_K: dequantize_q3_k,
    QType.Q4_K: dequantize_q4_k,
    QType.Q5_K: dequantize_q5_k,
    QType.Q6_K: dequantize_q6_k,
    QType.TQ1_0: dequantize_tq1_0,
    QType.TQ2_0: dequantize_tq2_0,
    QType.MXFP4: dequantize_mxfp4,
    QType.NVFP4: dequantize_nvfp4,
    QType.IQ4_NL: dequantize_iq4_nl,
    QType.IQ4_XS: dequantize_iq4_xs,
    QType.IQ2_XXS: dequantize_iq2_xxs,
    QType.IQ2_XS: dequantize_iq2_xs,
    QType.IQ2_S: dequantize_iq2_s,
    QType.IQ3_XXS: dequantize_iq3_xxs,
    QType.IQ3_S: dequantize_iq3_s,
    QType.IQ1_S: dequantize_iq1_s,
    QType.IQ1_M: dequantize_iq1_m,
}


def _dequantizer(qtype: QType) -> Dequantizer:
    try:
        return DEQUANTIZERS[qtype]
    except KeyError:
        raise NotImplementedError(
            f"dequantization of {qtype.name} is not supported (supported: {[t.name for t in DEQUANTIZERS]})"
        ) from None


def blocks_per_row(qtype: QType | int | str, n_bytes: int) -> int:
    """Number of blocks in a row of ``n_bytes``; ``ValueError`` if it is not a whole number."""
    layout = BLOCK_LAYOUTS[qtype_of(qtype)]
    if n_bytes % layout.type_size:
        raise ValueError(
            f"a row of {n_bytes} bytes is not a whole number of {layout.qtype.name} blocks"
            f" ({layout.type_size} bytes each)"
        )
    return n_bytes // layout.type_size


def dequantize_jnp(data: jax.Array, qtype: QType | int | str) -> jax.Array:
    """Dequantize ``uint8[..., n_bytes]`` (whole blocks along the last axis) to
    ``float32[..., n_bytes // type_size * block_size]``.

    Traceable: call it inside ``jax.jit`` with ``qtype`` static. Blocks in, blocks out: a
    ``uint8[..., n_blocks, type_size]`` array yields ``float32[..., n_blocks, block_size]``.
    Raises ``ValueError`` for an unknown type or a partial block, ``NotImplementedError`` for a
    known type without a dequantizer, ``TypeError`` for non-uint8 input.
    """
    qtype = qtype_of(qtype)
    dequantizer = _dequantizer(qtype)
    data = jnp.asarray(data)
    if data.dtype != jnp.uint8 or data.ndim == 0:
        raise TypeError(f"expected a uint8 array of at least one dimension, got {data.dtype}{list(data.shape)}")
    layout = BLOCK_LAYOUTS[qtype]
    n_blocks = blocks_per_row(qtype, data.shape[-1])
    return dequantizer(data.reshape(*data.shape[:-1], n_blocks, layout.type_size))


_dequantize_blocks = jax.jit(dequantize_jnp, static_argnums=1)


def dequantize(data: np.ndarray, qtype: QType | int | str) -> np.ndarray:
    """Drop-in for ``gguf.quants.dequantize``: rows of blocks along the last axis of ``data``
    (its bytes: any dtype is reinterpreted, like gguf does) to float32 rows, any leading shape.

    Runs one jitted XLA computation over all blocks (compiled per type and total block count).
    The result may be read-only. Errors as :func:`dequantize_jnp`.
    """
    qtype = qtype_of(qtype)
    _dequantizer(qtype)  # unsupported types fail before any shape check
    raw = np.ascontiguousarray(data)
    if raw.ndim == 0:
        raise ValueError("expected an array of at least one dimension")
    raw = raw.view(np.uint8)
    layout = BLOCK_LAYOUTS[qtype]
    n_blocks = blocks_per_row(qtype, raw.shape[-1])
    values = _dequantize_blocks(raw.reshape(-1, layout.type_size), qtype)
    return np.asarray(values).reshape(*raw.shape[:-1], n_blocks * layout.block_size)


CHUNK_BLOCKS = 1 << 18           # blocks per call of ``dequantize_as`` (256 Ki blocks: 64 Mi weights of a K-quant)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _dequantize_cast(blocks: jax.Array, qtype: QType, dtype) -> jax.Array:
    return dequantize_jnp(blocks, qtype).astype(dtype)


def dequantize_as(data: np.ndarray, qtype: QType | int | str, dtype) -> np.ndarray:
    """``dequantize(data, qtype).astype(dtype)`` (the same values), a chunk of ``CHUNK_BLOCKS`` blocks at a
    time straight into one aligned ``dtype`` array (``zoo.formats.host_arrays``): no float32 copy of
    the whole tensor is ever held (a 248k x 5120 embedding: 2.5 GB of bf16, not 5 GB of float32 more),
    and one program per type and dtype (the last chunk is padded to the chunk size)."""
    from zoo.formats.host_arrays import aligned_empty

    qtype = qtype_of(qtype)
    _dequantizer(qtype)
    raw = np.ascontiguousarray(data).view(np.uint8)
    if raw.ndim == 0:
        raise ValueError("expected an array of at least one dimension")
    layout = BLOCK_LAYOUTS[qtype]
    per_row = blocks_per_row(qtype, raw.shape[-1])
    blocks = raw.reshape(-1, layout.type_size)
    total = blocks.shape[0]
    out = aligned_empty((total, layout.block_size), dtype)
    chunk = min(CHUNK_BLOCKS, total)
    for start in range(0, total, chunk):
        part = blocks[start:start + chunk]
        n = part.shape[0]
        if n < chunk:
            part = np.concatenate([part, np.zeros((chunk - n, layout.type_size), np.uint8)])
        out[start:start + n] = np.asarray(_dequantize_cast(part, qtype, np.dtype(dtype)))[:n]
    return out.reshape(*raw.shape[:-1], per_row * layout.block_size)

