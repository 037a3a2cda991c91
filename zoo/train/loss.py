"""Training losses of any zoo model (the contract of ``zoo.models.contract``), computed by the
model's own forward: one full pass over the batch with a fresh cache, as ``Model.logits`` does.

Inputs, for a batch of B rows of T tokens::

    ids        [B, T] int   the tokens
    loss_mask  [B, T]       1 where token t is a *target* (e.g. only the assistant's tokens of a
                            chat), 0 for the prompt and padding
    mask       [B, T]       1 where there is a token at all (the model's attention mask; left or
                            right padding is 0); default all ones

Main model (next token): position t predicts x_{t+1}; it counts when ``loss_mask[t+1]`` and both
tokens are real::

    logits, hidden, cache = model(ids, mask, model.init_cache(B, T))     hidden: post-norm [B, T, D]

MTP head (the token after next), exactly as the speculative decoder uses it
(``zoo.engine.speculative``, ``step_programs.prefill_piece``): row t pairs the main model's post-norm
hidden state h_t with the next token x_{t+1} and predicts x_{t+2}; the rows run in order through the
MTP layer's own (fresh) cache, row t at MTP position t, as the prefill lays them out::

    draft, _, _ = model.mtp_forward(hidden[:, :T-2], ids[:, 1:T-1], rows, cache)   [B, T-2, V]
    row t counts when loss_mask[t+2] and x_t, x_{t+1}, x_{t+2} are real

That is the decoder's first draft of a step; its later drafts chain the MTP layer on its own output
(``MTP(o_i, d_i)``), which this loss does not train (the head is fitted at depth 1).

``teacher`` (self-distillation): the MTP row t's target is the main model's own prediction at t+1
(what the decoder's verify step compares a first draft with) instead of the batch's token x_{t+2}:
``teacher=0.0`` its argmax (greedy acceptance), ``teacher=T > 0`` its distribution at temperature T
(cross-entropy against softmax(logits / T)); the accuracy is then agreement with its argmax. The
targets exist at every row, prompt or not, so any text trains the head.

``detach_hidden``: the MTP loss sends gradients to the MTP head's own parameters (``mtp.*``) only:
h_t, and the embedding and output head the MTP layer shares with the model, are stop-gradient in
its branch (fitting a head to a frozen model; the main model's loss is not affected).

Every loss is kept as sums (``TokenStats``), so that a mean over micro-batches can be exact
(``zoo.train.step``). ``lm_loss`` / ``mtp_loss`` give the means directly.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.sharding.cache_axes import shard_cache


class TokenStats(NamedTuple):
    """Sums over the target tokens of a batch (float32 scalars): cross-entropy, argmax hits, count."""

    nll: jax.Array
    correct: jax.Array
    count: jax.Array

    @property
    def mean(self) -> jax.Array:
        return self.nll / jnp.maximum(self.count, 1.0)

    @property
    def accuracy(self) -> jax.Array:
        return self.correct / jnp.maximum(self.count, 1.0)


def default_mask(ids: jax.Array, mask: jax.Array | None) -> jax.Array:
    """The attention mask as bool [B, T] (all ones when None)."""
    return jnp.ones(ids.shape, bool) if mask is None else jnp.asarray(mask).astype(bool)


def token_stats(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> TokenStats:
    """logits [B, N, V], targets [B, N] int, weights [B, N] (0/1) -> the weighted sums."""
    logits = logits.astype(jnp.float32)
    weights = weights.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    hit = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return TokenStats(nll=jnp.sum((logz - picked) * weights), correct=jnp.sum(hit * weights),
                      count=jnp.sum(weights))


def lm_weights(loss_mask: jax.Array, mask: jax.Array) -> jax.Array:
    """[B, T-1]: position t's prediction of x_{t+1} counts."""
    loss_mask = jnp.asarray(loss_mask).astype(bool)
    return loss_mask[:, 1:] & mask[:, 1:] & mask[:, :-1]


def mtp_weights(loss_mask: jax.Array, mask: jax.Array) -> jax.Array:
    """[B, T-2]: MTP row t's prediction of x_{t+2} counts."""
    loss_mask = jnp.asarray(loss_mask).astype(bool)
    return loss_mask[:, 2:] & mask[:, 2:] & mask[:, 1:-1] & mask[:, :-2]


