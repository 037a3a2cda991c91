"""Prefill kernels (``zoo.kernels.grouped_matmul``): the ragged plan, grouped GEMM (Pallas interpret
mode) == jnp references == gguf-dequantize-then-float64 within 1e-6 for every format, and the
Mosaic lowering for a TPU v5e."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.kernel_cases import (
    EXPERTS,
    KERNEL_TYPES,
    LIMIT,
    TOP_K,
    activations,
    bank,
    jit_static,
    moe_banks,
    moe_oracle,
    rel_err,
    tpu_custom_calls,
)
from zoo.formats.ggml import QType
from zoo.kernels import dequant_matvec as mv
from zoo.kernels import grouped_matmul as gm

TOL = 1e-6
BLOCK_ROWS = 8


def test_ragged_plan_sorts_slots_into_single_expert_blocks():
    ids = jnp.asarray([[2, 0], [2, 1], [0, 2], [2, 3], [2, 1]], jnp.int32)
    weights = jnp.arange(1, 11, dtype=jnp.float32).reshape(5, 2)
    plan = gm.ragged_plan(ids, weights, n_experts=4, block_rows=2)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=4)                  # [2, 2, 5, 1]
    n_used = int(sum(-(-c // 2) for c in counts))
    assert plan.n_used.tolist() == [n_used] and plan.block_expert.shape == (5 + 4,)
    assert plan.block_expert.tolist() == [0, 1, 2, 2, 2, 3, 3, 3, 3]            # padding repeats the last
    assert live_rows(plan, 2) == slots(ids, weights)        # every slot has its own row, in its expert's blocks
    # weight-0 slots (other devices' experts in the ep layout) get no row and no block
    dead = np.asarray(weights).copy()
    dead[np.asarray(ids) == 2] = 0
    plan = gm.ragged_plan(ids, jnp.asarray(dead), n_experts=4, block_rows=2)
    assert plan.n_used.tolist() == [3] and plan.block_expert.tolist()[:3] == [0, 1, 3]
    assert live_rows(plan, 2) == slots(ids, dead) and not np.asarray(plan.row_weight)[3 * 2:].any()


def slots(ids, weights) -> list[tuple]:
    """(token, weight, expert) of every slot with a weight."""
    ids, weights = np.asarray(ids), np.asarray(weights)
    return sorted((t, float(weights[t, k]), int(ids[t, k])) for t, k in np.ndindex(ids.shape) if weights[t, k])


def live_rows(plan, block_rows: int) -> list[tuple]:
    """(token, weight, block expert) of every row with a weight; checks that they are the first rows
    of their block (the combining kernel adds a block's first ``live`` rows only)."""
    weight = np.asarray(plan.row_weight).reshape(-1, block_rows)
    live = weight != 0
    assert np.all(live[:, 1:] <= live[:, :-1]), "a padding row before a live row"
    rows = np.nonzero(live.ravel())[0]
    return sorted((int(plan.row_token[r]), float(plan.row_weight[r]), int(plan.block_expert[r // block_rows]))
                  for r in rows)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_grouped_moe_kernel_matches_reference_and_gguf(qtype):
    """moe_grouped (interpret) == reference_moe (decode path's jnp twin) == float64 oracle; 13 rows,
    top-2 of 8 experts in blocks of 8 rows (partial blocks, unused blocks, several blocks per expert)."""
    banks, dense = moe_banks(qtype)
    rows = 13
    x = jnp.asarray(activations((rows, banks[0].shape[1]), seed=3))
    rng = np.random.default_rng(4)
    ids = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(rows)]).astype(np.int32)
    ids[:9, 0] = 5                                                              # expert 5 spans two blocks
    weights = rng.random((rows, TOP_K)).astype(np.float32)
    ep_ids, ep_weights = ids.copy(), weights.copy()                             # as one device of "ep" sees it
    ep_ids[ids >= 4], ep_weights[ids >= 4] = 0, 0.0
    for ids, weights in ((ids, weights), (ep_ids, ep_weights)):
        ours = jit_static(functools.partial(gm.moe_grouped, block_rows=BLOCK_ROWS, interpret=True), 6)(
            x, weights, ids, *banks, LIMIT)
        theirs = jit_static(mv.reference_moe, 6)(x, weights, ids, *banks, LIMIT)
        oracle = moe_oracle(x, weights, ids, *dense, LIMIT)
        errors = rel_err(ours, oracle), rel_err(theirs, oracle), rel_err(ours, theirs)
        assert max(errors) <= TOL, errors


@pytest.mark.parametrize("qtype", [QType.Q6_K, QType.IQ3_XXS], ids=lambda t: t.name)
def test_grouped_reference_decodes_every_bank_exactly(qtype):
    """reference_moe (all banks decoded once, then dense_moe) == float64 oracle."""
    banks, dense = moe_banks(qtype, seed=20)
    x = activations((20, banks[0].shape[1]), seed=5)
    rng = np.random.default_rng(6)
    ids = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(20)]).astype(np.int32)
    weights = rng.random((20, TOP_K)).astype(np.float32)
    ours = jit_static(gm.reference_moe, 6)(x, weights, ids, *banks, LIMIT)
    assert rel_err(ours, moe_oracle(x, weights, ids, *dense, LIMIT)) <= TOL


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.IQ4_XS], ids=lambda t: t.name)
def test_grouped_linear_kernel_matches_reference_and_gguf(qtype):
    """linear_grouped (interpret): 2-D QArray, rows not a multiple of the block rows."""
    w, dense = bank(qtype, 0, 512, 160, seed=8)
    x = activations((3, 7, 512), seed=9)
    ours = jit_static(functools.partial(gm.linear_grouped, block_rows=BLOCK_ROWS, interpret=True), 2)(x, w, jnp.float32)
    theirs = jit_static(gm.reference_linear, 2)(x, w, jnp.float32)
    oracle = x.astype(np.float64) @ dense
    assert ours.shape == (3, 7, 160)
    assert max(rel_err(ours, oracle), rel_err(theirs, oracle), rel_err(ours, theirs)) <= TOL


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.IQ2_S], ids=lambda t: t.name)
def test_grouped_kernels_lower_for_tpu(qtype):
    """The grouped kernels' own plumbing (the decoders' Mosaic lowering is covered per format by the
    decode kernels' test)."""
    banks, _ = moe_banks(qtype)
    x = jnp.zeros((40, banks[0].shape[1]), jnp.bfloat16)
    ids, weights = jnp.zeros((40, TOP_K), jnp.int32), jnp.ones((40, TOP_K), jnp.float32)
    moe = jit_static(functools.partial(gm.moe_grouped, block_rows=16), 6)
    assert tpu_custom_calls(moe, x, weights, ids, *banks, LIMIT) == 2
    matrix, _ = bank(qtype, 0, banks[0].shape[1], 96, seed=2)
    linear = jit_static(functools.partial(gm.linear_grouped, block_rows=16), 2)
    assert tpu_custom_calls(linear, x, matrix, jnp.bfloat16) == 1
