"""MTP speculative decoding: draft k tokens with the model's MTP head, verify them in one forward of
k+1 tokens, accept the drafts that are what plain decoding would have sampled, roll back what the
rejected tokens changed.

Sampling is coupled to the token's position: the token at a row's output position n is drawn with
the key ``fold_in(key(seed), n)`` (``sampling.position_keys``) by the Gumbel-max rule, in plain
decoding as here. A step computes, at each verify position i, the token plain decoding would emit
there (``s_i``, drawn from the target distribution p_i with position n+i's key), and accepts the
leading drafts equal to it. The output is therefore *the* plain decoding output for the row's seed,
token for token, whatever was drafted, by whom, and how many (exact in distribution a fortiori). An
MTP draft is drawn from its own distribution q_i with the same key (the same Gumbel noise), so it
agrees with s_i as often as q_i resembles p_i; at temperature 0 both are argmaxes.

One decode step (``spec_step``, one compiled program for the whole model)::

    pending rows (h_t, x_{t+1}) -> MTP catch-up; the last row's output is draft 1   (q_1, o_1)
    chained drafts: MTP(o_{i-1}, d_{i-1}) -> d_i for i = 2..k (provisional MTP rows, dropped after)
    verify: model([x_m, d_1..d_k]) keeping the recurrent state after every token -> p_0..p_k, h
    accept: s_i = sample(p_i, key n+i); j leading drafts with d_{i+1} == s_i; the extra token is s_j
    rollback: keep the j+1 tokens [x_m, d_1..d_j]: attention slots beyond become invalid, recurrent
              layers take the state after token j (``model.rollback``); the provisional MTP rows are
              undone with ``model.mtp_restore``
    next pending rows: (h_m, d_1) .. (h_{m+j-1}, d_j), (h_{m+j}, extra)       -- j+1 rows

The model provides ``__call__(..., keep_steps=True)``, ``rollback``, ``rollback_meta`` and
``mtp_restore`` (the contract of ``zoo.models.contract``). ``accept`` is the acceptance rule on its
own (tested for the target distribution and against plain sampling).

Per-row draft lengths and host drafts (``zoo.engine.spec_policy`` chooses them each step): ``plan``
``{"len": [B] int32 in 0..k, "drafts": [B, k] int32, "host": [B] bool}``. A row drafts ``len`` tokens:
its verify positions past them are masked out (a MoE routes none of them) and only its first ``len``
drafts can be accepted; when all are, the extra token is s_len (the bonus).
A chained MTP draft runs only when some row drafts that far (``lax.cond``: a step costs what its
longest row asks). A ``host`` row's drafts are ``plan["drafts"]`` (prompt lookup), accepted by the
same rule. Without a plan every row drafts k from the MTP head. ``spec_step(k=0)`` is the step with
drafting off: the target on one token per row, whose row is appended to the pending ones; the MTP
catch-up runs when some row's pending rows are full (every P steps: the MTP layer's cache keeps up
at a fraction of the cost).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zoo.engine.sampling import draw, probs, sample
from zoo.engine.token_mask import apply_token_mask
from zoo.models.contract import CausalLMContract
from zoo.models.shared.cache import ModelCache
from zoo.models.shared.layers import take_step


def accept(keys: jax.Array, p: jax.Array, drafts: jax.Array, greedy: jax.Array,
           lengths: jax.Array | None = None):
    """The acceptance rule: the tokens plain decoding samples at the k+1 verify positions, and the
    leading drafts equal to them.

    keys [B, k+1] the PRNG key of each verify position's output token (``sampling.position_keys``);
    p [B, k+1, V] the target distributions there; drafts [B, k]; greedy [B] (temperature 0: the
    argmax); lengths [B]: the drafts each row proposed (default k; the rest cannot be accepted).
    Returns (n_accepted [B] in 0..lengths, extra token [B]: the plain sample after the accepted ones).
    """
    b, width, v = p.shape
    s = draw(keys.reshape(-1), p.reshape(-1, v), jnp.repeat(greedy, width)).reshape(b, width)
    ok = drafts == s[:, :-1]
    if lengths is not None:
        ok = ok & (jnp.arange(drafts.shape[1])[None, :] < lengths[:, None])
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    return n_acc, jnp.take_along_axis(s, n_acc[:, None], axis=1)[:, 0]


def catch_up(model: CausalLMContract, cache: ModelCache, pending: dict, active: jax.Array):
    """The MTP layer over each active row's pending rows (its first ``pending["n"]``), kept in its
    cache. Returns (draft logits [B, P, V], MTP outputs [B, P, D], cache)."""
    width = pending["tok"].shape[1]
    rows = (jnp.arange(width)[None, :] < pending["n"][:, None]) & active[:, None]
    mtp_before = cache.mtp.slots
    q_logits, o, cache = model.mtp_forward(pending["h"], pending["tok"], rows, cache)
    caught_up = model.rollback_meta(mtp_before, cache.mtp.slots, jnp.where(active, pending["n"], 0))
    return q_logits, o, cache.replace(mtp=cache.mtp.replace(slots=caught_up))


def keep_inactive(old: dict, new: dict, active: jax.Array) -> dict:
    """The pending rows after a step: ``new`` for the active rows, ``old`` for the rows that sat it
    out (a constrained row whose mask was late keeps what its MTP has still to see)."""
    return jax.tree.map(lambda a, b: jnp.where(active.reshape((-1,) + (1,) * (a.ndim - 1)), b, a.astype(b.dtype)),
                        old, new)


def draft(model: CausalLMContract, cache: ModelCache, pending: dict, active: jax.Array, keys: jax.Array,
          params: dict, k: int, plan: dict | None = None):
    """Phase 1 of a step: MTP catch-up on the pending rows, then k chained drafts (a chained draft
    runs only where some row's ``plan["len"]`` reaches it; a ``plan["host"]`` row takes its
    ``plan["drafts"]`` instead). Draft i is drawn with ``keys [B, k+1]``'s position i, the key of the
    output token it proposes. Returns (cache, drafts [B, k] int32, x_m [B] the last emitted token,
    which the verify feeds first)."""
    temp, top_k, top_p = params["temperature"], params["top_k"], params["top_p"]
    greedy = temp <= 0
    q_logits, o, cache = catch_up(model, cache, pending, active)
    mark = cache.mtp
    last = jnp.maximum(pending["n"] - 1, 0)
    x_m = take_step(pending["tok"], last)
    lengths = jnp.full(x_m.shape, k, jnp.int32) if plan is None else plan["len"]
    chain = active if plan is None else active & ~plan["host"]          # the rows the MTP drafts for
    longest = jnp.max(jnp.where(chain, lengths, 0))
    q_i, o_i = take_step(q_logits, last), take_step(o, last)
    drafts = []
    for i in range(k):
        if i:
            def chained(mtp, o_prev=o_i, d_prev=drafts[-1], i=i):
                q_l, o_l, c = model.mtp_forward(o_prev[:, None], d_prev[:, None], (chain & (lengths > i))[:, None],
                                                cache.replace(mtp=mtp))
                return q_l[:, 0].astype(q_i.dtype), o_l[:, 0].astype(o_i.dtype), c.mtp

            def skipped(mtp, q_prev=q_i, o_prev=o_i):
                return jnp.zeros_like(q_prev), jnp.zeros_like(o_prev), mtp
            q_i, o_i, mtp = jax.lax.cond(longest > i, chained, skipped, cache.mtp)
            cache = cache.replace(mtp=mtp)
        drafts.append(draw(keys[:, i], probs(q_i, temp, top_k, top_p), greedy))
    cache = model.mtp_restore(cache, mark)                              # drop the provisional rows
    drafts = jnp.stack(drafts, axis=1)
    if plan is not None:
        drafts = jnp.where(plan["host"][:, None], plan["drafts"], drafts).astype(jnp.int32)
    return cache, drafts, x_m


def verify(model: CausalLMContract, cache: ModelCache, x_m: jax.Array, drafts: jax.Array, active: jax.Array,
           lengths: jax.Array | None = None):
    """Phase 2: the target model over ``[x_m, d_1..d_k]``, keeping the recurrent state after each
    token (a row's positions past its ``lengths`` [B] drafts masked out). Returns (p_logits
    [B, k+1, V], h [B, k+1, D], cache, before: the slots to roll back to)."""
    verify_ids = jnp.concatenate([x_m[:, None], drafts], axis=1)
    before = cache.slots
    mask = jnp.broadcast_to(active[:, None], verify_ids.shape)
    if lengths is not None:
        mask = mask & (jnp.arange(verify_ids.shape[1])[None, :] <= lengths[:, None])
    p_logits, h, cache = model(verify_ids, mask, cache, keep_steps=True)
    return p_logits, h, cache, before


def settle(model: CausalLMContract, cache: ModelCache, before, p_logits: jax.Array, h: jax.Array,
           drafts: jax.Array, active: jax.Array, keys: jax.Array, params: dict, force: jax.Array | None = None,
           cap: jax.Array | None = None, mask: jax.Array | None = None, lengths: jax.Array | None = None):
    """Phase 3: accept (the target logits masked by ``mask`` [B, k+1, W] token bitmasks, if given:
    the target distribution is then the masked one, see ``zoo.engine.token_mask``; a row's drafts
    past its ``lengths`` [B] were not proposed; ``keys`` [B, k+1] as in ``accept``), apply ``cap`` /
    ``force``, roll back. Returns (cache, pending, tokens [B, k+1], n_tokens [B])."""
    k = drafts.shape[1]
    temp, top_k, top_p = params["temperature"], params["top_k"], params["top_p"]
    greedy = temp <= 0
    if mask is not None:
        p_logits = apply_token_mask(p_logits, mask)
    p = probs(p_logits, temp, top_k, top_p)
    n_acc, extra = accept(keys, p, drafts, greedy, lengths)
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
              with_logits: bool = False, plan: dict | None = None):
    """One speculative decode step for every row (see module docstring): ``draft``, ``verify`` and
    ``settle`` in one program.

    pending: ``{"h": [B, P, D], "tok": [B, P] int32, "n": [B] int32}`` rows for the MTP (P: the
    batch's width, the generator's k + 1; ``k`` is P - 1, or 0 for the step with drafting off);
    active [B] bool; keys [B, k+1] the PRNG keys of each row's next k+1 output positions
    (``sampling.position_keys``; [B, 1] when k = 0); params: ``temperature, top_k, top_p`` [B];
    force [B] int32 (optional): a row with ``force >= 0`` rejects every draft and emits that token;
    cap [B] int32 (optional): a row emits at most ``cap`` (>= 1) tokens this step (accepted drafts past
    the cap are dropped and rolled back; the last kept one is an accepted draft, so still exact);
    plan (optional): per-row draft lengths and host drafts (module docstring).
    Returns (cache, pending, tokens [B, k+1] int32, n_tokens [B] int32 (0 for inactive rows)), and
    with ``with_logits`` also the target's verify logits [B, k+1, V]: position i is the model's
    distribution for ``tokens[:, i]`` (what a plain decode step would have given for that token).
    """
    if not k:
        return _step_without_drafts(model, cache, pending, active, keys, params, force, with_logits)
    lengths = None if plan is None else plan["len"]
    cache, drafts, x_m = draft(model, cache, pending, active, keys, params, k, plan)
    p_logits, h, cache, before = verify(model, cache, x_m, drafts, active, lengths)
    cache, new, tokens, n_keep = settle(model, cache, before, p_logits, h, drafts, active, keys, params,
                                       force, cap, lengths=lengths)
    new = keep_inactive(pending, {**new, "h": new["h"].astype(pending["h"].dtype)}, active)
    if with_logits:
        return cache, new, tokens, n_keep, p_logits
    return cache, new, tokens, n_keep


def _step_without_drafts(model, cache, pending, active, keys, params, force, with_logits):
    """``spec_step`` with k = 0: the target on one token per row, as a plain decode step (no per-token
    states kept, nothing to roll back). The MTP catch-up is deferred while the pending rows have room
    (``lax.cond``): a step appends its row (h_m, token) to them, and runs the catch-up of every row
    only when some active row's are full (once every P steps)."""
    width = pending["tok"].shape[1]
    full = jnp.any(active & (pending["n"] >= width))

    def caught_up(mtp):
        return catch_up(model, cache.replace(mtp=mtp), pending, active)[2].mtp
    cache = cache.replace(mtp=jax.lax.cond(full, caught_up, lambda mtp: mtp, cache.mtp))
    x_m = take_step(pending["tok"], jnp.maximum(pending["n"] - 1, 0))
    logits, h, cache = model(x_m[:, None], active[:, None], cache)
    new = sample(logits[:, 0], keys[:, 0], params["temperature"], params["top_k"], params["top_p"])
    if force is not None:
        new = jnp.where(force >= 0, force, new)
    tokens, n_keep = new[:, None].astype(jnp.int32), active.astype(jnp.int32)
    at = jnp.where(full, 0, pending["n"])                                 # where this step's row goes
    row = jax.nn.one_hot(at, width, dtype=jnp.bool_)                      # [B, P]
    appended = {"h": jnp.where(row[..., None], h[:, :1].astype(pending["h"].dtype), pending["h"]),
                "tok": jnp.where(row, tokens, pending["tok"]), "n": at + 1}
    new_pending = keep_inactive(pending, appended, active)
    if with_logits:
        return cache, new_pending, tokens, n_keep, logits
    return cache, new_pending, tokens, n_keep
