"""``CausalLM``: what every causal LM of the zoo shares around its forward (the contract in
``zoo.models.contract``): the cache layout, the output head, the MTP forward, rollback and the MTP
bookkeeping, and the fixed-shape path of a vision tower (``image_geometry``, ``encode_images_padded``).

A model defines ``__call__`` and its position bookkeeping, as three functions of its slots
container (the ``cache.slots`` its attention layers share):

    empty_meta(batch, length) -> slots          a zeroed slots container
    advance(slots, mask) -> (positions, slots)  what the layers of one call read, and the new slots
    rollback_meta(before, after, n_keep) -> slots
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.models.shared.cache import ModelCache, MTPCache
from zoo.ops.matmul import matmul


def graph_dtype(dtype):
    """The one form a model keeps its dtype in (``np.dtype``): ``jnp.bfloat16`` and
    ``np.dtype("bfloat16")`` are equal but hash apart, and the module's graph keys its compiled
    programs, so a model built with either (a load from the sources, a cache restore) shares them."""
    return jnp.dtype(dtype)


class CausalLM(nnx.Module):
    """Base of ``Qwen38`` and ``Glm53``: ``embed_tokens``, ``layers`` (each with ``init_cache`` and
    ``select_step``), ``lm_head`` (None when tied), ``mtp`` (an ``MTPHead`` or None), ``dtype``."""

    # -- per architecture ---------------------------------------------------------------------------
    @staticmethod
    def empty_meta(batch: int, length: int):
        raise NotImplementedError

    def advance(self, meta, mask: jax.Array):
        raise NotImplementedError

    @staticmethod
    def rollback_meta(before, after, n_keep: jax.Array):
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------------------
    def image_geometry(self, grid_thw, n_patches: int):
        """Host side of ``encode_images_padded``: the vision tower's ``PatchGeometry`` of ``grid_thw``
        padded to ``n_patches`` rows (``VisionTower.geometry``)."""
        return self._tower().geometry(grid_thw, n_patches)

    def encode_images_padded(self, patches: jax.Array, geometry) -> jax.Array:
        """The fixed-shape tower: patches [n, C*T*P*P] zero-padded to ``geometry``'s n rows -> rows
        [n / m^2, D] in the model dtype, the first ones ``encode_images``' (``VisionTower.encode_padded``)."""
        return self._tower().encode_padded(patches, geometry).astype(self.dtype)

    def _tower(self):
        """The vision tower (``visual``); ``ValueError`` for a model without one."""
        if getattr(self, "visual", None) is None:
            raise ValueError("this model has no vision tower (no vision_config, or loaded with vision=False)")
        return self.visual

    def init_cache(self, batch: int, length: int) -> ModelCache:
        """A zeroed cache for ``batch`` rows and ``length`` token slots."""
        mtp = None if self.mtp is None else MTPCache(
            slots=self.empty_meta(batch, length), layers=(self.mtp.block.init_cache(batch, length),))
        return ModelCache(slots=self.empty_meta(batch, length),
                          layers=tuple(layer.init_cache(batch, length) for layer in self.layers), mtp=mtp)

    def head(self, hidden: jax.Array) -> jax.Array:
        """Post-norm hidden [B, T, D] -> float32 logits [B, T, V] (the shared output head)."""
        w = self.embed_tokens.embedding[...].T if self.lm_head is None else self.lm_head.kernel.get_value()
        axes = ("embed", "vocab") if self.lm_head is None else self.lm_head.kernel.axes   # layout on a mesh
        return matmul(hidden.astype(self.dtype), w, out_dtype=jnp.float32, axes=axes)

    def rollback(self, cache: ModelCache, before, n_keep: jax.Array) -> ModelCache:
        """Keep only the first ``n_keep[b]`` tokens of the last ``keep_steps`` call of each row.

        cache: the cache that call returned; before: its ``cache.slots`` as the call received it.
        Attention slots past the kept tokens become invalid (overwritten later); recurrent layers
        take their state after the last kept token.
        """
        layers = tuple(layer.select_step(c, n_keep - 1) for layer, c in zip(self.layers, cache.layers))
        return cache.replace(slots=self.rollback_meta(before, cache.slots, n_keep), layers=layers)

    def mtp_restore(self, cache: ModelCache, mark: MTPCache) -> ModelCache:
        """Undo MTP calls made since ``mark`` (an earlier ``cache.mtp``): the slots bookkeeping comes
        back, and whatever the MTP block keeps besides positional slots (``restore`` of the block,
        when it has one); positional slots written since are overwritten later."""
        block = self.mtp.block
        layers = cache.mtp.layers
        if hasattr(block, "restore"):
            layers = (block.restore(layers[0], mark.layers[0]),)
        return cache.replace(mtp=MTPCache(slots=mark.slots, layers=layers))

    def mtp_forward(self, hidden: jax.Array, next_ids: jax.Array, mask: jax.Array, cache: ModelCache):
        """MTP rows: hidden [B, T, D] (post-norm h_t), next_ids [B, T] (x_{t+1}), mask [B, T]
        -> (draft logits f32 [B, T, V] predicting x_{t+2}, MTP output hidden, new cache)."""
        if self.mtp is None:
            raise ValueError("this model has no MTP layer (mtp_num_hidden_layers == 0)")
        mask = mask.astype(bool)
        positions, meta = self.advance(cache.mtp.slots, mask)
        out, block_cache = self.mtp(hidden.astype(self.dtype), self.embed_tokens(next_ids), mask, positions,
                                    cache.mtp.layers[0])
        return self.head(out), out, cache.replace(mtp=MTPCache(slots=meta, layers=(block_cache,)))
