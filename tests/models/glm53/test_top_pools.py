"""The indexer's pool choice scored block by block (``select_top_pools``): the same pools as one
``top_k`` over the whole window at every fill level (ties included), and only the blocks up to the
furthest candidate scored."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo.models.glm53.mla import F32_MIN, POOL_BLOCKS, select_top_pools
from zoo.models.shared.filled_blocks import key_block

B, T, DI = 2, 5, 8


def whole_window(index: jax.Array, limit: jax.Array, kept: int) -> np.ndarray:
    """The choice as the indexer made it before the blocks: one top_k over every pool."""
    n_pools = index.shape[-1]
    candidate = jnp.arange(n_pools)[None, None, :] < limit[..., None]
    top = jax.lax.top_k(jnp.where(candidate, index, F32_MIN), min(kept, n_pools))[1]
    chosen = jnp.take_along_axis(candidate, top, axis=-1)
    return np.asarray(jnp.zeros(index.shape, bool).at[
        jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], top].set(chosen))


def case(n_pools: int, reach: list[int], seed: int, levels: int | None = None):
    """Queries whose candidate limits end at ``reach[b]``; scores are a fixed function of the pool
    (rounded to ``levels`` values when given, so that many of them tie)."""
    rng = np.random.default_rng(seed)
    limit = np.stack([np.sort(rng.integers(0, r + 1, T)) for r in reach]).astype(np.int32)
    limit[:, -1] = reach
    q = rng.standard_normal((B, T, DI)).astype(np.float32)
    keys = rng.standard_normal((B, n_pools, DI)).astype(np.float32)
    if levels:
        q, keys = np.round(q), np.round(keys * levels / 4) / levels
    return jnp.asarray(q), jnp.asarray(keys), jnp.asarray(limit)


def scorer(q):
    return lambda keys: jnp.einsum("btd,bpd->btp", q, keys.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("n_pools,reach,kept,levels", [
    (1088, [1088, 700], 16, None),        # a last block that overlaps the one before it
    (1088, [1088, 1088], 600, 3),         # more kept than a block, many ties
    (2048, [3, 0], 16, None),             # fewer candidates than kept; a row with none
    (2048, [1500, 520], 512, 2),          # ties across blocks
    (300, [300, 17], 16, 2),              # under two blocks: scored whole
])
def test_blocks_choose_what_one_top_k_chooses(n_pools, reach, kept, levels):
    q, keys, limit = case(n_pools, reach, seed=n_pools + kept, levels=levels)
    ours = jax.jit(lambda q, k, lim: select_top_pools(scorer(q), k, lim, kept))(q, keys, limit)
    assert ours.shape == (B, T, n_pools)
    np.testing.assert_array_equal(np.asarray(ours), whole_window(scorer(q)(keys), limit, kept))


def test_only_the_blocks_up_to_the_furthest_candidate_are_scored():
    n_pools = 8192
    block = key_block(n_pools, POOL_BLOCKS)
    widths = []

    def counted(q):
        def index_of(keys):
            jax.debug.callback(lambda: widths.append(keys.shape[1]))
            return scorer(q)(keys)
        return index_of

    run = jax.jit(lambda q, k, lim: select_top_pools(counted(q), k, lim, 16))
    for reach, blocks in (([10, 0], 1), ([block + 1, 3], 2), ([0, 0], 1), ([n_pools, 5], n_pools // block)):
        q, keys, limit = case(n_pools, reach, seed=1)
        widths.clear()
        jax.block_until_ready(run(q, keys, limit))
        assert widths == [block] * blocks, (reach, widths)
