"""Decoding quantized weights straight from the plane layout, one tile of blocks at a time.

The plane layout (``zoo.formats.planes``) keeps every block field as ``uint32 [*lead, n_words, out]``
with the output features on the minor (lane) axis. A *tile* is ``tb`` consecutive blocks of the
input axis for every output column of a plane slice. A format's tile decoder
(``zoo.kernels.tile_decoders``) turns a tile into ``float32 [..., P, tb, m, R]``: ``P`` *pieces* of
``m`` weights of every block (``P * m`` = weights per block, ``R`` = output columns), using only
shifts, masks, small-table lookups and float32 products in gguf's order, so every decoded weight is
bit-identical to ``gguf.quants.dequantize``. The same decoder runs in the jnp references (on whole arrays) and in
the Pallas kernel bodies (on VMEM tiles): it reads through a :class:`Reader`.

**Plane order.** A piece holds, for each block of the tile, ``m`` weights of that block that a
few shifts extract from the same words; piece ``p`` row ``r`` of block ``b`` is in-block weight
``fmt.in_block[p, r]``. Flattened, a tile's ``[P, tb, m, R]`` is ``[tb * bs, R]``: the input axis
in *plane order*. Activations are permuted once into that order (a static index map,
:func:`input_order`) so that ``x_plane @ W_plane == x @ W``; no weight is ever reordered.

**Tiling.** A weight's input axis is ``in_splits`` parts (``zoo.formats.planes``) of ``n_blocks /
in_splits`` blocks; each part is cut into chunks of ``tb`` blocks (``tb`` divides the part; it is
even unless it is the whole part, so two-byte fields never straddle a chunk). Chunk ``q`` of field
``f`` is then words ``[q * plane_words(f, tb), (q + 1) * plane_words(f, tb))`` of the plane.

Readers give the decoders int32 values (planes are bit-cast; tables are int32):

* ``words(name, first=0, stride=1) -> [..., tb, Wf // stride, R]``: words ``first, first + stride,
  ...`` of each block's ``Wf`` words of a field of whole words;
* ``halves(name) -> [..., tb, 1, R]``: each block's 16-bit field (``d``, ``dmin``, ``scales_h``:
  two blocks per word);
* ``lookup(table, idx, word=0) -> idx.shape``: word ``word`` of entries ``idx`` of a codebook
  table (:data:`TABLES`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from zoo.formats import planes as P
from zoo.formats.dequant import KVALUES_IQ4NL
from zoo.formats.dequant_iq import IQ2S_GRID, IQ3S_GRID, IQ3XXS_GRID
from zoo.formats.ggml import BLOCK_LAYOUTS, QType

F32 = jnp.float32
I32 = jnp.int32
LANES = 128


# --- bit helpers (int32 in, shifts may be arrays) ---------------------------------------------


def shr(x: jax.Array, shift) -> jax.Array:
    """Logical right shift of int32 ``x`` by ``shift`` (a Python int or an int32 array; the two
    broadcast against each other)."""
    x, shift = jnp.broadcast_arrays(x, jnp.asarray(shift, I32))
    return jax.lax.shift_right_logical(x, shift)


def bits(x: jax.Array, shift, width: int) -> jax.Array:
    """``(x >>> shift) & (2**width - 1)`` on int32."""
    return shr(x, shift) & ((1 << width) - 1)


def signed_byte(x: jax.Array, shift) -> jax.Array:
    """The byte at bit ``shift`` of each int32 word, sign-extended (an int8 field)."""
    x, shift = jnp.broadcast_arrays(x, jnp.asarray(shift, I32))
    return jax.lax.shift_right_arithmetic(x << (24 - shift), jnp.full(x.shape, 24, I32))


def to_f32(x: jax.Array) -> jax.Array:
    return x.astype(F32)


def f16_to_f32(h: jax.Array) -> jax.Array:
    """IEEE half bits (int32 in [0, 65535]) -> float32, exactly as numpy converts f16.

    Pure integer work plus one exact int->float product for subnormals, so it needs no f16
    support from the backend and cannot hit XLA:CPU's flushing of subnormal float32 (a subnormal
    f16 is a normal float32)."""
    sign = bits(h, 15, 1) << 31
    exponent, mantissa = bits(h, 10, 5), h & 0x3FF
    normal = sign | ((exponent + 112) << 23) | (mantissa << 13)
    special = sign | 0x7F800000 | (mantissa << 13)
    as_float = jax.lax.bitcast_convert_type(jnp.where(exponent == 31, special, normal), F32)
    tiny = to_f32(mantissa) * F32(2.0 ** -24)
    tiny = jnp.where(sign != 0, -tiny, tiny)
    return jnp.where(exponent == 0, tiny, as_float)


# --- codebook tables ----------------------------------------------------------------------------


def _packed(grid: np.ndarray) -> np.ndarray:
    """float32 [n, 4 * w] of byte values -> int32 [w, n]: word j = little-endian bytes 4j..4j+3."""
    as_bytes = grid.astype(np.uint8)
    n, width = as_bytes.shape
    return np.ascontiguousarray(as_bytes.reshape(n, width // 4, 4).view("<u4")[..., 0].T).view(np.int32)


# name -> int32 [words per entry, entries]
TABLES: dict[str, np.ndarray] = {
    "iq2s_grid": _packed(IQ2S_GRID),
    "iq3s_grid": _packed(IQ3S_GRID),
    "iq3xxs_grid": _packed(IQ3XXS_GRID),
    "kvalues": KVALUES_IQ4NL.astype(np.int32)[None, :],
}


def lane_table(name: str) -> np.ndarray:
    """A table as int32 ``[words * chunks, 128]``: row ``word * chunks + c`` holds word ``word`` of
    entries ``128 c .. 128 c + 127`` (zero padded), the form the TPU lane gathers read."""
    table = TABLES[name]
    words, n = table.shape
    chunks = -(-n // LANES)
    padded = np.zeros((words, chunks * LANES), np.int32)
    padded[:, :n] = table
    return padded.reshape(words * chunks, LANES)


# --- readers -----------------------------------------------------------------------------------


class Reader(Protocol):
    tb: int

    def words(self, name: str, first: int = 0, stride: int = 1) -> jax.Array: ...

    def halves(self, name: str) -> jax.Array: ...

    def lookup(self, table: str, idx: jax.Array, word: int = 0) -> jax.Array: ...


def words_per_block(qtype: QType, name: str) -> int:
    """Words per block of a field of whole words."""
    return BLOCK_LAYOUTS[qtype].field(name).nbytes // 4


def split_halves(w: jax.Array, tb: int) -> jax.Array:
    """Words ``[..., ceil(tb/2), R]`` of a two-blocks-per-word field -> ``[..., tb, 1, R]``."""
    low, high = (w & 0xFFFF)[..., None, :], bits(w, 16, 16)[..., None, :]   # [..., n, 1, R]
    both = jnp.stack([low, high], axis=-3)                                # [..., n, 2, 1, R]
    return both.reshape(*w.shape[:-2], 2 * w.shape[-2], 1, w.shape[-1])[..., :tb, :, :]


@dataclass(frozen=True)
class ArrayReader:
    """Reads a tile held as jnp arrays: ``planes[name]`` is ``int32 [..., plane_words(f, tb), R]``;
    lookups are direct gathers (the reference path)."""

    planes: dict[str, jax.Array]
    qtype: QType
    tb: int

    def words(self, name: str, first: int = 0, stride: int = 1) -> jax.Array:
        w = self.planes[name][..., first::stride, :]
        return w.reshape(*w.shape[:-2], self.tb, words_per_block(self.qtype, name) // stride, w.shape[-1])

    def halves(self, name: str) -> jax.Array:
        return split_halves(self.planes[name], self.tb)

    def lookup(self, table: str, idx: jax.Array, word: int = 0) -> jax.Array:
        return jnp.asarray(TABLES[table][word]).at[idx].get(mode="promise_in_bounds")


# --- tiling and the plane order ----------------------------------------------------------------


@dataclass(frozen=True)
class Tiling:
    """How a weight's input axis is cut: ``in_splits`` parts of ``part`` blocks, chunks of ``tb``."""

    qtype: QType
    n_blocks: int
    in_splits: int
    tb: int

    def __post_init__(self):
        if self.n_blocks % self.in_splits or self.part % self.tb or (self.tb % 2 and self.tb != self.part):
            raise ValueError(f"bad tiling {self}: tb must divide the part and be even unless it is the part")

    @property
    def part(self) -> int:
        return self.n_blocks // self.in_splits

    @property
    def n_chunks(self) -> int:
        return self.n_blocks // self.tb

    @property
    def block_size(self) -> int:
        return BLOCK_LAYOUTS[self.qtype].block_size

    @property
    def chunk_inputs(self) -> int:
        """Input features per chunk (``tb * block_size``)."""
        return self.tb * self.block_size

    def chunk_words(self, name: str) -> int:
        """Words of field ``name`` per chunk."""
        return P.plane_words(BLOCK_LAYOUTS[self.qtype].field(name), self.tb)


