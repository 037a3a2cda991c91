"""Prefix caching: a request that starts with a cached prefix prefills only the rest, and gets what
it gets without the cache.

Oracle: the same generator with the prefix cache off (``prefix_cache=0``): greedy and seeded tokens
equal, every generated token's logprob and top-3 alternatives equal to 1e-5 (float32), for both
tiny models (Qwen3.8: DeltaNet conv + recurrent state, gated attention KV; GLM-5.3: KDA states, MLA
latents, the indexer's pooled keys and tail pool), plain and with MTP speculative decoding (the
"bigram" variants accept most drafts, so snapshots follow multi-token acceptance). Blocks of 16
tokens and prefill pieces of 32 make every prompt span several blocks, pieces and pools. The models
are the demo models' configs with one decoder layer of each kind and random weights
(``random_tiny_checkpoint``): what is cached and restored is every kind of layer's state, whatever the
weights, and a shallower model is less to compile.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.helpers import assert_same_generation, random_models_and_bigrams
from zoo.engine.generator import Generator
from zoo.engine.prefix_cache import PrefixCache

MODELS = ("qwen38-tiny", "glm53-tiny")
BLOCK, CHUNK, NEW = 16, 32, 12
GB = 2**30


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return random_models_and_bigrams(tmp_path_factory, MODELS)


def words(seed: int, n: int, vocab: int = 200) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def cached(model, k=0, device=GB, host=GB, **kw) -> Generator:
    return Generator(model, spec_tokens=k, spec_policy="fixed", prefill_chunk=CHUNK,
                     prefix_cache=PrefixCache(device, host, BLOCK), **kw)


def uncached(model, k=0) -> Generator:
    return Generator(model, spec_tokens=k, spec_policy="fixed", prefill_chunk=CHUNK, prefix_cache=0)


def converse(gen: Generator, turns: list[list[int]], **kw) -> list:
    """An agent-like conversation: each turn's prompt is the last prompt, the last answer and new text."""
    prompt, outs = [], []
    for extra in turns:
        prompt = prompt + (outs[-1].tokens if outs else []) + extra
        outs.append(gen.generate([prompt], max_new_tokens=NEW, logprobs=3, **kw)[0])
    return outs


TURNS = [words(1, 75), words(2, 9), words(3, 21), words(4, 40)]


@pytest.mark.parametrize("which,k", [("qwen38-tiny", 0), ("glm53-tiny/bigram", 2)])   # each model, plain and MTP
def test_conversation_turns_hit_and_match_the_uncached_run(models, which, k):
    model = models[which]
    gen = cached(model, k)
    got = converse(gen, TURNS)
    want = converse(uncached(model, k), TURNS)
    prompt = []
    for i, (g, w) in enumerate(zip(got, want)):
        # float32 rounding: the turns are prefilled in other pieces than the uncached run's (from the
        # snapshot on), and 150 tokens of recurrent state round apart by up to ~1.2e-5 (relative)
        assert_same_generation(g, w, tol=3e-5)
        if i:
            # turn i hits where turn i-1's request ended: its prompt and its answer, but for the last
            # token when it ran out of tokens (sampled, never fed; an end-of-turn token is not in
            # ``tokens``, so after one every answer token was fed)
            last_unfed = got[i - 1].finish_reason == "length"
            assert g.stats["cached_tokens"] == len(prompt) + len(got[i - 1].tokens) - last_unfed, (i, g.stats)
        prompt = prompt + (got[i - 1].tokens if i else []) + TURNS[i]
        assert g.stats["prompt_tokens"] == len(prompt)
    stats = gen.prefix.stats
    assert stats.hits == len(TURNS) - 1 and stats.hit_tokens == sum(g.stats["cached_tokens"] for g in got)
    if k:       # speculation ran across the turns: every draft depth accepted, and some drafts rolled back
        by_position = [sum(g.stats["accepted_by_position"][i] for g in got) for i in range(k)]
        assert min(by_position) > 0 and sum(by_position) < sum(g.stats["drafted"] for g in got), by_position


@pytest.mark.parametrize("which", MODELS)
def test_shared_prefix_hits_at_a_block_boundary_and_sampling_matches(models, which):
    """Two prompts sharing a 70-token prefix: the second hits the first's snapshot at the last
    prefill-piece end inside the shared part (64), seeded sampling gives the same tokens."""
    model = models[which]
    shared = words(10, 70)
    a, b = shared + words(11, 15), shared + words(12, 30)
    gen, ref = cached(model), uncached(model)
    kw = dict(max_new_tokens=NEW, temperature=0.9, top_p=0.95, seed=5, logprobs=3)
    first = gen.generate([a], **kw)[0]
    second = gen.generate([b], **kw)[0]
    assert second.stats["cached_tokens"] == 64
    assert_same_generation(first, ref.generate([a], **kw)[0])
    assert_same_generation(second, ref.generate([b], **kw)[0])
    again = gen.generate([b], **kw)[0]            # the same prompt again: up to its last piece end (96)
    assert again.stats["cached_tokens"] == 96 and again.tokens == second.tokens


