"""Bounds and strict types on every request field of every API surface, over real HTTP: a value out
of range or of the wrong JSON type (2**31, 2**63, 2**64, -1, 1.0 for an integer, true for an
integer, "5" for a number, [false] as a prompt), empty Anthropic content and a tool schema that is
no JSON Schema object each get a 400 in that API's error schema naming the field; the valid
boundary values are served (200). Fields the engine does not implement (penalties, logit_bias,
best_of) are accepted at their neutral value only."""

from __future__ import annotations

import copy
import json

import httpx2 as httpx
import pytest

from tests.support.server_helpers import QWEN_TEMPLATE, say, scripted_model
from zoo.server.app import ServerThread, create_app

KEY = "bounds-key"
HEADERS = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY, "anthropic-version": "2023-06-01"}
I32, I64 = 2**31 - 1, 2**63 - 1
USER = [{"role": "user", "content": say(0)}]
OBJECT = {"type": "object", "properties": {"city": {"type": "string"}}}
BASE = {     # a small valid body per endpoint (the scripted model answers "Hi." and stops)
    "/v1/chat/completions": {"model": "m", "messages": USER, "max_tokens": 4},
    "/v1/completions": {"model": "m", "prompt": say(0), "max_tokens": 4},
    "/v1/responses": {"model": "m", "input": say(0), "max_output_tokens": 4},
    "/v1/messages": {"model": "m", "max_tokens": 4, "messages": USER},
    "/v1/messages/count_tokens": {"model": "m", "messages": USER},
    "/tokenize": {"model": "m", "prompt": "hi"},
    "/detokenize": {"model": "m", "tokens": [1, 2]},
}
CHAT, COMPLETIONS, RESPONSES, MESSAGES, COUNT, TOKENIZE, DETOKENIZE = BASE


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = scripted_model(tmp_path_factory.mktemp("bounds-ckpt"), QWEN_TEMPLATE, ["Hi."], context=512)
    with ServerThread(create_app(model, api_key=KEY, model_name="m")) as s, httpx.Client(timeout=60) as client:
        s.client = client                                   # one client: a new one per request costs ~50 ms
        for path, body in BASE.items():                     # warm up (compiles the programs)
            assert post(s, path, body).status_code == 200, path
        yield s


def post(server, path: str, body, **changes) -> httpx.Response:
    if isinstance(body, dict):
        body = with_changes(body, changes)
    content = body if isinstance(body, bytes) else None
    return server.client.post(server.url + path, json=None if content is not None else body, content=content,
                              headers=HEADERS)


def with_changes(body: dict, changes: dict) -> dict:
    """``body`` with dotted fields set (``thinking.budget_tokens``, ``messages.0.content``)."""
    out = copy.deepcopy(body)
    for dotted, value in changes.items():
        *head, last = dotted.split(".")
        at = out
        for part in head:
            at = at[int(part)] if isinstance(at, list) else at.setdefault(part, {})
        if isinstance(at, list):
            at[int(last)] = value
        else:
            at[last] = value
    return out


def assert_error(r: httpx.Response, path: str, field: str):
    """A 400 in the error schema of ``path``'s API whose message names ``field``."""
    assert r.status_code == 400, (path, field, r.status_code, r.text)
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] == "invalid_request_error", body
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["type"] == "invalid_request_error", body
    message = body["error"]["message"]
    assert field in message, (field, message)
    return message


def bad_ints(lo: int, hi: int) -> list:
    """Values an integer field in lo..hi must refuse: past each end, and of other JSON types."""
    return [v for v in (lo - 1, hi + 1, 2**31, 2**63, 2**64, -1, -(2**63) - 1) if not lo <= v <= hi] + [
        float(lo), True, str(lo), [lo]]


