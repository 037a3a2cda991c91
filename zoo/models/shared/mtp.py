"""Multi-token-prediction (MTP) head, the structure both models share.

Row t combines the main model's hidden state ``h_t`` with the embedding of the *next* token
``x_{t+1}`` and predicts ``x_{t+2}`` (the trained convention; docs/reference.md, "MTP pairing")::

    u = fc(concat(embed_norm(embed(x_{t+1})), hidden_norm(h_t)))     [B, T, D]
    u = block(u)           one decoder layer with its own cache (attention over earlier MTP rows)
    out = final_norm(u)    -> the shared lm_head gives the draft logits; ``out`` is also the
                              hidden state a chained second draft feeds back in place of ``h``.

The embedding and the output head are the main model's; this module holds only its own weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.models.shared.layers import Linear


class MTPHead(nnx.Module):
    def __init__(self, *, embed_norm: nnx.Module, hidden_norm: nnx.Module, dim: int,
                 block: nnx.Module, final_norm: nnx.Module, dtype):
        self.embed_norm = embed_norm
        self.hidden_norm = hidden_norm
        self.fc = Linear(2 * dim, dim, axes=("embed_in", "embed"), dtype=dtype)
        self.block = block
        self.final_norm = final_norm

    def __call__(self, hidden: jax.Array, next_embeds: jax.Array, mask: jax.Array, slots, cache):
        """hidden, next_embeds [B, T, D]; mask [B, T] -> (out [B, T, D] post-norm, block cache)."""
        u = self.fc(jnp.concatenate([self.embed_norm(next_embeds), self.hidden_norm(hidden)], axis=-1))
        u, cache = self.block(u, mask, slots, cache)
        return self.final_norm(u), cache
