"""Logical axes of every cache leaf, so caches are sharded like the weights that write them.

The caches are plain pytrees (``init_cache`` of each model); a leaf is identified by the dict keys on
its path (list positions dropped) and matched against ``RULES`` by suffix, longest suffix first.
A leaf no rule names, or whose rank differs from its rule's, is an error: a new cache leaf must be
given axes here rather than be silently replicated.

    path suffix                    shape                    axes
    slots.index / slots.pos        [B]                      batch
    slots.valid / slots.key_pos    [B, L]                   batch, cache_len
    k / v     (gated attention)    [B, L, KVH, hd]          batch, cache_len, kv_heads, head_dim
    conv.q / conv.k / conv.v (KDA) [B, K-1, H*dk]           batch, conv, heads
    conv      (gated DeltaNet)     [B, K-1, conv_dim]       batch, conv, linear_qkv
    state     (KDA / DeltaNet)     [B, H, dk, dv]           batch, cache_heads, head_dim, head_dim
    latent    (MLA)                [B, L, C]                batch, cache_len, kv_lora
    indexer.pool_k                 [B, L/P, di]             batch, pools, head_dim
    indexer.tail_k / tail_gate     [B, P, di]               batch, kpool, head_dim
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.sharding import Mesh

from zoo.sharding.mesh import Axes, constrain_tree, named_sharding


@dataclass(frozen=True)
class CacheRule:
    suffix: tuple[str, ...]
    axes: Axes


RULES: tuple[CacheRule, ...] = (
    CacheRule(("slots", "index"), ("batch",)),
    CacheRule(("slots", "pos"), ("batch",)),
    CacheRule(("slots", "valid"), ("batch", "cache_len")),
    CacheRule(("slots", "key_pos"), ("batch", "cache_len")),
    *(CacheRule(("conv", p), ("batch", "conv", "heads")) for p in ("q", "k", "v")),
    CacheRule(("conv",), ("batch", "conv", "linear_qkv")),
    CacheRule(("state",), ("batch", "cache_heads", "head_dim", "head_dim")),
    CacheRule(("k",), ("batch", "cache_len", "kv_heads", "head_dim")),
    CacheRule(("v",), ("batch", "cache_len", "kv_heads", "head_dim")),
    CacheRule(("latent",), ("batch", "cache_len", "kv_lora")),
    CacheRule(("indexer", "pool_k"), ("batch", "pools", "head_dim")),
    CacheRule(("indexer", "tail_k"), ("batch", "kpool", "head_dim")),
    CacheRule(("indexer", "tail_gate"), ("batch", "kpool", "head_dim")),
)
_BY_LENGTH = sorted(RULES, key=lambda r: -len(r.suffix))


def leaf_axes(path, leaf) -> Axes:
    """The logical axes of the cache leaf at ``path`` (a ``jax.tree_util`` key path)."""
    keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
    for rule in _BY_LENGTH:
        if keys[-len(rule.suffix):] == rule.suffix:
            if len(rule.axes) != len(leaf.shape):
                raise ValueError(f"cache leaf {'.'.join(keys)} has shape {tuple(leaf.shape)}; its rule "
                                 f"{'.'.join(rule.suffix)} names {len(rule.axes)} axes {rule.axes}")
            return rule.axes
    raise ValueError(f"cache leaf {'.'.join(keys)} (shape {tuple(leaf.shape)}) has no logical axes; "
                     f"add a rule to zoo.sharding.cache_axes.RULES")


def cache_axes(cache) -> dict[str, Axes]:
    """``{dotted path: axes}`` for every leaf of ``cache`` (arrays or ShapeDtypeStructs)."""
    flat = jax.tree_util.tree_flatten_with_path(cache)[0]
    return {jax.tree_util.keystr(p, simple=True, separator="."): leaf_axes(p, x) for p, x in flat}


def shard_cache(cache):
    """Pin every cache leaf to its layout on the current mesh (inside jit; identity without a mesh)."""
    return constrain_tree(cache, leaf_axes)


def cache_shardings(cache, mesh: Mesh):
    """The ``NamedSharding`` of every leaf of ``cache`` on ``mesh`` (a pytree like ``cache``)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: named_sharding(leaf_axes(p, x), x.shape, mesh), cache)
