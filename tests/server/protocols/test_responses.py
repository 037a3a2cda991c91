"""The OpenAI Responses surface of ``zoo serve`` (``/v1/responses``), driven by the official ``openai``
SDK (``client.responses``) and read off the wire over real HTTP on 127.0.0.1, against the tiny model
with a Qwen3.x-style chat template (scripted answers: reasoning, text, Qwen-format tool calls)."""

from __future__ import annotations

import json

import httpx2 as httpx
import openai
import pytest

from tests.support.server_helpers import QWEN_TEMPLATE, say, scripted_model, sse_events
from zoo.server.app import ServerThread, create_app

KEY = "responses-key"
SCRIPTS = [
    "The user greets me.\n</think>\n\nHello! The answer is 42.",
    "I need the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=spawn_agent>\n<parameter=task>\nlook\n</parameter>\n</function>\n</tool_call>"
    "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
    "alpha beta gamma delta",
]
REASON, TOOL, NAMED, TWO_CALLS, PLAIN = range(5)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
AGENTS = {"type": "namespace", "name": "multi_agent", "description": "sub-agents", "tools": [
    {"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {
        "task": {"type": "string"}}}}]}
HOSTED = {"type": "web_search", "external_web_access": False}
MAX = 200


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = scripted_model(tmp_path_factory.mktemp("responses-ckpt"), QWEN_TEMPLATE, SCRIPTS)
    app = create_app(model, api_key=KEY, keepalive_s=0.1, model_name="tiny", default_max_tokens=MAX)
    with ServerThread(app) as s:
        s.tokenizer, s.app = model.tokenizer, app
        client(s).responses.create(model="tiny", input=say(REASON))      # warm up
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def wire_events(server, body: dict) -> list[tuple[str, dict]]:
    """A streaming request read off the wire: [(SSE event name, data)]."""
    return sse_events(server.url + "/v1/responses", body, {"Authorization": f"Bearer {KEY}"})


def items(response) -> list[tuple]:
    out = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", [c.text for c in item.content], [s.text for s in item.summary]))
        elif item.type == "message":
            out.append(("message", [c.text for c in item.content]))
        else:
            out.append(("function_call", item.name, json.loads(item.arguments), item.namespace))
    return out


def test_reasoning_and_text(server):
    r = client(server).responses.create(model="tiny", input=say(REASON), reasoning={"effort": "high",
                                                                                    "summary": "auto"})
    assert items(r) == [("reasoning", ["The user greets me."], ["The user greets me."]),
                        ("message", ["Hello! The answer is 42."])]
    assert r.status == "completed" and r.output_text == "Hello! The answer is 42." and r.model == "tiny"
    assert r.id.startswith("resp_") and r.output[1].status == "completed" and r.output[1].role == "assistant"
    assert r.usage.output_tokens == len(server.tokenizer.encode(SCRIPTS[REASON]))
    assert r.usage.output_tokens_details.reasoning_tokens == len(server.tokenizer.encode("The user greets me."))
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    plain = client(server).responses.create(model="tiny", input=say(REASON))
    assert items(plain)[0] == ("reasoning", ["The user greets me."], [])          # no summary asked for
    assert client(server).responses.retrieve(r.id).output_text == r.output_text   # stored (store defaults on)


def test_stream_sends_the_named_events_in_order(server):
    body = {"model": "tiny", "input": say(REASON), "reasoning": {"summary": "detailed"}}
    events = wire_events(server, body)
    assert all(name == data["type"] for name, data in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    names = [n for n, _ in events]
    assert [n for n in names if not n.endswith(".delta")] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_summary_part.added", "response.reasoning_text.done",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.completed"]
    between = lambda first, last: names[names.index(first) + 1:names.index(last)]       # noqa: E731
    thinking = between("response.reasoning_summary_part.added", "response.reasoning_text.done")
    assert thinking and thinking == ["response.reasoning_text.delta", "response.reasoning_summary_text.delta"] * (
        len(thinking) // 2)
    answer = between("response.content_part.added", "response.output_text.done")
    assert answer and set(answer) == {"response.output_text.delta"}
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    reasoning = "".join(d["delta"] for n, d in events if n == "response.reasoning_text.delta")
    assert (reasoning, text) == ("The user greets me.", "Hello! The answer is 42.")
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] > 0
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    with client(server).responses.stream(**body) as stream:          # the SDK assembles the same response
        sdk = stream.get_final_response()
    assert items(sdk) == [("reasoning", ["The user greets me."], ["The user greets me."]),
                          ("message", ["Hello! The answer is 42."])]


