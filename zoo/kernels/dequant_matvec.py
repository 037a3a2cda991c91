"""Decode-step kernels: dequantization fused into the matvec, experts de-duplicated across rows.

A decode step has a few rows (streams of a batch, or the k+1 tokens of a speculative verify), each
routed to ``top_k`` experts. :func:`expert_plan` turns the routing into the step's *distinct*
experts (sorted, padded to a static ``U = min(rows * top_k, E)`` by repeating the last one) and a
``[U, rows]`` matrix of routing weights (0 where a row does not use the expert, and for padding).
A slot with routing weight 0 is no slot: its expert is not read (the expert-parallel layout routes
slots owned by another device that way); a step without any slot reads nothing and returns zeros.
The kernels then walk a grid of (output block, step): a step takes ``group`` distinct experts
and a block of up to the whole output axis of each (``zoo.kernels.tpu.block_lanes`` /
``experts_per_step``: ~1 MiB of planes per step, so the fixed cost of a grid step cannot dominate
its bytes); the experts' planes are DMA'd once (scalar-prefetched expert ids select them in the
``index_map``; steps past the valid slots map to the blocks already resident, so they move nothing,
and skip compute), decoded chunk by chunk and 128 output lanes at a time in VMEM
(``zoo.kernels.tpu``) and applied to *every* row of the step, so an expert shared by several rows
is read and decoded once.

    moe_matvec(x [N, D], weights [N, k], ids [N, k], gate, up, down, limit) -> [N, D]
        gate/up QArray banks [E, D, I], down [E, I, D]; two pallas_calls:
        1. gate and up of each distinct expert, SwiGLU (with its clamp) -> h [U, N, I]
        2. down of each distinct expert, times the routing weight, summed over experts -> [N, D]
    linear_matvec(x [..., in], w, out_dtype) -> [..., out]    a 2-D QArray (one "expert")

Activations enter in each weight's plane order (``zoo.kernels.tiles``: a static permutation of the
features, applied once in jnp). ``reference_moe`` / ``reference_linear`` compute the same thing in
jnp with the same tile decoders (direct gathers instead of lane gathers): the CPU fast path, and the
oracle the kernels are tested against. Rounding follows ``zoo.ops.moe.dense_moe``: projections
accumulate in float32 and are cast to the activation dtype, SwiGLU runs in that dtype, the weighted
sum over experts in float32.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from zoo.kernels.census import record
from zoo.kernels.operands import Weight, plane_inputs, split_refs
from zoo.kernels.tile_decoders import format_of
from zoo.kernels.tiles import decode_parts, input_order, n_tiles, tiling_for
from zoo.kernels.tpu import (
    LANES,
    block_lanes,
    block_specs,
    compiler_params,
    experts_per_step,
    lane_bytes,
    matvec,
    spec_bytes,
    staged,
    staging,
    sub_tiles,
    table_operands,
)
from zoo.ops.activation import swiglu
from zoo.ops.matmul import decode_after, dense_matmul, precision_for

F32 = jnp.float32


class ExpertPlan(NamedTuple):
    """The distinct experts of a step: ``experts`` int32 [U] (sorted; slots from ``n_valid`` on
    repeat the last, or are 0 when there is none), ``n_valid`` int32 [1] (0..U), ``row_weights``
    float32 [U, N] (0: not routed / padding)."""

    experts: jax.Array
    n_valid: jax.Array
    row_weights: jax.Array


def expert_plan(ids: jax.Array, weights: jax.Array, n_experts: int) -> ExpertPlan:
    """De-duplicate the experts of ``ids [N, k]`` (on device, static size ``min(N * k, E)``);
    slots with weight 0 are left out."""
    n, k = ids.shape
    size = min(n * k, n_experts)
    live = weights.reshape(-1) != 0
    flat = jnp.sort(jnp.where(live, ids.reshape(-1).astype(jnp.int32), n_experts))    # dead slots sort last
    first = jnp.concatenate([jnp.ones((1,), bool), flat[1:] != flat[:-1]]) & (flat < n_experts)
    slot = jnp.cumsum(first) - 1
    n_valid = jnp.sum(first, dtype=jnp.int32)
    n_live = jnp.sum(live, dtype=jnp.int32)
    fill = jnp.where(n_live > 0, flat[jnp.maximum(n_live - 1, 0)], 0)      # the last live expert, else 0
    experts = jnp.full((size,), fill).at[jnp.where(first, slot, size)].set(flat, mode="drop")
    hits = (ids[None] == experts[:, None, None]) & (jnp.arange(size) < n_valid)[:, None, None]
    row_weights = jnp.sum(jnp.where(hits, weights[None].astype(F32), 0.0), axis=-1)
    return ExpertPlan(experts, n_valid.reshape(1), row_weights)


def valid_slot(u, n_valid):
    """The slot whose blocks a grid step uses: padding slots reuse the last valid one's."""
    return jnp.maximum(jnp.minimum(u, n_valid[0] - 1), 0)


