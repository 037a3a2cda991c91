"""Multi-head latent attention without rotary (GLM-5.3 NoPE MLA) and its sparse k-pool indexer.

MLA, x [B, T, D] ->
  q_resid = q_a_layernorm(q_a_proj(x))                  [B, T, q_lora]
  q = q_b_proj(q_resid)                                 [B, T, H, dn]
  c = kv_a_layernorm(kv_a_proj_with_mqa(x))             [B, T, C]     (the only thing cached)
  kv_b: c -> per head [k_nope (dn) | v (dv)]; with no rotary part the attention is computed absorbed:
  scores = (q W_k^T) . c * dn^-0.5 over the tokens the indexer selected; o = (softmax @ c) W_v
  y = o_proj(o)                                          [B, T, D]

Indexer ("full" layers; scores in true f32), for queries at position p:
  qi = wq_b(q_resid) [B, T, Hi, di];  ki = k_norm(wk(x)) [B, T, di];  gi = compress_gate(x) [B, T, di]
  pools: tokens (by position) 0..P-1, P..2P-1, ...; pool key = sum_s softmax_s(gi_s + ape_s) * ki_s
  score(p, j) = sum_h w[p, h] * relu(qi[p, h] . poolkey_j * di^-0.5),  w = weights_proj(x) * Hi^-0.5
  candidates: complete pools ending at or before p; keep the best index_topk / P of them, plus the
  incomplete tail pool of p (tokens (p+1) - (p+1) % P .. p). Only the pools up to the furthest
  candidate are scored, block by block into a running top-k (``select_top_pools``). The result is
  the selected pools [B, T, NP] that "shared" layers reuse; the attention turns them into the slots
  a query sees block by block (``pool_visibility``), reading only the filled blocks (no [B, T, L]
  mask is built). On TPU the Pallas kernel with per-row lengths runs instead
  (``kernel_latent_attention``: each row, and each run of a piece's tokens, its own blocks; the
  latent read once; the pool flags looked up per block in the kernel).

Positions are token counts per row (padding excluded), so left padding does not shift the pools.
Cache per MLA layer: ``LatentCache(latent [B, L, C], indexer)``; on full-indexer layers ``indexer`` is an
``IndexerCache(pool_k [B, L/P, di] (one key per complete pool), tail_k, tail_gate [B, P, di] (the
incomplete pool))``, else None.
Which slot holds which position is shared by all layers (``Positions``).
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
    block_at,
    blocks_visited,
    first_rows,
    kernel_block,
    kernel_takes,
    key_block,
    local_blocks,
    online_softmax,
    read_block,
    split_online_softmax,
)
from zoo.models.shared.kv_slots import write_slots
from zoo.models.shared.layers import LayerNorm, Linear, RMSNorm, param, take_step
from zoo.ops.matmul import einsum, precision_for
from zoo.sharding.cache_axes import CacheState, cache_state
from zoo.sharding.mesh import current_spec

HIGHEST = jax.lax.Precision.HIGHEST
POOL_BLOCKS = (2048, 1024, 512, 256)    # pools the indexer scores per block (``select_top_pools``)
F32_MIN = jnp.finfo(jnp.float32).min


class Positions(NamedTuple):
    """Where a call of T tokens sits, for every MLA layer (built once per forward).

    write_at   [B]     first cache slot written by this call (tokens go to write_at .. write_at+T-1)
    start      [B]     real tokens before this call (the position of its first real token)
    count      [B]     real tokens in this call
    query_pos  [B, T]  position of each token of the call; -1 for padding
    key_pos    [B, L]  position of the token in each slot after this call's writes; -1 = empty
    """

    write_at: jax.Array
    start: jax.Array
    count: jax.Array
    query_pos: jax.Array
    key_pos: jax.Array


@cache_state
class PositionMeta(CacheState):
    """Bookkeeping for L slots: ``index [B]`` slots used, ``pos [B]`` real tokens seen,
    ``key_pos [B, L]`` position held by each slot (-1 = empty)."""

    AXES = {"index": ("batch",), "pos": ("batch",), "key_pos": ("batch", "cache_len")}
    index: jax.Array
    pos: jax.Array
    key_pos: jax.Array


@cache_state
class IndexerCache(CacheState):
    AXES = {"pool_k": ("batch", "pools", "head_dim"), "tail_k": ("batch", "kpool", "head_dim"),
            "tail_gate": ("batch", "kpool", "head_dim")}
    pool_k: jax.Array
    tail_k: jax.Array
    tail_gate: jax.Array


@cache_state
class LatentCache(CacheState):
    AXES = {"latent": ("batch", "latent_len", "kv_lora")}
    latent: jax.Array
    indexer: IndexerCache | None = None


def empty_positions(batch: int, length: int) -> PositionMeta:
    return PositionMeta(index=jnp.zeros((batch,), jnp.int32), pos=jnp.zeros((batch,), jnp.int32),
                        key_pos=jnp.full((batch, length), -1, jnp.int32))


def advance_positions(meta: PositionMeta, mask: jax.Array) -> tuple[Positions, PositionMeta]:
    """Account for a call of T tokens (``mask [B, T]``, True = token); returns (Positions, new meta).

    The caller guarantees ``index + T <= L``.
    """
    mask = mask.astype(bool)
    count = mask.sum(axis=1, dtype=jnp.int32)
    query_pos = jnp.where(mask, meta.pos[:, None] + jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, -1)
    key_pos = write_slots(meta.key_pos, query_pos, meta.index)
    positions = Positions(write_at=meta.index, start=meta.pos, count=count, query_pos=query_pos, key_pos=key_pos)
    new_meta = PositionMeta(index=meta.index + mask.shape[1], pos=meta.pos + count, key_pos=key_pos)
    return positions, new_meta


def rollback_positions(before: PositionMeta, after: PositionMeta, n_keep: jax.Array) -> PositionMeta:
    """Bookkeeping after keeping only the first ``n_keep [B]`` tokens written since ``before`` (they
    must be real tokens); later slots become empty (-1) and are overwritten by the next call."""
    index = before.index + n_keep
    slot_ids = jnp.arange(after.key_pos.shape[1])
    return PositionMeta(index=index, pos=before.pos + n_keep,
                        key_pos=jnp.where(slot_ids[None, :] < index[:, None], after.key_pos, -1))


class Indexer(nnx.Module):
    """The k-pool indexer of one "full" layer: ``__call__ -> (selected pools [B, T, NP], cache)``."""

    def __init__(self, cfg, *, dtype):
        d, di = cfg.hidden_size, cfg.index_head_dim
        self.n_heads, self.head_dim, self.pool = cfg.index_n_heads, di, cfg.index_kpool
        self.pools_kept = cfg.index_topk // cfg.index_kpool
        self.dtype = dtype
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * di, axes=("q_lora", "heads"), dtype=dtype)
        self.wk = Linear(d, di, axes=("embed_in", "head_dim"), dtype=dtype)
        self.k_norm = LayerNorm(di, eps=1e-6, dtype=dtype, axes=("head_dim",))
        self.weights_proj = Linear(d, self.n_heads, axes=("embed", "heads"), dtype=dtype)
        self.compress_gate = Linear(d, di, axes=("embed_in", "head_dim"), dtype=dtype)
        self.compress_ape = param((self.pool, di), ("kpool", "head_dim"), dtype)

    def init_cache(self, batch: int, length: int) -> IndexerCache:
        n_pools = -(-length // self.pool)
        tail = jnp.zeros((batch, self.pool, self.head_dim), self.dtype)
        return IndexerCache(pool_k=jnp.zeros((batch, n_pools, self.head_dim), self.dtype), tail_k=tail, tail_gate=tail)

    def _update_pools(self, k: jax.Array, gate: jax.Array, pos: Positions, cache: IndexerCache,
                      keep_steps: bool = False) -> IndexerCache:
        """Pool the call's keys (k, gate [B, T, di]) with the cached tail: writes the key of every pool
        completed by this call into ``pool_k`` and keeps the new incomplete pool as the tail.

        ``keep_steps``: the tails are kept after every token (``[B, T, P, di]``): the tail after t
        tokens is the window pool holding position start + min(t, count). Entries of rejected tokens beyond a
        kept prefix sit at offsets the next call treats as empty; ``pool_k`` needs no rollback,
        because a pool is only read once it is complete and is rewritten when it completes again."""
        p = self.pool
        b, t, di = k.shape
        window = t // p + 2                                   # pools a call can touch, incl. the old tail
        rows = jnp.arange(b)[:, None]
        first = pos.start // p                                # [B] global index of window pool 0
        tail_valid = jnp.arange(p)[None, :] < (pos.start % p)[:, None]
        offsets = jnp.concatenate([jnp.broadcast_to(jnp.arange(p), (b, p)),
                                   pos.query_pos - first[:, None] * p], axis=1)
        valid = jnp.concatenate([tail_valid, pos.query_pos >= 0], axis=1)
        offsets = jnp.where(valid, offsets, window * p)       # out of range: dropped by the scatters

        def scatter(prev, new):
            buf = jnp.zeros((b, window * p, di), self.dtype)
            rows_in = jnp.concatenate([prev, new.astype(self.dtype)], axis=1)
            return buf.at[rows, offsets].set(rows_in, mode="drop").reshape(b, window, p, di)

        keys, gates = scatter(cache.tail_k, k), scatter(cache.tail_gate, gate)
        filled = jnp.zeros((b, window * p), bool).at[rows, offsets].set(True, mode="drop").reshape(b, window, p)
        logits = gates.astype(jnp.float32) + self.compress_ape[...].astype(jnp.float32)
        probs = jax.nn.softmax(jnp.where(filled[..., None], logits, F32_MIN), axis=2)
        pooled = jnp.sum(probs.astype(self.dtype) * keys, axis=2)                          # [B, W, di]
        n_pools = cache.pool_k.shape[1]
        dest = jnp.where(filled.all(-1), first[:, None] + jnp.arange(window), n_pools)
        pool_k = cache.pool_k.at[rows, dest].set(pooled, mode="drop")
        if keep_steps:
            # a padding step keeps the tail of the last real token (a row of padding: its old tail)
            done = jnp.minimum(jnp.arange(1, t + 1)[None, :], pos.count[:, None])
            steps = (pos.start[:, None] + done) // p - first[:, None]                           # [B, T]
            return IndexerCache(pool_k=pool_k, tail_k=keys[rows, steps], tail_gate=gates[rows, steps])
        last = (pos.start + pos.count) // p - first                                        # new tail
        return IndexerCache(pool_k=pool_k, tail_k=keys[jnp.arange(b), last], tail_gate=gates[jnp.arange(b), last])

    def __call__(self, x: jax.Array, q_resid: jax.Array, pos: Positions, cache: IndexerCache,
                 keep_steps: bool = False):
        """x [B, T, D], q_resid [B, T, q_lora] -> (selected pools [B, T, NP] bool, new indexer cache);
        :func:`pool_visibility` turns them into the slots each query sees."""
        b, t, _ = x.shape
        q = self.wq_b(q_resid).reshape(b, t, self.n_heads, self.head_dim)
        cache = self._update_pools(self.k_norm(self.wk(x)), self.compress_gate(x), pos, cache, keep_steps)
        w = self.weights_proj(x).astype(jnp.float32) * self.n_heads ** -0.5
        q = q.astype(jnp.float32)

        def index_of(pool_k: jax.Array) -> jax.Array:               # [B, S, di] -> [B, T, S]
            scores = jnp.einsum("bthd,bpd->bthp", q, pool_k.astype(jnp.float32), precision=HIGHEST)
            scores = jax.nn.relu(scores * self.head_dim ** -0.5)
            return jnp.einsum("bth,bthp->btp", w, scores, precision=HIGHEST)

        limit = (pos.query_pos + 1) // self.pool          # candidates: complete pools before the query
        selected = select_top_pools(index_of, cache.pool_k, limit, self.pools_kept)
        return selected, cache


def select_top_pools(index_of, pool_k: jax.Array, limit: jax.Array, kept: int) -> jax.Array:
    """The indexer's choice -> selected pools ``[B, T, NP]`` bool: of the candidate pools ``j <
    limit[b, t]`` (``limit [B, T]``), the ``kept`` with the highest index score (ties: the lower pool),
    all of them where there are fewer. ``index_of(keys [B, S, di]) -> float32 [B, T, S]`` scores the
    queries against some of ``pool_k [B, NP, di]``'s pools.

    Only the pools up to the largest ``limit`` are scored: in blocks of ``key_block(NP, POOL_BLOCKS)``
    pools, each merged into a running top-``kept`` (a traced block count, so one program serves
    every fill level); a window under two blocks is scored whole. The blocks choose exactly what
    one ``top_k`` over every pool would, since the running entries precede the block's (lower pools
    first among equal scores) and no pool past the largest limit is a candidate."""
    b, t = limit.shape
    n_pools = pool_k.shape[1]
    kept = min(kept, n_pools)
    block = key_block(n_pools, POOL_BLOCKS)
    if block is None:
        candidate = jnp.arange(n_pools)[None, None, :] < limit[..., None]
        top = jax.lax.top_k(jnp.where(candidate, index_of(pool_k), F32_MIN), kept)[1]
    else:
        def step(i, carry):
            values, ids = carry
            at, own = block_at(i * block, block, n_pools)
            pools = at + jnp.arange(block, dtype=jnp.int32)
            scores = jnp.where(pools < limit[..., None], index_of(jax.lax.dynamic_slice_in_dim(pool_k, at, block, 1)),
                               F32_MIN)
            scores = jnp.where(own, scores, -jnp.inf)                 # a pool an overlapping block read before
            every = jnp.concatenate([values, scores], axis=-1)
            every_id = jnp.concatenate([ids, jnp.broadcast_to(jnp.where(own, pools, n_pools), scores.shape)], axis=-1)
            values, pick = jax.lax.top_k(every, kept)
            return values, jnp.take_along_axis(every_id, pick, axis=-1)

        n_blocks = jnp.clip(-(-jnp.max(limit) // block), 1, -(-n_pools // block))
        init = (jnp.full((b, t, kept), -jnp.inf, jnp.float32), jnp.full((b, t, kept), n_pools, jnp.int32))
        top = jax.lax.fori_loop(0, n_blocks, step, init)[1]
    chosen = top < limit[..., None]
    return jnp.zeros((b, t, n_pools), bool).at[
        jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], top].set(chosen, mode="drop")


def pool_visibility(pools: jax.Array, key_pos: jax.Array, query_pos: jax.Array, pool: int,
                    select_tail: bool) -> jax.Array:
    """The slots a query sees, from the indexer's selected pools ``pools [B, T, NP]``, for slots holding
    positions ``key_pos [B, S]`` (-1: empty; any range of the window: the attention asks block by
    block) and queries at ``query_pos [B, T]`` -> ``[B, T, S]`` bool: the slot's pool is selected, or
    (``select_tail``) it lies in the query's own incomplete pool, and it holds a token at or before
    the query."""
    kp = key_pos[:, None, :]                                                         # [B, 1, S]
    qp = query_pos[..., None]                                                        # [B, T, 1]
    key_pool = jnp.broadcast_to(jnp.maximum(kp, 0) // pool, qp.shape[:2] + kp.shape[2:])
    visible = jnp.take_along_axis(pools, key_pool, axis=2)
    if select_tail:
        visible = visible | (kp >= (qp + 1) - (qp + 1) % pool)
    return visible & (kp >= 0) & (kp <= qp)


def latent_attention(q_latent: jax.Array, c: jax.Array, selection: jax.Array, scale: float) -> jax.Array:
    """Absorbed attention over the whole window: q_latent [B, T, H, C], latent cache c [B, L, C],
    selection [B, T, L] -> [B, T, H, C] in q's dtype (softmax in float32; the reference for
    :func:`filled_latent_attention`)."""
    scores = einsum("bthc,blc->bthl", q_latent, c).astype(jnp.float32) * scale
    scores = jnp.where(selection[:, :, None], scores, F32_MIN)
    probs = jax.nn.softmax(scores, axis=-1).astype(q_latent.dtype)
    return einsum("bthl,blc->bthc", probs, c)


def filled_latent_attention(q_latent: jax.Array, c: jax.Array, pools: jax.Array, key_pos: jax.Array,
                            query_pos: jax.Array, write_at: jax.Array, scale: float, live: jax.Array | None = None,
                            *, pool: int, select_tail: bool) -> jax.Array:
    """:func:`latent_attention` over the filled part of the window only, its mask made block by block
    from the selected pools (:func:`pool_visibility` of ``pools [B, T, NP]``, ``key_pos [B, L]``,
    ``query_pos [B, T]``: no [B, T, L] mask is built), through ``zoo.models.shared.filled_blocks``:
    latent blocks up to the last slot any ``live [B]`` row holds, ``write_at [B]`` + T, online
    softmax; one program for every fill level. Where the mesh splits the latent cache over its slots
    ("tp"), each chip reads the filled blocks of its own share under ``shard_map`` and the partial
    sums are combined across chips. Returns [B, T, H, C] in q's dtype."""
    b, t, h, ch = q_latent.shape
    length = c.shape[1]
    spec = current_spec(LatentCache.AXES["latent"], c.shape)
    visibility = dict(pool=pool, select_tail=select_tail)
    live = jnp.ones(write_at.shape, bool) if live is None else live
    kernel = attention_kernel()
    if kernel is not None and kernel_takes(length, spec, 1, ch, ch):
        return kernel_latent_attention(q_latent, c, pools, key_pos, query_pos, write_at, live, scale, spec,
                                       **visibility, **kernel)
    if spec is not None and spec[1] is not None:
        local = functools.partial(split_latent_share, axis=spec[1], scale=scale, **visibility)
        rows, whole = P(spec[0]), P(spec[0], None, None, None)
        return jax.shard_map(local, in_specs=(whole, spec, P(spec[0], None, None), P(spec[0], spec[1]),
                                              P(spec[0], None), rows, rows),
                             out_specs=whole, check_vma=False)(q_latent, c, pools, key_pos, query_pos, write_at, live)
    block = key_block(length)
    if block is None:
        return latent_attention(q_latent, first_rows(c, b), pool_visibility(pools, key_pos, query_pos, **visibility),
                                scale)
    n_blocks = blocks_visited(write_at, t, length, live)
    return _blocked_latent_attention(q_latent, c, pools, key_pos, query_pos, scale, n_blocks, block,
                                     online_softmax, **visibility)


