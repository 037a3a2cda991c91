"""MTP speculative decoding: draft k tokens with the model's MTP head, verify them in one forward of
k+1 tokens, accept by exact rejection sampling, roll back what the rejected tokens changed.

One decode step (``spec_step``, one compiled program for the whole model)::

    pending rows (h_t, x_{t+1}) -> MTP catch-up; the last row's output is draft 1   (q_1, o_1)
    chained drafts: MTP(o_{i-1}, d_{i-1}) -> d_i for i = 2..k (provisional MTP rows, dropped after)
    verify: model([x_m, d_1..d_k]) keeping the recurrent state after every token -> p_0..p_k, h
    accept: j leading drafts pass ``u * q(d) < p(d)``; extra token from normalize(max(0, p_j - q_j))
            (or from p_k when all k pass: the bonus); at temperature 0 this is "d_i == argmax p_i"
    rollback: keep the j+1 tokens [x_m, d_1..d_j]: attention slots beyond become invalid, recurrent
              layers take the state after token j (``model.rollback``); the provisional MTP rows are
              undone with ``model.mtp_restore``

The model provides ``__call__(..., keep_steps=True)``, ``rollback``, ``rollback_meta`` and
``mtp_restore`` (the contract of ``zoo.models.contract``).
    next pending rows: (h_m, d_1) .. (h_{m+j-1}, d_j), (h_{m+j}, extra)       -- j+1 rows

``accept`` is the sampler on its own (tested for distributional exactness).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zoo.engine.sampling import draw, probs
from zoo.engine.token_mask import apply_token_mask
from zoo.models.contract import CausalLMContract
from zoo.models.shared.cache import ModelCache
from zoo.models.shared.layers import take_step


def accept(keys: jax.Array, p: jax.Array, q: jax.Array, drafts: jax.Array, greedy: jax.Array):
    """Exact rejection sampling.

    keys [B] (one per row); p [B, k+1, V] target distributions at the k+1 verify positions;
    q [B, k, V] the distributions the drafts were drawn from; drafts [B, k]; greedy [B]
    (temperature 0: accept iff the draft is the argmax of p).
    Returns (n_accepted [B] in 0..k, extra token [B]).
    """
    return jax.lax.cond(jnp.all(greedy), lambda: _accept_greedy(p, drafts),
                        lambda: _accept_sampled(keys, p, q, drafts, greedy))


def _accept_greedy(p: jax.Array, drafts: jax.Array):
    """``accept`` when every row is greedy: the drafts that are the argmax of p, then the argmax
    after them (no random numbers, no residual distribution)."""
    k = drafts.shape[1]
    ok = drafts == jnp.argmax(p[:, :k], axis=-1)
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    p_j = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]
    return n_acc, jnp.argmax(p_j, axis=-1).astype(jnp.int32)


def _accept_sampled(keys: jax.Array, p: jax.Array, q: jax.Array, drafts: jax.Array, greedy: jax.Array):
    b, k = drafts.shape
    split = jax.vmap(jax.random.split)(keys)                              # [B, 2]
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(split[:, 0])
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    ok = jnp.where(greedy[:, None], drafts == jnp.argmax(p[:, :k], axis=-1), u * q_d < p_d)
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    p_j = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)       # q_k = 0: the bonus is p_k
    q_j = jnp.take_along_axis(q_pad, n_acc[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_j - q_j, 0.0)
    mass = residual.sum(-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_j)
    residual = jnp.where(greedy[:, None], p_j, residual)      # greedy: the argmax of p_j itself
    return n_acc, draw(split[:, 1], residual, greedy)


def draft(model: CausalLMContract, cache: ModelCache, pending: dict, active: jax.Array, keys: jax.Array,
          params: dict, k: int):
    """Phase 1 of a step: MTP catch-up on the pending rows, then k chained drafts.
    Returns (cache, drafts [B, k] int32, q [B, k, V] the draft distributions, x_m [B] the last
    emitted token, which the verify feeds first)."""
    temp, top_k, top_p = params["temperature"], params["top_k"], params["top_p"]
    greedy = temp <= 0
    sub = jax.vmap(lambda kk: jax.random.split(kk, k + 1))(keys)           # [B, k+1]
    rows = (jnp.arange(k + 1)[None, :] < pending["n"][:, None]) & active[:, None]
    mtp_before = cache.mtp.slots
    q_logits, o, cache = model.mtp_forward(pending["h"], pending["tok"], rows, cache)
    caught_up = model.rollback_meta(mtp_before, cache.mtp.slots, jnp.where(active, pending["n"], 0))
    cache = cache.replace(mtp=cache.mtp.replace(slots=caught_up))
    mark = cache.mtp
    last = jnp.maximum(pending["n"] - 1, 0)
    q_i, o_i = take_step(q_logits, last), take_step(o, last)
    qs, drafts = [], []
    for i in range(k):
        if i:
            q_l, o_l, cache = model.mtp_forward(o_i[:, None], drafts[-1][:, None], active[:, None], cache)
            q_i, o_i = q_l[:, 0], o_l[:, 0]
        qs.append(probs(q_i, temp, top_k, top_p))
        drafts.append(draw(sub[:, i], qs[-1], greedy))
    cache = model.mtp_restore(cache, mark)                              # drop the provisional rows
    return cache, jnp.stack(drafts, axis=1), jnp.stack(qs, axis=1), take_step(pending["tok"], last)


def verify(model: CausalLMContract, cache: ModelCache, x_m: jax.Array, drafts: jax.Array, active: jax.Array):
    """Phase 2: the target model over ``[x_m, d_1..d_k]``, keeping the recurrent state after each
    token. Returns (p_logits [B, k+1, V], h [B, k+1, D], cache, before: the slots to roll back to)."""
    verify_ids = jnp.concatenate([x_m[:, None], drafts], axis=1)
    before = cache.slots
    p_logits, h, cache = model(verify_ids, jnp.broadcast_to(active[:, None], verify_ids.shape), cache,
                               keep_steps=True)
    return p_logits, h, cache, before


def settle(model: CausalLMContract, cache: ModelCache, before, p_logits: jax.Array, h: jax.Array, q: jax.Array,
           drafts: jax.Array, active: jax.Array, keys: jax.Array, params: dict, force: jax.Array | None = None,
           cap: jax.Array | None = None, mask: jax.Array | None = None):
    """Phase 3: accept (the target logits masked by ``mask`` [B, k+1, W] token bitmasks, if given:
    the target distribution is then the masked one, see ``zoo.engine.token_mask``), apply
    ``cap`` / ``force``, roll back. Returns (cache, pending, tokens [B, k+1], n_tokens [B])."""
    k = drafts.shape[1]
    temp, top_k, top_p = params["temperature"], params["top_k"], params["top_p"]
    greedy = temp <= 0
    sub = jax.vmap(lambda kk: jax.random.split(kk, k + 1))(keys)
    if mask is not None:
        p_logits = apply_token_mask(p_logits, mask)
    p = probs(p_logits, temp, top_k, top_p)
    n_acc, extra = accept(sub[:, k], p, q, drafts, greedy)
    if cap is not None:
        limit = jnp.maximum(cap, 1) - 1
        past = n_acc > limit                                  # then drafts[limit] was accepted: emit it last
        extra = jnp.where(past, jnp.take_along_axis(drafts, jnp.minimum(limit, k - 1)[:, None], axis=1)[:, 0], extra)
        n_acc = jnp.minimum(n_acc, limit)
    if force is not None:
        n_acc = jnp.where(force >= 0, 0, n_acc)
        extra = jnp.where(force >= 0, force, extra)
    n_keep = jnp.where(active, n_acc + 1, 0)
    cache = model.rollback(cache, before, n_keep)
    pos = jnp.arange(k + 1)[None, :]
    drafts_ext = jnp.concatenate([drafts, drafts[:, -1:]], axis=1)
    tokens = jnp.where(pos == n_acc[:, None], extra[:, None], drafts_ext).astype(jnp.int32)
    pending = {"h": h, "tok": tokens, "n": n_acc + 1}
    return cache, pending, tokens, n_keep


def spec_step(model: CausalLMContract, cache: ModelCache, pending: dict, active: jax.Array, keys: jax.Array,
              params: dict, k: int, force: jax.Array | None = None, cap: jax.Array | None = None,
              with_logits: bool = False):
    """One speculative decode step for every row (see module docstring): ``draft``, ``verify`` and
    ``settle`` in one program.

    pending: ``{"h": [B, k+1, D], "tok": [B, k+1] int32, "n": [B] int32}`` rows for the MTP;
    active [B] bool; keys [B] this step's key per row; params: ``temperature, top_k, top_p`` [B];
    force [B] int32 (optional): a row with ``force >= 0`` rejects every draft and emits that token;
    cap [B] int32 (optional): a row emits at most ``cap`` (>= 1) tokens this step (accepted drafts past
    the cap are dropped and rolled back; the last kept one is an accepted draft, so still exact).
    Returns (cache, pending, tokens [B, k+1] int32, n_tokens [B] int32 (0 for inactive rows)), and
    with ``with_logits`` also the target's verify logits [B, k+1, V]: position i is the model's
    distribution for ``tokens[:, i]`` (what a plain decode step would have given for that token).
    """
    cache, drafts, q, x_m = draft(model, cache, pending, active, keys, params, k)
    p_logits, h, cache, before = verify(model, cache, x_m, drafts, active)
    cache, new, tokens, n_keep = settle(model, cache, before, p_logits, h, q, drafts, active, keys, params,
                                       force, cap)
    new = {**new, "h": new["h"].astype(pending["h"].dtype)}
    if with_logits:
        return cache, new, tokens, n_keep, p_logits
    return cache, new, tokens, n_keep