INT_FIELDS = [     # (path, field, lo, hi, extra changes for a valid request)
    (CHAT, "max_tokens", 1, I32, {}), (CHAT, "max_completion_tokens", 1, I32, {}), (CHAT, "n", 1, 16, {}),
    (CHAT, "top_k", -1, I32, {}), (CHAT, "seed", -(2**63), I64, {}), (CHAT, "thinking_budget", 1, I32, {}),
    (CHAT, "top_logprobs", 0, 20, {"logprobs": True}),
    (COMPLETIONS, "max_tokens", 0, I32, {"echo": True}), (COMPLETIONS, "n", 1, 16, {}),
    (COMPLETIONS, "top_k", -1, I32, {}), (COMPLETIONS, "seed", -(2**63), I64, {}),
    (COMPLETIONS, "logprobs", 0, 20, {}), (COMPLETIONS, "prompt.0", 0, I32, {"prompt": [0]}),
    (COMPLETIONS, "prompt.0.0", 0, I32, {"prompt": [[0]]}),
    (RESPONSES, "max_output_tokens", 1, I32, {}),
    (RESPONSES, "top_logprobs", 0, 20, {"include": ["message.output_text.logprobs"]}),
    (MESSAGES, "max_tokens", 1, I32, {}), (MESSAGES, "top_k", 0, I32, {}),
    (MESSAGES, "thinking.budget_tokens", 1, I32, {"thinking": {"type": "enabled"}}),
    (COUNT, "thinking.budget_tokens", 1, I32, {"thinking": {"type": "enabled"}}),
    (DETOKENIZE, "tokens.0", 0, I32, {}),
]
FLOAT_FIELDS = [   # (path, field, bad values, valid boundary values)
    (CHAT, "temperature", [-0.01, 2.01, "1", True, None], [0, 2, 0.5]),
    (CHAT, "top_p", [0, -1, 1.01, "1", False], [1e-9, 1]),
    (COMPLETIONS, "temperature", [-1, 3, "0.5"], [0, 2]), (COMPLETIONS, "top_p", [0, 2, True], [1]),
    (RESPONSES, "temperature", [-1, 2.5, "1", True], [0, 2]), (RESPONSES, "top_p", [0, 1.5, "1"], [0.5, 1]),
    (MESSAGES, "temperature", [-0.5, 1.01, "1", True], [0, 1]), (MESSAGES, "top_p", [0, 1.2, [1]], [1]),
]


def field_name(field: str) -> str:
    """How a dotted test field reads in the error message (``prompt.0.0`` -> ``prompt[0][0]``)."""
    head, *rest = field.split(".")
    return head + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in rest)


def _int_cases():
    for path, field, lo, hi, extra in INT_FIELDS:
        for value in bad_ints(lo, hi):
            if field == "prompt.0" and isinstance(value, (str, list)):
                continue                    # ["1"] and [[1]] are prompts too
            yield pytest.param(path, field, value, extra, id=f"{path}:{field}={value!r}"[:80])


@pytest.mark.parametrize("path, field, value, extra", list(_int_cases()))
def test_an_integer_out_of_range_or_of_another_type_is_a_400(server, path, field, value, extra):
    body = with_changes(BASE[path], extra)
    assert_error(post(server, path, body, **{field: value}), path, field_name(field))


@pytest.mark.parametrize("path, field, lo, hi, extra", [pytest.param(*c, id=f"{c[0]}:{c[1]}") for c in INT_FIELDS])
def test_integer_boundaries_are_served(server, path, field, lo, hi, extra):
    body = with_changes(BASE[path], extra)
    for value in (lo, hi):
        r = post(server, path, body, **{field: value})
        if field.startswith(("prompt", "tokens")) and value == hi:      # past the vocabulary: the service's 400
            assert "vocabulary" in assert_error(r, path, field_name(field)[:9])
        elif (path, field, value) == (CHAT, "n", 16) or (path, field, value) == (COMPLETIONS, "n", 16):
            assert r.status_code == 200 and len(r.json()["choices"]) == 16, r.text
        else:
            assert r.status_code == 200, (field, value, r.text)


@pytest.mark.parametrize("path, field, bad, good", [pytest.param(*c, id=f"{c[0]}:{c[1]}") for c in FLOAT_FIELDS])
def test_float_bounds_and_types(server, path, field, bad, good):
    for value in bad:
        assert_error(post(server, path, BASE[path], **{field: value}), path, field)
    for literal in ("1e309", "-1e309", "NaN", "Infinity"):                  # no finite float
        raw = json.dumps({**BASE[path], field: "?"}).replace('"?"', literal).encode()
        assert "finite" in assert_error(post(server, path, raw), path, field)
    for value in good:
        assert post(server, path, BASE[path], **{field: value}).status_code == 200, (field, value)