def tiling_for(qtype: QType, n_blocks: int, in_splits: int = 1, max_inputs: int | None = 2048,
               power_of_two: bool = False, lane_aligned: bool = True) -> Tiling | None:
    """The tiling with the largest chunk of at most ``max_inputs`` input features (None: one chunk
    per part). Chunks must start on a 128-lane boundary of the activations (a multiple of 128
    inputs, or a single chunk): Mosaic cannot prove a dynamic lane offset off that grid legal; a
    single chunk up to 4x ``max_inputs`` is taken when no aligned smaller one exists. Among those,
    chunks of a multiple of 16 blocks (word offsets aligned to 8 sublanes) come first.
    With ``power_of_two`` (Triton's tensor shapes) only power-of-two chunks qualify; None if none does.
    ``lane_aligned`` False drops the lane rule (the jnp decoders do not need it)."""
    part = n_blocks // in_splits
    bs = BLOCK_LAYOUTS[qtype].block_size
    ok = [tb for tb in range(1, part + 1) if part % tb == 0 and (tb % 2 == 0 or tb == part)
          and (not power_of_two or tb & (tb - 1) == 0)]
    if max_inputs is not None:
        lanes = [tb for tb in ok if (tb * bs) % 128 == 0 or tb == n_blocks or not lane_aligned]
        fitting = [tb for tb in lanes if tb * bs <= max_inputs] or [
            tb for tb in lanes if tb == n_blocks and tb * bs <= 4 * max_inputs] or [
            tb for tb in ok if tb * bs <= max_inputs] or ok[:1]
        aligned = [tb for tb in fitting if tb % 16 == 0 or tb == part]
        ok = aligned or fitting
    return Tiling(qtype, n_blocks, in_splits, max(ok)) if ok else None


