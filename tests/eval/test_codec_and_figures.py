"""The 16-bit reference (``zoo.eval.logprob_codec``), its stated error bound, the figures
(``zoo.eval.figures``) and the windows (``zoo.eval.windows``), on numpy data alone."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo.eval.figures import figures
from zoo.eval.logprob_codec import EXACT, RANGE, decode, encode, kld_bound, log_softmax
from zoo.eval.windows import scored_positions, token_windows


def _kl(lp, lq):
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def _logits(rng, n, vocab, scale):
    """Logits of a language model's shape: a heavy head (a few likely tokens) over a long tail."""
    x = rng.standard_normal((n, vocab)) * scale
    x[:, rng.integers(0, vocab, 5)] += scale * 3
    return x


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])     # flat, language-model-like, very peaked
def test_the_bound_holds_for_every_token_and_is_small(scale):
    rng = np.random.default_rng(int(scale * 10))
    lp = log_softmax(_logits(rng, 64, 4096, scale))
    lq = log_softmax(lp + 0.2 * rng.standard_normal(lp.shape))   # a perturbed candidate
    enc = encode(lp)
    got, shift = decode(enc)
    exact, approx = _kl(lp, lq), _kl(got, lq)
    bound = kld_bound(enc, shift, got, lq)
    assert np.all(np.abs(approx - exact) <= bound + 1e-12)
    delta = enc.step / 2
    assert np.all(np.abs(got - lp)[lp > lp.max(axis=-1, keepdims=True) - RANGE] <= 2 * delta[:, None] + 1e-12)
    assert bound.max() < 2e-3                        # the bound is not vacuous: a small fraction of a nat
    assert np.abs(approx - exact).max() < bound.max()


def test_top_entries_are_stored_exactly_and_ordered():
    rng = np.random.default_rng(0)
    lp = log_softmax(_logits(rng, 8, 1000, 3.0))
    enc = encode(lp)
    assert enc.top_ids.shape == (8, EXACT)
    np.testing.assert_array_equal(enc.top_ids[:, 0], lp.argmax(axis=-1))
    assert np.all(np.diff(enc.top_logprobs, axis=-1) <= 0)
    np.testing.assert_array_equal(enc.top_logprobs, np.take_along_axis(lp, enc.top_ids, axis=-1))
    got, _ = decode(enc)
    top = np.take_along_axis(got, enc.top_ids, axis=-1)
    np.testing.assert_allclose(top, enc.top_logprobs, atol=1e-6)     # exact up to the renormalization


def test_a_vocabulary_smaller_than_the_exact_entries_is_stored_exactly():
    rng = np.random.default_rng(1)
    lp = log_softmax(rng.standard_normal((4, 20)))
    enc = encode(lp)
    got, shift = decode(enc)
    np.testing.assert_allclose(got, lp, atol=1e-14)
    assert np.all(kld_bound(enc, shift, got, lp) < 1e-12)


def test_entries_far_below_the_top_are_floored():
    lp = log_softmax(np.array([[0.0, -1.0, -200.0, -300.0] + [-2.0] * 40]))
    enc = encode(lp, exact=2)
    assert enc.low[0] == pytest.approx(lp.max() - RANGE)
    got, _ = decode(enc)
    assert got[0, 2] == got[0, 3] == pytest.approx(lp.max() - RANGE, abs=1e-3)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 300), st.floats(0.01, 30.0), st.integers(0, 2 ** 31 - 1))
def test_the_bound_holds_on_any_row(vocab, scale, seed):
    rng = np.random.default_rng(seed)
    lp = log_softmax(rng.standard_normal((3, vocab)) * scale)
    lq = log_softmax(rng.standard_normal((3, vocab)) * scale)
    enc = encode(lp, exact=min(4, vocab))
    got, shift = decode(enc)
    assert np.all(np.abs(_kl(got, lq) - _kl(lp, lq)) <= kld_bound(enc, shift, got, lq) + 1e-12)


def test_figures_match_their_definitions():
    rng = np.random.default_rng(2)
    n = 500
    base = rng.exponential(2.0, n)
    cand = base + rng.normal(0.01, 0.1, n)
    per_token = {"kld": rng.exponential(0.01, n), "kld_bound": np.full(n, 1e-5), "base_nll": base,
                 "cand_nll": cand, "same_top": rng.random(n) < 0.9, "dp_top": rng.normal(0, 0.02, n),
                 "dp_next": rng.normal(0, 0.01, n)}
    f = figures(per_token)
    kld = per_token["kld"]
    assert f["tokens"] == n
    assert f["kld"]["mean"] == pytest.approx(kld.mean())
    assert f["kld"]["stderr"] == pytest.approx(kld.std(ddof=1) / math.sqrt(n))
    assert (f["kld"]["median"], f["kld"]["p99"], f["kld"]["max"]) == pytest.approx(
        (np.median(kld), np.percentile(kld, 99), kld.max()))
    top1 = per_token["same_top"].mean()
    assert f["top1"]["mean"] == pytest.approx(top1)
    assert f["top1"]["stderr"] == pytest.approx(math.sqrt(top1 * (1 - top1) / (n - 1)))
    assert f["ppl_base"]["mean"] == pytest.approx(math.exp(base.mean()))
    assert f["ppl_cand"]["stderr"] == pytest.approx(math.exp(cand.mean()) * cand.std(ddof=1) / math.sqrt(n))
    assert f["ppl_ratio"]["mean"] == pytest.approx(math.exp(cand.mean()) / math.exp(base.mean()))
    assert f["ln_ppl_correlation"] == pytest.approx(np.corrcoef(base, cand)[0, 1])
    assert f["dp_top_abs"]["p99"] == pytest.approx(np.percentile(np.abs(per_token["dp_top"]), 99))
    assert f["dp_next"]["rms"] == pytest.approx(np.sqrt(np.mean(per_token["dp_next"] ** 2)))
    with pytest.raises(ValueError, match="missing"):
        figures({"kld": kld})


def test_windows_are_cut_and_scored_as_llama_cpp():
    assert scored_positions(512) == (256, 255)
    w = token_windows(np.arange(1000), 128, chunks=None)
    assert w.shape == (7, 128) and w[1, 0] == 128 and w.dtype == np.int32
    assert token_windows(np.arange(1000), 128, chunks=2).shape == (2, 128)
    with pytest.raises(ValueError, match="the text has 100 tokens: one window of ctx 128 needs 128"):
        token_windows(np.arange(100), 128)
    with pytest.raises(ValueError, match="ctx must be at least"):
        token_windows(np.arange(100), 2)
    with pytest.raises(ValueError, match="1-D array of integer ids"):
        token_windows(np.zeros((2, 300)), 128)
