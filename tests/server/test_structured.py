"""Structured outputs and n > 1 over real HTTP on 127.0.0.1, driven by the official ``openai`` SDK
(``parse`` with pydantic models) and raw requests: the embedded *random* tiny model, constrained,
must always produce output valid against the schema, plain and speculative."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx2 as httpx
import openai
import pytest
from pydantic import BaseModel, Field

import zoo
from tests.support.helpers import random_tiny_model
from tests.support.server_helpers import GLM_TEMPLATE, QWEN_TEMPLATE, checkpoint_with_template
from zoo.engine.request import fork_seed
from zoo.server.app import ServerThread, create_app

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "Describe someone."}]


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    ok: bool
    kind: Literal["a", "b"]


class Lookup(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=14)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The demo model's config and tokenizer with random weights and a plain ChatML template."""
    return random_tiny_model(tmp_path_factory)


def serve(model, **kwargs):
    app = create_app(model, api_key=KEY, model_name="tiny", keepalive_s=0.1, **kwargs)
    server = ServerThread(app)
    server.app = app
    return server


@pytest.fixture(scope="module")
def plain(model):
    with serve(model) as s:
        yield s


@pytest.fixture(scope="module")
def spec(model):
    with serve(model, spec_tokens=2) as s:
        yield s


@pytest.fixture(scope="module", params=["qwen", "glm"])
def templated(request, tmp_path_factory):
    """The random tiny model with a chat template that opens reasoning and renders tools."""
    template = QWEN_TEMPLATE if request.param == "qwen" else GLM_TEMPLATE
    m = zoo.load(checkpoint_with_template(tmp_path_factory.mktemp(request.param), template), dtype="float32")
    with serve(m) as s:
        s.format = request.param
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_parse_helper_always_valid(request, which):
    c = client(request.getfixturevalue(which))
    seen = set()
    for seed in range(8):
        r = c.chat.completions.parse(model="tiny", messages=USER, response_format=Person, temperature=1.0,
                                     seed=seed, max_tokens=200)
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
        seen.add(choice.message.content)
    assert len(seen) > 4                              # sampled, not a fixed answer


