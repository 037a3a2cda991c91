"""Decode kernels (``zoo.kernels.dequant_matvec``, ``dequant_matvec_gpu``) and the tile decoders they
share with the jnp references: bit-exact decoding, kernel (Pallas interpret mode) == jnp reference
== gguf-dequantize-then-float64 within 1e-6, de-duplicated expert reads, and lowering for TPU
(Mosaic) and GPU (Triton, on an abstract H100)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants as gq

from tests.support.kernel_cases import (
    EXPERTS,
    KERNEL_TYPES,
    LIMIT,
    TOP_K,
    activations,
    bank,
    blocks,
    jit_static,
    moe_banks,
    moe_oracle,
    raw_blocks,
    rel_err,
    routings,
    tpu_custom_calls,
    triton_calls,
)
from zoo.formats import planes as P
from zoo.formats.ggml import BLOCK_LAYOUTS, QType
from zoo.kernels import dequant_matvec as mv
from zoo.kernels import dequant_matvec_gpu as mv_gpu
from zoo.kernels import grouped_matmul as gm
from zoo.kernels.tile_decoders import FORMATS
from zoo.kernels.tiles import decode_parts, plane_order, tiling_for
from zoo.quant.qarray import QArray

TOL = 1e-6
ROWS = {t: 1 + i for i, t in enumerate(KERNEL_TYPES)}          # 1..8 rows per step, one count per format


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_tile_decoders_are_bit_exact_with_gguf(qtype):
    """Chunked tilings (even chunks; in_splits parts of an odd block count) decode every weight
    bit-exactly, f16 subnormals included."""
    bs = BLOCK_LAYOUTS[qtype].block_size
    fmt = FORMATS[qtype]
    cases = [(4, 1, 2 * bs), (6, 2, None)]               # two chunks of 2 blocks; two parts of 3 (odd)
    raws = [raw_blocks(qtype, (2,), 5, n, seed=n) for n, _, _ in cases]
    tilings = [tiling_for(qtype, n, splits, max_inputs, lane_aligned=False) for n, splits, max_inputs in cases]
    planes = [{k: jnp.asarray(v) for k, v in P.to_planes(raw, qtype, splits).items()}
              for raw, (_, splits, _) in zip(raws, cases)]
    decoded = jax.jit(lambda ps: [decode_parts(p, fmt, t) for p, t in zip(ps, tilings)])(planes)
    for raw, tiling, ours in zip(raws, tilings, decoded):
        ref = np.swapaxes(gq.dequantize(raw, qtype), -1, -2)[:, plane_order(tiling, fmt.in_block)]
        assert tiling.n_chunks == 2 and np.array_equal(np.asarray(ours).view(np.uint32), ref.view(np.uint32)), tiling


def test_expert_plan_deduplicates_and_pads():
    ids = jnp.asarray([[5, 1], [1, 7], [5, 1]], jnp.int32)
    weights = jnp.asarray([[0.5, 0.25], [0.125, 1.0], [2.0, 4.0]], jnp.float32)
    plan = mv.expert_plan(ids, weights, n_experts=8)
    assert plan.experts.tolist() == [1, 5, 7, 7, 7, 7] and plan.n_valid.tolist() == [3]
    expected = np.zeros((6, 3), np.float32)
    expected[0], expected[1], expected[2] = [0.25, 0.125, 4.0], [0.5, 0, 2.0], [0, 1.0, 0]
    assert np.array_equal(np.asarray(plan.row_weights), expected)
    one = mv.expert_plan(jnp.asarray([[3, 3]]), jnp.ones((1, 2)), n_experts=4)   # padding = the only expert
    assert one.experts.tolist() == [3, 3] and one.n_valid.tolist() == [1]
    # slots with weight 0 (another device's experts in the ep layout) are no slots: expert 0 is not used
    dead = mv.expert_plan(jnp.asarray([[0, 6], [0, 2]]), jnp.asarray([[0.0, 0.5], [0.0, 0.25]]), n_experts=8)
    assert dead.experts.tolist() == [2, 6, 6, 6] and dead.n_valid.tolist() == [2]
    none = mv.expert_plan(jnp.asarray([[0, 0]]), jnp.zeros((1, 2)), n_experts=8)
    assert none.experts.tolist() == [0, 0] and none.n_valid.tolist() == [0] and not np.any(np.asarray(none.row_weights))


def test_deduplication_reads_each_distinct_expert_once():
    """Replaying the kernels' weight ``index_map`` over the grid (each of a step's ``group`` expert
    buffers is DMA'd only when its block index changes): rows sharing experts cost one read per
    distinct expert and output block, however many experts a step takes (a first step with fewer
    valid slots than buffers still fills every buffer: max(distinct, group) reads)."""
    ids = jnp.asarray([[0, 3], [3, 0], [0, 5], [3, 5]], jnp.int32)     # 8 slots, 3 distinct experts
    plan = mv.expert_plan(ids, jnp.ones(ids.shape), n_experts=8)
    tiles, slots = 2, plan.experts.shape[0]

    def reads(plan, group):
        total, seen = 0, set()
        for g in range(group):
            index = mv.weight_block(g, group)
            blocks = [tuple(int(i) for i in index(j, s, plan.experts, plan.n_valid))
                      for j in range(tiles) for s in range(slots // group)]
            total += 1 + sum(a != b for a, b in zip(blocks, blocks[1:]))
            seen |= set(blocks)
        return total, {e for e, _, _ in seen}

    assert slots == 8
    for group in (1, 2, 4, 8):
        assert reads(plan, group) == (tiles * max(3, group), {0, 3, 5}), group
    ep = mv.expert_plan(ids, jnp.where(ids == 0, 0.0, 1.0), n_experts=8)          # expert 0 owned elsewhere
    for group in (1, 2):
        assert reads(ep, group)[1] == {3, 5}


def test_a_step_without_slots_reads_nothing_and_returns_zeros():
    """Every slot owned by another device: the kernels are not run at all (no expert is read)."""
    banks, _ = moe_banks(QType.Q8_0)
    x = jnp.asarray(activations((3, banks[0].shape[1]), seed=1))
    ids, weights = jnp.zeros((3, TOP_K), jnp.int32), jnp.zeros((3, TOP_K), jnp.float32)
    for fn in (functools.partial(mv.moe_matvec, interpret=True), mv.reference_moe,
               functools.partial(gm.moe_grouped, block_rows=8, interpret=True)):
        assert not np.any(np.asarray(jit_static(fn, 6)(x, weights, ids, *banks, LIMIT)))
    jaxpr = str(jax.make_jaxpr(functools.partial(mv.moe_matvec, interpret=False, limit=LIMIT))(
        x, weights, ids, *banks))
    assert "cond" in jaxpr                  # the pallas_calls sit in the branch taken only with slots


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_decode_moe_kernel_matches_reference_and_gguf(qtype):
    """moe_matvec (interpret) == reference_moe == float64 oracle, for rows sharing all experts, rows
    on distinct experts, and a mix (padding slots whenever experts repeat)."""
    banks, dense = moe_banks(qtype)
    rows = ROWS[qtype]
    x = jnp.asarray(activations((rows, banks[0].shape[1]), seed=rows))
    kernel = jit_static(functools.partial(mv.moe_matvec, interpret=True), 6)
    reference = jit_static(mv.reference_moe, 6)
    for ids, weights in routings(rows, TOP_K, EXPERTS, seed=rows):
        oracle = moe_oracle(x, weights, ids, *dense, LIMIT)
        ours = kernel(x, weights, ids, *banks, LIMIT)
        theirs = reference(x, weights, ids, *banks, LIMIT)
        errors = rel_err(ours, oracle), rel_err(theirs, oracle), rel_err(ours, theirs)
        assert max(errors) <= TOL, (ids.tolist(), errors)


@pytest.mark.parametrize("qtype,seed", [(QType.Q8_0, 11), (QType.IQ4_XS, 12), (QType.Q6_K, 13)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_decode_and_grouped_kernels_on_random_shapes(qtype, seed):
    """Random (seeded) widths in whole blocks, expert counts, top-k and rows: the decode kernel, the
    grouped kernel and the jnp reference all equal the float64 oracle."""
    rng = np.random.default_rng(seed)
    bs = BLOCK_LAYOUTS[qtype].block_size
    d, i = int(rng.integers(1, 4)) * 2 * bs, int(rng.integers(1, 4)) * bs
    n_experts, top_k, rows = int(rng.integers(3, 10)), int(rng.integers(1, 4)), int(rng.integers(1, 9))
    made = [bank(qtype, n_experts, d, i, seed + 1, in_splits=2), bank(qtype, n_experts, d, i, seed + 2, in_splits=2),
            bank(qtype, n_experts, i, d, seed + 3)]
    banks, dense = [q for q, _ in made], [w for _, w in made]
    x = jnp.asarray(activations((rows, d), seed=seed))
    ids = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(rows)]).astype(np.int32)
    weights = rng.random((rows, top_k)).astype(np.float32)
    oracle = moe_oracle(x, weights, ids, *dense, LIMIT)
    for fn in (functools.partial(mv.moe_matvec, interpret=True), mv.reference_moe,
               functools.partial(gm.moe_grouped, block_rows=8, interpret=True)):
        err = rel_err(jit_static(fn, 6)(x, weights, ids, *banks, LIMIT), oracle)
        assert err <= TOL, ((d, i, n_experts, top_k, rows), fn, err)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.IQ2_S], ids=lambda t: t.name)
def test_decode_linear_kernel_matches_reference_and_gguf(qtype):
    """linear_matvec (interpret) on a 2-D QArray with a head-permuted input (``in_order``)."""
    bs = BLOCK_LAYOUTS[qtype].block_size
    d_in, d_out = 4 * bs, 96
    raw = blocks(qtype, (), d_out, d_in // bs, seed=7)
    view, axes = (2, 2, d_in // 4), (1, 0, 2)
    w = QArray.from_blocks(raw, qtype, in_order=(view, axes))
    dense = np.asarray(w.dequantize(), np.float64)
    x = activations((2, 3, d_in), seed=0)
    ours = jit_static(functools.partial(mv.linear_matvec, interpret=True), 2)(x, w, jnp.float32)
    theirs = jit_static(mv.reference_linear, 2)(x, w, jnp.float32)
    oracle = x.astype(np.float64) @ dense
    assert ours.shape == (2, 3, d_out)
    assert max(rel_err(ours, oracle), rel_err(theirs, oracle), rel_err(ours, theirs)) <= TOL


def test_bfloat16_activations_on_the_cpu_paths():
    """The default model dtype through the jnp twins (what CPU runs), within bf16 rounding."""
    banks, dense = moe_banks(QType.IQ4_XS)
    x = jnp.asarray(activations((5, banks[0].shape[1]), seed=1), jnp.bfloat16)
    ids, weights = routings(5, TOP_K, EXPERTS, seed=3)[2]
    oracle = moe_oracle(np.asarray(x, np.float32), weights, ids, *dense, LIMIT)
    ours = jax.jit(mv.reference_moe, static_argnums=6)(x, weights, ids, *banks, LIMIT)
    assert ours.dtype == jnp.bfloat16 and rel_err(np.asarray(ours, np.float32), oracle) <= 1e-2
    w, dense_w = bank(QType.Q6_K, 0, 512, 128, seed=3)
    out = jax.jit(mv.reference_linear, static_argnums=2)(x, w, jnp.float32)
    assert out.dtype == jnp.float32 and rel_err(out, np.asarray(x, np.float64) @ dense_w) <= 1e-2


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_decode_kernels_lower_for_tpu(qtype):
    """The Mosaic lowering for a v5e (block shapes, dtypes, scalar prefetch, lane gathers), no TPU needed."""
    banks, _ = moe_banks(qtype)
    x = jnp.zeros((3, banks[0].shape[1]), jnp.bfloat16)
    ids, weights = jnp.zeros((3, TOP_K), jnp.int32), jnp.ones((3, TOP_K), jnp.float32)
    assert tpu_custom_calls(jit_static(mv.moe_matvec, 6), x, weights, ids, *banks, LIMIT) == 2


def test_linear_decode_kernel_lowers_for_tpu():
    w, _ = bank(QType.IQ4_XS, 0, 512, 96, seed=3)
    assert tpu_custom_calls(jit_static(mv.linear_matvec, 2), jnp.zeros((4, 512), jnp.bfloat16), w, jnp.bfloat16) == 1


# --- GPU (Triton) variant ------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_gpu_decode_kernel_lowers_for_cuda(qtype):
    """moe_matvec_gpu lowers to two Triton calls for an (abstract) H100."""
    banks, _ = moe_banks(qtype)
    assert mv_gpu.supported(*banks) == (qtype not in mv_gpu.NOT_ON_GPU)
    x = jnp.zeros((3, banks[0].shape[1]), jnp.bfloat16)
    ids, weights = jnp.zeros((3, TOP_K), jnp.int32), jnp.ones((3, TOP_K), jnp.float32)
    assert triton_calls(jit_static(mv_gpu.moe_matvec_gpu, 6), x, weights, ids, *banks, LIMIT) == 2


@pytest.mark.parametrize("qtype", [QType.Q3_K, QType.IQ2_S, QType.IQ3_S], ids=lambda t: t.name)
def test_gpu_decode_kernel_matches_gguf(qtype):
    """moe_matvec_gpu in interpret mode == float64 oracle on a mixed routing (strided, three-word and
    codebook reads among these formats; the decoders themselves are shared with the TPU kernels)."""
    banks, dense = moe_banks(qtype, seed=10)
    rows = ROWS[qtype]
    x = jnp.asarray(activations((rows, banks[0].shape[1]), seed=1))
    ids, weights = routings(rows, TOP_K, EXPERTS, seed=rows)[2]
    ours = jit_static(functools.partial(mv_gpu.moe_matvec_gpu, interpret=True), 6)(x, weights, ids, *banks, LIMIT)
    assert rel_err(ours, moe_oracle(x, weights, ids, *dense, LIMIT)) <= TOL


def test_gpu_linear_kernel_and_unsupported_shapes():
    w, dense = bank(QType.Q8_0, 0, 256, 48, seed=4)
    x = activations((3, 256), seed=2)
    ours = jit_static(functools.partial(mv_gpu.linear_matvec_gpu, interpret=True), 2)(x, w, jnp.float32)
    assert rel_err(ours, x.astype(np.float64) @ dense) <= TOL
    odd, _ = bank(QType.Q8_0, 0, 96, 12, seed=5)          # 12 outputs: no tile of 16..128 columns
    assert not mv_gpu.supported(odd)


def _abstract_bank(qtype: QType, n_experts: int, d_in: int, d_out: int) -> QArray:
    """A QArray bank of ShapeDtypeStructs (for tracing at full size without the bytes)."""
    shapes = P.plane_shapes(qtype, (n_experts,), d_out, d_in // BLOCK_LAYOUTS[qtype].block_size, 1)
    return QArray({n: jax.ShapeDtypeStruct(s, jnp.uint32) for n, s in shapes.items()}, qtype, (n_experts, d_in, d_out))


@pytest.mark.parametrize("rows", [1, 12])
def test_grid_step_overhead_cannot_dominate_at_full_size(rows):
    """GLM-5.3-Flash's routed experts as one v5e chip holds them in the "tp" layout (gate/up IQ2_S
    [288, 4096, 256], down IQ3_S [288, 256, 4096]), for one decode row and for 3 rows x 4 verify
    tokens: the kernels bring in every distinct slot's planes exactly once, in at most a few steps,
    and ``steps x 0.35 us + bytes / 819 GB/s`` stays within 1.5x of the bytes' time (the kernels
    took 2 + 32 steps of 128 output lanes per expert before: 272 steps for one row)."""
    from zoo.kernels.census import kernel_census
    from zoo.tools.roofline import HBM_BANDWIDTH, STEP_OVERHEAD_S

    experts, hidden, width = 288, 4096, 256
    banks = (_abstract_bank(QType.IQ2_S, experts, hidden, width), _abstract_bank(QType.IQ2_S, experts, hidden, width),
             _abstract_bank(QType.IQ3_S, experts, width, hidden))
    x = jax.ShapeDtypeStruct((rows, hidden), jnp.bfloat16)
    ids, weights = jax.ShapeDtypeStruct((rows, 8), jnp.int32), jax.ShapeDtypeStruct((rows, 8), jnp.float32)
    with kernel_census() as calls:
        jax.eval_shape(functools.partial(mv.moe_matvec, limit=10.0), x, weights, ids, *banks)
    slots = min(experts, rows * 8)
    per_expert = sum(b.nbytes for b in banks) // experts
    steps, moved = sum(c.steps for c in calls), sum(c.weight_bytes for c in calls)
    assert [c.kernel for c in calls] == ["dequant_matvec.project", "dequant_matvec.down"]
    assert moved == slots * per_expert
    assert steps <= 2 * slots and all(c.step_bytes >= 400_000 for c in calls)
    floor = moved / HBM_BANDWIDTH["v5e"]
    assert steps * STEP_OVERHEAD_S + floor <= 1.5 * floor, (steps, moved)


def test_prefill_kernels_take_whole_output_blocks_at_full_size():
    """The grouped GEMM at the same full-size "tp" shapes, a 512-token chunk: one output block per
    row block (the whole 256 / 4096 output columns), each expert's planes read once."""
    from zoo.kernels.census import kernel_census

    experts, hidden, width, tokens, bm = 288, 4096, 256, 512, 16
    banks = (_abstract_bank(QType.IQ2_S, experts, hidden, width), _abstract_bank(QType.IQ2_S, experts, hidden, width),
             _abstract_bank(QType.IQ3_S, experts, width, hidden))
    x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)
    ids, weights = jax.ShapeDtypeStruct((tokens, 8), jnp.int32), jax.ShapeDtypeStruct((tokens, 8), jnp.float32)
    with kernel_census() as calls:
        jax.eval_shape(functools.partial(gm.moe_grouped, limit=10.0, block_rows=bm), x, weights, ids, *banks)
    n_b = gm.n_blocks(tokens * 8, experts, bm)
    assert [c.kernel for c in calls] == ["grouped_matmul.project", "grouped_matmul.down"]
    assert [c.steps for c in calls] == [n_b, n_b]
    assert sum(c.weight_bytes for c in calls) == sum(b.nbytes for b in banks)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_kernel_chunks_start_on_a_lane_boundary(qtype):
    """Every kernel tiling (any block count and split) cuts the activations at multiples of 128
    inputs, or not at all, wherever its parts allow: Mosaic rejects a dynamic lane offset it cannot
    prove aligned (Qwen's 2176-input MLP shard in Q8_0 was cut into chunks of 1088)."""
    bs = BLOCK_LAYOUTS[qtype].block_size
    for n_blocks in range(1, 161):
        for splits in (1, 2, 4, 8):
            if n_blocks % splits or (splits > 1 and (n_blocks // splits * bs) % 128):
                continue                  # parts off the lane grid: the kernel unrolls their chunks
            t = tiling_for(qtype, n_blocks, splits)
            assert t is not None and (t.n_chunks == 1 or t.chunk_inputs % 128 == 0), (n_blocks, splits, t)
            assert t.chunk_inputs <= max(4 * 2048, bs * t.part)          # one chunk per part at most
