"""Prefill interleaved with decoding (``zoo.engine.fill``): a long prompt that arrives while a stream
decodes is prefilled one chunk per step, and the stream gets its tokens at every one of those steps.

- Exactness: every request's greedy tokens, logprobs and prompt logprobs equal the same request run
  alone, for both tiny models, plain and MTP, with and without prefix-cache hits, with choices.
  The models are the demo models' configs with one decoder layer of each kind and random weights
  (``random_tiny_checkpoint``: the interleaving is the engine's, whatever the weights, and a shallower
  model is less to compile), and for MTP their bigram variants, whose drafts are mostly accepted.
- Fairness, counted (not timed): while the long prompt fills, each step runs at most one chunk of
  prefill pieces and the running stream gets a token at that step; on a given timing table
  (``zoo.engine.prefill_pace``) the pieces narrow to what the time budget allows.
- A request cancelled while its prompt fills ends "cancelled" and frees its rows; the others go on.
"""

from __future__ import annotations

import pytest

from tests.support.helpers import assert_same_generation, random_models_and_bigrams
from zoo.engine.generator import Generator
from zoo.engine.prefix_cache import PrefixCache

CHUNK = 64                  # the prefill chunk (its small width: 16)
MODELS = ("qwen38-tiny", "glm53-tiny")
SHORT = [5, 17, 200, 33, 8, 91, 4]
LONG = [(7 * i + 3) % 230 + 10 for i in range(300)]    # 300 tokens: 4 chunks and small pieces


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return random_models_and_bigrams(tmp_path_factory, MODELS)


def engine(model, k: int, prefix: bool = False, ratio: float | None = None) -> Generator:
    cache = PrefixCache(2**30, 2**30, 64) if prefix else 0
    gen = Generator(model, spec_tokens=k, spec_policy="fixed", max_batch=4, context=1024, prefill_chunk=CHUNK,
                    prefix_cache=cache, interleave_ratio=ratio)
    gen.eos_token_ids = frozenset()          # the stream runs its full length (it must outlast the prefill)
    return gen


def alone(model, k: int, prompt, **options):
    return engine(model, k).generate([prompt], **options)[0]


def run_while_streaming(gen: Generator, stream_opts: dict, long_prompt, long_opts: dict, after: int = 3,
                        pace: dict | None = None):
    """Start a stream of SHORT, let it take ``after`` steps, submit ``long_prompt``; step to the end.
    ``pace``: the prefill's timing table each step decides from (``PrefillPace.load``, as replicas
    do), instead of the measured one. Returns (stream, long request, per step while the long prompt
    fills: (prefill tokens that step, tokens the stream got that step))."""
    stream = gen.submit(gen.make_request(SHORT, **stream_opts))
    for _ in range(after):
        gen.step()
    long = gen.submit(gen.make_request(long_prompt, **long_opts))
    filling = []
    while True:
        tokens, prefilled = len(stream.tokens), gen.prefill_tokens
        if pace is not None:
            gen.pace.load(pace)
        gen.step()
        filling.append((gen.prefill_tokens - prefilled, len(stream.tokens) - tokens))
        if long.raw or long.done.is_set():       # its prompt is prefilled: the rest is plain decoding
            break
    while not (stream.done.is_set() and all(m.done.is_set() for m in [long] + long.forks)):
        gen.step()
    return stream, long, filling


