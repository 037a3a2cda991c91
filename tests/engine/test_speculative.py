"""MTP speculative decoding and continuous batching.

- Greedy output with MTP (k = 1, 2, 3) is token-for-token plain greedy decoding, for both tiny
  models (Qwen3.8: DeltaNet state; GLM-5.3: KDA state and the indexer's tail pool), with random
  weights (their MTP heads' drafts are almost all rejected) and as "bigram" variants whose MTP agrees
  with the model (high acceptance: multi-token accepts and every rollback depth, across pool
  boundaries). The models are the demo models' configs with one decoder layer of each kind
  (``random_tiny_checkpoint``): the decoding is the engine's, whatever the weights, and a shallower
  model is less to compile. The shipped demo models' trained MTP heads draft in ``test_spec_policy.py``.
- Streams joining and leaving a running batch get exactly the tokens they get alone.
- The rejection sampler's output distribution equals the target's (total variation, many draws).
"""

from __future__ import annotations

import collections
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.helpers import random_models_and_bigrams
from zoo.engine.constraint import OutputGrammar
from zoo.engine.generator import Generator
from zoo.engine.speculative import accept
from zoo.server import grammar as G

PROMPTS = [[5, 17, 200, 33, 8, 91, 4, 250, 11], [300, 2, 77], [42] * 20, [7, 8, 9, 10, 11, 12]]
N_NEW = 16


