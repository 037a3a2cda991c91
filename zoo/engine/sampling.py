"""On-device token sampling: greedy, temperature, top-k, top-p, with a PRNG key per row.

    probs(logits [B, ..., V], temperature [B], top_k [B], top_p [B]) -> the sampling distribution
    draw(keys [B], p [B, V], greedy [B]) -> tokens [B] (Gumbel-max: argmax of log p + the key's noise)
    sample(logits [B, V], keys [B], temperature [B], top_k [B], top_p [B]) -> tokens [B] int32
    flag_nonfinite(n [B], logits [B, ..., V]) -> n, with -1 where a row's logits hold a NaN or inf

A row with ``temperature == 0`` takes the argmax; ``top_k == 0`` and ``top_p >= 1`` disable those
filters. Keys are per row and output position (``row_keys``, ``position_keys``: the request's seed
and the token's position in its output), so a request's samples depend neither on which other
requests share its batch nor on how many tokens each step emits (speculative decoding samples what
plain decoding does). Everything is jit-able; the parameters are arrays, so one compiled program
serves any mix of requests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def position_keys(params: dict, n: int) -> jax.Array:
    """[B, n] PRNG keys of each row's next ``n`` output tokens: the row's ``seed`` folded with the
    token's output position (``step`` [B] is the position of the next one: the tokens the row has
    emitted, 0 for the first, which the prefill's logits give). A token's key depends on its
    position alone, not on the steps that emit it: speculative steps (several tokens each) sample
    what plain steps (one each) would (``zoo.engine.speculative``)."""
    positions = params["step"][:, None] + jnp.arange(n, dtype=params["step"].dtype)[None, :]
    return jax.vmap(lambda s, ts: jax.vmap(lambda t: jax.random.fold_in(jax.random.key(s), t))(ts))(
        params["seed"], positions)


def row_keys(params: dict) -> jax.Array:
    """The PRNG key of each row's next output token [B] (``position_keys``' first column)."""
    return position_keys(params, 1)[:, 0]


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Set logits outside the top-k / nucleus (top-p) sets to -inf. logits [B, V]; top_k, top_p [B]."""
    v = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    sorted_desc = -jnp.sort(-logits, axis=-1)
    p = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(p, axis=-1) - p                      # mass strictly above each entry
    n_keep = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The sampling distribution of ``logits [B, ..., V]`` under per-row params ``[B]`` (float32)."""
    shape = logits.shape
    b, v = shape[0], shape[-1]
    flat = logits.reshape(b, -1, v).astype(jnp.float32)
    flat = flat / jnp.where(temperature > 0, temperature, 1.0)[:, None, None]
    rep = flat.shape[1]
    filtered = jax.lax.cond(   # the sorts over the vocabulary only run when some row filters
        jnp.any((top_k > 0) | (top_p < 1.0)),
        lambda: jax.vmap(lambda row, k, p: filter_logits(row, jnp.full((rep,), k), jnp.full((rep,), p)))(
            flat, top_k, top_p),
        lambda: flat)
    return jax.nn.softmax(filtered, axis=-1).reshape(shape)


def draw(keys: jax.Array, p: jax.Array, greedy: jax.Array) -> jax.Array:
    """One token per row from ``p [B, V]`` with that row's key (argmax where ``greedy [B]``). When every
    row is greedy the random draw is skipped (``lax.cond``): the same tokens, without the [B, V]
    random numbers."""
    def mixed():
        sampled = jax.vmap(lambda k, row: jax.random.categorical(k, jnp.log(row)))(keys, p)
        return jnp.where(greedy, jnp.argmax(p, axis=-1), sampled).astype(jnp.int32)
    return jax.lax.cond(jnp.all(greedy), lambda: jnp.argmax(p, axis=-1).astype(jnp.int32), mixed)


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> jax.Array:
    return draw(keys, probs(logits, temperature, top_k, top_p), temperature <= 0)


def flag_nonfinite(n: jax.Array, logits: jax.Array) -> jax.Array:
    """``n`` [B] (tokens a row emits this step) with -1 for each row whose ``logits`` [B, ..., V] are
    not all finite: its state is broken, so the engine fails that request (and no other)."""
    finite = jnp.isfinite(logits.reshape(logits.shape[0], -1)).all(axis=-1)
    return jnp.where(finite, n, -1)
