"""Output constraints below the server: grammars, the gated matcher, device masking, and the engine
decoding under them (plain and MTP-speculative) on the embedded random tiny model."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from tests.support.helpers import random_tiny_model
from zoo.engine.constraint import (
    LIMITS,
    Constraint,
    GrammarRejected,
    OutputGrammar,
    compile_constraints,
    llg_tokenizer,
    mask_words,
)
from zoo.engine.generator import Generator
from zoo.engine.request import fork_seed
from zoo.engine.token_mask import apply_token_mask
from zoo.server import grammar as G
from zoo.server.service import KEEP
from zoo.server.structured import marker_tokens
from zoo.text.tool_calls import GlmToolParser, QwenToolParser, ToolCallArgs, ToolCallStart


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    ok: bool
    kind: Literal["a", "b"]


SCHEMA = to_strict_json_schema(Person)
PROMPT = [1, 5, 9, 11, 40]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The demo model's config and tokenizer with random weights: constraints are tested against
    outputs the model did not learn to write, and sampling spreads over the vocabulary."""
    return random_tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def vocab(model):
    return llg_tokenizer(model.tokenizer, model.config.vocab_size, model.tokenizer.eos_token_ids)


def allowed(row: np.ndarray, v: int) -> np.ndarray:
    return np.flatnonzero(((row[:, None] >> np.arange(32)) & 1).reshape(-1)[:v])


def walk(c: Constraint, v: int, rng, limit: int = 400) -> list[int]:
    """A random output under ``c``: each token drawn uniformly from its mask."""
    out = []
    row = np.zeros((1, c.words), np.int32)
    while not c.complete and len(out) < limit:
        c.fill(row)
        tok = int(rng.choice(allowed(row[0], v)))
        out.append(tok)
        c.advance([tok])
    return out


def test_device_mask_equals_llguidance_numpy():
    rng = np.random.default_rng(0)
    bits = rng.integers(-2**31, 2**31, size=(2, 3, mask_words(70)), dtype=np.int64).astype(np.int32)
    logits = rng.normal(size=(2, 3, 70)).astype(np.float32)
    want = logits.reshape(6, 70).copy()
    apply_token_bitmask_inplace(want, bits.reshape(6, -1))
    got = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(bits)))
    np.testing.assert_array_equal(got.reshape(6, 70), want)


