"""Prefill kernels: a grouped GEMM over expert-sorted row blocks of quantized experts.

:func:`ragged_plan` sorts the ``N * k`` (token, expert) slots by expert into blocks of ``bm`` rows,
each block holding rows of one expert only (an expert's last block is padded with rows of weight 0;
blocks past the used ones repeat the last expert and are skipped). The static block count is
``ceil(N k / bm) + min(E, N k)``. The kernels walk the grid (output tile ``j``, row block ``b``):
the block's expert's planes for output block ``j`` (up to the whole output axis: ``zoo.kernels.tpu.
block_lanes``, bounded by the decoded column's VMEM) come in over the whole input axis (the
scalar-prefetched block experts choose them in the ``index_map``; consecutive blocks of one expert
keep the same block index, so nothing is re-read), are decoded, 128 lanes at a time, into a VMEM
scratch column **once, when the block's expert changes**, and every block of that expert is one
``jnp.dot`` (f32 accumulation) on the matrix unit.

    moe_grouped(x [N, D], weights [N, k], ids [N, k], gate, up, down, limit) -> [N, D]
        1. gate and up, SwiGLU with its clamp in the kernel      -> h     [rows, I] (sorted rows)
        2. down, times each row's routing weight, and each row added to its token's row in the
           kernel (the output tile stays in VMEM over the row blocks)  -> y [N, D] float32
    linear_grouped(x [..., in], w, out_dtype) -> [..., out]     a 2-D QArray: one expert, all rows

``reference_moe`` (jnp: the banks decoded by the same tile decoders, then ``dense_moe``) is the CPU
path and the kernels' oracle; for a matrix the reference is ``zoo.kernels.dequant_matvec``'s.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from zoo.kernels.census import record
from zoo.kernels.dequant_matvec import decode_bank, reference_linear
from zoo.kernels.operands import Weight, plane_inputs, split_refs
from zoo.kernels.tiles import n_tiles
from zoo.kernels.tpu import (
    LANES,
    block_lanes,
    block_specs,
    compiler_params,
    decode_chunk,
    lane_bytes,
    spec_bytes,
    staged,
    staging,
    sub_tiles,
    table_operands,
)
from zoo.ops.activation import swiglu
from zoo.ops.matmul import decode_after, precision_for
from zoo.ops.moe import dense_moe

F32 = jnp.float32
OUT_TILE = 16 << 20          # bytes of a combining kernel's output tile, resident in VMEM (double-buffered)

__all__ = ["RaggedPlan", "ragged_plan", "moe_grouped", "linear_grouped", "reference_moe", "reference_linear"]


class RaggedPlan(NamedTuple):
    """``block_expert`` int32 [NB] (padding blocks repeat the last used expert), ``n_used`` int32
    [1], ``row_token`` int32 [NB * bm] (the token of each sorted row; 0 for padding rows),
    ``row_weight`` float32 [NB * bm] (0 for padding rows, which are the last rows of their block)."""

    block_expert: jax.Array
    n_used: jax.Array
    row_token: jax.Array
    row_weight: jax.Array


def n_blocks(n_slots: int, n_experts: int, block_rows: int) -> int:
    """Static upper bound on the blocks a plan of ``n_slots`` slots uses."""
    return -(-n_slots // block_rows) + min(n_experts, n_slots)


def ragged_plan(ids: jax.Array, weights: jax.Array, n_experts: int, block_rows: int) -> RaggedPlan:
    """Sort the slots of ``ids [N, k]`` by expert into blocks of ``block_rows`` rows (on device).
    A slot with weight 0 gets no row."""
    n, k = ids.shape
    live = weights.reshape(-1) != 0
    flat = jnp.where(live, ids.reshape(-1).astype(jnp.int32), n_experts)     # dead slots: group E, last
    order = jnp.argsort(flat, stable=True)
    sorted_ids = flat[order]
    counts = jnp.bincount(flat, length=n_experts)                            # group E is dropped
    blocks = -(-counts // block_rows)
    block_end = jnp.cumsum(blocks)
    group_start = jnp.cumsum(counts) - counts
    expert = jnp.minimum(sorted_ids, n_experts - 1)
    rank = jnp.arange(n * k) - group_start[expert]
    nb = n_blocks(n * k, n_experts, block_rows)
    rows = nb * block_rows
    row = jnp.where(sorted_ids < n_experts, (block_end - blocks)[expert] * block_rows + rank, rows)
    used = block_end[-1]
    which = jnp.minimum(jnp.searchsorted(block_end, jnp.arange(nb), side="right"), n_experts - 1)
    last = which[jnp.maximum(used - 1, 0)]
    block_expert = jnp.where(jnp.arange(nb) < used, which, jnp.where(used > 0, last, 0)).astype(jnp.int32)
    return RaggedPlan(
        block_expert, used.reshape(1).astype(jnp.int32),
        jnp.zeros(rows, jnp.int32).at[row].set(order // k, mode="drop"),
        jnp.zeros(rows, F32).at[row].set(weights.reshape(-1).astype(F32)[order], mode="drop"))


def used_block(b, n_used):
    """The block whose tiles a grid step uses: blocks past the used ones reuse the last used one's."""
    return jnp.maximum(jnp.minimum(b, n_used[0] - 1), 0)


