"""A seeded fuzz of every endpoint's request body (hypothesis, ``derandomize``): no request may get a
5xx, hang, or answer a 4xx outside its API's error schema, and the server serves on afterwards.

Each example is one POST to a live server (the scripted tiny model, a short context so any answer
is short): mostly a valid body of that endpoint with one to three mutations (a known field, nested
or not, set to an arbitrary JSON value: huge and negative integers, floats, booleans, null,
strings empty or long and unicode, lists, objects; a field dropped; an unknown field added), else
a random JSON body or bytes that are no JSON. Asserted per example: a status below 500, an answer
within ``TIMEOUT_S``, a 4xx body in the endpoint's error schema (OpenAI's ``{"error": {message,
type, param, code}}``, Anthropic's ``{"type": "error", "error": {type, message}}``), and no
in-band error event in a 200 stream. ``test_zz_summary`` checks every endpoint still answers a
normal request and prints the examples run and the status histogram (``pytest -s`` shows it).
"""

from __future__ import annotations

import collections
import copy
import json
import time

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.server_helpers import QWEN_TEMPLATE, say, scripted_model
from zoo.server.app import ServerThread, create_app

KEY = "fuzz-key"
HEADERS = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY, "anthropic-version": "2023-06-01",
           "content-type": "application/json"}
TIMEOUT_S = 30                 # an answer slower than this is a hang
EXAMPLES = {"/v1/chat/completions": 70, "/v1/completions": 80, "/v1/responses": 70, "/v1/messages": 80,
            "/v1/messages/count_tokens": 120, "/tokenize": 120, "/detokenize": 100}    # examples per endpoint
CONTEXT = 256                  # the model's context: every generation is short
SCRIPTS = ["Hi.",
           "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"]
OBJECT = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
FUNCTION = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": OBJECT}}
CHAT_HISTORY = [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "user", "content": [{"type": "text", "text": say(0)}]}]
ANTHROPIC_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                                      {"type": "text", "text": "Checking."},
                                      {"type": "tool_use", "id": "t1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text",
                                                                                          "text": "sunny"}]},
                                 {"type": "text", "text": say(0), "cache_control": {"type": "ephemeral"}}]}]
ANTHROPIC = {"model": "m", "system": [{"type": "text", "text": "Be brief."}], "messages": ANTHROPIC_HISTORY,
             "tools": [{"name": "get_weather", "description": "Weather", "input_schema": OBJECT}],
             "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 16},
             "output_config": {"effort": "low"}, "metadata": {"user_id": "u"}}
