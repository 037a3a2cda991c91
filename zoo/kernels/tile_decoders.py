"""Tile decoders of the formats the kernels run: IQ2_S, IQ3_S, IQ3_XXS, IQ4_XS, Q8_0, Q6_K, Q3_K, Q2_K.

Each decoder reads one tile of ``tb`` blocks through a ``zoo.kernels.tiles.Reader`` and returns it
as ``float32 [..., P, tb, m, R]``: ``P`` pieces, each ``m`` weights of every block (``P m`` = block
size) for ``R`` output columns; ``in_block[p, r]`` is the in-block index of the weight in row ``r``
of piece ``p``. A piece is what one set of shifts extracts from the same code words, so the word
axis of the planes stays the row axis and no weight moves across rows; the decoders compute all
pieces at once, with shifts that vary along the piece axes (``iota``), so a decoder is a few dozen
array operations whatever its piece count. The field semantics are ggml's (``zoo.formats.ggml``
layouts, the math of ``zoo.formats.dequant`` / ``dequant_iq``): the same float32 operations in the
same order, so every weight is bit-identical to ``gguf.quants.dequantize``.

Integer math on traced values sticks to shifts and masks (no ``//`` or ``%``, which lower through
``sign``). Comments: ``w`` is a weight's index in its block; words are 32-bit little endian; "byte c" of a
field is bits ``8 (c % 4)`` of its word ``c // 4``. In a shape, ``..`` stands for the reader's
leading axes and the names are the piece axes, ``tb``, the row axes and ``R``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from zoo.formats.ggml import BLOCK_LAYOUTS, QType
from zoo.kernels.tiles import F32, Reader, bits, check_in_block, f16_to_f32, shr, signed_byte, to_f32


@dataclass(frozen=True)
class Format:
    """A format's tile decoder: ``decode(reader) -> float32 [..., P, tb, m, R]``."""

    qtype: QType
    decode: Callable[[Reader], jax.Array]
    in_block: np.ndarray            # int [P, m]
    tables: tuple[str, ...] = ()

    def __post_init__(self):
        check_in_block(self.in_block, BLOCK_LAYOUTS[self.qtype].block_size)


def iota(*shape: int) -> list[jax.Array | None]:
    """Per axis of ``shape``, an int32 iota along it, of that shape with 1 on every other axis
    (trailing axes line up with a tile's ``[.., *pieces, tb, *rows, R]``); None for axes of size 1."""
    return [jax.lax.broadcasted_iota(jnp.int32, tuple(n if a == axis else 1 for a in range(len(shape))), axis)
            if n > 1 else None for axis, n in enumerate(shape)]


def at(x: jax.Array, *trailing: int) -> jax.Array:
    """Reshape a reader result ``[.., tb, W, R]`` to ``[.., *trailing]`` (same elements)."""
    return x.reshape(*x.shape[:-3], *trailing)


def _lift(x: jax.Array, n: int, k: int) -> jax.Array:
    """Insert ``n`` unit axes before the last ``k`` axes (a new piece axis in front of ``tb``)."""
    return x.reshape(*x.shape[:-k], *(1,) * n, *x.shape[-k:])


def _merge(v: jax.Array, n_pieces: int, n_rows: int) -> jax.Array:
    """``[.., *pieces, tb, *rows, R] -> [.., P, tb, m, R]``."""
    lead = v.shape[:v.ndim - n_pieces - n_rows - 2]
    tb = v.shape[len(lead) + n_pieces]
    return v.reshape(*lead, -1, tb, math.prod(v.shape[-1 - n_rows:-1]), v.shape[-1])


def _signed(value: jax.Array, sign_bit: jax.Array) -> jax.Array:
    """``value * (-1 if sign_bit else +1)``, exactly."""
    return jnp.where(sign_bit != 0, -value, value)


def _word_pair(r: Reader, name: str, row: jax.Array) -> jax.Array:
    """A two-word field: word ``row // 4`` for each row of a ``[.., tb, 8, R]`` tile."""
    return jnp.where(row < 4, r.words(name, 0, 2), r.words(name, 1, 2))


def _half(r: Reader, name: str, *trailing: int) -> jax.Array:
    """A 16-bit field (f16 scale) as float32 ``[.., *trailing]``."""
    return at(f16_to_f32(r.halves(name)), *trailing)


# --- Q8_0: d f16, qs 32 x int8 (8 words). Pieces s: w = 4 j + s is byte s of word j. ------------