def test_loose_coercions_are_refused(server):
    """The tester's finds: ``prompt: [false]`` and ``n: 1.0`` used to be accepted."""
    cases = [(COMPLETIONS, {"prompt": [False]}, "prompt[0]"), (COMPLETIONS, {"prompt": [[1, True]]}, "prompt[0][1]"),
             (COMPLETIONS, {"prompt": [1, "a"]}, "prompt[1]"), (COMPLETIONS, {"prompt": 5}, "prompt"),
             (COMPLETIONS, {"prompt": None}, "prompt"), (CHAT, {"n": 1.0}, "n"), (CHAT, {"stream": 1}, "stream"),
             (CHAT, {"temperature": "0.5"}, "temperature"), (CHAT, {"model": 5}, "model"),
             (CHAT, {"stop": [1]}, "stop"), (CHAT, {"logprobs": "true"}, "logprobs"),
             (CHAT, {"messages": [5]}, "messages[0]"),
             (CHAT, {"messages": [*USER, {"role": "assistant", "content": "x", "tool_calls": 5}]},
              "messages[1].tool_calls"),
             (CHAT, {"tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
             (RESPONSES, {"max_output_tokens": 4.0}, "max_output_tokens"), (RESPONSES, {"input": 5}, "input"),
             (RESPONSES, {"stream": "yes"}, "stream"), (RESPONSES, {"metadata": {"a": 1}}, "metadata.a"),
             (RESPONSES, {"tool_choice": {"type": "function", "name": ["f"]}}, "tool_choice"),
             (RESPONSES, {"input": [{"type": "reasoning", "summary": 5}]}, "input[0].summary"),
             (RESPONSES, {"input": [{"type": "function_call", "name": 5, "call_id": "c", "arguments": "{}"}]},
              "input[0]: a function_call needs"),
             (RESPONSES, {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": "yes"}}},
              "text.format: strict: expected a boolean"),
             (CHAT, {"messages": [*USER, {"role": "tool", "tool_call_id": 5, "content": "x"}]},
              "messages[1].tool_call_id"),
             (CHAT, {"messages": [{"role": "assistant", "content": "x", "reasoning_content": ["r"]}, *USER]},
              "messages[0].reasoning_content"),
             (MESSAGES, {"max_tokens": True}, "max_tokens"), (MESSAGES, {"max_tokens": 4.0}, "max_tokens"),
             (MESSAGES, {"stop_sequences": "END"}, "stop_sequences"), (MESSAGES, {"stream": 0}, "stream"),
             (MESSAGES, {"system": 5}, "system"), (COUNT, {"model": 5}, "model"),
             (TOKENIZE, {"prompt": 5}, "prompt"), (TOKENIZE, {"add_special_tokens": "no"}, "add_special_tokens"),
             (DETOKENIZE, {"tokens": [True]}, "tokens[0]"), (DETOKENIZE, {"tokens": [1.0]}, "tokens[0]"),
             (DETOKENIZE, {"tokens": ["1"]}, "tokens[0]")]
    for path, changes, field in cases:
        message = assert_error(post(server, path, BASE[path], **changes), path, field)
        assert message.startswith(field), message


def test_a_body_that_is_no_json_object_is_a_400(server):
    for path in BASE:
        for raw in (b"", b"{", b"[1, 2]", b'"text"', b"\xff\xfe", b"NaN", b"[" * 5000):
            r = post(server, path, raw)
            assert_error(r, path, "body" if raw in (b"[1, 2]", b'"text"', b"NaN") else "JSON")


def test_unimplemented_sampling_fields_are_accepted_only_when_neutral(server):
    for path in (CHAT, COMPLETIONS):
        for field, neutral, others in (("presence_penalty", 0, [0.5, -2, 2]), ("frequency_penalty", 0.0, [1, -0.1]),
                                       ("repetition_penalty", 1, [1.1, 0.5])):
            assert post(server, path, BASE[path], **{field: neutral}).status_code == 200
            assert post(server, path, BASE[path], **{field: None}).status_code == 200
            for value in others:
                assert "not supported by this server" in assert_error(post(server, path, BASE[path],
                                                                           **{field: value}), path, field)
        for bad in (3, -2.5, "0", True):
            assert_error(post(server, path, BASE[path], presence_penalty=bad), path, "presence_penalty")
        assert_error(post(server, path, BASE[path], repetition_penalty=0), path, "repetition_penalty")
        assert post(server, path, BASE[path], logit_bias={}).status_code == 200
        assert "not supported" in assert_error(post(server, path, BASE[path], logit_bias={"5": 10}), path,
                                               "logit_bias")
        for bias, where in (({"abc": 1}, "logit_bias.abc"), ({"-1": 1}, "logit_bias.-1"),
                            ({str(2**31): 1}, "logit_bias"), ({"5": 101}, "logit_bias.5"),
                            ({"5": "1"}, "logit_bias.5"), ([5], "logit_bias")):
            assert_error(post(server, path, BASE[path], logit_bias=bias), path, where)
    assert post(server, COMPLETIONS, BASE[COMPLETIONS], best_of=2, n=2).status_code == 200
    assert "not supported" in assert_error(post(server, COMPLETIONS, BASE[COMPLETIONS], best_of=3), COMPLETIONS,
                                           "best_of")


@pytest.mark.parametrize("path", [MESSAGES, COUNT])
def test_anthropic_empty_content_is_a_400(server, path):
    assistant = lambda content: {"role": "assistant", "content": content}   # noqa: E731
    user = lambda content: {"role": "user", "content": content}             # noqa: E731
    cases = [([user("")], "messages[0].content: empty"), ([user([])], "messages[0].content: empty"),
             ([user("hi"), assistant(""), user("again")], "messages[1].content: empty"),
             ([user("hi"), assistant([]), user("again")], "messages[1].content: empty"),
             ([user([{"type": "text", "text": ""}])], "messages[0].content[0].text: text content blocks must be non"),
             ([user("hi"), assistant([{"type": "text", "text": ""}])], "messages[1].content[0].text"),
             ([user([{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": ""}]}])],
              "messages[0].content[0].content[0].text")]
    for messages, where in cases:
        message = assert_error(post(server, path, BASE[path], messages=messages), path, where)
        assert message.startswith(where), message
    message = assert_error(post(server, path, BASE[path], system=[{"type": "text", "text": ""}]), path, "system[0]")
    assert "non-empty" in message
    for final in ("", []):          # a final assistant message may be empty (it prefills nothing)
        r = post(server, path, BASE[path], messages=[user(say(0)), assistant(final)])
        assert r.status_code == 200, r.text


BAD_SCHEMAS = [{"type": "strin"}, {"type": "object", "properties": []}, {"type": "object", "required": "city"},
               {"pattern": "("}, {"$schema": 5}, 5, "object", [OBJECT]]


def test_tool_schemas_that_are_no_json_schema_are_a_400_naming_the_tool(server):
    def fn(schema):
        return {"type": "function", "function": {"name": "get_weather", "parameters": schema}}

    for schema in BAD_SCHEMAS:
        for path, changes, where in (
                (CHAT, {"tools": [fn(schema)]}, "tools[0].function.parameters"),
                (TOKENIZE, {"messages": USER, "prompt": None, "tools": [fn(schema)]}, "tools[0].function.parameters"),
                (RESPONSES, {"tools": [{"type": "function", "name": "get_weather", "parameters": schema}]},
                 "tools[0].parameters"),
                (RESPONSES, {"tools": [{"type": "namespace", "name": "ns", "tools": [
                    {"type": "function", "name": "get_weather", "parameters": schema}]}]},
                 "tools[0].tools[0].parameters"),
                (MESSAGES, {"tools": [{"name": "get_weather", "input_schema": schema}]}, "tools[0].input_schema"),
                (COUNT, {"tools": [{"name": "get_weather", "input_schema": schema}]}, "tools[0].input_schema")):
            message = assert_error(post(server, path, BASE[path], **changes), path, where)
            assert message.startswith(where), message
            if isinstance(schema, dict):
                assert "'get_weather'" in message, message
    for schema in ({"type": "array"}, {"properties": {}}, {}):    # valid JSON Schemas, but no object schema
        for path in (MESSAGES, COUNT):
            message = assert_error(post(server, path, BASE[path], tools=[{"name": "t", "input_schema": schema}]),
                                   path, "tools[0].input_schema: tool 't'")
            assert '"type": "object"' in message
    server_tool = {"type": "web_search_20250305", "name": "web_search", "input_schema": {"type": "junk"}}
    assert post(server, MESSAGES, BASE[MESSAGES], tools=[server_tool]).status_code == 200   # not ours to check
    assert post(server, CHAT, BASE[CHAT], tools=[fn(OBJECT)]).status_code == 200
    assert post(server, CHAT, BASE[CHAT], tools=[fn({})]).status_code == 200
    assert post(server, RESPONSES, BASE[RESPONSES], tools=[{"type": "function", "name": "f",
                                                             "parameters": OBJECT}]).status_code == 200
    assert post(server, MESSAGES, BASE[MESSAGES], tools=[{"name": "f", "input_schema": OBJECT}]).status_code == 200


def test_the_server_still_serves(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    for path, body in BASE.items():
        assert post(server, path, body).status_code == 200, path


def test_tool_names_follow_the_real_apis_pattern(server):
    """Letters, digits, _ and -: at most 64 (OpenAI) or 128 (Anthropic); a name with "<", ">", "=", a
    space or a newline would break the tool-call format the model writes."""
    def openai_tools(name):
        return {CHAT: {"tools": [{"type": "function", "function": {"name": name, "parameters": OBJECT}}]},
                RESPONSES: {"tools": [{"type": "function", "name": name, "parameters": OBJECT}]}}

    def anthropic_tools(name):
        return {path: {"tools": [{"name": name, "input_schema": OBJECT}]} for path in (MESSAGES, COUNT)}

    for name in ("a<b>", "get weather", "f\n", "a=b", "x" * 65, "ünï", ""):
        for path, changes in openai_tools(name).items():
            where = "tools[0].function.name" if path == CHAT else "tools[0].name"
            assert assert_error(post(server, path, BASE[path], **changes), path, where).startswith(where)
    for name in ("a<b>", "x" * 129, "a.b", ""):
        for path, changes in anthropic_tools(name).items():
            assert_error(post(server, path, BASE[path], **changes), path, "tools[0].name")
    for path, changes in {**openai_tools("get_Weather-2" + "x" * 51), **anthropic_tools("t" * 128)}.items():
        assert post(server, path, BASE[path], **changes).status_code == 200, path