def valid_step(s, n_valid, group: int):
    """The step whose blocks grid step ``s`` uses: steps past the valid slots reuse the last one's."""
    return jnp.maximum(jnp.minimum(s, (n_valid[0] - 1) // group), 0)


def weight_block(g: int, group: int):
    """Block index map of a bank's planes for the ``g``-th expert of a step of ``group`` experts:
    at grid step (output block ``j``, step ``s``), slot ``s * group + g``'s expert (steps past the
    valid slots keep the last valid step's blocks, and a slot past the valid ones in a step keeps
    the block its buffer already holds, so neither moves anything)."""
    def index(j, s, experts, n_valid):
        slot = valid_step(s, n_valid, group) * group + g
        held = jnp.where(slot >= group, slot - group, n_valid[0] - 1)
        return experts[jnp.maximum(jnp.where(slot < n_valid[0], slot, held), 0)], 0, j
    return index


def _combine(row_weights: jax.Array, y: jax.Array) -> jax.Array:
    """``row_weights * y`` where routed, 0 elsewhere (never ``0 * garbage``)."""
    return jnp.where(row_weights != 0, row_weights * y, 0.0)


# --- Pallas (TPU) ------------------------------------------------------------------------------
# Grid (output block j, step s): step s takes ``group`` distinct experts (slots s*group .. +group-1)
# and a block of ``lanes`` output columns of each, and walks the block's 128-lane sub-tiles itself
# (``zoo.kernels.tpu``: STEP_BYTES, MAX_BLOCK), so a step moves ~1 MiB, not a few KiB.


def _project(xs: list[jax.Array], weights: list[Weight], x_of: list[int], experts, n_valid,
             epilogue: Callable, out_dtype, group: int, interpret: bool) -> jax.Array:
    """``epilogue(xs[x_of[i]] @ W_i[e] for i) -> [U, rows, out]`` for each distinct expert ``e``."""
    u_size, rows, d_out = experts.shape[0], xs[0].shape[0], weights[0].d_out
    lanes = block_lanes(d_out, weights)
    names, tables, table_specs = table_operands(weights)
    x_specs = [pl.BlockSpec((rows, x.shape[1]), lambda j, s, e, nv: (0, 0)) for x in xs]
    w_specs = [spec for g in range(group) for w in weights for spec in block_specs(w, weight_block(g, group), lanes)]
    scratch = staging(weights, lanes)
    n_planes = [len(w.planes) for w in weights]
    counts = [len(xs)] + n_planes * group + [len(names), 1, len(scratch)]

    def kernel(experts_ref, n_valid_ref, *refs):
        x_refs, *w_refs, t_refs, (out_ref,), stage = split_refs(refs, counts)
        tables_ = dict(zip(names, t_refs))
        for g in range(group):
            refs_g = [r for refs_ in w_refs[g * len(weights):(g + 1) * len(weights)] for r in refs_]

            @pl.when(pl.program_id(1) * group + g < n_valid_ref[0])
            def _(g=g, refs_g=refs_g):
                def tile(lane):
                    parts = split_refs(staged(refs_g, stage, lane), n_planes)
                    accs = [matvec(w, x_refs[x_of[i]], parts[i], tables_) for i, w in enumerate(weights)]
                    out_ref[g, :, pl.ds(lane, LANES)] = epilogue(*accs).astype(out_ref.dtype)

                sub_tiles(lanes, tile)

    planes = [p for w in weights for p in w.planes]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(n_tiles(d_out, lanes), u_size // group),
        in_specs=x_specs + w_specs + table_specs,
        out_specs=pl.BlockSpec((group, rows, lanes), lambda j, s, e, nv: (valid_step(s, nv, group), 0, j)),
        scratch_shapes=scratch)
    blocks = spec_bytes([*xs, *planes * group, *tables], grid_spec.in_specs) + group * rows * lanes * 4
    _record("project", weights, lanes, group, grid_spec.grid)
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((u_size, rows, d_out), out_dtype),
        compiler_params=compiler_params(blocks, LANES * lane_bytes(weights) if scratch else 0,
                                        max(w.tiling.chunk_inputs for w in weights)),
        interpret=interpret,
    )(experts, n_valid, *xs, *planes * group, *tables)


def _down(h: jax.Array, row_weights: jax.Array, down: Weight, experts, n_valid, dtype, group: int,
          interpret: bool) -> jax.Array:
    """``sum_u row_weights[u] * (h[u] @ down[e_u])`` -> float32 [rows, out]; ``h [U, rows, in]``
    in the bank's plane order, ``row_weights [U, rows, 1]``."""
    u_size, rows, d_in = h.shape
    lanes = block_lanes(down.d_out, [down])
    names, tables, table_specs = table_operands([down])
    step_block = lambda j, s, e, nv: (valid_step(s, nv, group), 0, 0)       # noqa: E731
    n_planes = len(down.planes)
    scratch = staging([down], lanes)
    counts = [1, 1, n_planes * group, len(names), 1, len(scratch)]

    def kernel(experts_ref, n_valid_ref, *refs):
        (h_ref,), (w_ref,), w_refs, t_refs, (out_ref,), stage = split_refs(refs, counts)
        tables_ = dict(zip(names, t_refs))
        s = pl.program_id(1)

        @pl.when(s == 0)
        def _():
            out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

        for g in range(group):
            refs_g = w_refs[g * n_planes:(g + 1) * n_planes]

            @pl.when(s * group + g < n_valid_ref[0])
            def _(g=g, refs_g=refs_g):
                def tile(lane):
                    y = matvec(down, h_ref.at[g], staged(refs_g, stage, lane), tables_).astype(dtype).astype(F32)
                    out_ref[:, pl.ds(lane, LANES)] += _combine(w_ref[g], y)

                sub_tiles(lanes, tile)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(n_tiles(down.d_out, lanes), u_size // group),
        in_specs=[pl.BlockSpec((group, rows, d_in), step_block), pl.BlockSpec((group, rows, 1), step_block),
                  *[spec for g in range(group) for spec in block_specs(down, weight_block(g, group), lanes)],
                  *table_specs],
        out_specs=pl.BlockSpec((rows, lanes), lambda j, s, e, nv: (0, j)), scratch_shapes=scratch)
    blocks = spec_bytes([h, row_weights, *down.planes * group, *tables], grid_spec.in_specs) + rows * lanes * 4
    _record("down", [down], lanes, group, grid_spec.grid)
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((rows, down.d_out), F32),
        compiler_params=compiler_params(blocks, LANES * lane_bytes([down]) if scratch else 0,
                                        down.tiling.chunk_inputs),
        interpret=interpret,
    )(experts, n_valid, h, row_weights, *down.planes * group, *tables)