def _q8_0(r: Reader) -> jax.Array:
    qs = r.words("qs")
    tb, R = r.tb, qs.shape[-1]
    s = iota(4, 1, 1, 1)[0]
    return to_f32(signed_byte(at(qs, 1, tb, 8, R), 8 * s)) * _half(r, "d", 1, tb, 1, R)     # [.., s, tb, j, R]


_Q8_0 = np.array([[4 * j + s for j in range(8)] for s in range(4)])


# --- Q2_K / Q3_K: qs 64 bytes in halves h (16 words = [h, a]). Pieces (m, s), rows (h, a):
# w = 128 h + 32 m + 4 a + s takes bits 2m of byte 4a + s of half h; its 16-weight group is
# g = 8 h + 2 m + a // 4. -----------------------------------------------------------------------


def _q2_k(r: Reader) -> jax.Array:
    # scales: byte g = 4 (2h + m // 2) + 2 (m % 2) + a // 4: low nibble scale, high nibble min
    qs = r.words("qs")
    tb, R = r.tb, qs.shape[-1]
    m, _, _, a, _ = iota(4, 1, 2, 8, 1)
    words = [at(r.words("scales", first, 2), 1, tb, 2, 1, R) for first in range(2)]
    byte = bits(jnp.where(m < 2, *words), 16 * (m & 1) + 8 * (a >= 4), 8)            # [.., m, tb, h, a, R]
    dl = _half(r, "d", 1, tb, 1, 1, R) * to_f32(byte & 0xF)
    ml = _half(r, "dmin", 1, tb, 1, 1, R) * to_f32(shr(byte, 4))
    m, s = iota(4, 4, 1, 1, 1, 1)[:2]
    q = to_f32(bits(at(qs, 1, 1, tb, 2, 8, R), 8 * s + 2 * m, 2))                    # [.., m, s, tb, h, a, R]
    return _merge(_lift(dl, 1, 4) * q - _lift(ml, 1, 4), 2, 2)


_Q23_K = np.array([[128 * h + 32 * m + 4 * a + s for h in range(2) for a in range(8)]
                   for m in range(4) for s in range(4)])


def _q3_k(r: Reader) -> jax.Array:
    # hmask: bit 4h + m of byte 4a + s is the inverted third bit; scales (12 bytes = 3 words): the
    # low 4 bits of scale g in nibble h of byte g % 8, the high 2 bits at 2 (g // 4) of byte 8 + g % 4
    qs = r.words("qs")
    tb, R = r.tb, qs.shape[-1]
    m, _, h, a = iota(4, 1, 2, 8, 1)[:4]
    words = [at(r.words("scales", i, 3), 1, tb, 1, 1, R) for i in range(3)]
    byte_shift = 8 * (2 * (m & 1) + (a >= 4))
    low = bits(jnp.where(m < 2, words[0], words[1]), byte_shift + 4 * h, 4)
    high = bits(words[2], byte_shift + 2 * (2 * h + (m >> 1)), 2)
    dl = _half(r, "d", 1, tb, 1, 1, R) * to_f32((low | (high << 4)) - 32)             # [.., m, tb, h, a, R]
    m, s, _, h = iota(4, 4, 1, 2, 1, 1)[:4]
    hmask = at(r.words("hmask"), 1, 1, tb, 1, 8, R)
    q = bits(at(qs, 1, 1, tb, 2, 8, R), 8 * s + 2 * m, 2) - 4 + 4 * bits(hmask, 8 * s + 4 * h + m, 1)
    return _merge(_lift(dl, 1, 4) * to_f32(q), 2, 2)


# --- Q6_K: ql 128 bytes (32 words = [h, ah, al]), qh 64 bytes (16 words = [h, al]), 16 int8 scales,
# d. Pieces (s, n), rows (h, ah, al): w = 128 h + 64 n + 4 a + s (a = 8 ah + al) is nibble n of ql
# byte 4a + s of half h plus bits 4n + 2ah of qh byte 4 al + s of half h; scale 8h + 4n + 2ah + al//4.