MODELS = ("qwen38-tiny", "glm53-tiny")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each tiny model with random weights (one decoder layer of each kind) and its bigram variant
    (MTP agrees with the model: multi-token accepts, every rollback depth)."""
    return random_models_and_bigrams(tmp_path_factory, MODELS)


@pytest.fixture(scope="module")
def plain_runs(models):
    """Plain greedy decoding of each prompt on its own (the oracle for every other run)."""
    return {name: [m.generate([p], max_new_tokens=N_NEW)[0] for p in PROMPTS] for name, m in models.items()}


# k = 2 with random drafts; the bigram variants at the shallowest and the deepest draft (every rollback depth)
CASES = [(m, 2) for m in MODELS] + [(m + "/bigram", k) for m in MODELS for k in (1, 3)]


@pytest.mark.parametrize("which,k", CASES, ids=[f"{m}-k{k}" for m, k in CASES])
def test_spec_greedy_equals_plain_greedy(models, plain_runs, which, k):
    model = models[which]
    plain = plain_runs[which]
    spec = model.generate(PROMPTS, max_new_tokens=N_NEW, spec_tokens=k, spec_policy="fixed")
    for p, s in zip(plain, spec):
        assert s.tokens == p.tokens and s.finish_reason == p.finish_reason
        assert s.stats["drafted"] == k * s.stats["steps"]
    accepted = sum(s.stats["accepted"] for s in spec) / sum(s.stats["drafted"] for s in spec)
    print(f"[{which} k={k}] acceptance {accepted:.2f}, tokens/step "
          f"{sum(len(s.tokens) for s in spec) / sum(s.stats['steps'] + 1 for s in spec):.2f}")
    if which.endswith("/bigram"):
        assert accepted > 0.5, "the bigram model should accept most drafts"


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("k", [0, 2])
def test_streams_joining_and_leaving_match_solo_runs(models, plain_runs, name, k):
    which = name + "/bigram"
    alone = {i: g.tokens for i, g in enumerate(plain_runs[which])}
    # the default 16 rows (the programs of the runs above); stream 3 takes the lowest free row: one that
    # an earlier stream left, not a fourth
    gen = Generator(models[which], spec_tokens=k, spec_policy="fixed")
    lengths = [N_NEW, 5, N_NEW, 9]
    reqs = {0: gen.submit(gen.make_request(PROMPTS[0], max_new_tokens=lengths[0]))}
    for _ in range(3):
        gen.step()
    reqs[1] = gen.submit(gen.make_request(PROMPTS[1], max_new_tokens=lengths[1]))
    gen.step()
    reqs[2] = gen.submit(gen.make_request(PROMPTS[2], max_new_tokens=lengths[2]))
    for _ in range(4):   # request 1 finishes in here and leaves; 3 joins a freed row
        gen.step()
    reqs[3] = gen.submit(gen.make_request(PROMPTS[3], max_new_tokens=lengths[3]))
    gen.step()
    assert reqs[3] in gen._rows[:3] and not any(gen._rows[3:]), gen._rows    # a row an earlier stream left
    while gen.has_work():
        gen.step()
    for i, r in reqs.items():
        assert r.tokens == alone[i][:lengths[i]], f"stream {i}"


@pytest.mark.parametrize("name", MODELS)
def test_a_row_sitting_speculative_steps_out_keeps_its_state(models, name):
    """A constrained row whose mask is late sits a step out (``MaskSchedule.late``): inactive in the
    speculative step, whose verify writes its per-token states and whose rollback keeps none of its
    tokens. Its state must stay as it was: the short convs' windows (DeltaNet, KDA), the indexer's
    tail pool (GLM). Here it sits out every other step while another row decodes; its tokens equal
    those it has alone."""
    model = models[name + "/bigram"]
    g = OutputGrammar(G.regex("[a-z ]{400}"))          # no end within the test: every token is masked
    kw = dict(spec_tokens=2, spec_policy="fixed", max_batch=4)
    alone = Generator(model, **kw).generate([PROMPTS[0]], max_new_tokens=2 * N_NEW, grammar=g)[0]
    gen = Generator(model, **kw)
    schedule, calls = gen.mask_schedule, itertools.count()
    schedule.share = None                               # its masks are always ready in time ...
    on_time = schedule.late
    # ... and it is told late on every other step (the other row, constrained too, steps on)
    schedule.late = lambda rows, others: on_time(rows, others) or [
        r for r in rows if gen._rows[r] is held and next(calls) % 2]
    held = gen.submit(gen.make_request(PROMPTS[0], max_new_tokens=2 * N_NEW, grammar=g))
    gen.submit(gen.make_request(PROMPTS[2], max_new_tokens=8 * N_NEW, grammar=g))
    while not held.done.is_set():
        gen.step()
    print(f"[{name}] {held.stats['steps']} steps, {held.stats['mask_waits']} sat out")
    assert held.stats["mask_waits"] >= 4 and held.stats["steps"] >= 4
    assert held.tokens == alone.tokens


def test_spec_respects_stop_tokens(models, plain_runs):
    which = "qwen38-tiny/bigram"
    full = plain_runs[which][0].tokens
    stop = full[6]
    first = full.index(stop)
    spec = models[which].generate([PROMPTS[0]], max_new_tokens=N_NEW, stop=[stop], spec_tokens=3,
                                  spec_policy="fixed")[0]
    assert spec.tokens == full[:first] and spec.finish_reason == "stop"


@pytest.mark.parametrize("k", [1, 3])
def test_spec_stops_at_a_stop_string_as_plain_decoding(models, plain_runs, k):
    """A step that accepts several tokens stops at the one completing the stop string: the same
    tokens, text and finish as plain decoding, however the drafts fall."""
    which = "qwen38-tiny/bigram"
    tok = models[which].tokenizer
    text = tok.decode(plain_runs[which][0].tokens)
    at = next(i for i in range(len(text) // 3, len(text) - 1) if text[i:i + 2].strip() == text[i:i + 2])
    needle = text[at:at + 2]
    kw = dict(max_new_tokens=N_NEW, stop=[needle])
    plain = models[which].generate([PROMPTS[0]], **kw)[0]
    spec = models[which].generate([PROMPTS[0]], spec_tokens=k, spec_policy="fixed", **kw)[0]
    assert (plain.finish_reason, plain.stats["stop_sequence"], plain.text) == ("stop", needle, text[:text.find(needle)])
    assert (spec.tokens, spec.text, spec.finish_reason, spec.stats["stop_sequence"]) == \
        (plain.tokens, plain.text, "stop", needle)
    assert spec.stats["accepted"] > 0


def test_sampled_spec_is_plain_sampling_whatever_the_batch_and_policy(models):
    """A seeded sampled row's tokens are plain decoding's (a token's random draw follows its output
    position), alone or in a batch, under fixed drafts and under the auto policy."""
    model = models["glm53-tiny/bigram"]
    kw = dict(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=5)
    plain = model.generate([PROMPTS[1]], **kw)[0].tokens
    a = model.generate([PROMPTS[1]], spec_tokens=2, spec_policy="fixed", **kw)[0]
    b = model.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], spec_tokens=2, **kw)[1].tokens
    assert a.tokens == b == plain and a.stats["accepted"] > 0


def tv(samples: np.ndarray, p: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=p.size) / samples.size
    return 0.5 * float(np.abs(counts - p).sum())


def random_keys(n: int, width: int, seed: int) -> jax.Array:
    """[n, width] independent PRNG keys (one per row and position)."""
    return jax.random.split(jax.random.key(seed), n * width).reshape(n, width)


def plain_samples(keys: jax.Array, p: np.ndarray) -> np.ndarray:
    """What plain decoding samples at each position: ``draw`` with that position's key."""
    from zoo.engine.sampling import draw
    n, width = keys.shape
    return np.stack([np.asarray(draw(keys[:, i], jnp.broadcast_to(p[i], (n, p.shape[-1])), jnp.zeros(n, bool)))
                     for i in range(width)], axis=1)


