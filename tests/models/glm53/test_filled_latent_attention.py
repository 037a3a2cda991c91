"""Length-aware absorbed MLA (``filled_latent_attention``): equal to the whole-window reference at
every fill level, a row's result independent of the other rows' lengths, the blocks read following
the tokens present."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.helpers import rel_err
from zoo.models.glm53.mla import filled_latent_attention, latent_attention
from zoo.models.shared.filled_blocks import blocks_visited, key_block

B, T_HEADS, C = 2, 3, 32


def case(length: int, filled: list[int], t: int, seed: int = 0):
    """Row b holds ``filled[b]`` tokens, then a call of ``t``; the selection is a random subset of each
    query's causal slots (as the indexer's pools), at least the query's own slot."""
    rng = np.random.default_rng(seed)
    write_at = np.asarray(filled, np.int32)
    query_slot = write_at[:, None] + np.arange(t)[None, :]                                  # [B, T]
    causal = np.arange(length)[None, None, :] <= query_slot[..., None]
    selection = causal & (rng.random((B, t, length)) < 0.6)
    selection[np.arange(B)[:, None], np.arange(t)[None, :], query_slot] = True
    q = jnp.asarray(rng.standard_normal((B, t, T_HEADS, C)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((B, length, C)), jnp.float32)
    return q, c, jnp.asarray(selection), jnp.asarray(write_at)


@pytest.mark.parametrize("length,filled,t", [(1024, [0, 0], 5), (1024, [300, 40], 1), (768, [700, 10], 4),
                                             (4096, [1500, 1500], 64), (200, [20, 5], 3), (1100, [1000, 1090], 5)])
def test_equals_whole_window(length, filled, t):
    q, c, sel, write_at = case(length, filled, t)
    ours = jax.jit(filled_latent_attention, static_argnums=4)(q, c, sel, write_at, C ** -0.5)
    assert rel_err(ours, latent_attention(q, c, sel, C ** -0.5)) <= 1e-6


def test_row_independent_and_blocks_follow_fill():
    q, c, sel, _ = case(4096, [60, 3000], 2, seed=3)
    run = jax.jit(filled_latent_attention, static_argnums=4)
    short = jnp.asarray([60, 10], jnp.int32)                  # row 1 said shorter: fewer blocks visited
    sel_short = sel.at[1].set(sel[1] & (jnp.arange(4096) < 12)[None, :])
    a = run(q, c, sel_short, short, C ** -0.5)
    b = run(q, c, sel, jnp.asarray([60, 3000], jnp.int32), C ** -0.5)
    assert int(blocks_visited(short, 2, 4096)) == 1
    assert int(blocks_visited(jnp.asarray([60, 3000]), 2, 4096)) == 6
    idle = jnp.asarray([True, False])                      # row 1 has no token in the call: not read
    assert int(blocks_visited(jnp.asarray([60, 3000]), 2, 4096, idle)) == 1
    c_ = run(q, c, sel, jnp.asarray([60, 3000], jnp.int32), C ** -0.5, idle)
    assert np.array_equal(np.asarray(a[0]), np.asarray(c_[0])) and np.isfinite(np.asarray(c_)).all()
    assert np.array_equal(np.asarray(a[0]), np.asarray(b[0]))
    assert key_block(32768) == 512 and key_block(4160) == 512 and key_block(1000) == 256 and key_block(500) is None


def test_split_over_chips_equals_whole_window():
    """The latent cache split over 8 chips by its slots (``latent_len`` on "tp"), simulated with
    ``vmap`` over a named axis: each chip reads the filled blocks of its share and the combined
    result equals the whole window."""
    from zoo.models.glm53.mla import split_latent_share
    n, length = 8, 8 * 1100
    q, c, sel, write_at = case(length, [5000, 700], 3, seed=5)
    share = length // n
    c_shares = jnp.moveaxis(c.reshape(B, n, share, C), 1, 0)
    sel_shares = jnp.moveaxis(sel.reshape(B, 3, n, share), 2, 0)
    chip = jax.vmap(lambda c, s: split_latent_share(q, c, s, write_at, jnp.asarray([True, True]), axis="tp",
                                                    scale=C ** -0.5), axis_name="tp")
    out = jax.jit(chip)(c_shares, sel_shares)
    ref = latent_attention(q, c, sel, C ** -0.5)
    assert max(rel_err(out[k], ref) for k in range(n)) <= 1e-6
