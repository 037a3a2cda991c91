"""``Model.logits`` / ``hidden_states`` / ``mtp_logits`` run each length at ``padded_length(S)`` (right
padding, masked): lengths in one bucket share one compiled program, and every unmasked position's
outputs equal those of the forward at the exact length (both embedded models, float32, MTP included;
a left-padded row's masked positions carry no value either way)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import zoo
from zoo.api import _full_forward, _mtp_forward, padded_length


def test_padded_length_buckets():
    assert [padded_length(s) for s in (1, 15, 16, 17, 33, 100, 128, 129, 1100, 4097)] == [
        16, 16, 16, 32, 48, 112, 128, 144, 1152, 4608]
    for s in range(1, 5000):                     # never shorter; at most 1/8 (or 15 positions) of padding
        p = padded_length(s)
        assert s <= p <= max(s + 15, s * 9 // 8 + 1), s


@pytest.mark.parametrize("name", ["qwen38-tiny", "glm53-tiny"])
def test_lengths_in_a_bucket_share_a_program_and_equal_the_exact_forward(name):
    model = zoo.load(name, dtype="float32")
    rng = np.random.default_rng(0)
    seq = rng.integers(1, model.config.vocab_size, size=(2, 47))
    mask = np.ones(seq.shape, bool)
    mask[1, :5] = False                          # a left-padded row beside a full one
    mtp_rows = mask[:, :-1] & mask[:, 1:]        # MTP row t: positions t and t + 1 present
    present = lambda n: (mask[:, :n], mask[:, :n], mtp_rows[:, :n - 1])     # noqa: E731  (logits, hidden, MTP)
    compiled = model._logits_fn._cache_size()
    runs = {n: (model.logits(seq[:, :n], mask[:, :n]), model.hidden_states(seq[:, :n], mask[:, :n]),
                model.mtp_logits(seq[:, :n], mask[:, :n])) for n in (33, 40, 47)}     # one bucket: 48
    assert model._logits_fn._cache_size() == compiled + 1
    n = 40                                       # against the forward at exactly n (its own program)
    want_logits, want_hidden = jax.jit(lambda s, i, m: _full_forward(model._graphdef, s, i, m))(
        model._state, seq[:, :n], mask[:, :n])
    want_mtp = jax.jit(lambda s, i, m: _mtp_forward(model._graphdef, s, i, m))(model._state, seq[:, :n], mask[:, :n])
    for got, want, m in zip(runs[n], (want_logits, want_hidden, want_mtp), present(n)):
        want = np.asarray(want, np.float32)
        assert got.shape == want.shape and np.abs(got[m] - want[m]).max() <= 1e-5 * np.abs(want[m]).max(), name
    for n, got in runs.items():                  # every length: the longest run's first n positions
        assert got[0].shape == (2, n, model.config.vocab_size) and got[2].shape == (2, n - 1, model.config.vocab_size)
        for a, b, m in zip(got, runs[47], present(n)):
            assert np.abs(a[m] - b[:, :a.shape[1]][m]).max() <= 1e-6 * np.abs(b).max(), (name, n)