def _record(kernel: str, weights: list[Weight], lanes: int, group: int, grid: tuple[int, int]) -> None:
    """Census entry: grid steps, the weight bytes a step brings in, and all the call moves."""
    step_bytes = group * lanes * lane_bytes(weights)
    record(f"dequant_matvec.{kernel}", grid[0] * grid[1], step_bytes, grid[0] * grid[1] * step_bytes)


def _group(n_slots: int, weights: list[Weight], d_out: int) -> int:
    """Experts per step for ``weights`` (``zoo.kernels.tpu.experts_per_step``)."""
    return experts_per_step(n_slots, block_lanes(d_out, weights) * lane_bytes(weights))


def moe_matvec(x, weights, ids, gate, up, down, limit, *, interpret: bool = False) -> jax.Array:
    """Routed experts over QArray banks for a decode step (module docstring); ``[N, D]`` in x's dtype."""
    dtype = x.dtype
    plan = expert_plan(ids, weights, gate.shape[0])
    g, u, d = (Weight.of(b) for b in (gate, up, down))

    n_slots = plan.experts.shape[0]

    def routed(x):
        xs, x_of = plane_inputs(x, [g, u])
        h = _project(xs, [g, u], x_of, plan.experts, plan.n_valid,
                     lambda a, b: swiglu(a.astype(dtype), b.astype(dtype), limit), dtype,
                     _group(n_slots, [g, u], g.d_out), interpret)
        y = _down(h[..., d.order], plan.row_weights[..., None], d, plan.experts, plan.n_valid, dtype,
                  _group(n_slots, [d], d.d_out), interpret)
        return y.astype(dtype)

    return jax.lax.cond(plan.n_valid[0] > 0, routed, jnp.zeros_like, x)   # no slot here: read nothing


