"""Attention over the filled part of a slot cache: key blocks up to the last slot any row holds,
combined with an online softmax (flash-attention style), shared by Qwen's gated attention and GLM's
absorbed MLA.

    key_block(L, widths=(512, 256)) -> one of widths | None   slots per block (None: the window is under
        two blocks of the narrowest)
    kernel_block(S) -> the Pallas kernel's block for a share of S slots
    share_of(L, axis) -> the slots one chip holds where the mesh splits them over ``axis``
    kernel_takes(L, spec, slot_dim, dk, dv) -> whether the Pallas kernel computes a call
    block_at(start, block, L) -> (at, own [block])  where a block is read (a last block that would
        run past the window overlaps the one before it; ``own`` masks the slots read twice)
    blocks_visited(write_at [B], T, L, live [B]) -> int32 scalar, blocks up to max(write_at) + T over
        the live rows (those with a real token in the call), at least one
    read_block(x, at, block, axis, rows) -> x's slots at..at+block-1 on ``axis``, of its first ``rows``
    first_rows(x, rows) -> x [:rows]
    online_softmax(n_blocks, block, block_fn, stats_shape, d_out) -> float32 [*stats_shape, d_out]
        block_fn(start) -> (scores float32 [*stats_shape, S], masked entries at F32_MIN,
                            mix: p [*stats_shape, S] -> float32 [*stats_shape, d_out])
    split_online_softmax(axis, ...)  the same inside ``shard_map`` where the keys are split over the
        slots on mesh ``axis`` (each chip its blocks, then combined); ``local_blocks`` gives a
        chip's block count (``share_blocks`` for an interleaved share)

A cache may hold more rows than a call computes (``zoo.engine.step_programs.decode_narrow`` passes
the whole batch's slot buffers to a step of its first rows, so that they are written in place): the
reads take the call's rows, the first ones (``read_block``, ``first_rows``).

The block count is a traced loop bound, so one program serves every fill level. A row's result
does not depend on how many blocks the call visits: an all-masked block adds exact zeros to a row
that has a visible key (its running max is then real, so ``exp(F32_MIN - max)`` is 0 and the
rescale ``exp(0)`` is 1). A query with no visible key averages the visited slots.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from zoo.kernels.ragged_attention import supported as ragged_supported
from zoo.kernels.ragged_attention import token_blocks as ragged_token_blocks

F32_MIN = jnp.finfo(jnp.float32).min


def key_block(length: int, widths: tuple[int, ...] = (512, 256)) -> int | None:
    """Slots per key block for a window of ``length`` slots: the widest of ``widths`` that divides it
    into at least two blocks; else the widest of them that fits twice (the last block then starts
    at ``length - block`` and reads only the slots no block before it read: :func:`block_at`); or
    None (the whole window at once)."""
    fits = [n for n in widths if length >= 2 * n]
    return next((n for n in fits if length % n == 0), fits[0] if fits else None)


def kernel_block(share: int) -> int:
    """Slots per key block of the Pallas attention kernel (``zoo.kernels.ragged_attention``) for a
    share of ``share`` slots: :func:`key_block`'s width (the kernel's last block may run past the
    share), or the share whole."""
    return key_block(share) or share


def kernel_takes(length: int, spec, slot_dim: int, dk: int, dv: int) -> bool:
    """Whether the Pallas attention kernel computes a call over a window of ``length`` slots with
    head dims ``dk, dv``, the cache laid out by ``spec`` (its slots on ``spec[slot_dim]``; None: no
    mesh): on one device a window of at least two blocks of the narrowest width (else the
    whole-window product), and blocks and heads the kernel takes (``ragged_attention.supported``)."""
    share = share_of(length, None if spec is None else spec[slot_dim])
    if spec is None and key_block(share) is None:
        return False
    return ragged_supported(share, kernel_block(share), dk, dv)


def share_of(length: int, axis) -> int:
    """Slots of a window of ``length`` one chip holds where the mesh splits the slots over ``axis``
    (a mesh axis name, a tuple of them, or None: not split)."""
    if axis is None:
        return length
    names = axis if isinstance(axis, tuple) else (axis,)
    mesh = jax.sharding.get_abstract_mesh()
    return length // math.prod(mesh.shape[a] for a in names)


def block_at(start: jax.Array, block: int, length: int) -> tuple[jax.Array, jax.Array]:
    """Where the block that begins at slot ``start`` (a multiple of ``block``) is read in a window of
    ``length`` slots, and which of its slots are its own: ``(at, own [block])`` with ``at = min(start,
    length - block)`` and ``own[j] = at + j >= start`` (all True but in a last block that overlaps
    the one before it)."""
    at = jnp.minimum(start, length - block)
    return at, at + jnp.arange(block, dtype=jnp.int32) >= start


def blocks_visited(write_at: jax.Array, t: int, length: int, live: jax.Array | None = None) -> jax.Array:
    """int32 scalar: the key blocks a call of ``t`` tokens written at ``write_at [B]`` reads, those up
    to the last slot a live row holds after the call (``max(write_at) + t`` over the rows where
    ``live [B]`` holds, every row if None), and at least one.

    ``live``: the rows with a real token in this call. An idle row (a finished request's, or one never
    used, whose write index still moves with every step) does not widen the call: after a long
    request ends, the steps of the short ones read their own fill again. An idle row's output is
    never used (it is finite: a query with no visible key averages the visited slots)."""
    _, n, _ = local_blocks(write_at, t, length, 0, live)                 # the whole window as one share
    return jnp.maximum(n, 1)


def read_block(x: jax.Array, at: jax.Array, block: int, axis: int, rows: int) -> jax.Array:
    """``x``'s slots ``at .. at + block - 1`` on ``axis``, of its first ``rows`` rows (axis 0): a
    block of a cache that may hold more rows than the call computes."""
    starts = [0] * x.ndim
    starts[axis] = at
    sizes = list(x.shape)
    sizes[0], sizes[axis] = rows, block
    return jax.lax.dynamic_slice(x, starts, sizes)


def first_rows(x: jax.Array, rows: int) -> jax.Array:
    """``x`` [:rows] (``x`` itself where it has that many rows)."""
    return x if x.shape[0] == rows else x[:rows]


def online_softmax(n_blocks: jax.Array, block: int, block_fn: Callable, stats_shape: tuple[int, ...],
                   d_out: int) -> jax.Array:
    """``softmax(scores) @ values`` over blocks ``0 .. n_blocks-1`` (see the module docstring), in
    float32 ``[*stats_shape, d_out]``."""
    _, total, acc = _running_sums(n_blocks, block, block_fn, stats_shape, d_out)
    return acc / total[..., None]


def split_online_softmax(axis: str, n_blocks: jax.Array, block: int, block_fn: Callable,
                         stats_shape: tuple[int, ...], d_out: int) -> jax.Array:
    """:func:`online_softmax` where each chip of mesh ``axis`` holds a share of the keys (called
    inside ``shard_map``): each chip runs its own ``n_blocks`` (0 allowed: a chip whose slots hold no
    token reads nothing), then the running maxima, sums and weighted values are combined across the
    axis (a max and two sums of ``[*stats_shape]`` / ``[*stats_shape, d_out]``, flash-decoding style).
    Every chip returns the whole result, float32 ``[*stats_shape, d_out]``."""
    m, total, acc = _running_sums(n_blocks, block, block_fn, stats_shape, d_out)
    m_all = jax.lax.pmax(m, axis)
    keep = jnp.exp(m - m_all)
    total = jax.lax.psum(total * keep, axis)
    acc = jax.lax.psum(acc * keep[..., None], axis)
    return acc / total[..., None]


def _running_sums(n_blocks, block, block_fn, stats_shape, d_out):
    """(running max, sum of exp, exp-weighted values) over blocks ``0 .. n_blocks-1``."""

    def step(i, carry):
        m, total, acc = carry
        scores, mix = block_fn(i * block)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        p = jnp.exp(scores - m_new[..., None])
        keep = jnp.exp(m - m_new)
        return m_new, total * keep + p.sum(axis=-1), acc * keep[..., None] + mix(p)

    init = (jnp.full(stats_shape, F32_MIN, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros((*stats_shape, d_out), jnp.float32))
    return jax.lax.fori_loop(0, n_blocks, step, init)


def local_blocks(write_at: jax.Array, t: int, share: int, shard: jax.Array, live: jax.Array | None = None):
    """The key blocks one chip reads where a window is split evenly over a mesh axis, ``share`` slots
    per chip (chip ``shard`` holds global slots ``shard * share .. (shard + 1) * share - 1``).

    Returns ``(block, n_blocks, first_slot)``: the block width (``key_block(share)``, or the whole
    share), how many of the chip's blocks reach up to the last slot a live row holds after a call of
    ``t`` tokens at ``write_at [B]`` (0 where its share holds none of them), and its first global slot."""
    first = shard * share
    block, n = share_blocks(write_at, t, share, first, 1, live)
    return block, n, first


def share_blocks(write_at: jax.Array, t: int, share: int, offset, stride, live: jax.Array | None = None):
    """:func:`local_blocks` for a share of any layout (``zoo.sharding.slot_layout.share_layout``:
    global slot g is local slot ``(g - offset) // stride``): ``(block, n_blocks)``, the blocks of the
    share up to the last slot a live row holds after the call."""
    block = key_block(share) or share
    live = jnp.ones(write_at.shape, bool) if live is None else live
    last = ragged_token_blocks(write_at + t - 1, 1, live, share, block, offset, stride)    # each row's last token
    return block, jnp.max(last)
