"""Gated grouped-query attention with partial rotary (Qwen3.5/3.8 full-attention layers).

x [B, T, D] ->
  [q | gate] = q_proj(x) per head (2 * head_dim);  k = k_proj(x), v = v_proj(x)   [KVH heads]
  q, k = q_norm(q), k_norm(k)  (zero-centred RMSNorm per head); rotary on the first rotary_dim dims
  o = softmax(q k^T / sqrt(head_dim) + mask) v   (query head h reads kv head h // (H / KVH))
  y = o_proj(o * sigmoid(gate))                                                     [B, T, D]

The KV cache is a pair of slot buffers per layer, ``KVCache(k, v: [B, KVH, L, head_dim])`` (heads
before slots: the layout the attention products read, so XLA does not relay the whole cache out in
every decode step, as it did for ``[B, L, KVH, head_dim]``: 12.9 GB per step for Qwen3.8-27B at 3 x 32k); which
slots hold real tokens (``SlotMeta``, one for all layers), and where this call writes, are passed
in as a ``Slots`` (built once per forward by the model).

The attention reads the filled part of the window only: the jnp key blocks of
``zoo.models.shared.filled_blocks`` (``filled_attention``: blocks up to the batch's longest row) or, on
TPU, the Pallas kernel with per-row lengths (``kernel_attention``, ``zoo.kernels.ragged_attention``:
each row its own blocks); both under ``shard_map`` where the mesh splits the cache over its slots.
That split interleaves the slots (``zoo.sharding.slot_layout``: chip c of n holds slots c, c + n,
...), so every chip holds about 1/n of each row's tokens and a step's reads follow the fill on every
chip.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from zoo.kernels import ragged_attention as ragged
from zoo.kernels.dispatch import attention_kernel
from zoo.models.shared.filled_blocks import (
    F32_MIN,
    block_at,
    blocks_visited,
    first_rows,
    kernel_block,
    kernel_takes,
    key_block,
    online_softmax,
    read_block,
    share_blocks,
    split_online_softmax,
)
from zoo.models.shared.kv_slots import write_slots
from zoo.models.shared.layers import Linear, RMSNorm, apply_rotary
from zoo.ops.matmul import einsum, precision_for
from zoo.sharding.cache_axes import CacheState, cache_state
from zoo.sharding.mesh import current_spec
from zoo.sharding.slot_layout import local_slot, share_flags, share_layout, slot_interleave


class Slots(NamedTuple):
    """Where a forward of T tokens writes and what it may read, for every attention layer.

    write_at   [B]     first slot written by this call (tokens go to write_at .. write_at+T-1)
    key_valid  [B, L]  slot holds a real token (after this call's writes)
    query_slot [B, T]  the slot of each query token (causality: a query reads slots <= its own)
    live       [B]     the row has a real token in this call (idle rows do not widen what is read)
    cos, sin   [B, T, rotary_dim] rotary tables at the tokens' positions
    """

    write_at: jax.Array
    key_valid: jax.Array
    query_slot: jax.Array
    live: jax.Array
    cos: jax.Array
    sin: jax.Array


@cache_state
class SlotMeta(CacheState):
    """Bookkeeping shared by a model's attention caches: ``index [B]`` slots written so far,
    ``pos [B]`` real tokens seen so far (the next position), ``valid [B, L]`` slot holds a token."""

    AXES = {"index": ("batch",), "pos": ("batch",), "valid": ("batch", "cache_len")}
    index: jax.Array
    pos: jax.Array
    valid: jax.Array


@cache_state
class KVCache(CacheState):
    # ``kv_len``: the slots split over "tp" where the KV heads do not divide over it (Qwen3.8-27B's 4 KV
    # heads on 8 chips), instead of every chip holding the whole cache
    AXES = {"k": ("batch", "kv_heads", "kv_len", "head_dim"), "v": ("batch", "kv_heads", "kv_len", "head_dim")}
    k: jax.Array
    v: jax.Array


def empty_slot_meta(batch: int, length: int) -> SlotMeta:
    return SlotMeta(index=jnp.zeros((batch,), jnp.int32), pos=jnp.zeros((batch,), jnp.int32),
                    valid=jnp.zeros((batch, length), bool))


def advance_slots(meta: SlotMeta, mask: jax.Array) -> tuple[dict, jax.Array, SlotMeta]:
    """Account for a call of T tokens (``mask [B, T]``, 1 = token, 0 = padding).

    Returns (fields for ``Slots`` without the rotary tables, positions ``[B, T]``, updated meta).
    A padding token gets the position of the token before it (it is never attended to). The
    caller guarantees ``index + T <= L`` (a full cache would overwrite its last slots).
    """
    t = mask.shape[1]
    mask = mask.astype(bool)
    write_at = meta.index
    valid = write_slots(meta.valid, mask, write_at)
    query_slot = write_at[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    positions = jnp.maximum(meta.pos[:, None] + jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, 0)
    new_meta = SlotMeta(index=write_at + t, pos=meta.pos + mask.sum(axis=1, dtype=jnp.int32), valid=valid)
    return dict(write_at=write_at, key_valid=valid, query_slot=query_slot, live=mask.any(axis=1)), positions, new_meta


def rollback_slots(before: SlotMeta, after: SlotMeta, n_keep: jax.Array) -> SlotMeta:
    """Slot bookkeeping after keeping only the first ``n_keep [B]`` tokens written since ``before``.

    The kept tokens must be real (mask 1) and the prefix of what was written; later slots are
    marked invalid and will be overwritten by the next call.
    """
    index = before.index + n_keep
    slot_ids = jnp.arange(after.valid.shape[1])
    return SlotMeta(index=index, pos=before.pos + n_keep, valid=after.valid & (slot_ids[None, :] < index[:, None]))


def attention_mask(slots: Slots) -> jax.Array:
    """[B, T, L] boolean: key slot is a real token and not after the query's slot."""
    slot_ids = jnp.arange(slots.key_valid.shape[1])
    return slots.key_valid[:, None, :] & (slot_ids[None, None, :] <= slots.query_slot[:, :, None])


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """q [B, T, H, Dk], k [B, G, L, Dk], v [B, G, L, Dv], mask [B, T, L] -> [B, T, H, Dv].

    Softmax in float32; a query with no visible key (padding) gets a uniform average instead of NaN.
    The reference for :func:`filled_attention` (the whole window at once).
    """
    b, t, h, dk = q.shape
    g = k.shape[1]
    qg = q.reshape(b, t, g, h // g, dk)
    scores = einsum("btgrd,bgsd->bgrts", qg, k.astype(q.dtype)).astype(jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    # result in q's dtype directly (accumulated in f32 by every backend): XLA:CPU has no bf16 x bf16
    # -> f32 dot for this layout
    out = jnp.einsum("bgrts,bgsd->btgrd", probs, v.astype(q.dtype), precision=precision_for(q.dtype))
    return out.reshape(b, t, h, v.shape[-1])


def filled_attention(q: jax.Array, k: jax.Array, v: jax.Array, slots: Slots, scale: float) -> jax.Array:
    """:func:`grouped_attention` over the filled part of the window only
    (``zoo.models.shared.filled_blocks``: key blocks up to the last slot any live row has
    written, ``max(write_at) + T``, online softmax; one program for every fill level, its cost following the
    tokens present). Shapes as :func:`grouped_attention`; ``slots`` gives the mask. Where the mesh
    splits the cache over its slots, each chip reads the filled blocks of its own share and the
    partial results are combined across chips (:func:`split_filled_attention`)."""
    spec = current_spec(KVCache.AXES["k"], k.shape)
    kernel = attention_kernel()
    if kernel is not None and kernel_takes(k.shape[2], spec, 2, k.shape[-1], v.shape[-1]):
        return kernel_attention(q, k, v, slots, scale, spec, **kernel)
    if spec is not None and spec[2] is not None:
        return split_filled_attention(q, k, v, slots, scale, spec)
    b, t, h, dk = q.shape
    length = k.shape[2]
    block = key_block(length)
    if block is None:
        return grouped_attention(q, first_rows(k, b), first_rows(v, b), attention_mask(slots), scale)
    n_blocks = blocks_visited(slots.write_at, t, length, slots.live)
    return _blocked_attention(q, k, v, slots.key_valid, slots.query_slot, scale, n_blocks, block, 0, online_softmax)


def _blocked_attention(q, k, v, key_valid, query_slot, scale, n_blocks, block, first, softmax):
    """Online-softmax attention over ``n_blocks`` key blocks of ``k, v [B, G, S, D]`` whose slot 0 is
    global slot ``first`` (``key_valid [B, S]`` local, ``query_slot [B, T]`` global); ``softmax``:
    ``online_softmax`` or a ``split_online_softmax`` bound to its mesh axis."""
    b, t, h, dk = q.shape
    g, dv = k.shape[1], v.shape[-1]
    r = h // g
    qg = q.reshape(b, t, g, r, dk)

    def block_fn(start):
        at, own = block_at(start, block, k.shape[2])
        kb = read_block(k, at, block, 2, b).astype(q.dtype)        # the call's rows of a cache that may hold more
        vb = read_block(v, at, block, 2, b).astype(q.dtype)
        valid = jax.lax.dynamic_slice_in_dim(key_valid, at, block, axis=1) & own[None, :]
        slot_ids = first + at + jnp.arange(block, dtype=jnp.int32)
        mask = valid[:, None, :] & (slot_ids[None, None, :] <= query_slot[:, :, None])     # [B, T, S]
        scores = einsum("btgrd,bgsd->bgrts", qg, kb).astype(jnp.float32) * scale
        # in q's dtype, as grouped_attention (XLA:CPU has no bf16 x bf16 -> f32 dot for this layout)
        mix = lambda p: jnp.einsum("bgrts,bgsd->bgrtd", p.astype(q.dtype), vb,            # noqa: E731
                                   precision=precision_for(q.dtype)).astype(jnp.float32)
        return jnp.where(mask[:, None, None], scores, F32_MIN), mix

    out = softmax(n_blocks, block, block_fn, (b, g, r, t), dv).astype(q.dtype)    # [B, G, R, T, Dv]
    return jnp.moveaxis(out, 3, 1).reshape(b, t, h, dv)


def split_filled_attention(q: jax.Array, k: jax.Array, v: jax.Array, slots: Slots, scale: float,
                           spec: P) -> jax.Array:
    """:func:`filled_attention` with the cache split over its slots on mesh axis ``spec[2]``, under
    ``shard_map``: chip c of n holds slots ``c, c + n, c + 2n, ...`` of every row and KV head (the
    interleaved layout of ``zoo.sharding.slot_layout``: a row filled to f tokens has about f / n on
    every chip), reads the filled blocks of them (none where its share is still empty), and the
    partial softmax sums are combined across the axis. The queries are gathered to every chip (they
    are T tokens); the result is whole on every chip. Shapes as :func:`grouped_attention`."""
    axis = spec[2]
    local = functools.partial(split_attention_share, axis=axis, scale=scale, interleaved=_interleaved(k))
    rows = P(spec[0])
    return jax.shard_map(local, in_specs=(P(spec[0], None, None, None), spec, spec, P(spec[0], None),
                                          P(spec[0], None), rows, rows),
                         out_specs=P(spec[0], None, None, None), check_vma=False)(
        q, k, v, slots.key_valid, slots.query_slot, slots.write_at, slots.live)


def _interleaved(k: jax.Array) -> bool:
    """Whether the current mesh interleaves the slots of a KV cache shaped like ``k``
    (``slot_layout.INTERLEAVED_AXES``)."""
    return slot_interleave(KVCache.AXES["k"], k.shape) > 1


def split_attention_share(q, k, v, key_valid, query_slot, write_at, live, *, axis: str, scale: float,
                          interleaved: bool):
    """One chip's part of :func:`split_filled_attention` (under ``shard_map``, or ``vmap`` with
    ``axis_name``): ``k, v [B, G, S, D]`` its share of the slots in local order (``interleaved`` or
    contiguous: ``slot_layout.share_layout``), the rest whole (``key_valid [B, L]`` too); returns the
    whole result ``[B, T, H, Dv]``, combined across ``axis``. Visibility is compared in local slots."""
    share = k.shape[2]
    offset, stride = share_layout(axis, share, interleaved)
    block, n_blocks = share_blocks(write_at, q.shape[1], share, offset, stride, live)
    softmax = functools.partial(split_online_softmax, axis)
    key_valid = share_flags(key_valid, axis, share, interleaved)
    return _blocked_attention(q, k, v, key_valid, local_slot(query_slot, offset, stride), scale, n_blocks, block,
                              0, softmax)


def kernel_attention(q: jax.Array, k: jax.Array, v: jax.Array, slots: Slots, scale: float, spec: P | None,
                     *, interpret: bool = False) -> jax.Array:
    """:func:`filled_attention` by the Pallas kernel (``zoo.kernels.ragged_attention``): each row
    reads its own filled key blocks, not the batch's longest. Under a mesh it runs in ``shard_map``:
    rows and heads as the cache is split, and where the slots are split each chip reads its share
    and the partial sums are combined across the axis. Shapes as :func:`grouped_attention`."""
    local = functools.partial(kernel_attention_share, axis=None if spec is None else spec[2], scale=scale,
                              interpret=interpret, interleaved=_interleaved(k))
    args = (q, k, v, slots.key_valid, slots.query_slot, slots.write_at, slots.live)
    if spec is None:
        return local(*args)
    heads = P(spec[0], None, spec[1], None)
    rows = P(spec[0])
    return jax.shard_map(local, in_specs=(heads, spec, spec, P(spec[0], None), P(spec[0], None), rows, rows),
                         out_specs=heads, check_vma=False)(*args)


def kernel_attention_share(q, k, v, key_valid, query_slot, write_at, live, *, axis: str | None, scale: float,
                           interpret: bool = False, interleaved: bool = False):
    """One chip's part of :func:`kernel_attention` (the whole call where ``axis`` is None): ``k, v
    [B, G, S, D]`` its share of the slots in local order (``interleaved`` or contiguous), ``key_valid
    [B, L]`` whole; returns ``[B, T, H, Dv]``."""
    b, t, h, dk = q.shape
    g, dv = k.shape[1], v.shape[-1]
    r = h // g
    qg = jnp.moveaxis(q.reshape(b, t, g, r, dk), 1, 2).reshape(b, g, t * r, dk)    # token-major: row t * R + r
    if axis is not None:
        key_valid = share_flags(key_valid, axis, k.shape[2], interleaved)
    out = ragged.share_attention(qg, k, v, key_valid, query_slot, write_at, live, axis=axis,
                                 block=kernel_block(k.shape[2]), scale=scale, interpret=interpret,
                                 interleaved=interleaved)
    return jnp.moveaxis(out.reshape(b, g, t, r, dv), 2, 1).reshape(b, t, h, dv).astype(q.dtype)


class GatedAttention(nnx.Module):
    def __init__(self, cfg, *, dtype):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.dtype = dtype
        bias = cfg.attention_bias
        self.q_proj = Linear(d, self.n_heads * hd * 2, axes=("embed", "heads"), dtype=dtype, use_bias=bias)
        self.k_proj = Linear(d, self.n_kv * hd, axes=("embed", "kv_heads"), dtype=dtype, use_bias=bias)
        self.v_proj = Linear(d, self.n_kv * hd, axes=("embed", "kv_heads"), dtype=dtype, use_bias=bias)
        self.o_proj = Linear(self.n_heads * hd, d, axes=("heads", "embed"), dtype=dtype, use_bias=bias)
        norm = dict(eps=cfg.rms_norm_eps, dtype=dtype, zero_centered=True, axes=("head_dim",))
        self.q_norm = RMSNorm(hd, **norm)
        self.k_norm = RMSNorm(hd, **norm)

    def init_cache(self, batch: int, length: int) -> KVCache:
        shape = (batch, self.n_kv, length, self.head_dim)
        return KVCache(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype))

    def __call__(self, x: jax.Array, slots: Slots, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """x [B, T, D] -> (y [B, T, D], cache with this call's keys/values written)."""
        b, t, _ = x.shape
        q_gate = self.q_proj(x).reshape(b, t, self.n_heads, 2 * self.head_dim)
        q, gate = q_gate[..., :self.head_dim], q_gate[..., self.head_dim:]
        q = apply_rotary(self.q_norm(q), slots.cos, slots.sin)
        k = self.k_norm(self.k_proj(x).reshape(b, t, self.n_kv, self.head_dim))
        k = apply_rotary(k, slots.cos, slots.sin)
        v = self.v_proj(x).reshape(b, t, self.n_kv, self.head_dim)
        heads_first = lambda a: jnp.swapaxes(a, 1, 2)                       # noqa: E731   [B, T, G, D] -> [B, G, T, D]
        axes = KVCache.AXES["k"]
        cache = KVCache(k=write_slots(cache.k, heads_first(k), slots.write_at, axes, slot_axis=2),
                        v=write_slots(cache.v, heads_first(v), slots.write_at, axes, slot_axis=2))
        o = filled_attention(q, cache.k, cache.v, slots, self.head_dim ** -0.5)
        gate = jax.nn.sigmoid(gate.reshape(b, t, -1).astype(jnp.float32)).astype(x.dtype)
        o = o.reshape(b, t, self.n_heads * self.head_dim) * gate
        return self.o_proj(o), cache