def test_acceptance_emits_the_plain_samples_and_keeps_the_target_distribution():
    """V = 6, k = 2, fixed target p_0..p_2 and draft distribution q_1, q_2; 200k rows. Drafts drawn
    with the position's key (coupled, as the MTP drafts) or with other keys: either way every emitted
    token is the one plain decoding samples with that position's key, so the first token is
    distributed as p_0, the second (after an accepted first) as p_1, the bonus as p_2. Coupled drafts
    agree with the target's sample with probability between (1 - TV) / (1 + TV) and 1 - TV
    (TV(p, q): rejection sampling's rate is 1 - TV)."""
    rng = np.random.default_rng(0)
    v, k, n = 6, 2, 200_000
    p = rng.dirichlet(np.ones(v), size=k + 1).astype(np.float32)
    q = rng.dirichlet(np.ones(v) * 0.5, size=k).astype(np.float32)
    keys = random_keys(n, k + 1, 0)
    s = plain_samples(keys, p)
    for coupled in (True, False):
        draft_keys = keys if coupled else random_keys(n, k + 1, 1)
        drafts = plain_samples(draft_keys[:, :k], q)
        n_acc, extra = map(np.asarray, jax.jit(accept)(keys, jnp.broadcast_to(p, (n, k + 1, v)),
                                                       jnp.asarray(drafts, jnp.int32), jnp.zeros((n,), bool)))
        emitted = np.where(np.arange(k + 1)[None] < n_acc[:, None], np.pad(drafts, ((0, 0), (0, 1))), -1)
        emitted[np.arange(n), n_acc] = extra
        valid = np.arange(k + 1)[None] <= n_acc[:, None]
        assert np.array_equal(emitted[valid], s[valid])                       # the plain samples, token for token
        assert np.array_equal(n_acc, np.sum(np.cumprod(drafts == s[:, :k], axis=1), axis=1))
        assert tv(emitted[:, 0], p[0]) < 0.01
        assert tv(emitted[n_acc >= 1, 1], p[1]) < 0.01
        bonus = extra[n_acc == k]
        assert bonus.size > 1000 and tv(bonus, p[2]) < 0.03
        rate, tv0 = np.mean(n_acc >= 1), 0.5 * np.abs(p[0] - q[0]).sum()
        if coupled:
            assert (1 - tv0) / (1 + tv0) - 0.01 < rate < 1 - tv0 + 0.01
        else:
            assert abs(rate - float(p[0] @ q[0])) < 0.01                  # independent: sum p q


