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
    exact_logits = jax.jit(lambda s, i, m: _full_forward(model._graphdef, s, i, m))
    exact_mtp = jax.jit(lambda s, i, m: _mtp_forward(model._graphdef, s, i, m))
    compiled = model._logits_fn._cache_size()
    for n in (33, 40, 47):                       # one bucket: 48 positions
        ids = seq[:, :n]
        mask = np.ones(ids.shape, bool)
        mask[1, :5] = False                      # a left-padded row beside a full one
        got, hidden, mtp = (model.logits(ids, mask), model.hidden_states(ids, mask), model.mtp_logits(ids, mask))
        want_logits, want_hidden = exact_logits(model._state, ids, mask)
        want_mtp = exact_mtp(model._state, ids, mask)
        assert got.shape == (2, n, model.config.vocab_size) and hidden.shape[:2] == (2, n)
        assert mtp.shape == (2, n - 1, model.config.vocab_size)
        mtp_rows = mask[:, :-1] & mask[:, 1:]                # MTP row t: positions t and t + 1 present
        for a, b, m in ((got, want_logits, mask), (hidden, want_hidden, mask), (mtp, want_mtp, mtp_rows)):
            a, b = a[m], np.asarray(b, np.float32)[m]
            assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), (name, n)
    assert model._logits_fn._cache_size() == compiled + 1