def expert_block(j, b, block_expert, n_used, *_):
    """Block index of a bank's planes at grid step (output tile ``j``, row block ``b``)."""
    return block_expert[used_block(b, n_used)], 0, j


# --- Pallas (TPU) ------------------------------------------------------------------------------


class Combine(NamedTuple):
    """Sum the output rows into their tokens in the kernel: ``row_token`` int32 [rows] (each sorted
    row's token), ``block_live`` int32 [NB] (the rows of each block that hold a slot: a block's
    padding rows are its last ones), ``n_tokens``; the output is then float32 ``[n_tokens, out]``."""

    row_token: jax.Array
    block_live: jax.Array
    n_tokens: int


def _grouped(xs: list[jax.Array], weights: list[Weight], x_of: list[int], block_expert, n_used,
             block_rows: int, epilogue: Callable, out_dtype, row_weight: jax.Array | None,
             interpret: bool, kernel_name: str = "grouped", combine: Combine | None = None) -> jax.Array:
    """``epilogue(xs[x_of[i]][block] @ W_i[block expert] for i [, row weights]) -> [rows, out]``;
    with ``combine``, each row of it added to its token's row instead -> float32 ``[n_tokens, out]``:
    the output tile stays in VMEM over every row block (zeroed at the first), and a block's live
    rows are added one by one (a dynamic row of VMEM each)."""
    rows, d_out, n_b = xs[0].shape[0], weights[0].d_out, block_expert.shape[0]
    dtype = xs[0].dtype
    column_bytes = sum(w.order.size for w in weights) * jnp.dtype(dtype).itemsize      # decoded, per lane
    lanes = block_lanes(d_out, weights, per_lane=max(lane_bytes(weights), column_bytes))
    if combine is not None:                               # the resident output tile: OUT_TILE bytes at most
        lanes = min(lanes, block_lanes(d_out, weights, OUT_TILE, per_lane=combine.n_tokens * 4))
    names, tables, table_specs = table_operands(weights)
    row_block = lambda j, b, e, nu, *_: (used_block(b, nu), 0)          # noqa: E731
    x_specs = [pl.BlockSpec((block_rows, x.shape[1]), row_block) for x in xs]
    extra = [] if row_weight is None else [row_weight]
    extra_specs = [pl.BlockSpec((block_rows, 1), row_block) for _ in extra]
    w_specs = [s for w in weights for s in block_specs(w, expert_block, lanes)]
    stage = staging(weights, lanes)
    n_planes = [len(w.planes) for w in weights]
    summed = [] if combine is None else [pltpu.VMEM((block_rows, lanes), F32)]
    counts = [len(xs), len(extra), sum(n_planes), len(names), 1, len(weights), len(stage), len(summed)]
    prefetch = [block_expert, n_used] + ([] if combine is None else [combine.row_token, combine.block_live])

    def kernel(block_expert_ref, n_used_ref, *refs):
        if combine is not None:
            (row_token_ref, block_live_ref), refs = refs[:2], refs[2:]
        x_refs, extra_refs, w_refs, t_refs, (out_ref,), columns, stage_refs, summed_refs = split_refs(refs, counts)
        tables_ = dict(zip(names, t_refs))
        b = pl.program_id(1)
        live = b < n_used_ref[0]
        fresh = (b == 0) | (block_expert_ref[b] != block_expert_ref[jnp.maximum(b - 1, 0)])

        @pl.when(live & fresh)
        def _():
            def tile(lane):
                parts = split_refs(staged(w_refs, stage_refs, lane), n_planes)
                for w, refs_, column in zip(weights, parts, columns):
                    kc = w.tiling.chunk_inputs

                    def chunk(q, carry, w=w, refs_=refs_, column=column, kc=kc):
                        column[pl.ds(pl.multiple_of(q * kc, kc), kc), pl.ds(lane, LANES)] = \
                            decode_chunk(w, refs_, tables_, q).astype(dtype)
                        return carry

                    jax.lax.fori_loop(0, w.tiling.n_chunks, chunk, 0)

            sub_tiles(lanes, tile)

        if combine is not None:
            @pl.when(b == 0)
            def _():
                out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

        @pl.when(live)
        def _():
            accs = [jnp.dot(x_refs[x_of[i]][...], columns[i][...], precision=precision_for(dtype),
                            preferred_element_type=F32) for i in range(len(weights))]
            result = epilogue(*accs, *(r[...] for r in extra_refs))
            if combine is None:
                out_ref[...] = result.astype(out_ref.dtype)
                return
            summed_refs[0][...] = result.astype(F32)

            def add_row(r, carry):
                token = row_token_ref[b * block_rows + r]
                out_ref[pl.ds(token, 1), :] += summed_refs[0][pl.ds(r, 1), :]
                return carry

            jax.lax.fori_loop(0, block_live_ref[b], add_row, 0)

    planes = [p for w in weights for p in w.planes]
    if combine is None:
        out_shape = (rows, d_out)
        out_spec = pl.BlockSpec((block_rows, lanes), lambda j, b, e, nu: (used_block(b, nu), j))
    else:
        out_shape, out_dtype = (combine.n_tokens, d_out), F32
        out_spec = pl.BlockSpec((combine.n_tokens, lanes), lambda j, b, *_: (0, j))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch), grid=(n_tiles(d_out, lanes), n_b),
        in_specs=x_specs + extra_specs + w_specs + table_specs, out_specs=out_spec,
        scratch_shapes=[pltpu.VMEM((w.order.size, lanes), dtype) for w in weights] + stage + summed)
    blocks = spec_bytes([*xs, *extra, *planes, *tables], grid_spec.in_specs) + out_spec.block_shape[0] * lanes * 4
    scratch = (column_bytes * lanes + (LANES * lane_bytes(weights) if stage else 0)
               + block_rows * lanes * 4 * len(summed))
    step_bytes = lanes * lane_bytes(weights)
    distinct = min(n_b, weights[0].planes[0].shape[0])                 # an expert's blocks are read once per tile
    record(f"grouped_matmul.{kernel_name}", n_b * n_tiles(d_out, lanes), step_bytes,
           n_tiles(d_out, lanes) * distinct * step_bytes)
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
        compiler_params=compiler_params(blocks, scratch, max(w.tiling.chunk_inputs for w in weights)),
        interpret=interpret,
    )(*prefetch, *xs, *extra, *planes, *tables)