RESPONSES_INPUT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Look it up."}]},
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": say(0)}]}]
BASES = {      # valid bodies per endpoint, each mutated by the examples
    "/v1/chat/completions": [
        {"model": "m", "messages": CHAT_HISTORY, "tools": [FUNCTION], "tool_choice": "auto", "max_tokens": 8,
         "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 7, "stop": ["END"], "reasoning_effort": "low",
         "chat_template_kwargs": {"enable_thinking": False}, "parallel_tool_calls": True},
        {"model": "m", "messages": [{"role": "user", "content": say(1)}], "tools": [FUNCTION], "max_tokens": 40,
         "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2, "n": 2},
        {"model": "m", "messages": [{"role": "user", "content": say(0)}], "max_completion_tokens": 8,
         "thinking_budget": 4, "response_format": {"type": "json_schema", "json_schema": {
             "name": "w", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}}],
    "/v1/completions": [
        {"model": "m", "prompt": say(0), "max_tokens": 8, "logprobs": 2, "echo": True, "seed": 3, "stop": "END"},
        {"model": "m", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4, "n": 2, "temperature": 0},
        {"model": "m", "prompt": say(0), "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
         "guided_regex": "[a-z]+"}],
    "/v1/responses": [
        {"model": "m", "instructions": "Be brief.", "input": RESPONSES_INPUT, "max_output_tokens": 8,
         "tools": [{"type": "function", "name": "get_weather", "parameters": OBJECT}], "tool_choice": "auto",
         "reasoning": {"effort": "low", "summary": "auto"}, "text": {"format": {"type": "text"}},
         "metadata": {"k": "v"}, "include": ["message.output_text.logprobs"], "top_logprobs": 1},
        {"model": "m", "input": say(1), "stream": True, "max_output_tokens": 40, "store": False,
         "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "get_weather",
                                                                   "parameters": OBJECT}]}]}],
    "/v1/messages": [
        {**ANTHROPIC, "max_tokens": 8, "stop_sequences": ["END"], "temperature": 0.5, "top_k": 5},
        {"model": "m", "max_tokens": 40, "stream": True, "messages": [{"role": "user", "content": say(1)}],
         "tools": ANTHROPIC["tools"], "tool_choice": {"type": "any"}}],
    "/v1/messages/count_tokens": [ANTHROPIC],
    "/tokenize": [
        {"model": "m", "prompt": "Hello, zoo", "add_special_tokens": True, "return_token_strs": True},
        {"model": "m", "messages": CHAT_HISTORY, "tools": [FUNCTION], "add_generation_prompt": True,
         "chat_template_kwargs": {"enable_thinking": True}}],
    "/detokenize": [{"model": "m", "tokens": [1, 2, 3, 4]}],
}
EXTRA_FIELDS = {   # known fields the bases leave out, for the mutations to set
    "/v1/chat/completions": ["n", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
                             "logit_bias", "structured_outputs", "guided_json", "guided_regex", "guided_grammar",
                             "guided_choice", "prompt_cache_key", "max_completion_tokens", "thinking_budget"],
    "/v1/completions": ["suffix", "best_of", "top_p", "top_k", "presence_penalty", "logit_bias", "response_format",
                        "guided_json", "guided_choice", "structured_outputs"],
    "/v1/responses": ["previous_response_id", "background", "conversation", "parallel_tool_calls", "temperature",
                      "top_p", "prompt_cache_key"],
    "/v1/messages": ["cache_control", "context_management", "stream", "top_p"],
    "/v1/messages/count_tokens": ["cache_control", "context_management", "system"],
    "/tokenize": ["prompt", "messages", "add_special_tokens", "tools"],
    "/detokenize": [],
}
INTERESTING = [0, 1, -1, 2, 16, 17, 20, 21, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**40,
               1.0, 0.5, -0.0, 2.5, 1e-300, 1e300, True, False, None, "", " ", "5", "1.0", "true", "x" * 3000,
               "\u2603\u00e9\U0001f600" * 200, "\x00", "<|im_end|>", "</think>", "<tool_call>", say(0), say(1),
               [], {}, [False], [0], [-1], [[]], [[1, 2]], [""], ["a", 1], [None],
               "user", "assistant", "system", "developer", "tool", "function", "auto", "any", "none", "required",
               "text", "json_object", "json_schema", "enabled", "adaptive", "disabled", "low", "high", "omitted",
               "tool_use", "tool_result", "tool_reference", "thinking", "image", "message", "function_call",
               "function_call_output", "reasoning", "input_text", "namespace", "custom", "ephemeral",
               {"type": "object"}, {"type": "string"}, {"type": "text", "text": ""}, {"type": "text", "text": "hi"},
               {"type": "function", "function": {"name": "get_weather"}}, {"type": "function", "name": "get_weather"},
               {"type": "tool", "name": "get_weather"}, {"type": "json_schema", "json_schema": {"schema": 5}},
               {"type": "object", "properties": {"city": True}}, {"properties": {"city": {"type": "strin"}}},
               {"role": "user", "content": ""}, {"role": "assistant", "content": []}, {"json": {"type": "integer"}}]

COUNTS: collections.Counter = collections.Counter()     # (endpoint, status) -> examples
SLOWEST: dict[str, float] = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = scripted_model(tmp_path_factory.mktemp("fuzz-ckpt"), QWEN_TEMPLATE, SCRIPTS, context=CONTEXT)
    app = create_app(model, api_key=KEY, model_name="m", keepalive_s=1.0)
    with ServerThread(app) as s, httpx.Client(timeout=TIMEOUT_S) as client:
        s.client = client
        for path, bodies in BASES.items():                  # warm up, and every base is valid
            for body in bodies:
                r = client.post(s.url + path, json=body, headers=HEADERS)
                assert r.status_code == 200 and not in_band_error(r), (path, body, r.text)
        yield s