def test_greedy_acceptance_is_argmax_equality():
    p = jnp.asarray([[[0.1, 0.7, 0.2], [0.5, 0.3, 0.2], [0.2, 0.2, 0.6]]])
    keys = random_keys(1, 3, 1)
    n, extra = accept(keys, p, jnp.asarray([[1, 0]]), jnp.asarray([True]))
    assert int(n[0]) == 2 and int(extra[0]) == 2
    n, extra = accept(keys, p, jnp.asarray([[1, 2]]), jnp.asarray([True]))
    assert int(n[0]) == 1 and int(extra[0]) == 0


def test_all_greedy_batches_take_the_argmax_branch_with_the_mixed_batches_tokens():
    """A batch of greedy rows skips the random numbers (``lax.cond``); its tokens are the ones the
    same rows get in a batch where another row samples."""
    from zoo.engine.sampling import draw

    rng = np.random.default_rng(3)
    b, k, v = 6, 3, 11
    p = jnp.asarray(rng.dirichlet(np.ones(v), size=(b, k + 1)), jnp.float32)
    drafts = jnp.asarray(np.where(rng.random((b, k)) < 0.7, np.argmax(np.asarray(p[:, :k]), -1),
                                  rng.integers(0, v, (b, k))), jnp.int32)
    keys = random_keys(b, k + 1, 2)
    greedy = jnp.ones((b,), bool)
    mixed = greedy.at[0].set(False)
    n_all, extra_all = jax.jit(accept)(keys, p, drafts, greedy)
    n_mix, extra_mix = jax.jit(accept)(keys, p, drafts, mixed)
    assert np.array_equal(np.asarray(n_all)[1:], np.asarray(n_mix)[1:])
    assert np.array_equal(np.asarray(extra_all)[1:], np.asarray(extra_mix)[1:])
    assert sorted(set(np.asarray(n_all).tolist())) != [k]                 # some rows reject
    assert np.array_equal(np.asarray(jax.jit(draw)(keys[:, 0], p[:, 0], greedy))[1:],
                          np.asarray(jax.jit(draw)(keys[:, 0], p[:, 0], mixed))[1:])
    assert np.array_equal(np.asarray(draw(keys[:, 0], p[:, 0], greedy)), np.argmax(np.asarray(p[:, 0]), -1))


@pytest.mark.parametrize("which,k", [("qwen38-tiny", 0), ("qwen38-tiny/bigram", 2), ("glm53-tiny/bigram", 3)])
def test_thinking_budget_forces_the_close_and_the_model_continues_from_it(models, plain_runs, which, k):
    """With a thinking budget B the row emits exactly its own first B tokens (a speculative step is
    capped at the budget), then the forced "\\n</think>\\n\\n" ids (sampling replaced, drafts
    rejected), then exactly what the model generates when that text is in its context (to the
    length limit or its own end of turn); on the first prompt where the model neither closes its
    thinking by itself nor ends within the budget (plus a step's drafts)."""
    model, budget, n_new = models[which], 5, 14
    gen = model.generator(spec_tokens=k, spec_policy="fixed")
    insert, close = list(gen.thinking_budget(budget).insert), set(gen.thinking_budget(budget).close)
    i = next((i for i, run in enumerate(plain_runs[which])
              if len(run.tokens) > budget + k and not close & set(run.tokens[:budget + k])), None)
    assert i is not None, "on every prompt the model closes its thinking or ends within the budget"
    prompt, plain = PROMPTS[i], plain_runs[which][i].tokens
    req = gen.submit(gen.make_request(prompt, max_new_tokens=n_new, thinking_budget=budget, thinking_opened=True))
    while not req.done.is_set():
        gen.step()
    out = req.tokens
    pos = budget
    assert out[:pos] == plain[:pos] and out[pos:pos + len(insert)] == insert
    assert req.stats["forced"] == len(insert)
    head = pos + len(insert)
    reference = model.generate([prompt + out[:head]], max_new_tokens=n_new - head)[0].tokens
    assert out[head:] == reference and (len(out) == n_new or req.finish_reason == "stop")   # or its own end


