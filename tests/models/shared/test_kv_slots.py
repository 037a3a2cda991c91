"""Slot writes on a buffer split over its slots: every shard writing its own part of the tokens
(``zoo.models.shared.kv_slots._write_local``, what each chip runs under ``shard_map``) gives the
same buffer as one write on the whole buffer, for windows inside one shard, straddling shards,
off either end of a shard, and chunks wider than a shard; and in the interleaved layout (Qwen's
``kv_len``), every shard writing its every n-th slot."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from zoo.models.shared.kv_slots import _write, _write_local
from zoo.sharding.slot_layout import deinterleave, interleave


@pytest.mark.parametrize("tokens", [1, 4, 12, 40])
def test_sharded_writes_equal_one_write(tokens):
    rows, length, shards, width = 3, 64, 4, 5
    rng = np.random.default_rng(tokens)
    buf = jnp.asarray(rng.standard_normal((rows, length, width)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((rows, tokens, width)), jnp.float32)
    size = length // shards
    last = length - tokens                           # the engine never writes past the end
    for write_at in ([0, min(size - 1, last), max(2 * size - tokens // 2, 0)], [last, min(size * 2, last), 5]):
        at = jnp.asarray(write_at, jnp.int32)
        whole = _write(buf, new, at)
        pieces = [_write_local(buf[:, s * size:(s + 1) * size], new, at - s * size) for s in range(shards)]
        assert np.array_equal(np.concatenate(pieces, axis=1), np.asarray(whole)), write_at


@pytest.mark.parametrize("tokens", [1, 4, 12, 40])
def test_interleaved_writes_equal_one_write(tokens):
    """The interleaved layout (``zoo.sharding.slot_layout``: chip c of n holds slots c, c + n, ...):
    each shard writes the tokens whose slots are its own, at their local slots, and the shards put
    back in slot order (``deinterleave`` of their chip-major concatenation) equal one write."""
    rows, length, shards, width = 3, 64, 4, 5
    rng = np.random.default_rng(10 + tokens)
    buf = jnp.asarray(rng.standard_normal((rows, length, width)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((rows, tokens, width)), jnp.float32)
    chip_major = interleave(buf, shards, 1)
    assert np.array_equal(np.asarray(deinterleave(chip_major, shards, 1)), np.asarray(buf))
    assert np.array_equal(np.asarray(chip_major[0, 1]), np.asarray(buf[0, shards]))   # chip 0's local slot 1
    size = length // shards
    last = length - tokens
    for write_at in ([0, min(size - 1, last), 7], [last, 3, min(33, last)]):
        at = jnp.asarray(write_at, jnp.int32)
        whole = _write(buf, new, at)
        pieces = [_write_local(chip_major[:, c * size:(c + 1) * size], new, at - c, 1, shards) for c in range(shards)]
        got = deinterleave(jnp.concatenate(pieces, axis=1), shards, 1)
        assert np.array_equal(np.asarray(got), np.asarray(whole)), write_at
