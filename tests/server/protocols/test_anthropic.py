"""The Anthropic surface of ``zoo serve`` (``/v1/messages``, ``count_tokens``), driven by the official
``anthropic`` SDK over real HTTP on 127.0.0.1, against the tiny model with a GLM-style chat template
(so GLM-format tool calls; scripted answers) and a context of ``CONTEXT`` tokens. Also: requests
shaped as Claude Code sends them (system messages inside ``messages``, ``cache_control``, adaptive
thinking, ``?beta=true``, deferred and server tools, a huge ``max_tokens``) and malformed known
fields (a 400 in Anthropic's error schema)."""

from __future__ import annotations

import json

import anthropic
import httpx2 as httpx
import pytest

from tests.support.server_helpers import GLM_TEMPLATE, say, scripted_model, sse_events
from zoo.server.app import ServerThread, create_app

KEY = "anthropic-test-key"
SCRIPTS = [
    "<think>Let me think.</think>Hello from GLM.",
    "<think>Need the weather.</think>Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
    "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
    "<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>",
    "one two END three",
    "<tool_call>get_weather<arg_key>days</arg_key><arg_value>" + "1" * 200 + "</arg_value></tool_call>",
    "<think>first second third fourth fifth sixth seventh eighth ninth tenth</think>Done.",
    "tick " * 600,                                  # more tokens than the context holds
]
THINK, TOOL, NAMED, STOP, SLOW, LONG, ENDLESS = range(7)
TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]
MAX = 256
CONTEXT = 512
EPHEMERAL = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = scripted_model(tmp_path_factory.mktemp("glm-ckpt"), GLM_TEMPLATE, SCRIPTS, context=CONTEXT)
    app = create_app(model, api_key=KEY, keepalive_s=0.1, max_batch=4)
    with ServerThread(app) as s:
        assert app.state.service.tool_format.name == "glm"     # chosen from the chat template
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
    return sse_events(server.url + "/v1/messages", body, {"x-api-key": KEY, "anthropic-version": "2023-06-01"})


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


def claude_code_kwargs(**overrides) -> dict:
    """A request shaped as Claude Code 2.1 sends it (texts shortened)."""
    return {"model": "claude-opus-5-5", "max_tokens": 128_000,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1;"},
                       {"type": "text", "text": "You are an agent.", "cache_control": EPHEMERAL}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>Be kind.</system-reminder>"},
                {"type": "text", "text": say(THINK), "cache_control": EPHEMERAL}]},
                {"role": "system", "content": [{"type": "text", "text": "# Environment", "cache_control": EPHEMERAL}],
                 "output_config": {"effort": "medium"}}],
            "tools": [{**TOOLS[0], "cache_control": EPHEMERAL},
                      {"name": "Later", "description": "deferred", "input_schema": TOOLS[0]["input_schema"],
                       "defer_loading": True},
                      {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}],
            "metadata": {"user_id": '{"device_id": "d"}'}, "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "medium"}, **overrides}


def test_a_claude_code_request(server):
    """Claude Code's first request: a system message after the user turn, cache_control everywhere,
    adaptive thinking shown as omitted, deferred and server tools, ?beta=true with beta headers."""
    c = client(server)
    betas = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27"]
    with c.beta.messages.stream(betas=betas, **claude_code_kwargs()) as stream:    # as Claude Code: streaming
        m = stream.get_final_message()
    assert blocks(m) == [("thinking", ""), ("text", "Hello from GLM.")]
    assert m.stop_reason == "end_turn" and m.model == "claude-opus-5-5"
    assert m.usage.cache_read_input_tokens == 0 and m.context_management.applied_edits == []
    shown = c.beta.messages.create(betas=betas, **claude_code_kwargs(thinking={"type": "adaptive"}, max_tokens=64))
    assert blocks(shown) == [("thinking", "Let me think."), ("text", "Hello from GLM.")]
    events = raw_events(server, claude_code_kwargs())
    assert [d["content_block"]["type"] for e, d in events if e == "content_block_start"] == ["thinking", "text"]
    assert not [d for e, d in events if e == "content_block_delta" and d["delta"]["type"] == "thinking_delta"]
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"


def test_system_messages_deferred_and_server_tools_in_the_prompt(server):
    count = lambda **kw: client(server).beta.messages.count_tokens(**{  # noqa: E731
        k: v for k, v in claude_code_kwargs(**kw).items() if k not in ("max_tokens", "metadata")}).input_tokens
    full = count()
    assert full > count(messages=claude_code_kwargs()["messages"][:1])            # the system message is rendered
    assert full == count(tools=TOOLS)                # the deferred tool and the server tool stay out of the prompt
    loaded = [*claude_code_kwargs()["messages"][:1],
              {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                 "input": {"city": "Oslo"}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                  {"type": "tool_reference", "tool_name": "Later"}]}]}]
    unloaded = [*loaded[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                          "content": "Tool Later loaded."}]}]
    assert count(messages=loaded) > count(messages=unloaded)        # the reference put the deferred tool in


def test_a_huge_max_tokens_is_clipped_to_the_context(server):
    c = client(server)
    with c.messages.stream(model="m", max_tokens=10**9, messages=[user(ENDLESS)]) as stream:
        m = stream.get_final_message()
    assert m.stop_reason == "model_context_window_exceeded"
    assert m.usage.input_tokens + m.usage.output_tokens == CONTEXT
    events = raw_events(server, {"model": "m", "max_tokens": 10**9, "messages": [user(ENDLESS)]})
    assert events[-2][1]["delta"]["stop_reason"] == "model_context_window_exceeded"
    assert c.messages.create(model="m", max_tokens=5, messages=[user(ENDLESS)]).stop_reason == "max_tokens"
    with c.messages.stream(model="m", max_tokens=10**9, messages=[user(THINK)]) as stream:
        assert stream.get_final_message().stop_reason == "end_turn"


@pytest.mark.parametrize("change, where", [
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"thinking": {"type": "adaptive", "display": "loud"}}, "thinking.display"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "forever"}}]}, "system[0].cache_control.type"),
    ({"system": [{"type": "image", "source": {}}]}, "system[0].type"),
    ({"cache_control": {"type": "ephemeral", "ttl": "1d"}}, "cache_control.ttl"),
    ({"tools": [{"name": "no_schema"}]}, "tools[0]"),
    ({"tools": [{**TOOLS[0], "cache_control": {"type": "permanent"}}]}, "tools[0].cache_control.type"),
    ({"metadata": "user-1"}, "metadata"),
    ({"context_management": {"edits": "all"}}, "context_management.edits"),
    ({"max_tokens": "lots"}, "max_tokens"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]},
     "messages[0].content[0].cache_control.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "tool_reference"}]}]}]}, "messages[0].content[0].content[0].tool_name"),
])
def test_malformed_known_fields_are_a_400_in_the_anthropic_schema(server, change, where):
    body = {k: v for k, v in claude_code_kwargs(**change).items()}
    r = httpx.post(server.url + "/v1/messages?beta=true", json=body, timeout=60,
                   headers={"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "x-2025-01-01"})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith(where), r.json()


def test_top_k_past_int32_is_a_400_and_the_engine_serves_on(server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client(server).messages.create(model="m", max_tokens=4, messages=[user(THINK)], extra_body={"top_k": 2**40})
    assert "top_k" in str(e.value)
    assert client(server).messages.create(model="m", max_tokens=MAX, messages=[user(THINK)]).stop_reason == "end_turn"
