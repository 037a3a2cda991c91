"""Fault isolation in the engine, on the embedded tiny model with faults injected at each stage:
a request that raises while being admitted, while being prefilled, while its tokens are handled,
or whose logits turn NaN fails alone (its error recorded, its row freed) and every other request
decodes exactly what it decodes on its own; a step program that raises fails the running batch,
which is rebuilt, and the requests after it are served as if nothing happened.

The faults are injected around the engine's real programs (the wrappers call them), so every
code path is the one a real checkpoint takes. The model is the demo model's config with one decoder layer
of each kind and random weights (``random_tiny_checkpoint``): the isolation is the engine's, whatever
the weights, and the 4-row programs are those of ``test_constraint``'s and ``test_spec_policy``'s model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.support.helpers import random_tiny_model
from zoo.engine.generator import Generator

PROMPTS = {"a": [5, 17, 200, 33, 8], "b": [300, 2, 77, 41], "c": [11, 22, 33, 44, 55, 66]}
NEW = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return random_tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def solo(model):
    """Each prompt's greedy tokens, generated alone."""
    gen = Generator(model, max_batch=4)
    return {name: gen.generate([p], max_new_tokens=NEW)[0].tokens for name, p in PROMPTS.items()}


def run(gen: Generator, names, **kwargs) -> dict:
    """Submit the prompts named (together) and step until all are done: name -> Request."""
    reqs = {n: gen.submit(gen.make_request(PROMPTS[n], max_new_tokens=NEW, **kwargs.get(n, {}))) for n in names}
    for _ in range(200):
        if all(r.done.is_set() for r in reqs.values()):
            return reqs
        gen.step()
    raise AssertionError("the engine did not finish the requests")


def assert_failed(req, kind: str) -> None:
    assert req.finish_reason == "error", req.finish_reason
    assert req.stats["error_status"] == 500 and kind in req.stats["error"], req.stats


def test_a_request_that_raises_in_admission_fails_alone(model, solo):
    gen = Generator(model, max_batch=4)
    real = gen._lookup
    gen._lookup = lambda req: (_ for _ in ()).throw(RuntimeError("injected admission fault")) \
        if req.prompt == PROMPTS["b"] else real(req)
    reqs = run(gen, "abc")
    assert_failed(reqs["b"], "RuntimeError: injected admission fault")
    assert reqs["a"].tokens == solo["a"] and reqs["c"].tokens == solo["c"]
    assert gen.faults["failed_requests"] == 1 and gen.faults["failed_steps"] == 0
    assert "injected admission fault" in gen.faults["last_error"]
    gen._lookup = real
    assert run(gen, "b")["b"].tokens == solo["b"]            # the engine still serves that prompt


def test_a_request_that_raises_in_prefill_fails_alone(model, solo):
    gen = Generator(model, max_batch=4)
    real = gen._prefill_fn

    def prefill(state, ids, *args, **kwargs):
        if int(ids[0, 0]) == PROMPTS["b"][0]:
            raise RuntimeError("injected prefill fault")
        return real(state, ids, *args, **kwargs)
    gen._prefill_fn = prefill
    reqs = run(gen, "abc")
    assert_failed(reqs["b"], "injected prefill fault")
    assert reqs["a"].tokens == solo["a"] and reqs["c"].tokens == solo["c"]
    assert all(r is None for r in gen._rows)                 # every row free again, the failed one too


def test_a_request_whose_callback_raises_fails_alone(model, solo):
    gen = Generator(model, max_batch=4)
    seen = []

    def on_tokens(req, tokens):
        seen.extend(tokens)
        if len(seen) >= 3:
            raise ValueError("injected consumer fault")
    reqs = run(gen, "abc", b={"on_tokens": on_tokens})
    assert_failed(reqs["b"], "injected consumer fault")
    assert reqs["a"].tokens == solo["a"] and reqs["c"].tokens == solo["c"]


@pytest.mark.parametrize("spec", [0, 2])
def test_a_row_with_nan_logits_fails_alone_and_is_not_cached(model, solo, spec):
    """Row b's cache is poisoned with NaN before the second step: b fails with a clear error, a and
    c are untouched, and b's prompt and a continuation of b's conversation afterwards decode as on a
fresh engine (the broken state was not cached)."""
    gen = Generator(model, max_batch=4, spec_tokens=spec, spec_policy="fixed")
    real, calls = gen._step_fn, []

    def step(state, batch, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            r = next(i for i, q in enumerate(gen._rows) if q is not None and q.prompt == PROMPTS["b"])
            batch = {**batch, "cache": jax.tree.map(
                lambda x: x.at[r].set(jnp.nan) if jnp.issubdtype(x.dtype, jnp.floating) else x, batch["cache"])}
        return real(state, batch, *args, **kwargs)
    gen._step_fn = step
    reqs = run(gen, "abc")
    assert_failed(reqs["b"], "not finite")
    assert reqs["a"].tokens == solo["a"] and reqs["c"].tokens == solo["c"]
    assert gen.faults["failed_steps"] == 0
    assert run(gen, "b")["b"].tokens == solo["b"]
    # a continuation of b's conversation restores b's prompt from the prefix cache, never the broken row
    cont = PROMPTS["b"] + reqs["b"].raw + [7]
    expected = Generator(model, max_batch=4, spec_tokens=spec, spec_policy="fixed").generate(
        [cont], max_new_tokens=NEW)[0].tokens
    resumed = gen.generate([cont], max_new_tokens=NEW)[0]
    assert resumed.finish_reason != "error" and resumed.tokens == expected
    assert resumed.stats["cached_tokens"] == len(PROMPTS["b"])


def test_a_failed_step_fails_the_batch_which_is_rebuilt(model, solo):
    """The step program raises once (a device error): the two running requests fail, the one
    waiting for a row is then served on a new batch, and so is every later request."""
    gen = Generator(model, max_batch=2)
    real, calls = gen._step_fn, []

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected device fault")
        return real(*args, **kwargs)
    gen._step_fn = step
    reqs = run(gen, "abc")
    assert_failed(reqs["a"], "injected device fault")
    assert_failed(reqs["b"], "injected device fault")
    assert len(reqs["a"].tokens) == 3                        # the first token and two steps, then the fault
    assert reqs["c"].tokens == solo["c"] and reqs["c"].finish_reason != "error"
    assert gen.faults["failed_steps"] == 1 and gen.faults["failed_requests"] == 2
    again = run(gen, "ab")
    assert again["a"].tokens == solo["a"] and again["b"].tokens == solo["b"]


def test_zoo_generate_exits_non_zero_when_the_engine_fails_its_request(monkeypatch, capsys):
    """The command's exit status says whether the work was done (it was 0 after an out-of-memory)."""
    from zoo.cli import main

    def out_of_memory(self, req):
        raise RuntimeError("Out of memory allocating 51570468368 bytes")

    monkeypatch.setattr(Generator, "_lookup", out_of_memory)
    assert main(["generate", "--model", "qwen38-tiny", "--prompt", "What is 2 + 3?", "--max-tokens", "4"]) == 1
    assert "zoo generate: error: RuntimeError: Out of memory allocating 51570468368 bytes" in capsys.readouterr().err