def moe_grouped(x, weights, ids, gate, up, down, limit, *, block_rows: int = 128,
                interpret: bool = False) -> jax.Array:
    """Routed experts over QArray banks for many rows (module docstring); ``[N, D]`` in x's dtype."""
    dtype = x.dtype
    plan = ragged_plan(ids, weights, gate.shape[0], block_rows)
    g, u, d = (Weight.of(b) for b in (gate, up, down))

    def routed(x):
        xs, x_of = plane_inputs(x, [g, u])
        h = _grouped([xi[plan.row_token] for xi in xs], [g, u], x_of, plan.block_expert, plan.n_used, block_rows,
                     lambda a, b: swiglu(a.astype(dtype), b.astype(dtype), limit), dtype, None, interpret,
                     "project")
        weighted = lambda acc, w: jnp.where(w != 0, w * acc.astype(dtype).astype(F32), 0.0)    # noqa: E731
        # the rows of each block that hold a slot: its first ones
        live_rows = (plan.row_weight != 0).reshape(-1, block_rows).sum(axis=1, dtype=jnp.int32)
        y = _grouped([h[:, d.order]], [d], [0], plan.block_expert, plan.n_used, block_rows, weighted, F32,
                     plan.row_weight[:, None], interpret, "down", Combine(plan.row_token, live_rows, x.shape[0]))
        return y.astype(dtype)

    return jax.lax.cond(plan.n_used[0] > 0, routed, jnp.zeros_like, x)   # no slot here: read nothing


def linear_grouped(x: jax.Array, w, out_dtype, *, block_rows: int = 128, interpret: bool = False) -> jax.Array:
    """``x [..., in] @ w`` for a 2-D QArray and many rows; ``[..., out]`` in ``out_dtype``."""
    weight = Weight.of(w)
    rows = x.reshape(-1, x.shape[-1])[:, weight.order]
    n_b = -(-rows.shape[0] // block_rows)
    rows = jnp.pad(rows, ((0, n_b * block_rows - rows.shape[0]), (0, 0)))
    y = _grouped([rows], [weight], [0], jnp.zeros(n_b, jnp.int32), jnp.full((1,), n_b, jnp.int32), block_rows,
                 lambda acc: acc, out_dtype, None, interpret, "linear")
    return y[:np.prod(x.shape[:-1], dtype=int)].reshape(*x.shape[:-1], weight.d_out)


# --- jnp reference -------------------------------------------------------------------------------


def decode_logical(bank) -> jax.Array:
    """A QArray bank decoded by the tile decoders, float32 ``[E, in, out]`` in logical input order."""
    weight, order = decode_bank(bank)
    return weight[:, np.argsort(order)]


def reference_moe(x, weights, ids, gate, up, down, limit) -> jax.Array:
    """jnp twin of :func:`moe_grouped`: every bank decoded once (after ``x`` exists), then ``dense_moe``."""
    x, banks = decode_after(x, (gate, up, down))
    return dense_moe(x, weights, ids, *(decode_logical(b).astype(x.dtype) for b in banks), limit)
