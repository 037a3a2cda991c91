"""Slot buffers: a cache of L token slots per row, written at a per-row index."""

from __future__ import annotations

import jax


def write_slots(buf: jax.Array, new: jax.Array, write_at: jax.Array) -> jax.Array:
    """Write ``new [B, T, ...]`` into ``buf [B, L, ...]`` at per-row slot ``write_at [B]``."""
    def one(b, n, i):
        return jax.lax.dynamic_update_slice(b, n.astype(b.dtype), (i,) + (0,) * (b.ndim - 1))
    return jax.vmap(one)(buf, new, write_at)
