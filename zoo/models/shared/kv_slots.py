"""Slot buffers: a cache of L token slots per row, written at a per-row index.

    write_slots(buf [B, L, ...], new [B, T, ...], write_at [B], axes=None, slot_axis=1) -> buf
    (``slot_axis``: where the slots are, the same for ``new``'s tokens, e.g. 2 for ``[B, H, L, D]``)

``buf`` may hold more rows than ``new`` (a step of the batch's first rows,
``zoo.engine.step_programs.decode_narrow``): ``new``'s rows are its first ones, written in place.

With the buffer's logical ``axes`` and a mesh that splits its slot axis (the MLA latent cache in
"tp": ``latent_len``; Qwen's KV cache where its KV heads do not divide over "tp": ``kv_len``),
every chip writes the tokens that fall in its own slots, under ``shard_map``: a per-row update of
several slots is otherwise a scatter that the partitioner runs on the whole buffer gathered to every
chip (a decode step with 4 verify tokens all-gathered 100 MB of latent cache per layer and chip).

How the slots are split over the chips (contiguous, or interleaved for ``kv_len``) is
``zoo.sharding.slot_layout``'s: the writes follow it (``share_layout``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from zoo.sharding.mesh import current_spec
from zoo.sharding.slot_layout import share_layout, slot_interleave


def _write(buf: jax.Array, new: jax.Array, write_at: jax.Array, slot_axis: int = 1) -> jax.Array:
    def one(b, n, i):
        corner = [0] * b.ndim
        corner[slot_axis - 1] = i
        return jax.lax.dynamic_update_slice(b, n.astype(b.dtype), tuple(corner))
    return jax.vmap(one)(buf, new, write_at)


def _write_local(buf: jax.Array, new: jax.Array, offset: jax.Array, slot_axis: int = 1,
                 stride: int | jax.Array = 1) -> jax.Array:
    """Write ``new [B, ..., T, ...]`` at per-row slot ``offset [B]`` of a local ``buf [B, ..., S, ...]``
    (slots on ``slot_axis`` of both) where ``offset`` may lie outside ``[0, S)``: only the tokens
    landing in ``[0, S)`` are written. With a ``stride``, token i's slot ``offset + i`` is local slot
    ``(offset + i) / stride`` where the stride divides it, and is not this buffer's otherwise (an
    interleaved share: module docstring). One scatter that drops the others: no read of the buffer (a
    read of a window per row was a gather, for which the TPU compiler relaid the whole local cache
    out in every step)."""
    size, t = buf.shape[slot_axis], new.shape[slot_axis]
    rel = offset[:, None] + jnp.arange(t, dtype=offset.dtype)[None, :]                    # [B, T]
    slot = rel // stride
    slot = jnp.where((rel >= 0) & (rel % stride == 0) & (slot < size), slot, size)      # outside: dropped
    rows = jnp.arange(new.shape[0])[:, None]                # buf's first rows where it has more
    index = (rows, *(slice(None),) * (slot_axis - 1), slot)
    # advanced indices apart put their [B, T] first: values [B, T, <the axes between>, <the rest>]
    vals = jnp.moveaxis(new, slot_axis, 1) if slot_axis > 1 else new
    return buf.at[index].set(vals.astype(buf.dtype), mode="drop")


def write_slots(buf: jax.Array, new: jax.Array, write_at: jax.Array, axes: tuple | None = None,
                slot_axis: int = 1) -> jax.Array:
    """Write ``new [B, T, ...]`` into ``buf [B, L, ...]`` at per-row slot ``write_at [B]`` (see the
    module docstring for ``axes`` and ``slot_axis``)."""
    spec = current_spec(axes, buf.shape) if axes is not None else None
    if buf.shape[0] != new.shape[0]:                        # the first rows of a bigger batch, in place
        if spec is not None and any(spec):
            raise ValueError("a write into the first rows of a batch is for one device (no mesh layout)")
        return _write_local(buf, new, write_at, slot_axis)
    if spec is None or spec[slot_axis] is None:
        return _write(buf, new, write_at, slot_axis)
    mesh_axis = spec[slot_axis]
    interleaved = slot_interleave(axes, buf.shape) > 1

    def local(b, n, w):
        offset, stride = share_layout(mesh_axis, b.shape[slot_axis], interleaved)
        return _write_local(b, n, w - offset, slot_axis, stride)

    new_spec = PartitionSpec(*spec[:slot_axis], None, *spec[slot_axis + 1:])
    return jax.shard_map(local, in_specs=(spec, new_spec, PartitionSpec(spec[0])),
                         out_specs=spec, check_vma=False)(buf, new, write_at)
