"""``zoo.engine.step_programs``: generators over equal models share their compiled programs (one
jitted copy per configuration in the process), and so do the models' full forwards (``Model.logits``);
a model that differs (its dtype) gets its own."""

from __future__ import annotations

import jax.monitoring

import zoo
from zoo.engine.generator import Generator
from zoo.engine.step_programs import SHARED, _programs, forget_shared, shared_program

TRACE = "/jax/core/compile/jaxpr_trace_duration"


def test_a_second_generator_over_an_equal_model_traces_nothing():
    forget_shared()                      # nothing kept from other tests of this process: the first one traces
    first, second = zoo.load("qwen38-tiny"), zoo.load("qwen38-tiny")       # two loads: equal, not the same
    other = zoo.load("qwen38-tiny", dtype="float32")
    traced: list[str] = []

    def listen(event, secs, **kw):
        if event == TRACE:
            traced.append(str(kw.get("fun_name")))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        check(first, second, other, traced)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def check(first, second, other, traced):
    want = Generator(first, max_batch=2, prefix_cache=0).generate([[5, 6, 7]], max_new_tokens=4)[0].tokens
    assert {"decode_step", "prefill_piece"} <= set(traced)                   # the first one traced them
    traced.clear()
    gen = Generator(second, max_batch=2, prefix_cache=0)
    assert gen._step_fn is shared_program("decode", gen._graphdef, 0) and gen._prefill_fn is shared_program(
        "prefill", gen._graphdef, 0)
    assert gen._masked is Generator(first, max_batch=2, prefix_cache=0)._masked    # and the masked step's parts
    assert gen.generate([[5, 6, 7]], max_new_tokens=4)[0].tokens == want
    assert not {"decode_step", "prefill_piece"} & set(traced), traced        # nothing traced again
    gen32 = Generator(other, max_batch=2, prefix_cache=0)
    assert gen32._step_fn is not gen._step_fn and gen32._prefill_fn is not gen._prefill_fn
    assert gen32._masked is not gen._masked
    assert Generator(first, max_batch=2, spec_tokens=2, prefix_cache=0)._step_fn is not gen._step_fn   # k differs
    assert first._logits_fn is second._logits_fn and first._mtp_fn is second._mtp_fn      # the parity forwards
    assert other._logits_fn is not first._logits_fn
    assert len(_programs) <= SHARED


def test_a_step_flattens_no_parameter_in_python():
    """The weights go to every program as a ``FlatState`` (``zoo.engine.flat_state``): flattened once,
    not one Python callback per parameter at every call (about 1 us each; 2,923 parameters in
    GLM-5.3-Flash). Counted: ``nnx.Variable`` flattens during decode steps (none), against the same
    count for one flatten of the ``nnx.State`` (one per parameter: the counter sees them)."""
    import sys

    import jax

    from zoo.engine.flat_state import FlatState, as_state

    gen = Generator(zoo.load("qwen38-tiny"), max_batch=2, context=64, prefix_cache=0)
    gen.eos_token_ids = frozenset()
    state = as_state(gen.weights)
    assert isinstance(gen.weights, FlatState) and FlatState.of(gen.weights) is gen.weights
    assert jax.tree.structure(state) == gen.weights.treedef and len(gen.weights.leaves) == len(jax.tree.leaves(state))
    req = gen.submit(gen.make_request([5, 6, 7], max_new_tokens=8))
    gen.step()
    gen.step()                                               # every program this test runs has run once

    def counted(fn) -> int:
        calls = []
        sys.setprofile(lambda frame, event, arg: calls.append(1) if event == "call"
                       and frame.f_code.co_name == "_variable_flatten" else None)
        try:
            fn()
        finally:
            sys.setprofile(None)
        return len(calls)
    assert counted(lambda: jax.tree.flatten(state)) == len(gen.weights.leaves)
    before = len(req.tokens)
    assert counted(lambda: [gen.step() for _ in range(3)]) == 0
    assert len(req.tokens) == before + 3 and req.finish_reason is None
