"""``RequestOptions`` (``zoo.engine.options``): built from the Python API's keywords, normalized by
its annotations, checked once with a message naming the option, and sent to a replica's followers
as JSON over every field (a round trip gives an equal object; a field added to the class travels
with no change to ``zoo.engine.replica``)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from zoo.engine.constraint import OutputGrammar
from zoo.engine.options import RequestOptions, TokenIdError, check_token_ids
from zoo.registry import embedded_path
from zoo.text.tokenizer import Tokenizer

TOK = Tokenizer.from_dir(embedded_path("qwen38-tiny"))
VOCAB = 516
GRAMMAR = OutputGrammar("start: /[0-9]+/", wait=((7, 8), (9,)), rearm=(3, 4), reasoning=(11, (12, 13)))
EVERY_FIELD_SET = RequestOptions(
    max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=-12, stop=("END", "zz"), stop_token_ids=(5, 6),
    n=2, logprobs=3, prompt_logprobs=1, thinking_budget=40, thinking_opened=True, grammar=GRAMMAR,
    cache_marks=(4, 9), detokenize=True, keep_special=("<think>", "</think>"))


def over_json(options):
    return type(options).from_json(json.loads(json.dumps(options.to_json())))


def test_every_field_is_set_in_the_round_trip_case():
    """The round-trip case below sets each field to a value other than its default (so a field the
    JSON left out would come back as its default and differ)."""
    for f in dataclasses.fields(RequestOptions):
        if f.default is not dataclasses.MISSING:
            assert getattr(EVERY_FIELD_SET, f.name) != f.default, f"set {f.name} in EVERY_FIELD_SET"


def test_a_round_trip_through_json_equals_the_original():
    back = over_json(EVERY_FIELD_SET)
    assert back == EVERY_FIELD_SET
    assert isinstance(back.grammar, OutputGrammar) and back.grammar.wait == ((7, 8), (9,))
    assert set(EVERY_FIELD_SET.to_json()) == {f.name for f in dataclasses.fields(RequestOptions)}
    assert over_json(RequestOptions(3)) == RequestOptions(3)


def test_a_field_added_to_the_class_travels_with_no_other_change():
    """What the replica relies on (``to_json`` / ``from_json`` over the dataclass's fields): a
    subclass with a new field, of a tuple type, comes back equal, the field included."""
    Extended = dataclasses.make_dataclass("Extended", [("extra", tuple[int, ...], ())], bases=(RequestOptions,),
                                          frozen=True)
    options = Extended(**{f.name: getattr(EVERY_FIELD_SET, f.name) for f in dataclasses.fields(RequestOptions)},
                       extra=[1, 2])
    assert options.extra == (1, 2)                        # normalized by its annotation, as every field
    assert options.to_json()["extra"] == (1, 2)
    assert over_json(options) == options


def test_build_splits_stop_ids_and_strings_and_values_are_normalized():
    o = RequestOptions.build(max_new_tokens=np.int64(4), stop=[5, "END", np.int32(7)], cache_marks=[9, 2])
    assert (o.stop, o.stop_token_ids, o.cache_marks, o.max_new_tokens) == (("END",), (5, 7), (2, 9), 4)
    assert type(o.max_new_tokens) is int
    assert RequestOptions.build(max_new_tokens=1, stop="END").stop == ("END",)
    assert RequestOptions.build(max_new_tokens=1, stop=5).stop_token_ids == (5,)
    assert RequestOptions(1, stop="END").stop == ("END",)       # a lone string is one stop string
    assert RequestOptions(1, grammar={"grammar": "g", "wait": [[1]]}).grammar == OutputGrammar("g", ((1,),))
    assert not RequestOptions(1).needs_text and RequestOptions(1, stop=["x"]).needs_text
    assert RequestOptions(1, detokenize=True).needs_text and not RequestOptions(1, stop=[""]).needs_text


@pytest.mark.parametrize("fields, message", [
    ({"n": 0}, "n must be >= 1, got 0"),
    ({"max_new_tokens": 0}, r"max_new_tokens must be >= 1 \(0 only with prompt_logprobs\)"),
    ({"max_new_tokens": -1, "prompt_logprobs": 0}, "max_new_tokens must be >= 1"),
    ({"logprobs": 21}, r"logprobs must be in 0..20, got 21"),
    ({"prompt_logprobs": -1}, r"prompt_logprobs must be in 0..20, got -1"),
    ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
    ({"temperature": math.nan}, "temperature must be a finite number >= 0"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"thinking_budget": -1}, "thinking_budget must be >= 0"),
    ({"cache_marks": (-1, 3)}, "cache_marks must be prompt positions"),
    ({"stop_token_ids": (5, VOCAB)}, rf"stop_token_ids\[1\]: token id {VOCAB} is not in the vocabulary"),
])
def test_check_names_the_option(fields, message):
    with pytest.raises(ValueError, match=message):
        RequestOptions(**{"max_new_tokens": 4, **fields}).check(VOCAB, TOK)


def test_text_needs_a_tokenizer_and_a_valid_object_checks_to_itself():
    with pytest.raises(ValueError, match="stop strings need a tokenizer; this model has none"):
        RequestOptions(4, stop=("x",)).check(VOCAB, None)
    with pytest.raises(ValueError, match="detokenized output needs a tokenizer"):
        RequestOptions(4, detokenize=True).check(VOCAB, None)
    assert EVERY_FIELD_SET.check(VOCAB, TOK) is EVERY_FIELD_SET
    assert RequestOptions(0, prompt_logprobs=0).check(VOCAB, None).max_new_tokens == 0


def test_token_ids_outside_the_vocabulary_name_the_first_one():
    check_token_ids([0, 5, VOCAB - 1], VOCAB, "prompt")
    for ids, index, token in (([5, VOCAB], 1, VOCAB), ([-1], 0, -1), ([1, 2, 2**40, -3], 2, 2**40)):
        with pytest.raises(TokenIdError) as e:
            check_token_ids(ids, VOCAB, "prompt")
        assert str(e.value) == f"prompt[{index}]: token id {token} is not in the vocabulary (0..{VOCAB - 1})"
        assert e.value.named("prompt[3]").startswith(f"prompt[3][{index}]: token id {token} ")