def _blocked_latent_attention(q_latent, c, pools, key_pos, query_pos, scale, n_blocks, block, softmax, *,
                              pool, select_tail):
    """Online-softmax latent attention over ``n_blocks`` blocks of ``c [B, S, C]`` (``key_pos [B, S]``
    over the same slots), each block's mask from the selected pools; ``softmax``: ``online_softmax``
    or a bound ``split_online_softmax``."""
    b, t, h, ch = q_latent.shape

    def block_fn(start):
        at, own = block_at(start, block, c.shape[1])
        cb = read_block(c, at, block, 1, b)              # the call's rows of a cache that may hold more
        kp = jax.lax.dynamic_slice_in_dim(key_pos, at, block, axis=1)
        sel = pool_visibility(pools, kp, query_pos, pool, select_tail) & own
        scores = einsum("bthc,blc->bthl", q_latent, cb).astype(jnp.float32) * scale
        mix = lambda p: einsum("bthl,blc->bthc", p.astype(q_latent.dtype), cb).astype(jnp.float32)   # noqa: E731
        return jnp.where(sel[:, :, None], scores, F32_MIN), mix

    return softmax(n_blocks, block, block_fn, (b, t, h), ch).astype(q_latent.dtype)


def split_latent_share(q_latent, c, pools, key_pos, query_pos, write_at, live, *, axis: str, scale: float,
                       pool: int, select_tail: bool):
    """One chip's part of the split latent attention (under ``shard_map``, or ``vmap`` with
    ``axis_name``): ``c [B, S, C]`` and ``key_pos [B, S]`` its share of the slots, the rest whole;
    returns the whole result ``[B, T, H, C]``, combined across ``axis``."""
    block, n_blocks, _ = local_blocks(write_at, q_latent.shape[1], c.shape[1], jax.lax.axis_index(axis), live)
    softmax = functools.partial(split_online_softmax, axis)
    return _blocked_latent_attention(q_latent, c, pools, key_pos, query_pos, scale, n_blocks, block, softmax,
                                     pool=pool, select_tail=select_tail)


