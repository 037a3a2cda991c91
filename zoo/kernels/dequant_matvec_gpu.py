"""Decode-step kernels for GPUs (Pallas' Triton backend): the same fused dequant-matvec and the same
de-duplicated expert plan as ``zoo.kernels.dequant_matvec``, without scalar prefetch.

Triton's Pallas backend has no scalar prefetch and no data-dependent ``index_map``: the expert ids
are an ordinary input, and each program (output tile ``j``, distinct-expert slot ``u``) reads its
expert id and loads that expert's plane words itself (``GpuReader``: pointer loads from the whole
bank in global memory; codebooks are gathers from flat int32 tables). Every tensor in a Triton
kernel has power-of-two dimensions, so chunks are a power of two of blocks (at most 512 inputs),
output tiles ``tile_cols`` in (128, 64, 32, 16) columns (a float32 tile of at most 32k elements: it
is staged in shared memory, 227 KiB per block on an H100/H200), and the rows are padded to 16 (the smallest ``tl.dot``).
SwiGLU runs in float32 on the projections rounded to the activation dtype (Triton has no bf16
division for the sigmoid). Programs run concurrently, so the down projection cannot accumulate over
experts in its output block as the TPU kernel does: each slot writes ``[rows, out]`` and the
routing-weighted sum over the (few) slots is one jnp reduction. Padding slots are skipped; their
rows are masked out there. (Without a GPU, the tests run these bodies in interpret mode and lower
them to Triton for an abstract H100; compiling that Triton to PTX needs the GPU.)

    moe_matvec_gpu(x [N, D], weights, ids, gate, up, down, limit) -> [N, D]
    linear_matvec_gpu(x [..., in], w, out_dtype) -> [..., out]
    supported(*qarrays) -> bool      whether these shapes/formats fit the constraints above
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from zoo.formats.ggml import QType
from zoo.kernels.dequant_matvec import expert_plan
from zoo.kernels.operands import Weight, plane_inputs, split_refs
from zoo.kernels.tile_decoders import format_of
from zoo.kernels.tiles import TABLES, Tiling, bits, tiling_for, to_int32, words_per_block
from zoo.ops.activation import swiglu
from zoo.ops.matmul import precision_for

F32 = jnp.float32
MIN_ROWS = 16
# A program decodes a float32 tile [chunk inputs, output columns] that Triton stages in shared
# memory (an H100/H200 has 227 KiB per block; the tile takes about 1.1x its bytes there, measured on
# an H200): chunks of at most 512 inputs, and tiles of at most 32k elements (128 KiB).
MAX_CHUNK_INPUTS = 512
MAX_TILE_ELEMENTS = 32768
# Formats whose decoder does not fit those budgets: IQ4_XS's asked for 289.5 KiB of shared memory
# at a 512 x 64 tile on an H200 (bench/gpu_kernels.py, 2026-12-04), twice the other formats.
NOT_ON_GPU = frozenset({QType.IQ4_XS})


def tile_cols(d_out: int, max_width: int = 128) -> int | None:
    """The widest power-of-two output tile (16..``max_width``, at most 128) that divides ``d_out``, or None."""
    return next((t for t in (128, 64, 32, 16) if t <= max(max_width, 16) and d_out % t == 0), None)


def weight_of(q) -> Weight:
    """``q`` as a Triton operand: power-of-two chunks of at most ``MAX_CHUNK_INPUTS`` inputs."""
    return Weight.of(q, max_inputs=MAX_CHUNK_INPUTS, power_of_two=True)


def width_for(weights: list[Weight]) -> int | None:
    """Output columns per program: a power of two dividing the outputs whose tile, for the widest
    chunk among ``weights``, stays within ``MAX_TILE_ELEMENTS``."""
    chunk = max(w.tiling.chunk_inputs for w in weights)
    return tile_cols(weights[0].d_out, MAX_TILE_ELEMENTS // chunk)


def supported(*qarrays) -> bool:
    """Whether the Triton kernels take these QArrays (a tile decoder, a power-of-two tiling, an
    output tile of 16 to 128 columns within the shared-memory budget)."""
    for q in qarrays:
        if q.qtype in NOT_ON_GPU or format_of(q.qtype) is None or tile_cols(q.shape[-1]) is None:
            return False
        tiling = tiling_for(q.qtype, q.n_blocks, q.in_splits, MAX_CHUNK_INPUTS, power_of_two=True)
        if tiling is None or tile_cols(q.shape[-1], MAX_TILE_ELEMENTS // tiling.chunk_inputs) is None:
            return False
    return True


@dataclass(frozen=True)
class GpuReader:
    """``zoo.kernels.tiles.Reader`` over whole banks in global memory: expert ``expert``, chunk
    ``q``, output columns ``cols`` (a ``pl.ds`` of ``width``)."""

    refs: dict
    tables: dict
    tiling: Tiling
    expert: jax.Array
    q: jax.Array | int
    cols: pl.Slice
    width: int

    @property
    def tb(self) -> int:
        return self.tiling.tb

    def words(self, name: str, first: int = 0, stride: int = 1) -> jax.Array:
        per_block = words_per_block(self.tiling.qtype, name)
        n = self.tb * per_block // stride
        start = self.q * self.tiling.chunk_words(name) + first
        rows = pl.ds(start, n, stride) if stride > 1 else pl.ds(start, n)
        return to_int32(self.refs[name][self.expert, rows, self.cols]).reshape(self.tb, per_block // stride, self.width)

    def halves(self, name: str) -> jax.Array:
        block = jnp.arange(self.tb)
        words = to_int32(self.refs[name][self.expert, self.q * self.tiling.chunk_words(name) + (block >> 1), self.cols])
        return bits(words, 16 * (block & 1)[:, None], 16).reshape(self.tb, 1, self.width)

    def lookup(self, table: str, idx: jax.Array, word: int = 0) -> jax.Array:
        return self.tables[table][idx + word * TABLES[table].shape[1]]


def _matvec(weight: Weight, x_ref, slot, refs, tables: dict, expert, col, width: int) -> jax.Array:
    """``x @ W[expert][:, col tile]``, float32 ``[rows, width]``; ``x_ref`` is ``[rows, in]`` or, with
    ``slot`` not None, ``[U, rows, in]`` read at ``slot``."""
    t = weight.tiling
    rows, dtype = x_ref.shape[-2], x_ref.dtype
    cols = pl.ds(col * width, width)

    def chunk(q, acc):
        tile = weight.fmt.decode(GpuReader(dict(zip(weight.names, refs)), tables, t, expert, q, cols, width))
        inputs = pl.ds(q * t.chunk_inputs, t.chunk_inputs)
        xs = x_ref[:, inputs] if slot is None else x_ref[slot, :, inputs]
        w = tile.reshape(t.chunk_inputs, width).astype(dtype)
        return acc + jnp.dot(xs, w, precision=precision_for(dtype), preferred_element_type=F32)

    return jax.lax.fori_loop(0, t.n_chunks, chunk, jnp.zeros((rows, width), F32))


def _project(xs: list[jax.Array], weights: list[Weight], x_of: list[int], experts, n_valid,
             epilogue: Callable, out_dtype, interpret: bool) -> jax.Array:
    """``epilogue(x @ W_i[e] for i) -> [U, rows, out]`` per distinct-expert slot; ``xs`` are
    ``[rows, in]`` (shared by the slots) or ``[U, rows, in]`` (one per slot)."""
    u_size, rows, d_out = experts.shape[0], xs[0].shape[-2], weights[0].d_out
    width = width_for(weights)
    names = tuple(sorted({t for w in weights for t in w.fmt.tables}))
    tables = [jnp.asarray(TABLES[n].reshape(-1)) for n in names]
    per_slot = xs[0].ndim == 3
    counts = [len(xs)] + [len(w.planes) for w in weights] + [len(names), 1]

    def kernel(experts_ref, n_valid_ref, *refs):
        x_refs, *w_refs, t_refs, (out_ref,) = split_refs(refs, counts)
        col, u = pl.program_id(0), pl.program_id(1)

        @pl.when(u < n_valid_ref[0])
        def _():
            expert, slot = experts_ref[u], u if per_slot else None
            accs = [_matvec(w, x_refs[x_of[i]], slot, w_refs[i], dict(zip(names, t_refs)), expert, col, width)
                    for i, w in enumerate(weights)]
            out_ref[...] = epilogue(*accs).astype(out_ref.dtype)

    return pl.pallas_call(
        kernel, grid=(d_out // width, u_size),
        out_specs=pl.BlockSpec((None, rows, width), lambda j, u: (u, 0, j)),
        out_shape=jax.ShapeDtypeStruct((u_size, rows, d_out), out_dtype), interpret=interpret,
    )(experts, n_valid, *xs, *(p for w in weights for p in w.planes), *tables)


def _pad_rows(x: jax.Array) -> jax.Array:
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, -x.shape[-2] % MIN_ROWS), (0, 0)])


def moe_matvec_gpu(x, weights, ids, gate, up, down, limit, *, interpret: bool = False) -> jax.Array:
    """Routed experts over QArray banks for a decode step; ``[N, D]`` in x's dtype."""
    dtype, n = x.dtype, x.shape[0]
    plan = expert_plan(ids, weights, gate.shape[0])
    g, u, d = (weight_of(b) for b in (gate, up, down))
    xs, x_of = plane_inputs(_pad_rows(x), [g, u])
    rounded = lambda acc: acc.astype(dtype).astype(F32)      # noqa: E731  (as the dense path rounds)
    h = _project(xs, [g, u], x_of, plan.experts, plan.n_valid,
                 lambda a, b: swiglu(rounded(a), rounded(b), limit), dtype, interpret)
    y = _project([h[..., d.order]], [d], [0], plan.experts, plan.n_valid,
                 lambda acc: acc.astype(dtype), dtype, interpret)[:, :n].astype(F32)
    w = plan.row_weights[..., None]
    return jnp.sum(jnp.where(w != 0, w * y, 0.0), axis=0).astype(dtype)


def linear_matvec_gpu(x: jax.Array, w, out_dtype, *, interpret: bool = False) -> jax.Array:
    """``x [..., in] @ w`` for a 2-D QArray and a few rows; ``[..., out]`` in ``out_dtype``."""
    weight = weight_of(w)
    rows = x.reshape(-1, x.shape[-1])
    one = jnp.ones((1,), jnp.int32)
    y = _project([_pad_rows(rows)[:, weight.order]], [weight], [0], one - 1, one, lambda acc: acc, out_dtype,
                 interpret)
    return y[0, :rows.shape[0]].reshape(*x.shape[:-1], weight.d_out)
