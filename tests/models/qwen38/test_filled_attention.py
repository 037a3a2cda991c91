"""Length-aware attention (``filled_attention``): equal to the whole-window reference at every fill
level, a row's result independent of the other rows' lengths, and the key blocks read follow the
tokens present, not the window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.helpers import rel_err
from zoo.models.qwen38.gated_attention import (
    SlotMeta,
    Slots,
    advance_slots,
    attention_mask,
    filled_attention,
    grouped_attention,
)
from zoo.models.shared.filled_blocks import blocks_visited, key_block

B, H, G, D = 2, 4, 2, 16


def case(length: int, filled: list[int], t: int, seed: int = 0, live=(True, True)):
    """Row b already holding ``filled[b]`` tokens in its first slots (each row its own write index,
    as the engine's rows), then a call of ``t`` tokens (all padding in a row that is not ``live``)."""
    rng = np.random.default_rng(seed)
    index = jnp.asarray(filled, jnp.int32)
    meta = SlotMeta(index=index, pos=index, valid=jnp.arange(length)[None, :] < index[:, None])
    fields, _, _ = advance_slots(meta, jnp.broadcast_to(jnp.asarray(live)[:, None], (B, t)))
    slots = Slots(cos=jnp.zeros((B, t, 2)), sin=jnp.zeros((B, t, 2)), **fields)
    q = jnp.asarray(rng.standard_normal((B, t, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, G, length, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, G, length, D)), jnp.float32)
    return q, k, v, slots


@pytest.mark.parametrize("length,filled,t", [(1024, [0, 0], 7), (1024, [300, 40], 1), (1024, [511, 3], 2),
                                             (768, [700, 10], 4), (4096, [1500, 1500], 64), (200, [20, 5], 3)])
def test_equals_whole_window(length, filled, t):
    q, k, v, slots = case(length, filled, t)
    ours = jax.jit(filled_attention, static_argnums=4)(q, k, v, slots, D ** -0.5)
    ref = grouped_attention(q, k, v, attention_mask(slots), D ** -0.5)
    assert rel_err(ours, ref) <= 1e-6


def test_row_independent_of_other_rows():
    """Row 0 (60 tokens) gives bit-identical results whether row 1 holds 10 tokens or 3000 (more
    blocks visited)."""
    short = case(4096, [60, 10], 3, seed=1)
    long_ = case(4096, [60, 3000], 3, seed=1)
    run = jax.jit(filled_attention, static_argnums=4)
    a, b = run(*short, D ** -0.5), run(*long_, D ** -0.5)
    assert int(blocks_visited(short[3].write_at, 3, 4096)) == 1 and int(blocks_visited(long_[3].write_at, 3, 4096)) == 6
    assert not np.array_equal(np.asarray(a[1]), np.asarray(b[1]))
    assert np.array_equal(np.asarray(a[0]), np.asarray(b[0]))


def test_an_idle_row_does_not_widen_the_call():
    """A row with no real token in the call (a finished request's row, its write index at 3000) reads
    nothing for anyone: the call visits the live row's one block, and the live row's result is
    bit-identical to a call where the idle row is short."""
    run = jax.jit(filled_attention, static_argnums=4)
    idle_long = case(4096, [60, 3000], 1, seed=2, live=(True, False))
    idle_short = case(4096, [60, 10], 1, seed=2, live=(True, False))
    assert np.asarray(idle_long[3].live).tolist() == [True, False]
    assert int(blocks_visited(idle_long[3].write_at, 1, 4096, idle_long[3].live)) == 1
    assert int(blocks_visited(idle_long[3].write_at, 1, 4096)) == 6           # what it cost before
    assert int(blocks_visited(idle_long[3].write_at, 1, 4096, jnp.asarray([False, False]))) == 1   # at least one
    a, b = run(*idle_long, D ** -0.5), run(*idle_short, D ** -0.5)
    assert np.array_equal(np.asarray(a[0]), np.asarray(b[0]))
    assert np.isfinite(np.asarray(a)).all()


def test_blocks_follow_the_tokens_present():
    assert key_block(32768) == 512 and key_block(4160) is None and key_block(768) == 256
    for filled, t, want in [([0, 0], 1, 1), ([511, 0], 1, 1), ([512, 0], 1, 2), ([4000, 17], 64, 8),
                            ([4033, 17], 64, 9), ([7000, 0], 1024, 16)]:
        slots = case(32768, filled, t)[3]
        assert int(blocks_visited(slots.write_at, t, 32768)) == want, (filled, t)
