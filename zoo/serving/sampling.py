"""On-device token sampling: greedy, temperature, top-k, top-p, with a seed per row.

``sample(logits [B, V] f32, keys [B] (typed PRNG keys), temperature [B], top_k [B], top_p [B])
-> tokens [B] int32``. A row with ``temperature == 0`` takes the argmax; ``top_k == 0`` and
``top_p >= 1`` disable those filters. Everything is jit-able; the parameters are arrays, so one
compiled program serves any mix of requests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Set logits outside the top-k / nucleus (top-p) sets to -inf. logits [B, V]."""
    v = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    probs = jax.nn.softmax(-jnp.sort(-logits, axis=-1), axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs          # mass strictly above each sorted entry
    keep_sorted = cum_before < top_p[:, None]                  # the first entry is always kept
    n_keep = jnp.maximum(keep_sorted.sum(axis=-1), 1)
    sorted_after_k = -jnp.sort(-logits, axis=-1)
    threshold = jnp.take_along_axis(sorted_after_k, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    filtered = filter_logits(scaled, top_k, top_p)
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, filtered).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)
