"""The cache containers every model has: the whole cache and the MTP layer's part of it.

    ModelCache(slots, layers, mtp)   slots: the model's position bookkeeping (one container shared
                                     by its attention layers); layers: one container per decoder
                                     layer; mtp: an ``MTPCache`` or None (no MTP layer, or dropped)
    MTPCache(slots, layers)          the same for the MTP layer's own block

The per-layer containers live beside the layers that write them (``zoo.models.<arch>``); all are
``zoo.sharding.cache_axes.CacheState``s, which carry the logical axes of their arrays.
"""

from __future__ import annotations

from typing import Any

from zoo.sharding.cache_axes import CacheState, cache_state


@cache_state
class MTPCache(CacheState):
    slots: Any
    layers: tuple


@cache_state
class ModelCache(CacheState):
    slots: Any
    layers: tuple
    mtp: MTPCache | None = None

    def without_mtp(self) -> "ModelCache":
        """This cache with no MTP part (a generator that does not speculate)."""
        return self.replace(mtp=None)
