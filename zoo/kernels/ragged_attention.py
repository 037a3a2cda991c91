"""Attention over the filled part of each row's slot cache: a Pallas TPU kernel with per-row (and
per-token) lengths that skips empty key blocks (flash-decoding style), and its jnp reference.

    ragged_attention(q, k, v, key_valid, query_slot, n_blocks, first, *, block, scale, selection=None)
        -> (m, l, acc)
        q           [B, G, M, Dk]    M = T * P query rows per KV head, token-major: rows t*P .. t*P+P-1
                                     are token t's (the P heads of a group; all H heads for GLM's MLA)
        k, v        [Bc, G, S, Dk] / [Bc, G, S, Dv]   a cache (or one chip's share of S of its slots);
                                     it may hold more rows than the call (Bc >= B): the call's are its first.
                                     ``v`` None: the values are the keys (GLM's latent, read once)
        key_valid   [Bc, S] bool     the slot holds a token
        query_slot  [B, T] int32     the global slot of each token (it reads slots <= its own)
        n_blocks    [B, T] int32     key blocks token t of row b reads: blocks 0 .. n_blocks-1 of ``block``
        first       int32 scalar     the global slot of the share's slot 0
        selection   PoolSelection    instead of ``key_valid`` and ``query_slot`` (then unused): the slots
                                     each token sees from GLM's indexer (its pools, the slots' positions)
      -> m, l  float32 [B, G, M]      running max of the scores, sum of exp(score - m)
         acc   float32 [B, G, M, Dv]  sum of exp(score - m) * v
    token_blocks(write_at [B], t, live [B], share, block, first) -> n_blocks [B, T]
    finish(m, l, acc) -> acc / l      (0 for a query row that read nothing)
    combine(m, l, acc, axis) -> the same over the shares of a mesh axis
    share_attention(q, k, v, key_valid, query_slot, write_at [B], live [B], *, axis, block, scale, ...)
        -> one chip's share of a call, finished (block counts, kernel, finish or combine)
    reference_attention(...)          the same contract in jnp (the blocks each token reads, masked)

Each row, and each block of its tokens, reads its own blocks, not the batch's longest. The grid is
``(row, query block, key block)``; a query block is a run of whole tokens (:func:`tokens_per_block`),
and a step takes every KV head (enough bytes to hide a grid step's fixed cost). A key block past the
count of a (row, query block) maps (``index_map``, :func:`block_read`) to its last block, which is
already resident, so the pipeline moves nothing for it, and its compute is skipped (``pl.when``). A
step's cost therefore follows the tokens each row holds: a row at 4k of a 32k window reads 4k of
keys whatever the other rows hold, and in a prefill chunk the first tokens do not read the slots of
the last. The counts come in by scalar prefetch, so one program serves every fill level.

The slots a token sees are made per token and block (``[tokens, block]``: from ``key_valid`` and
causality, or from the token's pool flags at each slot's pool: a row's positions rise by one per slot,
so a block's slots span at most ``block / pool + 1`` pools, read as a 128-aligned lane window of the
flags (``pool_window``, ``window_starts``) and gathered 128 lanes at a time) and spread to the
token's query rows with a 0/1 matmul (exact), so any head count works.
Scores and the softmax are float32; the values are mixed in v's dtype with float32 accumulation, as
``zoo.models.qwen38.gated_attention.grouped_attention`` does. A query row with no visible key in the
blocks it reads (padding) averages them, as ``zoo.models.shared.filled_blocks.online_softmax`` does;
one that reads no block gets ``l = 0`` (:func:`finish` gives 0).

Shapes the kernel takes (:func:`supported`): ``block`` a multiple of 128 and at most ``S``, head dims
multiples of 128 (Qwen3.8-27B's 256, GLM-5.3-Flash's 512-dim latent). Where ``block`` does not divide
``S`` (Qwen3.8-27B's 33,024-slot window is 4,128 slots a chip), the last block runs past the share:
its slots there are masked out and their values zeroed (whatever the buffer holds past the array;
interpret mode fills it with NaN, which the tests rely on). The caller falls back to the jnp blocks
otherwise.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from zoo.kernels.census import record
from zoo.ops.matmul import precision_for
from zoo.sharding.slot_layout import local_slot, share_layout

F32 = jnp.float32
F32_MIN = jnp.finfo(jnp.float32).min
LANES = 128
Q_ROWS = 1024            # query rows per grid step, at most (a prefill chunk's rows are split into runs of
                         # whole tokens; each run reads the row's keys again, up to its own last token)


def supported(share: int, block: int, dk: int, dv: int) -> bool:
    """Whether the kernel takes a share of ``share`` slots in blocks of ``block`` with head dims ``dk, dv``:
    the block a multiple of 128 lanes within the share, the head dims whole lanes (a narrower head is
    padded to 128 lanes as a kernel operand, and XLA then relays the whole cache out for every call:
    measured on qwen38-tiny's 32-wide heads at 32M slots a row, 1 row fit a v5e-8 instead of 2)."""
    return block % LANES == 0 and share >= block and dk % LANES == 0 and dv % LANES == 0


def token_blocks(write_at: jax.Array, t: int, live: jax.Array, share: int, block: int, first,
                 stride=1) -> jax.Array:
    """int32 [B, T]: the key blocks of a share (``share`` slots; global slot g is its local slot
    ``(g - first) // stride``: ``zoo.sharding.slot_layout.share_layout``) that token i of row b reads
    in a call of ``t`` tokens written at ``write_at[b]``: those up to its own slot ``write_at[b] + i``;
    none for a row without a real token in the call (``live[b]`` False) or a token whose slots all lie
    before the share."""
    slot = write_at[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    reach = jnp.where(live[:, None], local_slot(slot, first, stride) + 1, 0)
    return jnp.clip(-(-reach // block), 0, -(-share // block)).astype(jnp.int32)


def block_read(j, n_blocks):
    """The key block grid step ``j`` brings in for a (row, query block) that reads ``n_blocks``: block
    ``j`` up to its last one, then that last one again (the block already resident, so the pipeline
    moves nothing for the steps past the fill); block 0 for one that reads none."""
    return jnp.minimum(j, jnp.maximum(n_blocks - 1, 0))


def tokens_per_block(t: int, per_token: int) -> int:
    """Tokens per query block: all ``t`` while their ``t * per_token`` rows are at most :data:`Q_ROWS`,
    else the largest divisor of ``t`` that is a multiple of 8 and keeps a block within it (``t``
    itself if there is none)."""
    if t * per_token <= Q_ROWS:
        return t
    return next((d for d in range(Q_ROWS // per_token // 8 * 8, 7, -8) if t % d == 0), t)


class PoolSelection(NamedTuple):
    """The slots each token sees, from GLM's sparse indexer: the slot's pool (``pool`` consecutive
    positions) is selected for the token, or (``select_tail``) lies in the token's own incomplete pool,
    and it holds a position at or before the token's (``zoo.models.glm53.mla.pool_visibility``).

    pools      [B, T, NP] bool   the selected pools of each token (whole: every pool of the window)
    key_pos    [Bc, S] int32     the position each slot of the share holds (-1: empty)
    query_pos  [B, T] int32      each token's position
    """

    pools: jax.Array
    key_pos: jax.Array
    query_pos: jax.Array
    pool: int
    select_tail: bool


def pool_window(pool: int, block: int) -> int:
    """Lanes of a token's pool flags a key block can need: the pools its positions span (a row's
    positions rise by one per slot, with empty slots between: at most ``block`` consecutive
    positions, so at most ``(block - 1) // pool + 2`` pools) after a start aligned down to 128 lanes
    (up to 127 lanes before the first)."""
    return -(-((block - 1) // pool + 2 + LANES - 1) // LANES) * LANES


def window_starts(key_pos: jax.Array, rows: int, pool: int, block: int, n_k: int) -> jax.Array:
    """int32 [rows * n_k]: for each row and key block, the first pool-flag lane its window reads (the
    block's smallest pool, aligned down to 128; 0 for a block without a token)."""
    kp = key_pos[:rows]
    kp = jnp.pad(kp, ((0, 0), (0, n_k * block - kp.shape[1])), constant_values=-1).reshape(rows, n_k, block)
    lowest = jnp.min(jnp.where(kp >= 0, kp // pool, jnp.iinfo(jnp.int32).max), axis=2)
    lowest = jnp.where(lowest == jnp.iinfo(jnp.int32).max, 0, lowest)
    return (lowest // LANES * LANES).astype(jnp.int32).reshape(-1)


def ragged_attention(q, k, v, key_valid, query_slot, n_blocks, first, *, block: int, scale: float,
                     selection: PoolSelection | None = None, interpret: bool = False, stride: int = 1):
    """The kernel (module docstring); ``(m [B, G, M], l [B, G, M], acc [B, G, M, Dv])``, float32.
    ``stride``: the share holds every ``stride``-th slot of its rows (an interleaved share, whose
    ``query_slot`` and ``first`` the caller gave in local slots); only the census uses it (a row
    filled to f tokens has f / stride of them here)."""
    b, g, m, dk = q.shape
    t = n_blocks.shape[1]
    share = k.shape[2]
    dv = dk if v is None else v.shape[-1]
    if not supported(share, block, dk, dv) or m % t:
        raise ValueError(f"ragged_attention: a share of {share} slots in blocks of {block} (the block must be a "
                         f"multiple of 128 and at most the share), {m} query rows for {t} tokens")
    per_token = m // t
    tq = tokens_per_block(t, per_token)
    mq, n_q, n_k = tq * per_token, t // tq, -(-share // block)
    counts = n_blocks.astype(jnp.int32).reshape(b, n_q, tq).max(axis=2).reshape(-1)      # per (row, query block)
    first = jnp.reshape(jnp.asarray(first, jnp.int32), (1,))

    def last(r, i, j, nb):
        return block_read(j, nb[r * n_q + i])

    # a step takes every KV head of the call (the chip's), so that it moves enough bytes to hide its
    # fixed cost: 4 heads x 512 slots x (256 + 256) x 2 bytes = 2 MiB for Qwen3.8-27B on a v5e-8
    in_specs = [pl.BlockSpec((None, g, mq, dk), lambda r, i, j, nb, *_: (r, 0, i, 0)),
                pl.BlockSpec((None, g, block, dk), lambda r, i, j, nb, *_: (r, 0, last(r, i, j, nb), 0))]
    operands = [q, k]
    if v is not None:
        in_specs.append(pl.BlockSpec((None, g, block, dv), lambda r, i, j, nb, *_: (r, 0, last(r, i, j, nb), 0)))
        operands.append(v)
    slots_spec = pl.BlockSpec((None, 1, block), lambda r, i, j, nb, *_: (r, 0, last(r, i, j, nb)))
    tokens_spec = pl.BlockSpec((None, tq, 1), lambda r, i, j, nb, *_: (r, i, 0))
    width, starts, flag_bytes = 0, jnp.zeros((1,), jnp.int32), 0
    if selection is None:
        in_specs += [slots_spec, tokens_spec]
        operands += [key_valid.astype(jnp.int32)[:, None, :], query_slot.astype(jnp.int32)[:, :, None]]
    else:
        width = pool_window(selection.pool, block)
        n_pools = selection.pools.shape[2]
        lanes = -(-n_pools // LANES) * LANES + width                      # every window stays inside
        # whole sublane tiles of flags (Mosaic's lane gather takes [8k, 128]): a query block of fewer than
        # 8 tokens, or of a count 8 does not divide, is the call's only one, padded with unused rows
        flag_rows = tq if tq % 8 == 0 else -(-tq // 8) * 8
        flags = jnp.pad(selection.pools.astype(jnp.int32),
                        ((0, 0), (0, flag_rows * n_q - t), (0, lanes - n_pools)))
        flag_bytes = flag_rows * lanes * 4
        starts = window_starts(selection.key_pos, b, selection.pool, block, n_k)
        in_specs += [slots_spec, tokens_spec,
                     pl.BlockSpec((None, flag_rows, lanes), lambda r, i, j, nb, *_: (r, i, 0))]
        operands += [selection.key_pos.astype(jnp.int32)[:, None, :],
                     selection.query_pos.astype(jnp.int32)[:, :, None], flags]
    stat_spec = pl.BlockSpec((None, g, mq, LANES), lambda r, i, j, nb, *_: (r, 0, i, 0))
    acc_spec = pl.BlockSpec((None, g, mq, dv), lambda r, i, j, nb, *_: (r, 0, i, 0))
    stats = [pltpu.VMEM((g, mq, LANES), F32), pltpu.VMEM((g, mq, LANES), F32), pltpu.VMEM((g, mq, dv), F32)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(b, n_q, n_k), in_specs=in_specs,
        out_specs=[stat_spec, stat_spec, acc_spec], scratch_shapes=stats)
    step_bytes = g * block * (dk + (0 if v is None else dv)) * k.dtype.itemsize
    record("ragged_attention", b * n_q * n_k, step_bytes, b * n_q * n_k * step_bytes, share, block, stride)
    state = g * mq * (2 * LANES + dv) * 4
    mask_bytes = block * 4 + tq * 4 + flag_bytes
    vmem = 2 * (g * mq * dk * q.dtype.itemsize + step_bytes + mask_bytes + state) + state + 6 * mq * block * 4
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                  vmem_limit_bytes=None if vmem <= 12 << 20 else min(100 << 20, vmem * 3 // 2))
    kernel = functools.partial(
        _kernel, block=block, scale=scale, n_q=n_q, n_k=n_k, share=share, heads=g, shared_values=v is None,
        per_token=per_token, pools=None if selection is None else (selection.pool, selection.select_tail, width))
    m_out, l_out, acc = pl.pallas_call(
        kernel, grid_spec=grid_spec, compiler_params=params, interpret=interpret,
        out_shape=[jax.ShapeDtypeStruct((b, g, m, LANES), F32), jax.ShapeDtypeStruct((b, g, m, LANES), F32),
                   jax.ShapeDtypeStruct((b, g, m, dv), F32)],
    )(counts, first, starts, *operands)
    return m_out[..., 0], l_out[..., 0], acc


def _lane_gather(table: jax.Array, index: jax.Array) -> jax.Array:
    """``table [R, W]`` (W a multiple of 128) at lane ``index [1, N]`` (N a multiple of 128, each in
    ``[0, W)``) for every row: ``[R, N]``, by 128-lane gathers (one per 128-lane slice of the table,
    kept where the index's high bits select it)."""
    rows = table.shape[0]
    tiles = []
    for o in range(index.shape[1] // LANES):
        idx = jnp.broadcast_to(index[:, o * LANES:(o + 1) * LANES], (rows, LANES))
        out = jnp.zeros((rows, LANES), table.dtype)
        for c in range(table.shape[1] // LANES):
            got = jnp.take_along_axis(table[:, c * LANES:(c + 1) * LANES], idx & (LANES - 1), axis=-1)
            out = jnp.where(jnp.right_shift(idx, 7) == c, got, out)
        tiles.append(out)
    return tiles[0] if len(tiles) == 1 else jnp.concatenate(tiles, axis=1)


def _kernel(nb_ref, first_ref, start_ref, *refs, block: int, scale: float, n_q: int, n_k: int, share: int,
            heads: int, shared_values: bool, per_token: int, pools):
    q_ref, k_ref, *refs = refs
    v_ref = k_ref if shared_values else refs.pop(0)
    if pools is None:
        valid_ref, slot_ref, m_ref, l_ref, acc_ref, m_sc, l_sc, acc_sc = refs
    else:
        kpos_ref, qpos_ref, flags_ref, m_ref, l_ref, acc_ref, m_sc, l_sc, acc_sc = refs
    row, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    mq = q_ref.shape[1]
    tq = mq // per_token

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, F32_MIN, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    @pl.when(j < nb_ref[row * n_q + i])
    def _():
        local = j * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        inside = local < share                      # a last block past the share: the rest is not the cache's
        if pools is None:
            seen = inside & (valid_ref[...] != 0) & (first_ref[0] + local <= slot_ref[...])   # [tq, block]
        else:                                       # the token's pool flags at each slot's pool
            pool, select_tail, width = pools
            kp, qp = kpos_ref[...], qpos_ref[...]                                      # [1, block], [tq, 1]
            start = start_ref[row * n_k + j]
            window = flags_ref[:, pl.ds(pl.multiple_of(start, LANES), width)]          # [tq, width]
            lane = jnp.clip(jnp.where(kp >= 0, kp // pool - start, 0), 0, width - 1)
            seen = _lane_gather(window, lane)[:tq] != 0
            if select_tail:
                seen = seen | (kp >= (qp + 1) - (qp + 1) % pool)
            seen = seen & inside & (kp >= 0) & (kp <= qp)
        if per_token == 1:
            visible = seen
        else:                                       # token t's slots to its rows t*P .. t*P+P-1 (exact 0/1 sums)
            owner = jax.lax.broadcasted_iota(jnp.int32, (mq, tq), 0) // per_token
            spread = (owner == jax.lax.broadcasted_iota(jnp.int32, (mq, tq), 1)).astype(jnp.bfloat16)
            visible = jnp.dot(spread, seen.astype(jnp.bfloat16), preferred_element_type=F32) > 0.5   # [Mq, block]
        rows_inside = j * block + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0) < share
        for h in range(heads):                      # the KV heads of the step, each with its query rows
            q, k, v = q_ref[h], k_ref[h], v_ref[h]
            s = jax.lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
                                    precision=precision_for(q.dtype), preferred_element_type=F32) * scale
            if share % block:
                v = jnp.where(rows_inside, v, jnp.zeros_like(v))                    # whatever it holds, 0 weight
            s = jnp.where(visible, s, F32_MIN)                                       # [Mq, block]
            m_prev = m_sc[h]                                                         # [Mq, 128], lanes equal
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
            p = jnp.exp(s - m_new[:, :1])
            keep = jnp.exp(m_prev - m_new)
            l_sc[h] = l_sc[h] * keep + jnp.sum(p, axis=-1, keepdims=True)
            mix = jnp.dot(p.astype(v.dtype), v, precision=precision_for(v.dtype), preferred_element_type=F32)
            acc_sc[h] = acc_sc[h] * keep[:, :1] + mix
            m_sc[h] = m_new

    @pl.when(j == n_k - 1)
    def _():
        m_ref[...] = m_sc[...]
        l_ref[...] = l_sc[...]
        acc_ref[...] = acc_sc[...]


def share_attention(q, k, v, key_valid, query_slot, write_at, live, *, axis, block: int, scale: float,
                    selection: PoolSelection | None = None, interpret: bool = False,
                    interleaved: bool = False) -> jax.Array:
    """One chip's share of a call, finished: each token's block counts from ``write_at [B]`` and
    ``live [B]`` (:func:`token_blocks`, the share's slots as ``zoo.sharding.slot_layout.share_layout``
    lays them out over ``axis``: ``interleaved``, or contiguous from ``axis_index(axis) * S``; the
    whole window where ``axis`` is None), the kernel, then :func:`finish` or, across ``axis``,
    :func:`combine`. ``key_valid`` is the share's, in its local order; ``query_slot`` global. Shapes
    as :func:`ragged_attention`; returns float32 ``[B, G, M, Dv]``."""
    share = k.shape[2]
    t = (query_slot if selection is None else selection.query_pos).shape[1]
    first, stride = (0, 1) if axis is None else share_layout(axis, share, interleaved)
    if interleaved and selection is not None:
        raise ValueError("share_attention: GLM's pool selection reads contiguous shares only")
    n_blocks = token_blocks(write_at, t, live, share, block, first, stride)
    if stride != 1:                     # visibility in local slots: j <= local_slot(q)
        query_slot, first = local_slot(query_slot, first, stride), 0
    m, l, acc = ragged_attention(q, k, v, key_valid, query_slot, n_blocks, first, block=block,  # noqa: E741
                                 scale=scale, selection=selection, interpret=interpret, stride=stride)
    return finish(m, l, acc) if axis is None else combine(m, l, acc, axis)


def finish(m: jax.Array, l: jax.Array, acc: jax.Array) -> jax.Array:        # noqa: E741
    """``acc / l`` float32 ``[..., Dv]``; 0 where a query row read no block (``l = 0``)."""
    del m
    return acc / jnp.where(l == 0, 1.0, l)[..., None]


def combine(m: jax.Array, l: jax.Array, acc: jax.Array, axis: str) -> jax.Array:  # noqa: E741
    """:func:`finish` over the shares of mesh ``axis`` (inside ``shard_map``): each chip's running
    max, sum and values rescaled to the global max and summed. Every chip returns the whole result."""
    m_all = jax.lax.pmax(m, axis)
    keep = jnp.exp(m - m_all)
    return finish(m_all, jax.lax.psum(l * keep, axis), jax.lax.psum(acc * keep[..., None], axis))


def reference_attention(q, k, v, key_valid, query_slot, n_blocks, first, *, block: int, scale: float,
                        token_mask=None):
    """jnp twin of :func:`ragged_attention`: the whole share at once, each query block masked to the
    blocks it reads; the same ``(m, l, acc)``."""
    b, g, m, dk = q.shape
    t, share = n_blocks.shape[1], k.shape[2]
    per_token = m // t
    tq = tokens_per_block(t, per_token)
    v = k if v is None else v
    k, v = k[:b], v[:b]
    s = jnp.einsum("bgmd,bgsd->bgms", q, k.astype(q.dtype), precision=precision_for(q.dtype),
                   preferred_element_type=F32) * scale
    local = jnp.arange(share, dtype=jnp.int32)
    counts = jnp.repeat(n_blocks.reshape(b, t // tq, tq).max(axis=2), tq * per_token, axis=1)     # [B, M]
    read = local[None, None, :] < (counts * block)[:, :, None]                         # [B, M, S]
    if token_mask is None:
        seen = key_valid[:b, None, :] & (first + local[None, None, :] <= query_slot[:, :, None])   # [B, T, S]
    else:
        seen = token_mask[:b].astype(bool)
    visible = jnp.repeat(seen, per_token, axis=1)
    s = jnp.where(visible[:, None], s, F32_MIN)
    s = jnp.where(read[:, None], s, -jnp.inf)                                          # unread: outside the softmax
    m_out = jnp.max(s, axis=-1)
    m_out = jnp.where(jnp.isneginf(m_out), F32_MIN, m_out)
    p = jnp.exp(s - m_out[..., None])
    acc = jnp.einsum("bgms,bgsd->bgmd", p.astype(v.dtype), v, precision=precision_for(v.dtype),
                     preferred_element_type=F32)
    return m_out, p.sum(axis=-1), acc