def test_draft_masks_equal_sequential_masks_and_roll_back(model, vocab):
    v = model.config.vocab_size
    rng = np.random.default_rng(1)
    c = Constraint(vocab, G.json_schema(SCHEMA, strict=True))
    seq = walk(Constraint(vocab, G.json_schema(SCHEMA, strict=True)), v, rng)
    c.advance(seq[:5])
    drafts = seq[5:9]
    spec = np.zeros((5, c.words), np.int32)
    c.fill(spec, drafts)
    for i in range(5):                       # position i: after drafts[:i], one at a time
        ref = Constraint(vocab, G.json_schema(SCHEMA, strict=True))
        ref.advance(seq[:5 + i])
        one = np.zeros((1, c.words), np.int32)
        ref.fill(one)
        np.testing.assert_array_equal(spec[i], one[0])
    again = np.zeros((1, c.words), np.int32)
    c.fill(again)                            # the drafts were rolled back
    np.testing.assert_array_equal(again[0], spec[0])
    bad = [int(t) for t in range(v) if not (spec[1, t // 32] >> (t % 32)) & 1][0]
    spec[:] = 0
    c.fill(spec, [drafts[0], bad, drafts[2], drafts[3]])   # a refused draft: the rest all-allowed
    assert (spec[2:] == -1).all() and c.advance([drafts[0]]) == 1


def test_gate_waits_for_the_reasoning_close_and_forced_tokens_pass(model, vocab):
    close = tuple(model.tokenizer.encode("</think>"))
    c = Constraint(vocab, G.regex("[0-9]{3}"), wait=(close,))
    row = np.zeros((1, c.words), np.int32)
    c.fill(row)
    assert (row == -1).all() and not c.armed
    c.advance([7, 8] + list(close), forced=True)
    assert c.armed
    c.fill(row)
    digits = {model.tokenizer.decode([int(t)]) for t in allowed(row[0], model.config.vocab_size)}
    assert digits and all(d and all(ch.isdigit() for ch in d) for d in digits)
    c.advance(model.tokenizer.encode("\n\n"), forced=True)    # the budget's layout: not grammar output
    digits = model.tokenizer.encode("123")
    assert c.error is None and c.advance(digits + [9]) == len(digits) and c.complete


def test_tool_call_rearms_after_each_call(model, vocab):
    tok = model.tokenizer
    tools = [{"type": "function", "function": {"name": "get", "strict": True, "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]
    trigger = tuple(tok.encode("<tool_call>"))
    grammar = G.tool_call_grammar("qwen", tools, prefix="<tool_call>", repeat=False,
                                  tokens=marker_tokens(tok, KEEP))
    c = Constraint(vocab, grammar, wait=(trigger,), rearm=trigger)
    text = tok.encode("hi ") + list(trigger)
    assert c.advance(text) == len(text) and c.armed
    call = tok.encode("\n<function=get>\n<parameter=n>\n42\n</parameter>\n</function>\n</tool_call>")
    assert c.advance(call) == len(call) and not c.armed and not c.complete
    assert c.advance(tok.encode(" free text ") + list(trigger)) > 0 and c.armed
    wrong = tok.encode("\n<function=nope>")
    assert c.advance(wrong) < len(wrong) and c.error


@pytest.mark.parametrize("fmt,parser", [("qwen", QwenToolParser), ("glm", GlmToolParser)])
def test_tool_call_grammar_outputs_parse_to_valid_arguments(model, vocab, fmt, parser):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": to_strict_json_schema(Person)}},
             {"type": "function", "function": {"name": "flag", "parameters": {
                 "type": "object", "properties": {"on": {"type": "boolean"}, "tag": {"type": "string",
                                                                                   "maxLength": 3}},
                 "required": ["on"]}}}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    rng = np.random.default_rng(2)
    for prefix in ("", "<tool_call>" + ("\n<function=" if fmt == "qwen" else "")):
        for _ in range(6):
            grammar = G.tool_call_grammar(fmt, tools, prefix=prefix, tokens=marker_tokens(model.tokenizer, KEEP))
            c = Constraint(vocab, grammar)
            out = walk(c, model.config.vocab_size, rng, limit=3000)
            assert c.complete or c.matcher.is_accepting()
            p = parser(tools)
            events = p.feed(prefix + model.tokenizer.decode(out, skip_special_tokens=False)) + p.flush()
            names = [e.name for e in events if isinstance(e, ToolCallStart)]
            args = {}
            for e in events:
                if isinstance(e, ToolCallArgs):
                    args[e.index] = args.get(e.index, "") + e.delta
            assert names and len(args) == len(names)
            for i, name in enumerate(names):
                jsonschema.validate(json.loads(args[i]), schemas[name])


def test_bad_grammars_name_the_problem(vocab):
    for build, arg, words in [(G.json_schema, {"type": "strin"}, "strin"), (G.regex, "a(b", "unclosed"),
                              (G.lark, "start: foo", "foo"), (G.choice, [], "non-empty")]:
        with pytest.raises(G.GrammarError, match=words):
            G.check(build(arg), vocab)
    with pytest.raises(ValueError, match="strin"):
        Constraint(vocab, G.json_schema({"type": "strin"}))


def test_grammars_that_cannot_start_are_refused_at_compile(vocab):
    """Empty languages llguidance can tell (a $ref loop, an impossible class, a rule that never
    ends) are ``GrammarRejected`` by ``compile_constraints`` (their first mask: in error, or only the
    end of the sequence allowed), with a one-line message and no parser dump; a grammar whose empty
    output is complete is not refused. A regex bomb starts (llguidance lexes lazily) and its lexer
    gives up within a few tokens: the constraint's ``error`` is set by the mask that cannot go on,
    rather than a mask of end-of-sequence only that would end the choice "stop", silently cut."""
    for grammar in [G.json_schema({"$ref": "#"}), G.regex("[a&&b]"), G.lark('start: a\na: a "x"')]:
        with pytest.raises(GrammarRejected, match="it matches no text: no token can start") as e:
            compile_constraints(vocab, OutputGrammar(grammar), 2)
        assert "\n" not in str(e.value) and "<state>" not in str(e.value)
    assert len(compile_constraints(vocab, OutputGrammar(G.regex("a{0,3}")), 1)) == 1
    for pattern in ("(a{1000}){1000}", "(a{669}){918}"):
        c = compile_constraints(vocab, OutputGrammar(G.regex(pattern)), 1)[0]
        row = np.zeros((1, c.words), np.int32)
        for _ in range(4):
            c.fill(row)
            if c.error is not None:
                break
            c.advance([int(allowed(row[0], vocab.vocab_size)[0])])
        assert c.error is not None and c.error.startswith("the output grammar cannot go on"), (pattern, c.error)
    assert LIMITS.initial_lexer_fuel == 200_000 and LIMITS.step_max_items == 20_000 and not LIMITS.verbose_errors


def test_choices_share_one_compile_and_walk_independently(model, vocab):
    """``compile_constraints`` compiles once and copies: each choice's matcher is its own (one
    choice's tokens do not move another's), and each walk is valid."""
    rng = np.random.default_rng(0)
    first, second = compile_constraints(vocab, OutputGrammar(G.json_schema(SCHEMA, strict=True)), 2)
    assert first.matcher is not second.matcher
    a = walk(first, vocab.vocab_size, rng)
    row = np.zeros((1, second.words), np.int32)
    second.fill(row)
    fresh = np.zeros((1, second.words), np.int32)
    compile_constraints(vocab, OutputGrammar(G.json_schema(SCHEMA, strict=True)), 1)[0].fill(fresh)
    assert np.array_equal(row, fresh)                     # untouched by the first choice's walk
    assert first.complete
    Person.model_validate_json(model.tokenizer.decode(a))


@pytest.mark.parametrize("k", [0, 2])
def test_constrained_decoding_always_valid(model, k):
    # 4 rows: the two prompts' two choices at once (the other tests' shape: their programs)
    gen = Generator(model, spec_tokens=k, spec_policy="fixed", max_batch=4)
    g = OutputGrammar(G.json_schema(SCHEMA, strict=True))
    outs = []
    for seed in range(4):
        outs += gen.generate([PROMPT, PROMPT[:3]], max_new_tokens=120, temperature=1.0, seed=seed, grammar=g, n=2)
    for o in outs:
        assert o.finish_reason == "stop"
        Person.model_validate_json(model.tokenizer.decode(o.tokens))
    assert len({tuple(o.tokens) for o in outs}) > len(outs) // 2


def test_speculative_constrained_equals_plain_greedy(model):
    g = OutputGrammar(G.json_schema(SCHEMA, strict=True))
    plain = Generator(model, max_batch=4).generate([PROMPT], max_new_tokens=120, grammar=g)[0]
    spec = Generator(model, spec_tokens=3, spec_policy="fixed", max_batch=4).generate([PROMPT], max_new_tokens=120,
                                                                                      grammar=g)[0]
    assert plain.tokens == spec.tokens and plain.finish_reason == "stop"


@pytest.mark.parametrize("k", [0, 2])
def test_split_step_with_all_allowed_masks_is_the_fused_step(model, k):
    """A constrained neighbour row switches the batch to the split programs; an unconstrained row's
    tokens (sampled) must be those of the fused step."""
    g = OutputGrammar(G.regex("[a-z ]{0,400}"))
    runs = []
    for with_neighbour in (False, True):
        gen = Generator(model, spec_tokens=k, spec_policy="fixed", max_batch=4)
        free = gen.submit(gen.make_request(PROMPT, max_new_tokens=24, temperature=1.0, seed=5))
        if with_neighbour:
            gen.submit(gen.make_request(PROMPT[:2], max_new_tokens=40, temperature=1.0, seed=6, grammar=g))
        while not free.done.is_set():
            gen.step()
        runs.append(free.tokens)
    assert runs[0] == runs[1]


def test_forks_prefill_once_and_follow_their_seed_streams(model):
    gen = Generator(model, max_batch=4)
    before = gen.prefills
    forked = gen.generate([PROMPT], max_new_tokens=10, temperature=1.0, seed=11, n=3)
    assert gen.prefills == before + 1 and len(forked) == 3
    for i, o in enumerate(forked):
        alone = gen.generate([PROMPT], max_new_tokens=10, temperature=1.0, seed=fork_seed(11, i))[0]
        assert o.tokens == alone.tokens
    assert len({tuple(o.tokens) for o in forked}) == 3


def test_a_prefetched_mask_is_the_one_computed_in_place_and_a_deadline_stops_the_drafts(model, vocab):
    v = model.config.vocab_size
    seq = walk(Constraint(vocab, G.json_schema(SCHEMA, strict=True)), v, np.random.default_rng(2))
    pool = ThreadPoolExecutor(2)
    ahead, here = (Constraint(vocab, G.json_schema(SCHEMA, strict=True)) for _ in range(2))
    for c in (ahead, here):
        c.advance(seq[:4])
    ahead.prefetch(pool)
    assert ahead.pending is not None
    got, want = np.zeros((4, ahead.words), np.int32), np.zeros((4, here.words), np.int32)
    assert ahead.fill(got, seq[4:7]) == 4 and here.fill(want, seq[4:7]) == 4
    np.testing.assert_array_equal(got, want)
    assert ahead.pending is None
    ahead.prefetch(pool)
    assert ahead.advance(seq[4:6]) == 2 and ahead.pending is None     # tokens taken: the mask ahead is dropped
    past = np.zeros((4, ahead.words), np.int32)
    assert ahead.fill(past, seq[6:9], deadline=time.perf_counter()) == 1  # only the first position in time
    assert (past[1:] == -1).all() and ahead.advance(seq[6:7]) == 1       # nothing was consumed for good


def test_a_row_whose_mask_is_late_sits_out_and_the_others_go_on(model):
    """The masks' pool is held busy: the constrained row's next mask cannot be ready, so it sits
    every step out (no wait: share 0) while the free row decodes to its end; released, the row
    finishes with the output it has alone."""
    g = OutputGrammar(G.json_schema(SCHEMA, strict=True))
    alone = Generator(model, max_batch=4).generate([PROMPT], max_new_tokens=120, grammar=g)[0]
    gen = Generator(model, max_batch=4)
    gen.mask_schedule.share = 0.0
    gate = threading.Event()
    release = threading.Timer(120, gate.set)          # an engine that waited for the mask fails, not hangs
    release.start()
    pool = gen.mask_schedule.pool
    for _ in range(pool._max_workers):
        pool.submit(gate.wait)
    held = gen.submit(gen.make_request(PROMPT, max_new_tokens=120, grammar=g))
    free = gen.submit(gen.make_request(PROMPT[:3], max_new_tokens=24))
    while not free.done.is_set():
        gen.step()
    assert not gate.is_set(), "the free row waited for the held row's mask"
    release.cancel()
    assert len(free.tokens) == 24 and free.finish_reason == "length"
    assert len(held.tokens) == 1 and held.stats["mask_waits"] >= free.stats["steps"] > 0
    gate.set()
    while not held.done.is_set():
        gen.step()
    assert held.tokens == alone.tokens and held.finish_reason == "stop"
    assert gen.mask_schedule.waits == held.stats["mask_waits"]


def test_draft_masks_past_the_budget_cap_the_row_and_the_output_stands(model):
    """MTP with no time for masks (share 0): each verify position after the first is past the
    deadline, so a constrained row takes one token per step; the output is plain greedy's."""
    g = OutputGrammar(G.json_schema(SCHEMA, strict=True))
    plain = Generator(model, max_batch=4).generate([PROMPT], max_new_tokens=120, grammar=g)[0]
    gen = Generator(model, spec_tokens=2, spec_policy="fixed", max_batch=4)
    gen.mask_schedule.share = 0.0
    out = gen.generate([PROMPT], max_new_tokens=120, grammar=g)[0]
    assert out.tokens == plain.tokens
    assert out.stats["accepted"] == 0 and out.stats["steps"] == len(out.tokens) - 1
