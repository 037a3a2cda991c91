"""Length-aware absorbed MLA (``filled_latent_attention``): equal to the whole-window reference at
every fill level, its mask made block by block from the indexer's selected pools, a row's result
independent of the other rows' lengths, the blocks read following the tokens present."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.helpers import rel_err
from zoo.models.glm53.mla import filled_latent_attention, latent_attention, pool_visibility
from zoo.models.shared.filled_blocks import blocks_visited, key_block

B, T_HEADS, C, POOL = 2, 3, 32, 4


def case(length: int, filled: list[int], t: int, seed: int = 0, width: int = C):
    """Row b holds ``filled[b]`` tokens (slot s holds position s), then a call of ``t``; each query
    selects a random subset of the pools, its own among them (as the indexer's top-k; ``pool_visibility``
    keeps the causal slots of them and of the query's own incomplete pool)."""
    rng = np.random.default_rng(seed)
    write_at = np.asarray(filled, np.int32)
    query_pos = write_at[:, None] + np.arange(t)[None, :]                                   # [B, T]
    key_pos = np.where(np.arange(length)[None, :] < (write_at + t)[:, None], np.arange(length)[None, :], -1)
    pools = rng.random((B, t, length // POOL)) < 0.6
    pools[np.arange(B)[:, None], np.arange(t)[None, :], query_pos // POOL] = True   # each query sees its own slot
    q = jnp.asarray(rng.standard_normal((B, t, T_HEADS, width)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((B, length, width)), jnp.float32)
    ints = lambda a: jnp.asarray(a, jnp.int32)                   # noqa: E731
    return q, c, jnp.asarray(pools), ints(key_pos), ints(query_pos), ints(write_at)


@functools.partial(jax.jit, static_argnums=6)
def run(q, c, pools, key_pos, query_pos, write_at, scale, live=None):
    return filled_latent_attention(q, c, pools, key_pos, query_pos, write_at, scale, live, pool=POOL, select_tail=True)


def reference(q, c, pools, key_pos, query_pos, scale):
    return latent_attention(q, c, pool_visibility(pools, key_pos, query_pos, POOL, True), scale)


@pytest.mark.parametrize("length,filled,t", [(1024, [0, 0], 5), (1024, [300, 40], 1), (768, [700, 10], 4),
                                             (4096, [1500, 1500], 64), (200, [20, 5], 3), (1100, [1000, 1090], 5)])
def test_equals_whole_window(length, filled, t):
    q, c, pools, key_pos, query_pos, write_at = case(length, filled, t)
    ours = run(q, c, pools, key_pos, query_pos, write_at, C ** -0.5)
    assert rel_err(ours, reference(q, c, pools, key_pos, query_pos, C ** -0.5)) <= 1e-6


def test_row_independent_and_blocks_follow_fill():
    q, c, pools, key_pos, query_pos, _ = case(4096, [60, 3000], 2, seed=3)
    short = jnp.asarray([60, 10], jnp.int32)                  # row 1 said shorter: fewer blocks visited
    key_pos_short = key_pos.at[1].set(jnp.where(jnp.arange(4096) < 12, jnp.arange(4096), -1))
    query_short = query_pos.at[1].set(jnp.asarray([10, 11]))
    a = run(q, c, pools, key_pos_short, query_short, short, C ** -0.5)
    b = run(q, c, pools, key_pos, query_pos, jnp.asarray([60, 3000], jnp.int32), C ** -0.5)
    assert int(blocks_visited(short, 2, 4096)) == 1
    assert int(blocks_visited(jnp.asarray([60, 3000]), 2, 4096)) == 6
    idle = jnp.asarray([True, False])                      # row 1 has no token in the call: not read
    assert int(blocks_visited(jnp.asarray([60, 3000]), 2, 4096, idle)) == 1
    c_ = run(q, c, pools, key_pos, query_pos, jnp.asarray([60, 3000], jnp.int32), C ** -0.5, idle)
    assert np.array_equal(np.asarray(a[0]), np.asarray(c_[0])) and np.isfinite(np.asarray(c_)).all()
    assert np.array_equal(np.asarray(a[0]), np.asarray(b[0]))
    assert key_block(32768) == 512 and key_block(4160) == 512 and key_block(500) is None


@pytest.mark.parametrize("form", ["jnp", "kernel"])
def test_split_over_chips_equals_whole_window(form):
    """The latent cache split over 8 chips by its slots (``latent_len`` on "tp"), simulated with
    ``vmap`` over a named axis: each chip reads the filled blocks of its share (the jnp blocks, or
    the Pallas kernel in interpret mode, each row its own blocks) and the combined result equals
    the whole window on every chip."""
    from zoo.models.glm53.mla import kernel_latent_share, split_latent_share
    share_of_chip = split_latent_share if form == "jnp" else functools.partial(kernel_latent_share, interpret=True)
    width = C if form == "jnp" else 128                        # the kernel takes whole-lane latents
    n, length = 8, 8 * 1100
    q, c, pools, key_pos, query_pos, write_at = case(length, [5000, 700], 3, seed=5, width=width)
    share = length // n
    c_shares = jnp.moveaxis(c.reshape(B, n, share, width), 1, 0)
    key_shares = jnp.moveaxis(key_pos.reshape(B, n, share), 1, 0)
    chip = jax.vmap(lambda c, kp: share_of_chip(q, c, pools, kp, query_pos, write_at, jnp.asarray([True, True]),
                                                axis="tp", scale=C ** -0.5, pool=POOL, select_tail=True),
                    axis_name="tp")
    out = jax.jit(chip)(c_shares, key_shares)
    ref = reference(q, c, pools, key_pos, query_pos, C ** -0.5)
    assert max(rel_err(out[k], ref) for k in range(n)) <= 1e-6
