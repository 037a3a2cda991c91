"""Token bitmasks on the device: the logits of tokens a row's grammar refuses become -inf.

    apply_token_mask(logits [B, T, V] (or [B, V]), bitmask [B, T, W] (or [B, W]) int32) -> logits

Bit ``t % 32`` of word ``t // 32`` allows token ``t`` (llguidance's layout, filled on the host by
``zoo.engine.constraint``); an all-ones row (-1 words) leaves its logits unchanged. Pure jnp,
jit-able; the engine runs it only in steps where some row is constrained.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def unpack(bitmask: jax.Array, vocab: int) -> jax.Array:
    """[..., W] int32 -> [..., vocab] bool."""
    bits = jnp.right_shift(bitmask[..., None].view(jnp.uint32), jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(*bitmask.shape[:-1], -1)[..., :vocab].astype(bool)


def apply_token_mask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    allowed = unpack(bitmask, logits.shape[-1])
    return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, logits.dtype))
