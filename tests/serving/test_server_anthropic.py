"""The Anthropic surface of ``zoo serve`` (``/v1/messages``, ``count_tokens``), driven by the official
``anthropic`` SDK over real HTTP on 127.0.0.1, against the tiny model with a GLM-style chat template
(so GLM-format tool calls; scripted answers)."""

from __future__ import annotations

import json

import anthropic
import httpx2 as httpx
import pytest

from tests.support.serving_helpers import GLM_TEMPLATE, say, scripted_model
from zoo.serving.server import ServerThread, create_app

KEY = "anthropic-test-key"
SCRIPTS = [
    "<think>Let me think.</think>Hello from GLM.",
    "<think>Need the weather.</think>Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
    "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
    "<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>",
    "one two END three",
    "<tool_call>get_weather<arg_key>days</arg_key><arg_value>" + "1" * 200 + "</arg_value></tool_call>",
    "<think>first second third fourth fifth sixth seventh eighth ninth tenth</think>Done.",
]
THINK, TOOL, NAMED, STOP, SLOW, LONG = range(6)
TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]
MAX = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = scripted_model(tmp_path_factory.mktemp("glm-ckpt"), GLM_TEMPLATE, SCRIPTS)
    app = create_app(model, api_key=KEY, keepalive_s=0.1, max_batch=4)
    with ServerThread(app) as s:
        assert app.state.service.tool_format == "glm"          # chosen from the chat template
        s.tokenizer = model.tokenizer
        client(s).messages.create(model="m", max_tokens=MAX, messages=[user(THINK)])    # warm up
        yield s


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def user(script_or_text) -> dict:
    text = say(script_or_text) if isinstance(script_or_text, int) else script_or_text
    return {"role": "user", "content": text}


def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    """A streaming request read off the wire: [(event name, data)]."""
    events, name = [], None
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, timeout=60,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events


def blocks(message) -> list[tuple]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text if b.type == "text" else (b.name, b.input))
            for b in message.content]


def test_thinking_and_text(server):
    m = client(server).messages.create(model="m", max_tokens=64, messages=[user(THINK)])
    assert blocks(m) == [("thinking", "Let me think."), ("text", "Hello from GLM.")]
    assert m.stop_reason == "end_turn" and m.model == "m" and m.role == "assistant"
    assert m.usage.output_tokens == len(server.tokenizer.encode(SCRIPTS[THINK]))
    with client(server).messages.stream(model="m", max_tokens=64, messages=[user(THINK)]) as stream:
        final = stream.get_final_message()
    assert blocks(final) == blocks(m) and final.usage.output_tokens == m.usage.output_tokens
    events = raw_events(server, {"model": "m", "max_tokens": 64, "messages": [user(THINK)]})
    kinds = [e for e, _ in events if e != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"]["type"] for e, d in events if e == "content_block_start"]
    assert starts == ["thinking", "text"] and kinds.count("content_block_stop") == 2
    assert all(e == n for (e, n) in [(e, d["type"]) for e, d in events])


def test_tool_use_glm_format(server):
    m = client(server).messages.create(model="m", max_tokens=128, messages=[user(TOOL)], tools=TOOLS)
    assert blocks(m) == [("thinking", "Need the weather."), ("text", "Checking."),
                         ("tool_use", ("get_weather", {"city": "Paris", "days": 3}))]
    assert m.stop_reason == "tool_use" and m.content[2].id.startswith("toolu_")
    events = raw_events(server, {"model": "m", "max_tokens": 128, "messages": [user(TOOL)], "tools": TOOLS})
    pieces = [d["delta"]["partial_json"] for e, d in events if e == "content_block_delta"
              and d["delta"]["type"] == "input_json_delta"]
    assert len(pieces) > 2 and json.loads("".join(pieces)) == {"city": "Paris", "days": 3}
    with client(server).messages.stream(model="m", max_tokens=128, messages=[user(TOOL)], tools=TOOLS) as stream:
        assert blocks(stream.get_final_message()) == blocks(m)


def test_named_tool_choice_and_tool_result_round_trip(server):
    m = client(server).messages.create(model="m", max_tokens=128, messages=[user(NAMED)], tools=TOOLS,
                                       tool_choice={"type": "tool", "name": "get_weather"})
    assert blocks(m) == [("tool_use", ("get_weather", {"city": "Rome"}))]
    history = [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[0].id,
                                             "content": [{"type": "text", "text": "sunny"}]},
                                            {"type": "text", "text": say(THINK)}]}]
    r = client(server).messages.create(model="m", max_tokens=64, messages=history, tools=TOOLS)
    assert blocks(r)[-1] == ("text", "Hello from GLM.")
    count = client(server).messages.count_tokens(model="m", messages=history, tools=TOOLS)
    assert count.input_tokens == r.usage.input_tokens
    assert count.input_tokens > client(server).messages.count_tokens(model="m", messages=[user(THINK)]).input_tokens


