"""One generator's side of the prefix cache (``zoo.engine.prefix_cache``): the device programs that
move one cache row in and out of it, for the model (``graphdef``), draft length ``k`` and mesh, and
the restore / store calls built from them (entries keyed under ``root``, the model's identity). The
programs (``RowCopies``) are shared by every generator of an equal configuration in the process.

    restore(snap, cache) -> (cache, hidden)    a fresh 1-row cache holding the snapshot's prefix
    store(tokens, row)                         cache the state after ``tokens`` (``row()``: the row)

    take_block(cache, start) -> block          per-token leaves of slots start .. start+block-1
    take_rest(cache, hidden, start, window)    a snapshot's arrays: {"window", "state", "hidden"}
    put_block(cache, block, start) -> cache    the block written at slot ``start`` (cache donated)
    put_state(cache, state) -> cache           the leaves without a token axis replaced (donated)
    row(weights, batch, r) -> (cache, hidden)  batch row r holding exactly the tokens it consumed

``cache`` is a 1-row cache (``[1, L, ...]`` leaves) of a compact row (slot s holds position s).
A leaf is per token when one of its logical axes is a token axis (``zoo.sharding.cache_axes.token_axis``);
``strides``: tokens per entry of that axis (1 for slots, the pool size for pooled keys). A block is in
global slot order whatever the mesh (a cache whose slots interleave over the chips, Qwen's KV on a
mesh its KV heads do not divide, is read and written through ``slot_layout.take_slots`` / ``put_slots``).
Every output is a fresh buffer: the row it was read from is donated to the next prefill piece.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.engine.flat_state import as_state
from zoo.engine.prefix_cache import PrefixCache, Snapshot, split_leaves
from zoo.engine.step_programs import shared
from zoo.sharding.cache_axes import map_with_axes, shard_cache, token_axis
from zoo.sharding.mesh import host_value, on_mesh
from zoo.sharding.slot_layout import put_slots, slot_interleave, take_slots


def _by_path(tree) -> dict:
    out = {}
    map_with_axes(lambda path, x, axes: out.setdefault(path, x), tree)
    return out


class PrefixRows:
    def __init__(self, prefix: PrefixCache, root: bytes, graphdef, k: int, strides: dict[str, int], mesh=None):
        block = prefix.block
        bad = {path: st for path, st in strides.items() if block % st}
        if bad:
            raise ValueError(f"prefix block {block} is not a multiple of the tokens per entry of {bad}")
        self.prefix, self.root, self.block = prefix, root, block
        copies = shared_row_copies(graphdef, k, strides, block, mesh)     # one set per configuration
        self.take_block, self.take_rest, self.put_block = copies.take_block, copies.take_rest, copies.put_block
        self.put_state, self.row = copies.put_state, copies.row

    def restore(self, snap: Snapshot, cache):
        """A fresh 1-row ``cache`` holding the snapshot's prefix; returns (cache, h_{N-1} [1, D] or None)."""
        for i, key in enumerate(snap.blocks):
            cache = self.put_block(cache, self.prefix.block_arrays(key), jnp.int32(i * self.block))
        arrays = snap.arrays
        if arrays["window"] is not None:
            cache = self.put_block(cache, arrays["window"], jnp.int32(len(snap.blocks) * self.block))
        return self.put_state(cache, arrays["state"]), arrays["hidden"]

    def store(self, tokens: list[int], row) -> None:
        """Cache the state after ``tokens``; ``row()`` gives the 1-row cache holding it and h of its last
        token (called once, and only when the prefix cache lacks something of it)."""
        got = []

        def cache_row():
            if not got:
                got.append(row())
            return got[0]

        def rest(start):
            cache, hidden = cache_row()
            return self.take_rest(cache, hidden, jnp.int32(start or 0), window=start is not None)

        self.prefix.store(self.root, tokens, lambda start: self.take_block(cache_row()[0], jnp.int32(start)), rest)

    def warmup(self, weights, batch, cache, hidden):
        """Run every copy once, with its inputs of each kind a request gives them (a prefill's row
        or a finished batch row; entries on the device tier or in host RAM), so that none compiles
        later; ``cache`` (a one-row cache, donated) and ``hidden`` ([1, D], None without MTP) come
        from a prefill. Returns the last cache written."""
        from_row = self.row(weights, batch, jnp.int32(0))
        for c, h in (from_row, (cache, hidden)):
            block = self.take_block(c, jnp.int32(0))
            rests = [self.take_rest(c, h, jnp.int32(0), window=w) for w in (False, True)]
        for arrays in (block, jax.tree.map(host_value, block)):
            cache = self.put_block(cache, arrays, jnp.int32(0))
        for state in (rests[1]["state"], jax.tree.map(host_value, rests[1]["state"])):
            cache = self.put_state(cache, state)
        return cache