def test_function_tool_and_previous_response_id(server):
    c = client(server)
    r = c.responses.create(model="tiny", input=say(TOOL), tools=[WEATHER, HOSTED])      # the hosted tool: left out
    assert items(r) == [("reasoning", ["I need the weather."], []),
                        ("function_call", "get_weather", {"city": "Paris", "days": 3}, None)]
    call = r.output[1]
    assert call.call_id.startswith("call_") and call.status == "completed" and r.status == "completed"
    events = wire_events(server, {"model": "tiny", "input": say(TOOL), "tools": [WEATHER]})
    deltas = [d["delta"] for n, d in events if n == "response.function_call_arguments.delta"]
    done = next(d for n, d in events if n == "response.function_call_arguments.done")
    assert len(deltas) > 1 and json.loads("".join(deltas)) == {"city": "Paris", "days": 3}
    assert done["arguments"] == "".join(deltas) and done["name"] == "get_weather"
    follow = c.responses.create(model="tiny", previous_response_id=r.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        {"role": "user", "content": say(REASON)}])
    assert follow.output_text == "Hello! The answer is 42." and follow.previous_response_id == r.id
    fresh = c.responses.create(model="tiny", tools=[WEATHER], input=say(REASON))
    assert follow.usage.input_tokens > fresh.usage.input_tokens + 20           # the stored history came first
    unstored = c.responses.create(model="tiny", input=say(REASON), store=False)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model="tiny", previous_response_id=unstored.id, input="again")
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"


def test_a_long_chain_tokenizes_only_what_each_turn_adds(server):
    """40 turns by ``previous_response_id``: each prompt is the whole conversation rendered, and its
    ids are those of tokenizing it whole, yet each turn tokenizes about what it added (the previous
    turn's tokens are reused up to where the texts differ). The prefix cache's side:
    ``tests/server/test_prefix_cache.py``."""
    c, tok = client(server), server.tokenizer
    store = server.app.state.responses
    prev, tokenized, last = None, [], None
    for _ in range(40):
        before = tok.chars_encoded
        last = c.responses.create(model="tiny", input=say(PLAIN), previous_response_id=prev)
        tokenized.append(tok.chars_encoded - before)
        prev = last.id
        prompt = store.get(last.id).prompt
        assert (prompt.ids, prompt.ends) == tok.encode_with_ends(prompt.text)
    turn = store.get(last.id)
    assert turn.depth == 39 and len(turn.conversation()) == 80
    assert turn.parent.prompt is None                   # only the chain's latest turn keeps its prompt
    assert len(turn.prompt.text) > 20 * tokenized[0] and max(tokenized[1:]) < 2 * tokenized[0]


def test_forced_function_namespaces_and_parallel_tool_calls(server):
    c = client(server)
    r = c.responses.create(model="tiny", input=say(NAMED), tools=[WEATHER],
                           tool_choice={"type": "function", "name": "get_weather"})
    assert items(r) == [("function_call", "get_weather", {"city": "Rome"}, None)]
    both = c.responses.create(model="tiny", input=say(TWO_CALLS), tools=[WEATHER, AGENTS],
                              reasoning={"effort": "none"})
    assert [i[1:] for i in items(both)] == [("spawn_agent", {"task": "look"}, "multi_agent"),
                                           ("get_weather", {"city": "Oslo"}, None)]
    one = c.responses.create(model="tiny", input=say(TWO_CALLS), tools=[WEATHER, AGENTS], parallel_tool_calls=False,
                             reasoning={"effort": "none"})
    assert [i[1] for i in items(one)] == ["spawn_agent"]


def test_max_output_tokens_makes_an_incomplete_response(server):
    r = client(server).responses.create(model="tiny", input=say(PLAIN), max_output_tokens=3,
                                        reasoning={"effort": "minimal"})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[-1].status == "incomplete"
    events = wire_events(server, {"model": "tiny", "input": say(PLAIN), "max_output_tokens": 3,
                                  "reasoning": {"effort": "minimal"}})
    assert events[-1][0] == "response.incomplete"


@pytest.mark.parametrize("body, status, where", [
    ({"input": [{"type": "computer_call"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input[0].content"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": 5}}}, 400, "text.format"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": []}, 400, "input"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata: at most 16 key-value pairs"),
    ({"input": "hi", "metadata": {"k" * 65: "v"}}, 400, "metadata: keys are at most 64 characters"),
    ({"input": "hi", "metadata": {"k": "v" * 513}}, 400, "metadata: values are at most 512 characters"),
])
def test_errors_use_the_openai_schema(server, body, status, where):
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny", **body}, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and where in error["message"], error


def test_unknown_response_and_missing_key(server):
    r = httpx.get(server.url + "/v1/responses/resp_missing", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 404 and "resp_missing" in r.json()["error"]["message"]
    long_id = "resp_" + "x" * 100_000                     # not echoed whole
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny", "input": "hi", "previous_response_id": long_id},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 404 and "(100005 characters)" in r.json()["error"]["message"]
    assert len(r.content) < 1000
    assert httpx.post(server.url + "/v1/responses", json={"input": "hi"}, timeout=60).status_code == 401