def full_forward(model, ids: jax.Array, mask: jax.Array):
    """One full pass with a fresh cache made here (inside the caller's jit: zeros, no transfer; on a
    mesh, pinned to its layout) -> (logits f32 [B, T, V], post-norm hidden [B, T, D], cache)."""
    b, t = ids.shape
    return model(ids, mask, shard_cache(model.init_cache(b, t)))


def _mtp_only_view(model):
    """``model`` with every parameter outside ``mtp.*`` stop-gradient (the MTP layer's branch of
    ``detach_hidden``: the shared embedding and output head get no gradient from it)."""
    graphdef, mtp, rest = nnx.split(model, lambda path, _: bool(path) and path[0] == "mtp", ...)
    return nnx.merge(graphdef, mtp, jax.lax.stop_gradient(rest))


def teacher_stats(logits: jax.Array, teacher: jax.Array, weights: jax.Array, temperature: float) -> TokenStats:
    """logits, teacher [B, N, V], weights [B, N] -> sums of the cross-entropy against the teacher's
    argmax (``temperature`` 0) or its softmax at ``temperature``; hits: the argmaxes agree."""
    teacher = jax.lax.stop_gradient(teacher.astype(jnp.float32))
    target = jnp.argmax(teacher, axis=-1)
    if not temperature:
        return token_stats(logits, target, weights)
    logits, weights = logits.astype(jnp.float32), weights.astype(jnp.float32)
    nll = -jnp.sum(jax.nn.softmax(teacher / temperature, axis=-1) * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    hit = (jnp.argmax(logits, axis=-1) == target).astype(jnp.float32)
    return TokenStats(nll=jnp.sum(nll * weights), correct=jnp.sum(hit * weights), count=jnp.sum(weights))


def mtp_stats(model, hidden: jax.Array, ids: jax.Array, loss_mask: jax.Array, mask: jax.Array, cache,
              detach_hidden: bool = False, teacher: float | None = None, logits: jax.Array | None = None
              ) -> TokenStats:
    """The MTP head's sums over rows t = 0..T-3 (see the module docstring); ``hidden``, ``cache`` and
    (with ``teacher``) ``logits`` from ``full_forward`` (its MTP part is still fresh)."""
    if getattr(model, "mtp", None) is None:
        raise ValueError("this model has no MTP layer")
    if ids.shape[1] < 3:
        raise ValueError("the MTP loss needs at least 3 tokens per row")
    h = hidden[:, :-2]
    if detach_hidden:
        h, model = jax.lax.stop_gradient(h), _mtp_only_view(model)
    rows = mask[:, :-2] & mask[:, 1:-1]
    draft, _, _ = model.mtp_forward(h, ids[:, 1:-1], rows, cache)
    if teacher is None:
        return token_stats(draft, ids[:, 2:], mtp_weights(loss_mask, mask))
    return teacher_stats(draft, logits[:, 1:-1], mtp_weights(loss_mask, mask), teacher)


def batch_stats(model, ids: jax.Array, loss_mask: jax.Array, mask: jax.Array | None = None, *,
                mtp: bool = False, detach_hidden: bool = False, teacher: float | None = None
                ) -> dict[str, TokenStats]:
    """``{"lm": TokenStats}`` and with ``mtp`` also ``"mtp"``, from one full pass of ``model``."""
    mask = default_mask(ids, mask)
    logits, hidden, cache = full_forward(model, ids, mask)
    out = {"lm": token_stats(logits[:, :-1], ids[:, 1:], lm_weights(loss_mask, mask))}
    if mtp:
        out["mtp"] = mtp_stats(model, hidden, ids, loss_mask, mask, cache, detach_hidden, teacher, logits)
    return out


def lm_loss(model, ids: jax.Array, loss_mask: jax.Array, mask: jax.Array | None = None
            ) -> tuple[jax.Array, jax.Array]:
    """(mean next-token cross-entropy over the targets, next-token accuracy) of ``model``."""
    stats = batch_stats(model, ids, loss_mask, mask)["lm"]
    return stats.mean, stats.accuracy


def mtp_loss(model, ids: jax.Array, loss_mask: jax.Array, mask: jax.Array | None = None,
             detach_hidden: bool = False) -> tuple[jax.Array, jax.Array]:
    """(mean cross-entropy of the MTP head's x_{t+2} predictions over the targets, its accuracy)."""
    stats = batch_stats(model, ids, loss_mask, mask, mtp=True, detach_hidden=detach_hidden)["mtp"]
    return stats.mean, stats.accuracy