def kernel_latent_attention(q_latent, c, pools, key_pos, query_pos, write_at, live, scale: float, spec: P | None,
                            *, pool: int, select_tail: bool, interpret: bool = False) -> jax.Array:
    """:func:`filled_latent_attention` by the Pallas kernel (``zoo.kernels.ragged_attention``): each
    row, and each run of a prefill piece's tokens, reads its own filled latent blocks, once (the
    latent is both keys and values); the slots a token sees come from its selected pools, looked up
    in the kernel per block (``PoolSelection``: no ``[B, T, L]`` mask in HBM). Where the mesh splits
    the latent over its slots it runs in ``shard_map`` and the partial sums are combined across the
    axis. Returns [B, T, H, C] in q's dtype."""
    axis = None if spec is None else spec[1]
    local = functools.partial(kernel_latent_share, axis=axis, scale=scale, pool=pool, select_tail=select_tail,
                              interpret=interpret)
    args = (q_latent, c, pools, key_pos, query_pos, write_at, live)
    if spec is None:
        return local(*args)
    rows, whole = P(spec[0]), P(spec[0], None, None, None)
    return jax.shard_map(local, in_specs=(whole, spec, P(spec[0], None, None), P(spec[0], spec[1]),
                                          P(spec[0], None), rows, rows),
                         out_specs=whole, check_vma=False)(*args)