@pytest.mark.parametrize("which,k", [("qwen38-tiny", 0), ("glm53-tiny/bigram", 3)])
def test_a_batch_where_some_rows_hit_and_others_miss(models, which, k):
    model = models[which]
    base = [words(20 + i, 40 + 9 * i) for i in range(3)]
    gen = cached(model, k)                                        # the uncached generator's rows: its programs
    gen.generate(base[:2], max_new_tokens=4)                      # warm: two of the three prefixes
    prompts = [base[0] + words(30, 12), base[2] + words(31, 7), base[1] + words(32, 20), words(33, 50)]
    got = gen.generate(prompts, max_new_tokens=NEW, logprobs=3)
    want = uncached(model, k).generate(prompts, max_new_tokens=NEW, logprobs=3)
    for g, w in zip(got, want):
        assert_same_generation(g, w)
    hits = [g.stats["cached_tokens"] for g in got]
    assert hits[0] > 0 and hits[2] > 0 and hits[1] == 0 and hits[3] == 0, hits


@pytest.mark.parametrize("which,k", [("glm53-tiny", 0), ("qwen38-tiny/bigram", 2)])
def test_eviction_under_memory_pressure_while_requests_run(models, which, k):
    """Tiers of a few entries: blocks and snapshots move to host RAM and are dropped while a batch
    of conversations runs; whatever is still whole is used, and the output does not change."""
    model = models[which]
    gen = cached(model, k, max_batch=4)
    probe = gen.prefix
    convs = [[words(40 + i, 50), words(50 + i, 10), words(60 + i, 12)] for i in range(3)]
    want = [converse(uncached(model, k), c) for c in convs]
    converse(gen, [words(99, 40)])                                 # measure an entry's bytes
    unit = max(e.nbytes for e in probe._blocks.values()) * 4 + max(s.entry.nbytes for s in probe._snaps.values())
    probe.device_budget, probe.host_budget = 2 * unit, 3 * unit     # a conversation turn needs ~1 unit
    probe.clear()
    prompts = [c[0] for c in convs]
    got = [[g] for g in gen.generate(prompts, max_new_tokens=NEW, logprobs=3)]
    for turn in (1, 2):
        prompts = [p + g[-1].tokens + c[turn] for p, g, c in zip(prompts, got, convs)]
        for g, out in zip(got, gen.generate(prompts, max_new_tokens=NEW, logprobs=3)):
            g.append(out)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert_same_generation(a, b)
    assert probe.stats.demoted > 0 and probe.stats.evicted > 0, probe.stats
    assert probe.device_used <= probe.device_budget and probe.host_used <= probe.host_budget
    assert any(g[t].stats["cached_tokens"] > 0 for g in got for t in (1, 2))


def test_the_batch_takes_memory_from_the_cache_not_the_other_way(models):
    """A budget the batch and the cached prefixes cannot share: admitting a request moves cached
    entries to host RAM (never refuses the request), and they still hit from there."""
    model = models["qwen38-tiny"]
    shape = {"context": 512, "max_batch": 2}
    budget = Generator(model, prefill_chunk=CHUNK, prefix_cache=0, **shape)._state_bytes() + 1000
    gen = cached(model, memory_budget=budget, device=GB, **shape)
    assert gen.rows == 2
    first = gen.generate([words(70, 120)], max_new_tokens=NEW)[0]
    assert gen.prefix.device_used <= budget - gen._state_bytes()
    assert gen.prefix.stats.demoted > 0
    follow = words(70, 120) + first.tokens + words(71, 10)
    out = gen.generate([follow], max_new_tokens=NEW)[0]
    assert out.stats["cached_tokens"] == 120 + len(first.tokens) - 1
    assert out.tokens == uncached(model).generate([follow], max_new_tokens=NEW)[0].tokens


