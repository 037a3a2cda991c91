"""The narrow decode programs (``Generator(narrow_rows=N)``, ``step_programs.decode_narrow``): a step
whose decoding rows all lie below N runs on those N rows instead of the whole batch.

Three requests of different lengths (rows 0, 1, 2 of a 4-row batch, N = 2): once the third ends, the
first two step on the narrow programs, which read and write the batch's slot buffers in place (Qwen
with MTP drafts under the auto policy, whose "off" step has a narrow twin too, over blocks of slots;
GLM plain over the whole window). In the other order the first ends first, and the third moves from
row 2 into row 0 (row compaction, ``Generator._compact``), so the two left step on the narrow
programs. Their tokens equal the engine without them, token for token; logprobs agree to float32
rounding (other matmul shapes sum in other orders). A request with an output grammar steps on the
narrow rows too (the step split around its token masks, ``masked_step``, on the first N rows). A
warmed engine compiles nothing while it switches between the widths and moves rows.
``narrow_width``'s defaults and bad values. The models are the demo models' configs with one decoder
layer of each kind and random weights (``random_tiny_checkpoint``; Qwen's bigram variant, whose drafts
are mostly accepted): the rows' mechanics do not depend on the weights, and a shallower model is less
to compile.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.support.helpers import bigram_variant, random_tiny_model
from tests.support.metrics import metric_total
from zoo.engine.compile_cache import CompileCounter
from zoo.engine.constraint import OutputGrammar
from zoo.engine.generator import Generator
from zoo.engine.rows import narrow_width
from zoo.models.shared.filled_blocks import first_rows, read_block
from zoo.models.shared.kv_slots import write_slots
from zoo.server import grammar as G

QUESTIONS = ["What is 123 + 456?", "Spell the word 'banana'.", "What's the weather in Paris?"]
LENGTHS = [20, 12, 3]


ANSWER = OutputGrammar(G.json_schema({"type": "object", "properties": {"answer": {"type": "integer"}},
                                      "required": ["answer"], "additionalProperties": False}, strict=True))


def run(gen: Generator, prompts, lengths=LENGTHS, grammars=()) -> list:
    reqs = [gen.submit(gen.make_request(p, max_new_tokens=n, logprobs=0, grammar=g))
            for p, n, g in zip(prompts, lengths, list(grammars) + [None] * len(prompts))]
    while not all(r.done.is_set() for r in reqs):
        gen.step()
    return [(r.tokens, np.array([t.logprob for t in r.token_logprobs])) for r in reqs]


def engine_metrics(gen: Generator) -> str:
    """The engine's metrics as ``/metrics`` renders them (Prometheus text)."""
    from zoo.server.metrics import Metrics
    metrics = Metrics()
    metrics.watch_engine(gen)
    return metrics.render().decode()


def steps_of(gen: Generator, prompts, lengths, grammars=()) -> tuple[list, int, int, int]:
    """``run``'s results, and the decode steps, narrow steps and row moves it took."""
    before = gen.steps, gen.narrow_steps, gen.moved_rows
    out = run(gen, prompts, lengths, grammars)
    return (out,) + tuple(after - b for after, b in zip((gen.steps, gen.narrow_steps, gen.moved_rows), before))