def test_stop_sequences_system_and_prefill(server):
    m = client(server).messages.create(model="m", max_tokens=64, messages=[user(STOP)], stop_sequences=["END"])
    assert blocks(m) == [("text", "one two ")]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "END")
    with client(server).messages.stream(model="m", max_tokens=64, messages=[user(STOP)],
                                        stop_sequences=["END"]) as stream:
        final = stream.get_final_message()
    assert blocks(final) == blocks(m) and final.stop_sequence == "END"
    m = client(server).messages.create(model="m", max_tokens=64, system="Be brief.",
                                       messages=[user(STOP), {"role": "assistant", "content": "Sure:"}])
    assert blocks(m) == [("text", "one two END three")]           # continues the prefill, not repeated
    with_system = client(server).messages.count_tokens(model="m", system="Be brief.", messages=[user(STOP)])
    without = client(server).messages.count_tokens(model="m", messages=[user(STOP)])
    assert with_system.input_tokens > without.input_tokens


def test_max_tokens_and_thinking_off(server):
    m = client(server).messages.create(model="m", max_tokens=3, messages=[user(STOP)])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    count = client(server).messages.count_tokens
    off = count(model="m", messages=[user(THINK)], thinking={"type": "disabled"}).input_tokens
    assert off == count(model="m", messages=[user(THINK)]).input_tokens + 2      # the template added <think></think>


def test_ping_while_tool_value_is_buffered(server):
    events = raw_events(server, {"model": "m", "max_tokens": MAX, "messages": [user(SLOW)], "tools": TOOLS})
    assert ("ping", {"type": "ping"}) in events
    pieces = "".join(d["delta"].get("partial_json", "") for e, d in events if e == "content_block_delta")
    assert json.loads(pieces) == {"days": int("1" * 200)}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_errors(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="m", max_tokens=8, messages=[user("hi")])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    c = client(server)
    cases = [dict(max_tokens=8, messages=[]), dict(max_tokens=0, messages=[user("hi")]),
             dict(max_tokens=8, messages=[{"role": "system", "content": "hi"}]),
             dict(max_tokens=8, messages=[{"role": "user", "content": [
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]),
             dict(max_tokens=8, messages=[user("hi")], tools=TOOLS, tool_choice={"type": "tool", "name": "nope"})]
    for case in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="m", **case)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error", case
    r = httpx.post(server.url + "/v1/messages", json={"model": "m", "messages": [user("hi")]},
                   headers={"x-api-key": KEY})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_thinking_budget_closes_the_reasoning(server):
    """budget_tokens is enforced: after that many reasoning tokens the engine forces "</think>" into
    the row, so the thinking block ends there and the answer follows in a text block."""
    tok = server.tokenizer
    ids = tok.encode(SCRIPTS[LONG])
    assert ids[0] == tok.encode("<think>")[0]
    full = client(server).messages.create(model="m", max_tokens=MAX, messages=[user(LONG)],
                                          thinking={"type": "enabled", "budget_tokens": 1000})
    assert blocks(full) == [("thinking", "first second third fourth fifth sixth seventh eighth ninth tenth"),
                            ("text", "Done.")]
    budget = 4
    cut = client(server).messages.create(model="m", max_tokens=MAX, messages=[user(LONG)],
                                         thinking={"type": "enabled", "budget_tokens": budget})
    assert blocks(cut)[0] == ("thinking", tok.decode(ids[1:1 + budget]).strip())
    assert [b[0] for b in blocks(cut)] == ["thinking", "text"] and blocks(cut)[1][1].endswith("Done.")
    with pytest.raises(anthropic.BadRequestError):
        client(server).messages.create(model="m", max_tokens=MAX, messages=[user(LONG)],
                                       thinking={"type": "enabled", "budget_tokens": 0})