def plane_order(tiling: Tiling, in_block: np.ndarray) -> np.ndarray:
    """int [n_blocks * block_size]: the stored input index at each plane-order position (chunks in
    order; inside a chunk, piece-major ``[P, tb, m]``)."""
    bs, tb = tiling.block_size, tiling.tb
    blocks = np.arange(tiling.n_chunks)[:, None, None, None] * tb + np.arange(tb)[None, None, :, None]
    order = blocks * bs + in_block[None, :, None, :]                       # [chunks, P, tb, m]
    return order.reshape(-1)


def input_order(tiling: Tiling, in_block: np.ndarray, in_order=None) -> np.ndarray:
    """int [d_in]: the logical input feature at each plane-order position (``x[..., order]`` is
    ``x`` in plane order), undoing a QArray's ``in_order`` head permutation as well."""
    stored = np.arange(tiling.n_blocks * tiling.block_size)
    if in_order is not None:
        view, axes = in_order
        stored = stored.reshape(view).transpose(axes).reshape(-1)
    return stored[plane_order(tiling, in_block)]


def to_int32(plane: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(plane, I32)


def decode_parts(planes: dict[str, jax.Array], fmt, tiling: Tiling) -> jax.Array:
    """The whole weight in plane order, ``float32 [*lead, n_blocks * bs, R]``, from planes
    ``uint32 [*lead, n_words, R]`` (jnp: one tile per chunk, chunks as a leading axis)."""
    chunked = {}
    for name, p in planes.items():
        w = tiling.chunk_words(name)
        chunked[name] = to_int32(p).reshape(*p.shape[:-2], tiling.n_chunks, w, p.shape[-1])
    decoded = fmt.decode(ArrayReader(chunked, tiling.qtype, tiling.tb))    # [*lead, C, P, tb, m, R]
    lead_shape = next(iter(planes.values())).shape[:-2]
    return decoded.reshape(*lead_shape, tiling.n_blocks * tiling.block_size, decoded.shape[-1])


def check_in_block(in_block: np.ndarray, block_size: int) -> np.ndarray:
    """``in_block`` must be a permutation of the block's weights."""
    if sorted(in_block.reshape(-1).tolist()) != list(range(block_size)):
        raise ValueError("a format's pieces must cover every weight of a block exactly once")
    return in_block


def n_tiles(n: int, tile: int) -> int:
    return math.ceil(n / tile)