# Qwen with MTP drafts (both narrow programs of the auto policy) over blocks of 256 slots; GLM plain over
# the whole window (the reads are the same two helpers for both models' attention)
@pytest.mark.parametrize("name,spec,context", [("qwen38-tiny", 2, 1024), ("glm53-tiny", 0, 256)])
def test_narrow_steps_give_the_whole_batchs_tokens_and_compile_nothing_once_warm(name, spec, context,
                                                                                tmp_path_factory):
    model = random_tiny_model(tmp_path_factory, name)
    model = bigram_variant(model) if spec else model
    tok = model.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    kw = {"spec_tokens": spec, "spec_policy": "auto"} if spec else {}
    whole = Generator(model, max_batch=4, context=context, prefix_cache=0, **kw)
    want = run(whole, prompts)
    want_reversed = run(whole, prompts, LENGTHS[::-1])
    want_masked = run(whole, prompts[:2], [24, 6], [ANSWER])
    assert whole.narrow_steps == 0 and whole.narrow_rows == 0 and whole.moved_rows == 0
    narrow = Generator(model, max_batch=4, context=context, prefix_cache=0, narrow_rows=2, **kw)
    names = [name for name, _, _ in narrow.program_set()]
    assert sum("on rows 0..1" in n for n in names) == (2 if spec else 1), names
    assert [name for name, _ in narrow.warmup()].count("move a row") == 1
    with CompileCounter() as counter:
        got, steps, narrow_steps, moved = steps_of(narrow, prompts, LENGTHS)
        got_reversed, steps_r, narrow_r, moved_r = steps_of(narrow, prompts, LENGTHS[::-1])
        got_masked, steps_m, narrow_m, _ = steps_of(narrow, prompts[:2], [24, 6], [ANSWER])
    assert counter.compiled == 0
    # rows 0 and 1 ran alone after row 2's 3 tokens: those steps were narrow, the first ones were not;
    # nothing moved (no decoding row past row 1 once the narrow steps could start)
    assert 0 < narrow_steps < steps and moved == 0
    # the other order: row 0's 3 tokens end first, then row 2 (20 tokens) moves into row 0 and every
    # later step is narrow; without the move rows 1 and 2 would have stepped at full width to the end
    assert moved_r == 1 and 0 < narrow_r < steps_r and steps_r - narrow_r == steps - narrow_steps
    # a constrained row in rows 0 and 1: every step is split around its masks, and narrow
    assert narrow_m == steps_m > 0 and "masked narrow" in narrow._ran
    for (tokens, lp), (want_tokens, want_lp) in zip(got + got_reversed + got_masked,
                                                    want + want_reversed + want_masked):
        assert tokens == want_tokens
        np.testing.assert_allclose(lp, want_lp, rtol=1e-4, atol=1e-5)
    assert '"answer"' in model.tokenizer.decode(got_masked[0][0])
    # the server's /metrics reads these counters (``zoo.server.metrics``)
    exported = engine_metrics(narrow)
    narrowed = narrow_steps + narrow_r + narrow_m
    assert metric_total(exported, "zoo_engine_decode_steps_total", rows="narrow") == narrow.narrow_steps == narrowed
    assert metric_total(exported, "zoo_engine_decode_steps_total", rows="all") == narrow.steps - narrow.narrow_steps > 0
    assert metric_total(exported, "zoo_engine_rows_moved_total") == narrow.moved_rows == 1
    assert metric_total(exported, "zoo_engine_prefills_total") == narrow.prefills == 8
    assert any(program.endswith(" narrow") for program in narrow._ran), narrow._ran


def test_narrow_width_defaults_and_bad_values():
    cpu = jax.default_backend() == "cpu"
    assert narrow_width(None, 16, None) == (4 if cpu else 0)
    assert narrow_width(None, 3, None) == 0                 # a quarter of 3 rows is none
    assert narrow_width(0, 16, None) == 0 and narrow_width(16, 16, None) == 0 and narrow_width(5, 16, None) == 5
    mesh = jax.make_mesh((1,), ("x",))
    assert narrow_width(None, 16, mesh) == 0
    with pytest.raises(ValueError, match="mesh"):
        narrow_width(2, 16, mesh)
    with pytest.raises(ValueError, match=">= 0"):
        narrow_width(-1, 16, None)


def test_zoo_serve_takes_a_count_or_auto_and_refuses_anything_else(capsys):
    from zoo.cli import build_parser

    parse = lambda *a: build_parser().parse_args(["serve", *a])       # noqa: E731
    assert parse().narrow_rows is None and parse("--narrow-rows", "auto").narrow_rows is None
    assert parse("--narrow-rows", "4").narrow_rows == 4 and parse("--narrow-rows", "0").narrow_rows == 0
    for bad in ("-1", "two"):
        with pytest.raises(SystemExit) as exit_:
            parse("--narrow-rows", bad)
        assert exit_.value.code == 2
        assert f"--narrow-rows: expected a number of rows >= 0 or auto, got '{bad}'" in capsys.readouterr().err


def test_a_write_into_the_first_rows_of_a_bigger_buffer_is_the_write_into_those_rows():
    rng = np.random.default_rng(0)
    buf = rng.standard_normal((4, 2, 16, 3)).astype(np.float32)            # [B, H, L, D], slots on axis 2
    new = rng.standard_normal((2, 2, 3, 3)).astype(np.float32)
    at = np.array([5, 13], np.int32)
    got = np.asarray(write_slots(jax.numpy.asarray(buf), new, at, slot_axis=2))
    want = buf.copy()
    want[:2] = np.asarray(write_slots(jax.numpy.asarray(buf[:2]), new, at, slot_axis=2))
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got[:2], buf[:2])


def test_reads_of_the_first_rows_of_a_bigger_buffer():
    x = jax.numpy.arange(4 * 2 * 16 * 3, dtype=jax.numpy.float32).reshape(4, 2, 16, 3)
    np.testing.assert_array_equal(read_block(x, 5, 4, 2, 2), x[:2, :, 5:9])
    np.testing.assert_array_equal(read_block(x, 12, 4, 2, 4), x[:, :, 12:16])
    assert first_rows(x, 4) is x and first_rows(x, 1).shape == (1, 2, 16, 3)
