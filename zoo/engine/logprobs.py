"""Token log-probabilities: computed on the device inside the engine's programs, carried to the
API surfaces as ``TokenLogprob`` records.

What is reported is the *model's* distribution: ``log_softmax`` in float32 of the logits the
sampler receives, before temperature, top-k and top-p reshape them (as OpenAI reports them; a
sampled token outside a top-k set still has its model logprob). With MTP speculation these are
the target model's verify logits at each emitted position, the same numbers a plain decode gives.

    token_logprobs(logits [B, T, V], tokens [B, T], top_n) -> {"logprob": [B, T] f32,
                                                              "top_ids": [B, T, K] i32,
                                                              "top_logprobs": [B, T, K] f32}

``K`` is always ``MAX_TOP`` (each request keeps as many as it asked for), so the engine's
programs have one shape whatever the requests ask. ``maybe_token_logprobs`` computes them under a
traced flag (``lax.cond``): a step where no row asks runs the same program and skips the work. The
prefill of a request asking for its prompt's logprobs scores every position of its piece: it holds
a [C, V] float32 log-softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from zoo.sharding.mesh import host_value

MAX_TOP = 20                  # the most alternatives a request may ask for (OpenAI's bound)


def token_logprobs(logits: jax.Array, tokens: jax.Array, top_n: int = MAX_TOP) -> dict:
    """Log-probabilities (float32) of ``tokens [B, T]`` under ``logits [B, T, V]`` and the ``top_n``
    most likely tokens at each position, most likely first (see the module doc)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    top, ids = jax.lax.top_k(logp, top_n)
    return {"logprob": chosen, "top_ids": ids.astype(jnp.int32), "top_logprobs": top}


def maybe_token_logprobs(want: jax.Array, logits: jax.Array, tokens: jax.Array) -> dict:
    """``token_logprobs(logits, tokens, MAX_TOP)`` where the traced bool ``want`` is true, zeros of
    the same shapes otherwise (the work skipped at run time, one program either way)."""
    k = min(MAX_TOP, logits.shape[-1])

    def skip():
        b, t = tokens.shape
        return {"logprob": jnp.zeros((b, t), jnp.float32), "top_ids": jnp.zeros((b, t, k), jnp.int32),
                "top_logprobs": jnp.zeros((b, t, k), jnp.float32)}
    return jax.lax.cond(want, lambda: token_logprobs(logits, tokens, k), skip)


@dataclass(frozen=True)
class TokenLogprob:
    """One token and its log-probability; ``top``: (token id, logprob) of the most likely tokens at
    that position, most likely first (as many as the request asked for; none for the first prompt
    token, which has no logprob: ``logprob`` None)."""
    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def records(tokens, out: dict, n_top: int) -> list[TokenLogprob]:
    """``TokenLogprob`` per token from one row of ``token_logprobs``' output (numpy, ``[T]`` and
    ``[T, K]``), keeping ``n_top`` alternatives."""
    lp, ids, top = out["logprob"], out["top_ids"], out["top_logprobs"]
    return [TokenLogprob(int(t), float(lp[i]), tuple(zip(ids[i, :n_top].tolist(), top[i, :n_top].tolist())))
            for i, t in enumerate(tokens)]


def to_numpy(out: dict) -> dict:
    return {k: host_value(v) for k, v in out.items()}
