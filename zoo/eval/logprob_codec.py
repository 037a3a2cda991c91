"""The reference model's log-softmax in 16 bits per vocabulary entry (its top entries exact), and the
error that costs.

    log_softmax(logits) -> float64 [n, V]
    encode(logprobs [n, V], exact=EXACT) -> Encoded(codes uint16 [n, V], low, step [n],
                                                    top_ids int32 [n, exact], top_logprobs float64 [n, exact])
    decode(encoded) -> (logprobs float64 [n, V], shift float64 [n])     renormalized
    kld_bound(encoded, shift, p_logprobs, q_logprobs) -> float64 [n]

The scheme extends llama.cpp's ``--kl-divergence-base``: per token, the log-probabilities are mapped
linearly onto 0..65535 between ``low`` and the top one, so each stored value is within
``delta = step / 2`` of the true one, ``step = (top - low) / 65535``. ``low`` is the smallest
log-probability, but never more than ``RANGE`` (64) nats below the top: an entry further down is
stored at ``low`` (its true probability is below e^-64 of the top one's, immaterial to every figure
and left out of the bound). The ``exact`` (32) most likely entries are also stored exactly
(float64), and decoding puts them back. The decoded values are renormalized by subtracting
``shift = log sum exp(stored)``, which is known.

So per entry ``log p_hat_i - log p_i = e_i - shift`` with ``e_i = 0`` for the exact entries and
``|e_i| <= delta`` for the rest: ``|log p_hat_i - log p_i| <= eta_i``, ``eta_i = |shift|`` or
``|shift| + delta``. Writing ``p = p_hat e^-h`` and expanding, the KL divergence computed from
``p_hat`` differs from the exact one by at most, per token (``kld_bound``, sums over the vocabulary)::

    |KL(p_hat || q) - KL(p || q)| <= sum_i p_hat_i (e^eta_i - 1) |log p_hat_i - log q_i|
                                     + sum_i p_hat_i eta_i e^eta_i

Real logits' log-softmax spans ~20-60 nats, so ``delta`` is 1.5e-4 .. 4.6e-4 nats; since the top
entries are exact, only the probability mass outside them carries it, and ``shift`` is of the order
of that mass times ``delta``. The bound is a worst case, every rounding error pointing the same way.
Everything else ``zoo eval`` reports (perplexities, top-1 agreement, the top token's probability)
is stored exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LEVELS = 65535
RANGE = 64.0
EXACT = 32


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis."""
    x = np.asarray(logits, np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


@dataclass(frozen=True)
class Encoded:
    codes: np.ndarray         # uint16 [n, V]
    low: np.ndarray           # float64 [n]: the log-probability of code 0
    step: np.ndarray          # float64 [n]: the log-probability between two codes
    top_ids: np.ndarray       # int32 [n, exact]: the most likely entries, most likely first
    top_logprobs: np.ndarray  # float64 [n, exact]: their log-probabilities, exactly


def top_entries(logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest entries of each row, largest first (ties: the lower id first): ids, values."""
    k = min(k, logprobs.shape[-1])
    part = np.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(logprobs, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    ids = np.take_along_axis(part, order, axis=-1)
    return ids.astype(np.int32), np.take_along_axis(logprobs, ids, axis=-1)


def encode(logprobs: np.ndarray, exact: int = EXACT) -> Encoded:
    """``logprobs`` float [n, V] (a log-softmax) -> 16-bit codes with their per-row ``low`` and ``step``,
    and the ``exact`` largest entries as they are."""
    lp = np.asarray(logprobs, np.float64)
    top = lp.max(axis=-1)
    low = np.maximum(lp.min(axis=-1), top - RANGE)
    step = (top - low) / LEVELS
    divisor = np.where(step > 0, step, 1.0)[:, None]   # a flat row (step 0): every code 0, decoded exactly
    codes = np.rint((np.maximum(lp, low[:, None]) - low[:, None]) / divisor)
    ids, vals = top_entries(lp, exact)
    return Encoded(np.clip(codes, 0, LEVELS).astype(np.uint16), low, step, ids, vals)


def decode(e: Encoded) -> tuple[np.ndarray, np.ndarray]:
    """The stored log-probabilities [n, V], exact entries put back, renormalized; and the ``shift``
    [n] the renormalization subtracted."""
    stored = np.asarray(e.low)[:, None] + e.codes.astype(np.float64) * np.asarray(e.step)[:, None]
    np.put_along_axis(stored, e.top_ids.astype(np.intp), e.top_logprobs, axis=-1)
    top = stored.max(axis=-1, keepdims=True)
    shift = top + np.log(np.exp(stored - top).sum(axis=-1, keepdims=True))
    return stored - shift, shift[:, 0]


def kld_bound(e: Encoded, shift: np.ndarray, p_logprobs: np.ndarray, q_logprobs: np.ndarray) -> np.ndarray:
    """Per token, the most ``KL(p_hat || q)`` can differ from ``KL(p || q)`` (module doc): ``e`` the
    encoded reference, ``shift`` and ``p_logprobs`` its ``decode``, ``q_logprobs`` the candidate's [n, V]."""
    p_hat = np.exp(p_logprobs)
    weighted = p_hat * np.abs(p_logprobs - q_logprobs)
    ids = e.top_ids.astype(np.intp)
    spread_top = np.take_along_axis(weighted, ids, axis=-1).sum(axis=-1)
    mass_top = np.take_along_axis(p_hat, ids, axis=-1).sum(axis=-1)
    spread_rest = weighted.sum(axis=-1) - spread_top
    a = np.abs(shift)
    b = a + np.asarray(e.step) / 2
    return (np.expm1(a) * spread_top + np.expm1(b) * np.maximum(spread_rest, 0.0)
            + a * np.exp(a) * mass_top + b * np.exp(b) * np.maximum(1.0 - mass_top, 0.0))