def kernel_latent_share(q_latent, c, pools, key_pos, query_pos, write_at, live, *, axis, scale: float, pool: int,
                        select_tail: bool, interpret: bool = False):
    """One chip's part of :func:`kernel_latent_attention` (the whole call where ``axis`` is None):
    ``c [B, S, C]`` and ``key_pos [B, S]`` its share of the slots; returns ``[B, T, H, C]``."""
    b, t, h, ch = q_latent.shape
    selection = ragged.PoolSelection(pools, key_pos, query_pos, pool, select_tail)
    out = ragged.share_attention(q_latent.reshape(b, 1, t * h, ch), c[:, None], None, None, None, write_at, live,
                                 axis=axis, block=kernel_block(c.shape[1]), scale=scale, selection=selection,
                                 interpret=interpret)
    return out.reshape(b, t, h, ch).astype(q_latent.dtype)


class MultiLatentAttention(nnx.Module):
    """NoPE MLA; ``indexer=True`` for "full" layers, else the caller passes the shared selection."""

    def __init__(self, cfg, *, indexer: bool, dtype):
        d, c = cfg.hidden_size, cfg.kv_lora_rank
        self.n_heads, self.dn, self.dv, self.latent = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, c
        self.dtype = dtype
        bias = cfg.attention_bias
        norm = dict(eps=cfg.rms_norm_eps, dtype=dtype, zero_centered=False)
        self.q_a_proj = Linear(d, cfg.q_lora_rank, axes=("embed_in", "q_lora"), dtype=dtype, use_bias=bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, axes=("q_lora",), **norm)
        self.q_b_proj = Linear(cfg.q_lora_rank, self.n_heads * self.dn, axes=("q_lora", "heads"), dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(d, c, axes=("embed_in", "kv_lora"), dtype=dtype, use_bias=bias)
        self.kv_a_layernorm = RMSNorm(c, axes=("kv_lora",), **norm)
        # Used absorbed (q W_k^T, then (p @ c) W_v), so stored as the checkpoint keeps it, [H*(dn+dv), C]:
        # per head [dn+dv, C] is the (contracted, output) layout both products read without a relayout
        # (stored [C, H*(dn+dv)], XLA copied it twice per layer and decode step).
        self.kv_b = param((self.n_heads * (self.dn + self.dv), c), ("heads", "kv_lora"), dtype)
        self.o_proj = Linear(self.n_heads * self.dv, d, axes=("heads", "embed"), dtype=dtype, use_bias=bias)
        self.indexer = Indexer(cfg, dtype=dtype) if indexer else None
        # how a selection of pools (this layer's indexer's, or the last full layer's) maps to slots
        self.pool, self.select_tail = cfg.index_kpool, cfg.index_kpool_always_select_tail

    def init_cache(self, batch: int, length: int) -> LatentCache:
        indexer = None if self.indexer is None else self.indexer.init_cache(batch, length)
        return LatentCache(latent=jnp.zeros((batch, length, self.latent), self.dtype), indexer=indexer)

    @staticmethod
    def select_step(steps: LatentCache, idx: jax.Array) -> LatentCache:
        """A ``keep_steps`` cache -> the cache after token ``idx[b]`` (only the indexer tails have steps)."""
        if steps.indexer is None:
            return steps
        ix = steps.indexer
        tails = dict(tail_k=take_step(ix.tail_k, idx), tail_gate=take_step(ix.tail_gate, idx))
        return steps.replace(indexer=ix.replace(**tails))

    @staticmethod
    def restore(now: LatentCache, mark: LatentCache) -> LatentCache:
        """Undo the calls made since ``mark``: the indexer tails come back (the latent slots and the
        pooled keys are positional: rewritten later)."""
        return now.replace(indexer=now.indexer.replace(tail_k=mark.indexer.tail_k, tail_gate=mark.indexer.tail_gate))

    def __call__(self, x: jax.Array, pos: Positions, cache: LatentCache, selection: jax.Array | None,
                 keep_steps: bool = False):
        """x [B, T, D]; selection: the selected pools [B, T, NP] of the last full layer (shared layers).

        Returns (y [B, T, D], new cache, the selected pools this layer used).
        """
        b, t, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).reshape(b, t, self.n_heads, self.dn)
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))
        cache = cache.replace(latent=write_slots(cache.latent, latent, pos.write_at, LatentCache.AXES["latent"]))
        if self.indexer is not None:
            selection, indexer = self.indexer(x, q_resid, pos, cache.indexer, keep_steps)
            cache = cache.replace(indexer=indexer)
        kv_b = self.kv_b[...].astype(x.dtype).reshape(self.n_heads, self.dn + self.dv, self.latent)
        w_k, w_v = kv_b[:, :self.dn], kv_b[:, self.dn:]
        c = cache.latent
        # result in q's dtype directly (accumulated in f32 by every backend): XLA:CPU has no bf16 x bf16
        # -> f32 dot for this layout
        q_latent = jnp.einsum("bthd,hdc->bthc", q, w_k, precision=precision_for(q.dtype))
        o_latent = filled_latent_attention(q_latent, c, selection, pos.key_pos, pos.query_pos, pos.write_at,
                                           self.dn ** -0.5, pos.count > 0, pool=self.pool,
                                           select_tail=self.select_tail)
        o = einsum("bthc,hdc->bthd", o_latent, w_v)
        return self.o_proj(o.reshape(b, t, self.n_heads * self.dv)), cache, selection
