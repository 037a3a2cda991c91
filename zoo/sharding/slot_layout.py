"""How a cache's slot axis is split over the chips of a mesh, and reads across that split.

How the slots are split (``share_layout``):
    contiguous    chip c of n holds slots ``c * S .. (c+1) * S - 1`` (``latent_len``: GLM's pooled
                  indexer reads runs of consecutive positions)
    interleaved   chip c holds slots ``c, c + n, c + 2n, ...`` at local slots 0, 1, 2, ...
                  (``INTERLEAVED_AXES``: ``kv_len``). A row filled to f tokens then has about f / n of
                  them on every chip, so the busiest chip's attention reads follow the fill; with
                  contiguous shares chip 0 holds every row's first S tokens and reads its whole share
                  until the rows pass S.
In both, global slot g is chip c's local slot ``(g - offset) // stride`` (``(offset, stride)``:
``(c * S, 1)`` or ``(c, n)``), and a local slot j is visible to a query at global slot q iff
``j <= (q - offset) // stride``: the attention of a share compares local slots only.
``share_flags`` gives a chip the flags ``[B, L]`` (whole on every chip, in global slot order) of its
own slots, for the attention of its share. ``interleave(x, n, axis)`` / ``deinterleave`` reorder a
whole ``[.., L, ..]`` axis between the global slot order and the interleaved one (chip-major); the
TPU compiler takes minutes to compile that reorder of a 32M-slot window (a relayout of the lanes), so
a step's flags go by ``share_flags``' gather instead. ``take_slots`` / ``put_slots`` read and write
a run of slots of a cache in either layout, the run in global slot order (the prefix cache's blocks,
``zoo.engine.prefix_rows``: an entry is the same whatever the mesh).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zoo.sharding.mesh import current_mesh, current_spec

INTERLEAVED_AXES = ("kv_len",)      # slot axes whose split over the mesh interleaves the slots


def slot_interleave(axes: tuple | None, shape: tuple[int, ...]) -> int:
    """How many chips the slots of a leaf with logical ``axes`` interleave over on the current mesh:
    the mesh's split of its ``INTERLEAVED_AXES`` axis, 1 where that axis is whole, the leaf has none,
    or there is no mesh."""
    hits = [i for i, a in enumerate(axes or ()) if a in INTERLEAVED_AXES]
    spec = current_spec(axes, shape) if hits else None
    if spec is None or spec[hits[0]] is None:
        return 1
    names = spec[hits[0]] if isinstance(spec[hits[0]], tuple) else (spec[hits[0]],)
    mesh = current_mesh()
    return int(np.prod([mesh.shape[n] for n in names]))


def share_layout(axis: str, share: int, interleaved: bool) -> tuple[jax.Array, int]:
    """``(offset, stride)`` of this chip's share (inside ``shard_map`` over mesh ``axis``; ``share``
    local slots): global slot g is local slot ``(g - offset) // stride`` (module docstring)."""
    c = jax.lax.axis_index(axis)
    return (c, jax.lax.axis_size(axis)) if interleaved else (c * share, 1)


def local_slot(g: jax.Array, offset, stride) -> jax.Array:
    """Global slot(s) ``g`` in a share's local numbering, ``(g - offset) // stride``
    (:func:`share_layout`): the local slots at or before it are ``0 .. local_slot(g)`` (negative:
    none)."""
    return (g - offset) // stride


def share_flags(flags: jax.Array, axis: str, share: int, interleaved: bool) -> jax.Array:
    """This chip's ``[B, share]`` of per-slot ``flags [B, L]`` (whole on every chip, global order),
    inside ``shard_map`` over mesh ``axis``: its slots as :func:`share_layout` lays them out, in
    local order (a gather of every n-th flag where the slots interleave, a slice where contiguous)."""
    offset, stride = share_layout(axis, share, interleaved)
    if not interleaved:
        return jax.lax.dynamic_slice_in_dim(flags, offset, share, 1)
    index = offset + stride * jnp.arange(share, dtype=jnp.int32)
    return jnp.take(flags, index, axis=1, unique_indices=True, indices_are_sorted=True)


def interleave(x: jax.Array, n: int, axis: int) -> jax.Array:
    """``x [.., L, ..]`` (global slot order on ``axis``) reordered chip-major for ``n`` interleaved
    shares: position ``c * (L / n) + j`` holds global slot ``j * n + c``."""
    if n == 1:
        return x
    split = x.reshape(*x.shape[:axis], x.shape[axis] // n, n, *x.shape[axis + 1:])
    return jnp.swapaxes(split, axis, axis + 1).reshape(x.shape)


def deinterleave(x: jax.Array, n: int, axis: int) -> jax.Array:
    """The inverse of :func:`interleave`: chip-major ``x`` back in global slot order."""
    if n == 1:
        return x
    split = x.reshape(*x.shape[:axis], n, x.shape[axis] // n, *x.shape[axis + 1:])
    return jnp.swapaxes(split, axis, axis + 1).reshape(x.shape)


def take_slots(x: jax.Array, start: jax.Array, size: int, axis: int, n: int = 1) -> jax.Array:
    """Global slots ``start .. start + size - 1`` of ``x`` on its slot ``axis``, in global order, where
    ``x``'s slots interleave over ``n`` chips (1: the global order itself). ``start`` and ``size``
    must be multiples of ``n``: each chip gives its ``size / n`` consecutive local slots."""
    if n == 1:
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis)
    if size % n:
        raise ValueError(f"a run of {size} slots does not split over {n} interleaved shares")
    split = x.reshape(*x.shape[:axis], n, x.shape[axis] // n, *x.shape[axis + 1:])
    part = jax.lax.dynamic_slice_in_dim(split, start // n, size // n, axis + 1)
    return deinterleave(part.reshape(*x.shape[:axis], size, *x.shape[axis + 1:]), n, axis)


def put_slots(x: jax.Array, part: jax.Array, start: jax.Array, axis: int, n: int = 1) -> jax.Array:
    """``x`` with ``part`` (global order, as :func:`take_slots` gives it) written at global slots
    ``start ..`` on ``axis``; the inverse of :func:`take_slots`."""
    if n == 1:
        return jax.lax.dynamic_update_slice_in_dim(x, part.astype(x.dtype), start, axis)
    size = part.shape[axis]
    if size % n:
        raise ValueError(f"a run of {size} slots does not split over {n} interleaved shares")
    split = x.reshape(*x.shape[:axis], n, x.shape[axis] // n, *x.shape[axis + 1:])
    mine = interleave(part.astype(x.dtype), n, axis).reshape(*part.shape[:axis], n, size // n, *part.shape[axis + 1:])
    return jax.lax.dynamic_update_slice_in_dim(split, mine, start // n, axis + 1).reshape(x.shape)