def test_responses_parse_and_anthropic_output_format(plain, spec):
    for server in (plain, spec):
        r = client(server).responses.parse(model="tiny", input="Describe someone.", text_format=Person,
                                           temperature=1.0, max_output_tokens=200)
        assert isinstance(r.output_parsed, Person)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    r = httpx.post(plain.url + "/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                   json={"model": "tiny", "max_tokens": 60, "messages": USER,
                         "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert r.status_code == 200, r.text
    value = json.loads(r.json()["content"][0]["text"])
    assert set(value) == {"n"} and 0 <= value["n"] <= 99


def test_completions_regex_choice_grammar_and_n(plain, spec):
    for server in (plain, spec):
        c = client(server)
        r = c.completions.create(model="tiny", prompt="Code:", max_tokens=30, temperature=1.0, n=3, seed=1,
                                 extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
        assert len(r.choices) == 3 and [ch.index for ch in r.choices] == [0, 1, 2]
        assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", ch.text) for ch in r.choices)
        r = c.completions.create(model="tiny", prompt="Pick:", max_tokens=10, temperature=1.0,
                                 extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
        assert r.choices[0].text in ("red", "green", "blue")
        r = c.chat.completions.create(model="tiny", messages=USER, max_tokens=20, temperature=1.0,
                                      extra_body={"guided_grammar": 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'})
        assert re.fullmatch("yes|no|maybe [0-9]", r.choices[0].message.content)


def test_json_object(plain):
    r = client(plain).chat.completions.create(model="tiny", messages=USER, response_format={"type": "json_object"},
                                              temperature=0.0, max_tokens=400)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_tool_calls_follow_the_schema(templated):
    c = client(templated)
    tool = openai.pydantic_function_tool(Lookup, name="lookup")
    other = openai.pydantic_function_tool(Person, name="person")
    models = {"lookup": Lookup, "person": Person}
    for seed in range(4):
        for choice in ("required", {"type": "function", "function": {"name": "lookup"}}):
            r = c.chat.completions.parse(model="tiny", messages=USER, tools=[tool, other], tool_choice=choice,
                                         temperature=1.0, seed=seed, max_tokens=200, parallel_tool_calls=False)
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1, msg
            assert isinstance(msg.tool_calls[0].function.parsed_arguments, (Lookup, Person))
            if isinstance(choice, dict):
                assert msg.tool_calls[0].function.name == "lookup"
    # parallel calls: every call is valid (a random model may go on calling until the length limit,
    # which cuts the last one)
    r = c.chat.completions.create(model="tiny", messages=USER, tools=[tool, other], tool_choice="required",
                                  temperature=1.0, seed=9, max_tokens=300)
    calls = r.choices[0].message.tool_calls
    complete = calls if r.choices[0].finish_reason == "tool_calls" else calls[:-1]
    assert calls and all(models[t.function.name].model_validate_json(t.function.arguments) for t in complete)


def test_constraint_starts_after_the_reasoning(templated):
    """Qwen's template opens the reasoning: the answer is constrained once the budget closes it; GLM's
    leaves it to the model: its first token may open reasoning, or start the answer."""
    reasoned = 0
    for seed in range(6):
        r = client(templated).chat.completions.parse(model="tiny", messages=USER, response_format=Person,
                                                     temperature=1.0, seed=seed, max_tokens=200,
                                                     extra_body={"thinking_budget": 6})
        msg = r.choices[0].message
        assert isinstance(msg.parsed, Person)
        reasoned += bool((msg.model_extra or {}).get("reasoning_content"))
    assert reasoned == 6 if templated.format == "qwen" else 0 < reasoned < 6


def test_n_choices_fork_the_prompt(plain, spec, model):
    for server in (plain, spec):
        c = client(server)
        gen = server.app.state.service.engine.generator
        before = gen.prefills
        r = c.chat.completions.create(model="tiny", messages=USER, n=3, seed=7, temperature=1.0, max_tokens=12)
        assert gen.prefills == before + 1
        texts = [ch.message.content for ch in sorted(r.choices, key=lambda ch: ch.index)]
        assert [ch.index for ch in r.choices] == [0, 1, 2] and len(set(texts)) == 3
        for i, text in enumerate(texts):                 # choice i: the seed stream fork_seed(seed, i)
            alone = c.chat.completions.create(model="tiny", messages=USER, seed=fork_seed(7, i), temperature=1.0,
                                              max_tokens=12)
            assert alone.choices[0].message.content == text
        assert r.usage.prompt_tokens == alone.usage.prompt_tokens
        streamed = {0: "", 1: "", 2: ""}
        for chunk in c.chat.completions.create(model="tiny", messages=USER, n=3, seed=7, temperature=1.0,
                                               max_tokens=12, stream=True):
            for ch in chunk.choices:
                streamed[ch.index] += ch.delta.content or ""
        assert [streamed[i] for i in range(3)] == texts


def test_bad_constraints_are_400(plain):
    c = client(plain)
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "strin"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "start: foo"}}, "foo"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "one output constraint"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "exactly one"),
        ({"n": 17}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
            "type": "object", "properties": {"x": {"type": "nope"}}}}}], "tool_choice": "required"}, ""),
    ]
    for kwargs, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=USER, max_tokens=5, **kwargs)
        assert words in e.value.body["message"], (kwargs, e.value.body)
    r = httpx.post(plain.url + "/v1/responses", headers=AUTH, json={
        "model": "tiny", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}})
    assert r.status_code == 400 and "text.format" in r.json()["error"]["message"]


def test_responses_tool_calls_follow_the_schema(templated):
    schema = openai.pydantic_function_tool(Lookup, name="lookup")["function"]["parameters"]
    tools = [{"type": "function", "name": "lookup", "parameters": schema, "strict": True}]
    for seed_choice in ("required", {"type": "function", "name": "lookup"}):
        r = client(templated).responses.create(model="tiny", input="Weather?", tools=tools, tool_choice=seed_choice,
                                               parallel_tool_calls=False, temperature=1.0, max_output_tokens=200)
        calls = [item for item in r.output if item.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "lookup"
        Lookup.model_validate_json(calls[0].arguments)
