"""Typed cache containers that carry the logical axes of their arrays, so caches are sharded like
the weights that write them.

A model's cache is a tree of ``CacheState`` containers: frozen dataclasses registered as jax
pytrees, each declaring in ``AXES`` the logical axes of its array fields (the others hold nested
containers, tuples of them, or None). Models define their containers beside the layers that write
them (``zoo.models.shared.cache``, ``zoo.models.<arch>``); nothing outside a model reads a cache by
string keys. A leaf outside a container, or whose rank differs from its declared axes, is an
error: a new cache array must be given axes rather than be silently replicated.

    cache_axes(cache) -> {dotted path: axes}        every array, by its field path
    shard_cache(cache)                              pin every array to its layout (inside jit)
    cache_shardings(cache, mesh)                    the NamedSharding of every array (a tree like cache)
    token_axis(axes)                                which axis of a leaf runs over tokens (None: none)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
from jax.sharding import Mesh

from zoo.sharding.mesh import Axes, current_mesh, named_sharding, partition_spec

TOKEN_AXES = ("cache_len", "kv_len", "latent_len", "pools")     # logical axes that run over the tokens of a row


def token_axis(axes: tuple) -> int | None:
    """The position of a cache leaf's per-token axis among its logical ``axes`` (None: no such
    axis): slots (``cache_len``, ``kv_len``, ``latent_len``: one per token) or pools of tokens (``pools``)."""
    hits = [i for i, a in enumerate(axes) if a in TOKEN_AXES]
    if len(hits) > 1:
        raise ValueError(f"a cache leaf with two token axes: {axes}")
    return hits[0] if hits else None


class CacheState:
    """Base of the typed cache containers (declare them with ``@cache_state``)."""

    AXES: ClassVar[dict[str, Axes]] = {}

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def cache_state(cls):
    """Class decorator: a frozen dataclass and a jax pytree whose fields are all children."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = set(cls.AXES) - set(fields)
    if unknown:
        raise TypeError(f"{cls.__name__}.AXES names fields it does not have: {sorted(unknown)}")
    return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


def map_with_axes(fn: Callable[[str, Any, Axes], Any], cache, path: str = "") -> Any:
    """The cache with every array ``x`` at dotted ``path`` replaced by ``fn(path, x, axes)``."""
    if cache is None:
        return None
    if isinstance(cache, (list, tuple)):
        return type(cache)(map_with_axes(fn, x, f"{path}.{i}" if path else str(i)) for i, x in enumerate(cache))
    if isinstance(cache, CacheState):
        out = {}
        for field in dataclasses.fields(cache):
            value, where = getattr(cache, field.name), f"{path}.{field.name}" if path else field.name
            if field.name in cache.AXES and value is None:   # a part of the cache (``split_leaves``)
                out[field.name] = None
            elif field.name in cache.AXES:
                axes = cache.AXES[field.name]
                if len(axes) != len(value.shape):
                    raise ValueError(f"cache array {where} has shape {tuple(value.shape)}; "
                                     f"{type(cache).__name__} declares {len(axes)} axes {axes}")
                out[field.name] = fn(where, value, axes)
            else:
                out[field.name] = map_with_axes(fn, value, where)
        return dataclasses.replace(cache, **out)
    raise ValueError(f"cache value at {path or 'the root'} ({type(cache).__name__}) has no logical axes: "
                     f"declare it in a typed cache container (zoo.sharding.cache_axes.CacheState) with its AXES")


def cache_axes(cache) -> dict[str, Axes]:
    """``{dotted path: axes}`` for every array of ``cache`` (arrays or ShapeDtypeStructs)."""
    out: dict[str, Axes] = {}
    map_with_axes(lambda path, x, axes: out.setdefault(path, axes), cache)
    return out


def shard_cache(cache):
    """Pin every cache array to its layout on the current mesh (inside jit; identity without a mesh)."""
    mesh = current_mesh()
    if mesh is None:
        return cache
    return map_with_axes(lambda _, x, axes: jax.lax.with_sharding_constraint(
        x, partition_spec(axes, tuple(x.shape), mesh)), cache)


def cache_shardings(cache, mesh: Mesh):
    """The ``NamedSharding`` of every array of ``cache`` on ``mesh`` (a tree like ``cache``)."""
    return map_with_axes(lambda _, x, axes: named_sharding(axes, x.shape, mesh), cache)
