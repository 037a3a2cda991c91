"""Slot buffers: a cache of L token slots per row, written at a per-row index.

    write_slots(buf [B, L, ...], new [B, T, ...], write_at [B], axes=None, slot_axis=1) -> buf
    (``slot_axis``: where the slots are, the same for ``new``'s tokens, e.g. 2 for ``[B, H, L, D]``)

With the buffer's logical ``axes`` and a mesh that splits its slot axis (the MLA latent cache in
"tp": ``latent_len``), every chip writes the tokens that fall in its own slots, under
``shard_map``: a per-row update of several slots is otherwise a scatter that the partitioner runs
on the whole buffer gathered to every chip (a decode step with 4 verify tokens all-gathered 100 MB
of latent cache per layer and chip).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from zoo.sharding.mesh import current_mesh, partition_spec


def _write(buf: jax.Array, new: jax.Array, write_at: jax.Array, slot_axis: int = 1) -> jax.Array:
    def one(b, n, i):
        corner = [0] * b.ndim
        corner[slot_axis - 1] = i
        return jax.lax.dynamic_update_slice(b, n.astype(b.dtype), tuple(corner))
    return jax.vmap(one)(buf, new, write_at)


def _write_local(buf: jax.Array, new: jax.Array, offset: jax.Array) -> jax.Array:
    """Write ``new [B, T, ...]`` at per-row slot ``offset [B]`` of a local ``buf [B, S, ...]``
    where ``offset`` may lie outside ``[0, S)``: only the tokens landing in ``[0, S)`` are written."""
    size, t = buf.shape[1], new.shape[1]
    if t > size:                                            # a chunk wider than the shard: select slot-wise
        src = jnp.arange(size)[None, :] - offset[:, None]                           # [B, S]
        inside = (src >= 0) & (src < t)
        vals = jnp.take_along_axis(new, jnp.clip(src, 0, t - 1).reshape(*src.shape, *(1,) * (new.ndim - 2)), 1)
        return jnp.where(inside.reshape(*inside.shape, *(1,) * (buf.ndim - 2)), vals.astype(buf.dtype), buf)
    start = jnp.clip(offset, 0, size - t)                                           # a window inside the shard

    def one(b, n, s, off):
        window = jax.lax.dynamic_slice_in_dim(b, s, t, 0)
        src = jnp.arange(t) + s - off                       # the token each window slot takes
        inside = (src >= 0) & (src < t)
        vals = jnp.take(n, jnp.clip(src, 0, t - 1), axis=0).astype(b.dtype)
        window = jnp.where(inside.reshape(t, *(1,) * (b.ndim - 1)), vals, window)
        return jax.lax.dynamic_update_slice_in_dim(b, window, s, 0)
    return jax.vmap(one)(buf, new, start, offset)


def write_slots(buf: jax.Array, new: jax.Array, write_at: jax.Array, axes: tuple | None = None,
                slot_axis: int = 1) -> jax.Array:
    """Write ``new [B, T, ...]`` into ``buf [B, L, ...]`` at per-row slot ``write_at [B]`` (see the
    module docstring for ``axes`` and ``slot_axis``)."""
    mesh = current_mesh() if axes is not None else None
    spec = partition_spec(axes, tuple(buf.shape), mesh) if mesh is not None else None
    if spec is None or spec[slot_axis] is None:
        return _write(buf, new, write_at, slot_axis)
    if slot_axis != 1:
        raise NotImplementedError("a buffer split over its slots keeps them on axis 1")
    slot_axis = spec[1]

    def local(b, n, w):
        return _write_local(b, n, w - jax.lax.axis_index(slot_axis) * b.shape[1])

    return jax.shard_map(local, in_specs=(spec, PartitionSpec(spec[0], None, *spec[2:]), PartitionSpec(spec[0])),
                         out_specs=spec, check_vma=False)(buf, new, write_at)