def _q6_k(r: Reader) -> jax.Array:
    ql = r.words("ql")
    tb, R = r.tb, ql.shape[-1]
    n, _, _, ah, al = iota(2, 1, 1, 2, 8, 1)[:5]
    words = [at(r.words("scales", first, 2), 1, tb, 2, 1, 1, R) for first in range(2)]
    scale = signed_byte(jnp.where(n == 0, *words), 8 * (2 * ah + (al >= 4)))          # [.., n, tb, h, ah, al, R]
    dl = _half(r, "d", 1, tb, 1, 1, 1, R) * to_f32(scale)
    s, n, _, _, ah = iota(4, 2, 1, 1, 2, 1, 1)[:5]
    low = bits(at(ql, 1, 1, tb, 2, 2, 8, R), 8 * s + 4 * n, 4)
    high = bits(at(r.words("qh"), 1, 1, tb, 2, 1, 8, R), 8 * s + 4 * n + 2 * ah, 2)
    return _merge(_lift(dl, 1, 6) * to_f32((low | (high << 4)) - 32), 2, 3)


_Q6_K = np.array([[128 * h + 64 * n + 4 * (8 * ah + al) + s for h in range(2) for ah in range(2) for al in range(8)]
                  for s in range(4) for n in range(2)])


# --- IQ4_XS: d, scales_h u16, scales_l 4 bytes, qs 128 bytes (32 words v = 8 vh + vl). Pieces (s, n),
# rows (vh, vl): group g = v // 4 of 32 weights; w = 32 g + 16 n + 4 (v % 4) + s is nibble n of byte
# s of word v. -----------------------------------------------------------------------------------


def _iq4_xs(r: Reader) -> jax.Array:
    qs = r.words("qs")
    tb, R = r.tb, qs.shape[-1]
    _, vh, vl, _ = iota(1, 4, 8, 1)
    g = 2 * vh + (vl >= 4)
    low, high = at(r.words("scales_l"), tb, 1, 1, R), at(r.halves("scales_h"), tb, 1, 1, R)
    dl = _half(r, "d", tb, 1, 1, R) * to_f32((bits(low, 4 * g, 4) | (bits(high, 2 * g, 2) << 4)) - 32)
    s, n = iota(4, 2, 1, 1, 1, 1)[:2]
    values = to_f32(r.lookup("kvalues", bits(at(qs, 1, 1, tb, 4, 8, R), 8 * s + 4 * n, 4)))
    return _merge(_lift(dl, 2, 4) * values, 2, 2)                                      # dl: [.., tb, vh, vl, R]