def test_sampled_spec_decoding_has_the_models_distribution_with_a_stop_token(models):
    """End to end through the engine (bigram GLM, k=2 under the auto policy: drafts mostly accepted,
    bonus tokens, and a stop token that is often drafted): the empirical distribution of the first two tokens of 1,500
    seeded requests (temperature 1, top-k 3, stop after a stop token) against the exact one
    computed from the model's logits (expected TV from sampling noise alone ~0.025; at 3,000
    requests plain and speculative sampling measured 0.014 and 0.017)."""
    from zoo.engine.sampling import probs

    model, prompt, n = models["glm53-tiny/bigram"], PROMPTS[1], 1500
    one = lambda ids: jnp.asarray(model.logits(np.asarray([ids]))[:, -1])          # noqa: E731
    dist = lambda logits: np.asarray(probs(logits, jnp.ones(1), jnp.full((1,), 3), jnp.ones(1)))[0]   # noqa: E731
    p1 = dist(one(prompt))
    first = np.flatnonzero(p1)
    stop = int(first[np.argsort(p1[first])[1]])                  # a likely first token, not the likeliest
    exact = {(stop,): p1[stop]}
    for t in first[first != stop]:
        p2 = dist(one(prompt + [int(t)]))
        exact.update({(int(t), int(u)): p1[t] * p2[u] for u in np.flatnonzero(p2)})
    assert abs(sum(exact.values()) - 1) < 1e-5 and len(exact) == 7
    assert not {t for o in exact for t in o} & set(model.generator().eos_token_ids)    # only `stop` stops

    def empirical(spec_tokens):
        # 64 rows of a short context: 24 rounds of admission and decoding instead of 94 at 16 rows. The
        # auto speculation policy: steps with drafting off, with 1 or 2 drafts, rows of several lengths
        gen = Generator(model, spec_tokens=spec_tokens, max_batch=64, context=64, prefill_chunk=64,
                        spec_policy="auto")
        # 3 new tokens, so that the first step after the prompt may take 2 tokens (a draft and the bonus)
        reqs = [gen.submit(gen.make_request(prompt, max_new_tokens=3, temperature=1.0, top_k=3, seed=s, stop=[stop]))
                for s in range(n)]
        while not all(r.done.is_set() for r in reqs):
            gen.step()
        stopped = lambda r: r.finish_reason == "stop" and len(r.tokens) < 2      # noqa: E731
        counts = collections.Counter(tuple(r.tokens) + (stop,) if stopped(r) else tuple(r.tokens[:2]) for r in reqs)
        assert len([o for o, n in gen.spec_policy.chosen.items() if n]) > 1, gen.spec_policy.chosen
        return counts, sum(r.stats.get("accepted", 0) for r in reqs), sum(r.stats.get("drafted", 0) for r in reqs)

    counts, accepted, drafted = empirical(2)
    assert set(counts) <= set(exact), set(counts) - set(exact)
    tv_distance = 0.5 * sum(abs(counts.get(o, 0) / n - p) for o, p in exact.items())
    print(f"TV {tv_distance:.3f}, accepted drafts {accepted} of {drafted}")
    assert tv_distance < 0.05 and accepted > 100 and accepted > drafted // 2    # the bigram MTP: mostly accepted


def test_capped_steps_keep_the_sample_path(models):
    """A speculative step is capped near a request's length limit (and its thinking budget): the last
    kept token is an accepted draft, so a shorter request is a prefix of a longer one, same seed."""
    model = models["glm53-tiny/bigram"]
    kw = dict(temperature=1.0, top_k=3, spec_tokens=3)
    prompts = [PROMPTS[1]] * 6
    long = [g.tokens for g in model.generate(prompts, max_new_tokens=12, seed=9, **kw)]
    for n in (2, 5):
        short = model.generate(prompts, max_new_tokens=n, seed=9, **kw)
        assert [g.tokens for g in short] == [t[:n] for t in long]