def linear_matvec(x: jax.Array, w, out_dtype, *, interpret: bool = False) -> jax.Array:
    """``x [..., in] @ w`` for a 2-D QArray and a few rows; ``[..., out]`` in ``out_dtype``."""
    weight = Weight.of(w)
    rows = x.reshape(-1, x.shape[-1])
    one = jnp.ones((1,), jnp.int32)
    y = _project([rows[:, weight.order]], [weight], [0], one - 1, one, lambda acc: acc, out_dtype, 1, interpret)
    return y[0].reshape(*x.shape[:-1], weight.d_out)


# --- jnp reference -------------------------------------------------------------------------------


def decode_bank(q, experts: jax.Array | None = None):
    """QArray ``q`` (or its experts ``experts``) decoded in plane order, ``float32 [U, in, out]``
    (``[1, in, out]`` for a matrix), and the activation order that goes with it."""
    fmt = format_of(q.qtype)
    tiling = tiling_for(q.qtype, q.n_blocks, q.in_splits, None)
    planes = {n: p if q.ndim == 3 else p[None] for n, p in q.planes.items()}
    if experts is not None:
        planes = {n: p[experts] for n, p in planes.items()}
    return decode_parts(planes, fmt, tiling), input_order(tiling, fmt.in_block, q.in_order)


def reference_linear(x: jax.Array, w, out_dtype) -> jax.Array:
    """jnp twin of :func:`linear_matvec`. (The barrier keeps XLA:CPU from fusing the permutation
    into a bf16 x bf16 -> f32 dot, which its dot thunk does not implement. The decode waits for ``x``:
    ``decode_after``.)"""
    x, w = decode_after(x, w)
    weight, order = decode_bank(w)
    return dense_matmul(jax.lax.optimization_barrier(x[..., order]), weight[0], out_dtype)


def reference_moe(x, weights, ids, gate, up, down, limit) -> jax.Array:
    """jnp twin of :func:`moe_matvec`: decodes only the step's distinct experts (after ``x`` exists)."""
    x, (gate, up, down) = decode_after(x, (gate, up, down))
    dtype, precision = x.dtype, precision_for(x.dtype)
    plan = expert_plan(ids, weights, gate.shape[0])

    def project(rows, bank):                      # rows [N, in] or [U, N, in] -> [U, N, out]
        weight, order = decode_bank(bank, plan.experts)
        rows = jnp.broadcast_to(rows[..., order], (weight.shape[0], *rows.shape[-2:]))   # a batched matmul
        return jnp.einsum("unk,ukm->unm", rows, weight.astype(dtype), precision=precision,
                          preferred_element_type=F32).astype(dtype)

    h = swiglu(project(x, gate), project(x, up), limit)
    y = project(h, down).astype(F32)
    return jnp.sum(_combine(plan.row_weights[..., None], y), axis=0).astype(dtype)