_IQ4_XS = np.array([[32 * (2 * vh + vl // 4) + 16 * n + 4 * (vl % 4) + s for vh in range(4) for vl in range(8)]
                    for s in range(4) for n in range(2)])


# --- IQ2_S: d, qs 32 (grid index low bytes), signs 32, qh 8 (2 high index bits each), scales 8
# (nibbles). Pieces (s, j), rows v: group G = 4 v + s of 8 weights (v: word of qs / signs), w = 8 G + j.


def _iq2_s(r: Reader) -> jax.Array:
    qs, signs = r.words("qs"), r.words("signs")                                       # [.., tb, v, R]
    tb, R = r.tb, qs.shape[-1]
    _, v, _ = iota(1, 8, 1)
    qh, scales = _word_pair(r, "qh", v), _word_pair(r, "scales", v)
    byte = 8 * (v & 3)
    s = iota(4, 1, 1, 1)[0]
    idx = bits(at(qs, 1, tb, 8, R), 8 * s, 8) | (bits(at(qh, 1, tb, 8, R), byte + 2 * s, 2) << 8)
    grid = [_lift(r.lookup("iq2s_grid", idx, word), 1, 3) for word in range(2)]     # [.., s, 1, tb, v, R]
    scale = to_f32(bits(at(scales, 1, tb, 8, R), byte + 4 * (s >> 1), 4))
    db = _lift(_half(r, "d", 1, tb, 1, R) * (0.5 + scale) * F32(0.25), 1, 3)
    s, j = iota(4, 8, 1, 1, 1)[:2]
    value = db * to_f32(bits(jnp.where(j < 4, *grid), 8 * (j & 3), 8))                 # [.., s, j, tb, v, R]
    return _merge(_signed(value, bits(at(signs, 1, 1, tb, 8, R), 8 * s + j, 1)), 2, 1)


_IQ2_S = np.array([[32 * v + 8 * s + j for v in range(8)] for s in range(4) for j in range(8)])


# --- IQ3_S: d, qs 64 (grid index low bytes, 16 words u = 2 p + par), qh 8, signs 32 (8 words p),
# scales 4. Pieces (par, s, t), rows p: index K = 4 u + s, w = 4 K + t = 32 p + 16 par + 4 s + t. --


def _iq3_s(r: Reader) -> jax.Array:
    signs = r.words("signs")                                                          # [.., tb, p, R]
    tb, R = r.tb, signs.shape[-1]
    _, p, _ = iota(1, 8, 1)
    qh = at(_word_pair(r, "qh", p), 1, 1, tb, 8, R)
    db = at(_half(r, "d", tb, 1, R) * to_f32(1 + 2 * bits(r.words("scales"), 4 * p, 4)), 1, 1, 1, tb, 8, R)
    par, s, _, p = iota(2, 4, 1, 8, 1)[:4]
    qs = jnp.where(par == 0, at(r.words("qs", 0, 2), 1, 1, tb, 8, R), at(r.words("qs", 1, 2), 1, 1, tb, 8, R))
    idx = bits(qs, 8 * s, 8) | (bits(qh, 8 * (p & 3) + 4 * par + s, 1) << 8)
    grid = _lift(r.lookup("iq3s_grid", idx), 1, 3)                                    # [.., par, s, 1, tb, p, R]
    par, s, t = iota(2, 4, 4, 1, 1, 1)[:3]
    value = db * to_f32(bits(grid, 8 * t, 8))
    sign = bits(at(signs, 1, 1, 1, tb, 8, R), 8 * (2 * par + (s >> 1)) + 4 * (s & 1) + t, 1)
    return _merge(_signed(value, sign), 3, 1)


_IQ3_S = np.array([[32 * p + 16 * par + 4 * s + t for p in range(8)]
                   for par in range(2) for s in range(4) for t in range(4)])


# --- IQ3_XXS: d, qs 64 (grid indices, 16 words = 2 i + l // 2), 8 words aux (one per 32 weights i:
# four 7-bit ksigns indices and a 4-bit scale). Pieces (l, j = 4 jq + t), rows i: w = 32 i + 8 l + j;
# ksigns' 8th sign bit is the parity of the other seven. -----------------------------------------


def _parity7(x: jax.Array) -> jax.Array:
    x = x ^ shr(x, 4)
    x = x ^ shr(x, 2)
    return (x ^ shr(x, 1)) & 1


def _iq3_xxs(r: Reader) -> jax.Array:
    aux = r.words("scales_and_signs")                                                 # [.., tb, i, R]
    tb, R = r.tb, aux.shape[-1]
    db = _half(r, "d", tb, 1, R) * (0.5 + to_f32(shr(aux, 28))) * F32(0.5)
    l, jq = iota(4, 2, 1, 1, 1)[:2]
    qs = jnp.where(l < 2, at(r.words("qs", 0, 2), 1, 1, tb, 8, R), at(r.words("qs", 1, 2), 1, 1, tb, 8, R))
    grid = _lift(r.lookup("iq3xxs_grid", bits(qs, 8 * (2 * (l & 1) + jq), 8)), 1, 3)    # [.., l, jq, 1, tb, i, R]
    l, jq, t = iota(4, 2, 4, 1, 1, 1)[:3]
    value = at(db, 1, 1, 1, tb, 8, R) * to_f32(bits(grid, 8 * t, 8))                 # [.., l, jq, t, tb, i, R]
    signs = bits(at(aux, 1, 1, 1, tb, 8, R), 7 * l, 7)
    j = 4 * jq + t
    return _merge(_signed(value, jnp.where(j == 7, _parity7(signs), bits(signs, j, 1))), 3, 1)


_IQ3_XXS = np.array([[32 * i + 8 * l + j for i in range(8)] for l in range(4) for j in range(8)])


FORMATS: dict[QType, Format] = {f.qtype: f for f in (
    Format(QType.Q8_0, _q8_0, _Q8_0),
    Format(QType.Q2_K, _q2_k, _Q23_K),
    Format(QType.Q3_K, _q3_k, _Q23_K),
    Format(QType.Q6_K, _q6_k, _Q6_K),
    Format(QType.IQ4_XS, _iq4_xs, _IQ4_XS, ("kvalues",)),
    Format(QType.IQ2_S, _iq2_s, _IQ2_S, ("iq2s_grid",)),
    Format(QType.IQ3_S, _iq3_s, _IQ3_S, ("iq3s_grid",)),
    Format(QType.IQ3_XXS, _iq3_xxs, _IQ3_XXS, ("iq3xxs_grid",)),
)}


def format_of(qtype: QType) -> Format | None:
    """The tile decoder of ``qtype``, or None when the kernels do not run it."""
    return FORMATS.get(qtype)