# both models and both decoders, not every pair (the engine's interleaving does not branch on the model)
@pytest.mark.parametrize("which,k", [("qwen38-tiny", 0), ("qwen38-tiny/bigram", 2), ("glm53-tiny/bigram", 2)])
def test_a_long_prompt_is_prefilled_a_chunk_per_step_and_every_output_is_exact(models, which, k):
    model = models[which]
    stream_opts = dict(max_new_tokens=24, logprobs=2)
    long_opts = dict(max_new_tokens=8, logprobs=1, prompt_logprobs=1)
    stream, long, filling = run_while_streaming(engine(model, k), stream_opts, LONG, long_opts)
    assert_same_generation(stream.result(), alone(model, k, SHORT, **stream_opts))
    assert_same_generation(long.result(), alone(model, k, LONG, **long_opts))
    assert len(filling) >= -(-len(LONG) // CHUNK) - 1        # the prompt took several steps, not one
    assert all(0 < spent <= CHUNK for spent, _ in filling)    # one chunk at most per step
    assert all(got >= 1 for _, got in filling)                 # the stream got tokens at each of them
    if k:                   # the bigram variant's drafts were accepted: MTP rows moved on by several tokens
        assert stream.result().stats["accepted"] > 0 and long.result().stats["accepted"] > 0


def test_a_time_budget_narrows_the_pieces_and_every_output_is_exact(models):
    """With a decode step timed at 1 and pieces at 1 (16 wide) and 4 (64 wide), a ratio of 3 leaves
    2 for prefill: each step runs two narrowed 16-token pieces instead of a 64-token chunk, and every
    output (MTP rows included) equals the request run alone, where the pieces are the chunk's: the
    same tokens, logprobs within 1e-4 (16-token pieces sum in another order than 64-token ones:
    measured 2.6e-5 at most on the prompt's logprobs, 3e-6 on the generated ones)."""
    model = models["qwen38-tiny/bigram"]
    stream_opts = dict(max_new_tokens=80, logprobs=2)       # it outlasts the prefill at 3 tokens a step
    long_opts = dict(max_new_tokens=8, logprobs=1, prompt_logprobs=1)
    gen = engine(model, 2, ratio=3.0)
    stream, long, filling = run_while_streaming(gen, stream_opts, LONG, long_opts,
                                                pace={"decode": 1.0, "pieces": {"16": 1.0, "64": 4.0}})
    assert [spent for spent, _ in filling] == [32] * (len(LONG) // 32) + [16] * (len(LONG) % 32 > 0)
    assert all(got >= 1 for _, got in filling)
    assert_same_generation(stream.result(), alone(model, 2, SHORT, **stream_opts))
    assert_same_generation(long.result(), alone(model, 2, LONG, **long_opts), tol=1e-4)


@pytest.mark.parametrize("which,k", [("qwen38-tiny", 0), ("glm53-tiny/bigram", 2)])
def test_prefix_hits_and_choices_while_streaming_are_exact(models, which, k):
    model = models[which]
    gen = engine(model, k, prefix=True)
    first = gen.generate([LONG[:200]], max_new_tokens=4)[0]
    turn = LONG[:200] + first.tokens + LONG[200:]                # a second turn: its first 192 tokens are cached
    opts = dict(max_new_tokens=6, n=2, temperature=1.0, seed=7)
    stream, long, _ = run_while_streaming(gen, dict(max_new_tokens=20), turn, opts)
    assert long.stats["cached_tokens"] >= 192
    want = engine(model, k).generate([turn], **opts)
    for got, ref in zip([long] + long.forks, want):
        assert_same_generation(got.result(), ref)
    assert_same_generation(stream.result(), alone(model, k, SHORT, max_new_tokens=20))


def test_cancelled_while_its_prompt_fills(models):
    model = models["qwen38-tiny"]
    gen = engine(model, 0)
    stream = gen.submit(gen.make_request(SHORT, max_new_tokens=30))
    gen.step()
    long = gen.submit(gen.make_request(LONG, max_new_tokens=8, n=2))
    gen.step()
    assert not long.raw and sum(r is not None for r in gen._rows) == 3      # its rows held, not decoded
    gen.cancel(long)
    gen.cancel(long.forks[0])
    nxt = gen.submit(gen.make_request(SHORT[:3], max_new_tokens=5))
    while not (stream.done.is_set() and nxt.done.is_set()):
        gen.step()
    assert long.finish_reason == long.forks[0].finish_reason == "cancelled" and not long.tokens
    assert gen._fill is None and all(r is None for r in gen._rows)
    assert_same_generation(stream.result(), alone(model, 0, SHORT, max_new_tokens=30))
    assert_same_generation(nxt.result(), alone(model, 0, SHORT[:3], max_new_tokens=5))