class RowCopies:
    """The jitted copies of one configuration (model ``graphdef``, draft length ``k``, per-token
    ``strides``, ``block`` tokens per entry, ``mesh``): ``take_block``, ``take_rest``, ``put_block``,
    ``put_state``, ``row`` (the module docstring). Shared by the generators of equal configurations
    (``shared_row_copies``)."""

    def __init__(self, graphdef, k: int, strides: dict[str, int], block: int, mesh=None):
        self.graphdef, self.k, self.strides, self.block = graphdef, k, strides, block
        self.take_block = on_mesh(jax.jit(self._take_block), mesh)
        self.take_rest = on_mesh(jax.jit(self._take_rest, static_argnames=("window",)), mesh)
        self.put_block = on_mesh(jax.jit(self._put_block, donate_argnums=(0,)), mesh)
        self.put_state = on_mesh(jax.jit(self._put_state, donate_argnums=(0,)), mesh)
        self.row = on_mesh(jax.jit(self._row), mesh)

    def _take_block(self, cache, start):
        def take(path, x, axes):
            a = token_axis(axes)
            if a is None:
                return None
            st = self.strides[path]
            return take_slots(x, start // st, self.block // st, a, slot_interleave(axes, x.shape))
        return map_with_axes(take, cache)

    def _take_rest(self, cache, hidden, start, window: bool):
        return {"window": self._take_block(cache, start) if window else None,
                "state": jax.tree.map(jnp.copy, split_leaves(cache, keep_token=False)),
                "hidden": None if hidden is None else jnp.copy(hidden)}

    def _put_block(self, cache, block, start):
        new = _by_path(block)

        def put(path, x, axes):
            a = token_axis(axes)
            if a is None:
                return x
            return put_slots(x, new[path], start // self.strides[path], a, slot_interleave(axes, x.shape))
        return shard_cache(map_with_axes(put, cache))

    def _put_state(self, cache, state):
        new = _by_path(state)
        return shard_cache(map_with_axes(
            lambda path, x, axes: x if token_axis(axes) is not None else new[path].astype(x.dtype), cache))

    def _row(self, weights, batch, r):
        """Row ``r`` as a 1-row cache and h of its last consumed token ([1, D]; None without MTP).
        With MTP the pending rows but the last are caught up first (the last pairs h_{N-1} with the
        sampled, never fed token), so the MTP slots cover the same tokens as the model's."""
        row = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, r, 1, 0), batch)
        cache = row["cache"]
        if not self.k:
            return shard_cache(cache), None
        model = nnx.merge(self.graphdef, as_state(weights))
        h, tok, n = row["carry"]["h"], row["carry"]["tok"], row["carry"]["n"]
        keep = n - 1
        index = cache.mtp.slots.index
        rows = jnp.arange(self.k + 1)[None, :] < keep[:, None]
        _, _, cache = model.mtp_forward(h, tok, rows, cache)
        cache = cache.replace(mtp=cache.mtp.replace(slots=cache.mtp.slots.replace(index=index + keep)))
        return shard_cache(cache), jnp.take_along_axis(h, keep[:, None, None], axis=1)[:, 0]


def shared_row_copies(graphdef, k: int, strides: dict[str, int], block: int, mesh=None) -> RowCopies:
    """The ``RowCopies`` of this configuration, one per process (``step_programs``' registry)."""
    key = ("row copies", graphdef, int(k), tuple(sorted(strides.items())), int(block), mesh)
    return shared(key, lambda: RowCopies(graphdef, int(k), dict(strides), int(block), mesh))
