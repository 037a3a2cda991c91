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
from zoo.models.shared.filled_blocks import block_at, blocks_visited, key_block

B, H, G, D = 2, 4, 2, 16


def case(length: int, filled: list[int], t: int, seed: int = 0, live=(True, True), d: int = D):
    """Row b already holding ``filled[b]`` tokens in its first slots (each row its own write index,
    as the engine's rows), then a call of ``t`` tokens (all padding in a row that is not ``live``)."""
    rng = np.random.default_rng(seed)
    index = jnp.asarray(filled, jnp.int32)
    meta = SlotMeta(index=index, pos=index, valid=jnp.arange(length)[None, :] < index[:, None])
    fields, _, _ = advance_slots(meta, jnp.broadcast_to(jnp.asarray(live)[:, None], (B, t)))
    slots = Slots(cos=jnp.zeros((B, t, 2)), sin=jnp.zeros((B, t, 2)), **fields)
    q = jnp.asarray(rng.standard_normal((B, t, H, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, G, length, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, G, length, d)), jnp.float32)
    return q, k, v, slots


@pytest.mark.parametrize("length,filled,t", [(1024, [0, 0], 7), (1024, [300, 40], 1), (1024, [511, 3], 2),
                                             (768, [700, 10], 4), (4096, [1500, 1500], 64), (200, [20, 5], 3),
                                             # windows no block width divides: the last block overlaps
                                             (1100, [1000, 1090], 5), (4128, [4100, 3000], 20), (1100, [500, 3], 1)])
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
    assert key_block(32768) == 512 and key_block(768) == 256 and key_block(33024) == 256
    assert key_block(1000) == 256 and key_block(500) is None
    assert key_block(4160) == 512 and key_block(4128) == 512          # no width divides: an overlapping last block
    assert int(blocks_visited(jnp.asarray([4100]), 20, 4128)) == 9
    assert int(blocks_visited(jnp.asarray([4000]), 20, 4128)) == 8
    at, own = block_at(jnp.asarray(4096), 512, 4128)                 # the 9th block: slots 3616..4127, 32 its own
    assert int(at) == 3616 and int(own.sum()) == 32 and bool(own[-1]) and not bool(own[-33])
    for filled, t, want in [([0, 0], 1, 1), ([511, 0], 1, 1), ([512, 0], 1, 2), ([4000, 17], 64, 8),
                            ([4033, 17], 64, 9), ([7000, 0], 1024, 16)]:
        slots = case(32768, filled, t)[3]
        assert int(blocks_visited(slots.write_at, t, 32768)) == want, (filled, t)


@pytest.mark.parametrize("length,filled,t,live", [(8 * 1100, [5000, 1200], 3, (True, True)),   # 1-2 blocks per chip
                                                  (8 * 1100, [600, 30], 1, (True, False)),     # an idle row
                                                  (8 * 1100, [2, 0], 1, (True, False)),        # chips 3..7 empty
                                                  (8 * 16, [0, 100], 40, (True, True))])       # a chunk over shares
def test_split_over_chips_equals_whole_window(length, filled, t, live):
    """The cache split over 8 chips by its slots (Qwen3.8-27B's 4 KV heads on 8 chips), interleaved
    (chip c holds slots c, c + 8, ...), simulated with ``vmap`` over a named axis (the collectives as
    under ``shard_map``): each chip reads the filled blocks of its share, an empty share reads none,
    and the combined result equals the whole window."""
    from zoo.models.qwen38.gated_attention import split_attention_share
    n = 8
    q, k, v, slots = case(length, filled, t, seed=4, live=live)
    share = length // n
    # chip c holds slots c, c + n, ... (the interleaved layout, ``slot_layout``): [n, ..., share, ...]
    shares = lambda a, axis: jnp.moveaxis(a.reshape(*a.shape[:axis], share, n, *a.shape[axis + 1:]), axis + 1, 0)  # noqa: E731
    chip = jax.vmap(lambda k, v: split_attention_share(q, k, v, slots.key_valid, slots.query_slot, slots.write_at,
                                                       slots.live, axis="tp", scale=D ** -0.5, interleaved=True),
                    axis_name="tp")
    out = jax.jit(chip)(shares(k, 2), shares(v, 2))
    ref = grouped_attention(q, k, v, attention_mask(slots), D ** -0.5)
    rows = np.asarray(live)
    for c in range(n):                                        # every chip holds the whole result
        assert rel_err(np.asarray(out[c])[rows], np.asarray(ref)[rows]) <= 1e-6, c
    assert np.isfinite(np.asarray(out)).all()
