"""Slot writes on a buffer split over its slots: every shard writing its own part of the tokens
(``zoo.models.shared.kv_slots._write_local``, what each chip runs under ``shard_map``) gives the
same buffer as one write on the whole buffer, for windows inside one shard, straddling shards,
off either end of a shard, and chunks wider than a shard."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from zoo.models.shared.kv_slots import _write, _write_local


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