# -- values and mutations ------------------------------------------------------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=40), st.sampled_from(INTERESTING))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
WORDS = [w for w in INTERESTING if isinstance(w, str) and len(w) < 40]


def like(value):
    """Values of the same JSON type as ``value`` (so a mutation often stays valid and gets deeper)."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.one_of(st.integers(-2, 40), st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**63 - 1, -(2**63)]),
                         st.integers())
    if isinstance(value, float):
        return st.one_of(st.floats(0, 2), st.floats(allow_nan=False, allow_infinity=False))
    if isinstance(value, str):
        return st.one_of(st.text(max_size=60), st.sampled_from(WORDS), st.text(min_size=500, max_size=2000))
    if isinstance(value, list):
        return st.one_of(st.just([]), st.lists(st.sampled_from(value), max_size=6) if value else st.just([]),
                         st.lists(json_values, max_size=3))
    return st.one_of(st.just({}), st.dictionaries(st.text(max_size=12), json_values, max_size=3))


NOT_JSON = [b"", b"{", b"}", b"nul", b'{"model": "m",}', b"\xff\xfe\x00", b"[" * 3000, b'{"a": ' * 3000,
            b"NaN", b"Infinity", b'{"max_tokens": NaN}', b'{"temperature": Infinity, "max_tokens": 4}',
            b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}', b"\x00" * 64]


def field_paths(body, prefix=()) -> list[tuple]:
    """Every nested field of ``body``: dict keys and list indices."""
    out = []
    items = body.items() if isinstance(body, dict) else enumerate(body) if isinstance(body, list) else []
    for key, value in items:
        out.append(prefix + (key,))
        out += field_paths(value, prefix + (key,))
    return out


def set_path(body, path: tuple, value):
    """Set ``body[path]``, making (or replacing with) containers on the way; an index past a list's
    end appends."""
    at = body
    for i, key in enumerate(path):
        last = i == len(path) - 1
        new = value if last else [] if isinstance(path[i + 1], int) else {}
        if isinstance(at, list):
            if not (isinstance(key, int) and key < len(at)):
                at.append(new)
                key = len(at) - 1
            elif last or not isinstance(at[key], (dict, list)):
                at[key] = new
        else:
            key = str(key)
            if last or not isinstance(at.get(key), (dict, list)):
                at[key] = new
        at = at[key]


def get_path(body, path: tuple):
    for key in path:
        body = body[key]
    return body


def drop_path(body, path: tuple):
    at = body
    for key in path[:-1]:
        try:
            at = at[key]
        except (KeyError, IndexError, TypeError):
            return
    if isinstance(at, dict):
        at.pop(path[-1], None)
    elif isinstance(at, list) and isinstance(path[-1], int) and path[-1] < len(at):
        del at[path[-1]]


@st.composite
def request_bodies(draw, endpoint: str) -> bytes:
    kind = draw(st.sampled_from(["mutate"] * 16 + ["json", "json", "bytes", "not-json"]))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "not-json":
        return draw(st.sampled_from(NOT_JSON))
    body = copy.deepcopy(draw(st.sampled_from(BASES[endpoint])))
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        op = draw(st.sampled_from(["set"] * 6 + ["drop", "drop", "extra"]))
        paths = field_paths(body) + [(f,) for f in EXTRA_FIELDS[endpoint]]
        if op == "extra":
            where = draw(st.sampled_from([()] + [p for p in field_paths(body) if isinstance(get_path(body, p), dict)]))
            set_path(body, where + (draw(st.sampled_from(["zzz_unknown", "x-extra", ""])),),
                     copy.deepcopy(draw(json_values)))
        elif not paths:
            break
        elif op == "drop":
            drop_path(body, draw(st.sampled_from(paths)))
        else:
            path = draw(st.sampled_from(paths))
            try:
                old = get_path(body, path)
            except (KeyError, IndexError, TypeError):
                old = None
            values = [like(old)] * (old is not None) + [st.sampled_from(INTERESTING), json_values]
            value = draw(st.one_of(values))
            set_path(body, path, copy.deepcopy(value))      # (the constants stay as they are)
    return json.dumps(body).encode()


# -- the checks ----------------------------------------------------------------------------------------
def sse_data(text: str) -> list[tuple[str | None, object]]:
    """(event name, parsed data) of each SSE event in a response body."""
    out, name = [], None
    for line in text.replace("\r\n", "\n").split("\n"):      # SSE lines (not str.splitlines: U+2028 is text)
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: ") and line[6:] != "[DONE]":
            out.append((name, json.loads(line[6:])))
    return out


def in_band_error(r: httpx.Response) -> bool:
    """A 200 stream that carries an error event (a generation that failed after the headers)."""
    if not r.headers.get("content-type", "").startswith("text/event-stream"):
        return False
    return any(name in ("error", "response.failed") or (isinstance(data, dict) and (
        "error" in data and name is None or data.get("type") == "error")) for name, data in sse_data(r.text))


def check_error_schema(endpoint: str, r: httpx.Response) -> None:
    body = r.json()
    if endpoint.startswith("/v1/messages"):
        assert isinstance(body, dict) and body.get("type") == "error", body
        assert set(body["error"]) == {"type", "message"} and isinstance(body["error"]["message"], str), body
    else:
        assert isinstance(body, dict) and set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), body
        assert error["param"] is None or isinstance(error["param"], str), body


def send(server, endpoint: str, raw: bytes) -> httpx.Response:
    start = time.monotonic()
    try:
        r = server.client.post(server.url + endpoint, content=raw, headers=HEADERS)
    except httpx.TimeoutException:
        COUNTS[endpoint, "hang"] += 1
        pytest.fail(f"{endpoint}: no answer within {TIMEOUT_S} s to {raw[:2000]!r}")
    except httpx.TransportError as e:                    # e.g. a stream cut off without its end
        COUNTS[endpoint, "broken"] += 1
        pytest.fail(f"{endpoint}: {type(e).__name__}: {e} for {raw[:2000]!r}")
    took = time.monotonic() - start
    SLOWEST[endpoint] = max(SLOWEST.get(endpoint, 0.0), took)
    if took > 5:
        print(f"slow: {took:.1f} s for {endpoint} {r.status_code} {raw[:300]!r}")
    error = r.status_code == 200 and in_band_error(r)
    COUNTS[endpoint, "200+error" if error else r.status_code] += 1
    assert r.status_code < 500 and not error, f"{endpoint}: {r.status_code} for {raw[:2000]!r}: {r.text[:2000]}"
    if r.status_code >= 400:
        check_error_schema(endpoint, r)
    return r


def fuzz(endpoint: str):
    @settings(derandomize=True, max_examples=EXAMPLES[endpoint], deadline=None, database=None, print_blob=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                                     HealthCheck.function_scoped_fixture])
    @given(raw=request_bodies(endpoint))
    def test(server, raw):
        send(server, endpoint, raw)
    test.__name__ = f"test_fuzz_{endpoint.strip('/').replace('/', '_')}"
    return test


test_fuzz_chat = fuzz("/v1/chat/completions")
test_fuzz_completions = fuzz("/v1/completions")
test_fuzz_responses = fuzz("/v1/responses")
test_fuzz_messages = fuzz("/v1/messages")
test_fuzz_count_tokens = fuzz("/v1/messages/count_tokens")
test_fuzz_tokenize = fuzz("/tokenize")
test_fuzz_detokenize = fuzz("/detokenize")


def test_zz_summary(server):
    """After the fuzz every endpoint serves a normal request; the counts, for the record."""
    assert server.client.get(server.url + "/health").json()["status"] == "ok"
    for endpoint, bodies in BASES.items():
        r = server.client.post(server.url + endpoint, json=bodies[0], headers=HEADERS)
        assert r.status_code == 200 and not in_band_error(r), (endpoint, r.text)
    endpoints = list(BASES)
    print(f"\nfuzz: {sum(COUNTS.values())} examples")
    for endpoint in endpoints:
        statuses = {k[1]: v for k, v in COUNTS.items() if k[0] == endpoint}
        histogram = ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items(), key=lambda x: str(x[0])))
        print(f"  {endpoint:28s} {sum(statuses.values()):4d} examples  ({histogram}); slowest "
              f"{SLOWEST.get(endpoint, 0):.2f} s")
    assert not [k for k in COUNTS if k[1] in ("hang", "broken", "200+error") or (isinstance(k[1], int) and k[1] >= 500)]
