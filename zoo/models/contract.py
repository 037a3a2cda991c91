"""The model contract: what the generator (``zoo.engine.generator``), the speculative decoder
(``zoo.engine.speculative``) and ``zoo.Model`` call on a model, and nothing more.

One forward serves a full pass (a fresh cache as long as the input), prefill, one-token decode and
k-token verify; the cache is an explicit ``ModelCache`` (``zoo.models.shared.cache``) of typed
containers that carry their logical axes (``zoo.sharding.cache_axes``).

Speculative decoding (MTP drafts, verify, rollback):

    logits, hidden, cache = model(ids, mask, cache, keep_steps=True)   recurrent layers keep their
                                                                        state after every token
    cache = model.rollback(cache, before, n_keep)     keep the first n_keep[b] tokens of that call
                                                      (``before``: the ``cache.slots`` it received)
    meta = model.rollback_meta(before, after, n_keep) the same for one slots container alone
    logits, out, cache = model.mtp_forward(hidden, next_ids, mask, cache)   MTP rows (``cache.mtp``)
    cache = model.mtp_restore(cache, mark)            undo MTP calls made since ``mark`` (an
                                                      earlier ``cache.mtp``)

``CausalLM`` (``zoo.models.shared.causal_lm``) implements everything but the forward and the
per-architecture position bookkeeping; ``Qwen38`` and ``Glm53`` derive from it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from zoo.models.shared.cache import ModelCache, MTPCache


@runtime_checkable
class CausalLMContract(Protocol):
    config: Any          # the frozen config: hidden_size, eos_token_id, mtp_num_hidden_layers, arch, ...
    dtype: Any           # the activation dtype
    mtp: Any             # the MTP head module, or None

    def init_cache(self, batch: int, length: int) -> ModelCache:
        """A zeroed cache for ``batch`` rows and ``length`` token slots (with an MTP part when the
        model has an MTP layer)."""

    def __call__(self, ids: jax.Array, mask: jax.Array, cache: ModelCache, keep_steps: bool = False
                 ) -> tuple[jax.Array, jax.Array, ModelCache]:
        """ids, mask [B, T] -> (logits f32 [B, T, V], post-norm hidden [B, T, D], new cache)."""

    def head(self, hidden: jax.Array) -> jax.Array:
        """Post-norm hidden [B, T, D] -> float32 logits [B, T, V]."""

    def mtp_forward(self, hidden: jax.Array, next_ids: jax.Array, mask: jax.Array, cache: ModelCache
                    ) -> tuple[jax.Array, jax.Array, ModelCache]:
        """hidden [B, T, D] (h_t), next_ids [B, T] (x_{t+1}), mask [B, T] -> (draft logits f32
        [B, T, V] predicting x_{t+2}, MTP output hidden [B, T, D], new cache)."""

    def rollback(self, cache: ModelCache, before: Any, n_keep: jax.Array) -> ModelCache: ...

    def rollback_meta(self, before: Any, after: Any, n_keep: jax.Array) -> Any: ...

    def mtp_restore(self, cache: ModelCache, mark: MTPCache) -> ModelCache: ...
