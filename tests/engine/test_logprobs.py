"""Log-probabilities from the engine (``Generator``), against a numpy log-softmax of the full
forward (``Model.logits``, float32) on the demo model's config with one decoder layer of each kind
and random weights (``random_tiny_checkpoint``: the values are the engine's, whatever the weights, and
a shallower model is less to compile):

- generated tokens' logprobs and top alternatives, plain decoding;
- with MTP speculation (random MTP head: mostly rejected drafts; bigram variant: long accepted runs),
  the same values as plain decoding (the verify logits are the target model's);
- the prompt's logprobs from the prefill, over several prefill chunks, and a request that only
  asks for them (``max_new_tokens=0``);
- the bounds of the request fields, and the tokenizer's token bytes.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.helpers import bigram_variant, random_tiny_model
from zoo.engine.generator import Generator
from zoo.engine.logprobs import MAX_TOP, maybe_token_logprobs, token_logprobs

PROMPT = [5, 17, 200, 33, 8, 91, 4, 250, 11]
LONG = [(7 * i + 3) % 500 + 7 for i in range(41)]       # 41 tokens: three chunks of 16
N_NEW = 12
TOL = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return random_tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def bigram(model):
    return bigram_variant(model)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """numpy float32 log-softmax over the last axis."""
    x = logits.astype(np.float32)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def reference(model, seq: list[int]) -> np.ndarray:
    """[S, V]: row t is the model's log-distribution of the token after seq[:t+1]."""
    return log_softmax(model.logits([seq])[0])


def check_generated(model, prompt, gen, n_top: int):
    ref = reference(model, prompt + gen.tokens)
    assert len(gen.logprobs) == len(gen.tokens) > 0
    for i, (tok, rec) in enumerate(zip(gen.tokens, gen.logprobs)):
        row = ref[len(prompt) - 1 + i]
        # the engine's attention reads its cache in blocks (online softmax), the full forward the
        # whole window at once: float32 sums in another order, a few 1e-6 relative
        assert rec.token == tok and abs(rec.logprob - row[tok]) <= TOL * (1 + abs(row[tok]))
        ids, lps = zip(*rec.top) if rec.top else ((), ())
        assert len(rec.top) == n_top
        np.testing.assert_allclose(lps, np.sort(row)[::-1][:n_top], rtol=TOL, atol=TOL)
        assert list(ids) == list(np.argsort(-row, kind="stable")[:n_top])


def test_token_logprobs_is_a_log_softmax():
    logits = np.random.default_rng(0).normal(size=(2, 3, 50)).astype(np.float32) * 4
    tokens = np.array([[1, 7, 49], [0, 0, 3]], np.int32)
    out = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), 5)
    ref = log_softmax(logits)
    np.testing.assert_allclose(out["logprob"], np.take_along_axis(ref, tokens[..., None], -1)[..., 0], atol=1e-6)
    np.testing.assert_allclose(out["top_logprobs"], -np.sort(-ref, -1)[..., :5], atol=1e-6)
    assert out["top_ids"].shape == (2, 3, 5) and out["top_ids"].dtype == jnp.int32
    # the engine's form: always MAX_TOP alternatives, computed only under its flag (zeros otherwise)
    on = maybe_token_logprobs(jnp.bool_(True), jnp.asarray(logits), jnp.asarray(tokens))
    off = maybe_token_logprobs(jnp.bool_(False), jnp.asarray(logits), jnp.asarray(tokens))
    assert MAX_TOP == 20 and on["top_ids"].shape == off["top_ids"].shape == (2, 3, 20)
    np.testing.assert_allclose(on["top_logprobs"][..., :5], out["top_logprobs"], atol=1e-6)
    assert not np.asarray(off["top_logprobs"]).any() and not np.asarray(off["logprob"]).any()


def test_plain_decoding_logprobs_match_full_forward(model):
    gen = model.generate([PROMPT], max_new_tokens=N_NEW, logprobs=3)[0]
    check_generated(model, PROMPT, gen, 3)
    sampled = model.generate([PROMPT], max_new_tokens=N_NEW, logprobs=0, temperature=1.0, top_k=5, seed=3)[0]
    check_generated(model, PROMPT, sampled, 0)      # the model's distribution, not the filtered one
    assert model.generate([PROMPT], max_new_tokens=N_NEW)[0].logprobs is None


@pytest.mark.parametrize("which,k", [("shipped", 2), ("bigram", 2), ("bigram", 3)])
def test_speculative_logprobs_equal_plain(model, bigram, which, k):
    m = model if which == "shipped" else bigram
    plain = m.generate([PROMPT, LONG], max_new_tokens=N_NEW, logprobs=4)
    spec = m.generate([PROMPT, LONG], max_new_tokens=N_NEW, logprobs=4, spec_tokens=k, spec_policy="fixed")
    for p, s in zip(plain, spec):
        assert s.tokens == p.tokens
        np.testing.assert_allclose([r.logprob for r in s.logprobs], [r.logprob for r in p.logprobs], atol=TOL)
        np.testing.assert_allclose([[lp for _, lp in r.top] for r in s.logprobs],
                                   [[lp for _, lp in r.top] for r in p.logprobs], atol=TOL)
    if which == "bigram":
        assert sum(s.stats["accepted"] for s in spec) > N_NEW // 2      # multi-token steps were scored
    check_generated(m, PROMPT, spec[0], 4)


@pytest.mark.parametrize("k", [0, 2])
def test_prompt_logprobs_over_prefill_chunks(model, k):
    gen = Generator(model, spec_tokens=k, spec_policy="fixed", prefill_chunk=16)
    out = gen.generate([LONG], max_new_tokens=0, prompt_logprobs=2)[0]
    assert out.tokens == [] and out.finish_reason == "length" and out.logprobs is None
    recs = out.prompt_logprobs
    assert [r.token for r in recs] == LONG and recs[0].logprob is None and recs[0].top == ()
    ref = reference(model, LONG)
    got = np.array([r.logprob for r in recs[1:]])
    # later chunks read the cache the earlier ones left (DeltaNet state, KV): float32 sums in another
    # order than the one-pass forward, a few 1e-6 relative (one chunk: within TOL, tests/engine/
    # test_server_logprobs.py)
    np.testing.assert_allclose(got, ref[np.arange(len(LONG) - 1), LONG[1:]], rtol=TOL, atol=TOL)
    assert all(r.top[0][0] == int(np.argmax(ref[i])) for i, r in enumerate(recs[1:]))
    both = gen.generate([LONG], max_new_tokens=4, prompt_logprobs=0, logprobs=0)[0]
    assert [r.logprob for r in both.prompt_logprobs] == [r.logprob for r in recs]
    assert len(both.logprobs) == len(both.tokens) and all(r.top == () for r in both.logprobs)


def test_request_bounds(model):
    gen = model.generator()
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.submit(gen.make_request(PROMPT, max_new_tokens=0))
    with pytest.raises(ValueError, match="logprobs must be in 0..20"):
        gen.submit(gen.make_request(PROMPT, max_new_tokens=1, logprobs=21))
    with pytest.raises(ValueError, match="prompt_logprobs must be in 0..20"):
        gen.submit(gen.make_request(PROMPT, max_new_tokens=1, prompt_logprobs=-1))


def test_token_bytes(model):
    tok = model.tokenizer
    text = "Hello, wörld ✓ <|im_end|> 42"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert any(len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80 for i in ids)   # a piece of "ö"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.token_bytes(tok.vocab_size + 5)