def test_entries_of_another_model_or_layout_are_never_used(models):
    shared = PrefixCache(GB, GB, BLOCK)
    prompt = words(80, 60)
    qwen = Generator(models["qwen38-tiny"], prefill_chunk=CHUNK, prefix_cache=shared)
    bigram = Generator(models["qwen38-tiny/bigram"], prefill_chunk=CHUNK, prefix_cache=shared)
    spec = Generator(models["qwen38-tiny"], spec_tokens=2, spec_policy="fixed", prefill_chunk=CHUNK,
                     prefix_cache=shared)
    glm = Generator(models["glm53-tiny"], prefill_chunk=CHUNK, prefix_cache=shared)
    qwen.generate([prompt], max_new_tokens=4)
    again = prompt + words(81, 5)
    assert qwen.generate([again], max_new_tokens=4)[0].stats["cached_tokens"] > 0
    for other in (bigram, spec, glm):      # other weights, a cache with MTP slots, another model
        out = other.generate([again], max_new_tokens=4)[0]
        assert out.stats["cached_tokens"] == 0


def test_prompt_logprobs_and_forks_with_the_cache(models):
    """A request for the prompt's logprobs prefills everything (it needs every position); n > 1
    shares one (cached) prefill."""
    model = models["glm53-tiny"]
    gen, ref = cached(model), uncached(model)
    prompt = words(90, 70)
    gen.generate([prompt[:50]], max_new_tokens=2)
    got = gen.generate([prompt], max_new_tokens=3, prompt_logprobs=2)[0]
    want = ref.generate([prompt], max_new_tokens=3, prompt_logprobs=2)[0]
    assert got.stats["cached_tokens"] == 0
    np.testing.assert_allclose([p.logprob for p in got.prompt_logprobs[1:]],
                               [p.logprob for p in want.prompt_logprobs[1:]], rtol=1e-5, atol=1e-5)
    kw = dict(max_new_tokens=NEW, temperature=1.0, seed=3, n=3)
    got = gen.generate([prompt + [7]], **kw)
    want = ref.generate([prompt + [7]], **kw)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert all(g.stats["cached_tokens"] == len(prompt) for g in got)


def test_store_and_lookup_keys():
    """The key structure on its own: a hash chain over blocks from a model root; the longest
    snapshot whose blocks are all present wins; dropping a block drops the snapshots that need it;
    the LRU tiers move and drop entries by bytes."""
    cache = PrefixCache(device_bytes=10_000, host_bytes=10_000, block=4)
    root, other = PrefixCache.root("model-a"), PrefixCache.root("model-b")
    taken = []

    def store(tokens):
        return cache.store(root, tokens, lambda s: taken.append(s) or {"kv": np.zeros(100, np.float32) + s},
                           lambda w: {"window": None if w is None else np.zeros(20, np.float32),
                                     "state": np.zeros(50, np.float32)})

    toks = list(range(1, 40))
    store(toks[:10])                                  # blocks 0, 1 + a snapshot at 10 (window at 8)
    assert taken == [0, 4]
    store(toks[:13])                                  # block 2 new only
    assert taken == [0, 4, 8]
    assert cache.lookup(root, toks, 38).length == 13
    assert cache.lookup(root, toks, 12).length == 10
    assert cache.lookup(root, toks, 9) is None
    assert cache.lookup(other, toks, 38) is None
    assert cache.lookup(root, toks[:11] + [999] + toks[12:], 38).length == 10
    assert cache.store(root, toks[:13], None, None).length == 13     # already there: nothing taken
    cache._drop("block", cache.chain(root, toks, 3)[3])              # block 2 gone: snapshot 13 with it
    assert cache.lookup(root, toks, 38).length == 10
    cache.fit_device(0)
    assert cache.device_used == 0 and cache.host_used > 0 and cache.stats.demoted == 3
    assert cache.lookup(root, toks, 38).length == 10                  # host entries still hit
    cache.host_budget = 500
    cache.fit_device(0)
    assert cache.lookup(root, toks, 38) is None and cache.host_used <= 500


@pytest.mark.parametrize("which", MODELS)
def test_the_planner_sizes_entries_as_the_cache_stores_them(models, which):
    """``zoo.tools.prefix_plan`` (config only, what ``zoo plan --prefix-cache`` prints for the full-size
    models) gives the bytes of the blocks and snapshots a generator with MTP actually stores."""
    from zoo.tools.prefix_plan import prefix_cache_plan
    gen = cached(models[which], 2)
    gen.generate([words(95, 70)], max_new_tokens=4)
    plan = prefix_cache_plan(which, devices=1, block=BLOCK, dtype="float32", mtp=True, config=models[which].config)
    blocks = {e.nbytes for e in gen.prefix._blocks.values()}
    whole = {s.entry.nbytes for s in gen.prefix._snaps.values() if s.partial == 0}
    windowed = {s.entry.nbytes for s in gen.prefix._snaps.values() if s.partial}
    assert blocks == {plan["block_bytes"]} and whole == {plan["snapshot"]}
    assert windowed == {plan["snapshot_with_window"]}
