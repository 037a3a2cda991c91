"""The OpenAI surface of ``zoo serve``, driven by the official ``openai`` SDK over real HTTP on
127.0.0.1, against the tiny model (scripted answers for reasoning and Qwen3.x-format tool calls)."""

from __future__ import annotations

import concurrent.futures
import json

import httpx2 as httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server_helpers import QWEN_TEMPLATE, say, scripted_model
from zoo.server.app import ServerThread, create_app

KEY = "test-key"
SCRIPTS = [
    "The user greets me.\n</think>\n\nHello! The answer is 42.",
    "I need the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, \"FR\"\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
    "get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
    "alpha beta STOP gamma",
    "<tool_call>\n<function=get_weather>\n<parameter=days>\n" + "1" * 300 + "\n</parameter>\n</function>\n</tool_call>",
]
REASON, TOOL, NAMED, REQUIRED, STOP, SLOW = range(6)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
MAX = 360           # the longest request: with a 128-token prompt, the cache length stays 512


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = scripted_model(tmp_path_factory.mktemp("qwen-ckpt"), QWEN_TEMPLATE, SCRIPTS)
    app = create_app(model, api_key=KEY, keepalive_s=0.1, model_name="tiny")
    with ServerThread(app) as s:
        s.model, s.app = model, app
        client(s).chat.completions.create(model="tiny", messages=[user(REASON)], max_tokens=MAX)   # warm up
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def user(script_or_text) -> dict:
    text = say(script_or_text) if isinstance(script_or_text, int) else script_or_text
    return {"role": "user", "content": text}


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


def stream_chat(server, **kwargs) -> dict:
    """Run a streaming chat completion; its reasoning, content, tool calls, finish reason, usage."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "usage": None, "arg_deltas": 0}
    for chunk in client(server).chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                        **kwargs):
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            out["reasoning"] += extra(delta, "reasoning_content") or ""
            out["content"] += delta.content or ""
            for tc in delta.tool_calls or []:
                call = out["calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    call["id"], call["name"] = tc.id, tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
                    out["arg_deltas"] += 1
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def test_health_and_models(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert [m.id for m in client(server).models.list()] == ["tiny"]
    assert client(server).models.retrieve("tiny").id == "tiny"


def test_chat_reasoning_content_and_usage(server):
    r = client(server).chat.completions.create(model="tiny", messages=[user(REASON)], max_tokens=64)
    msg = r.choices[0].message
    assert extra(msg, "reasoning_content") == "The user greets me."
    assert msg.content == "Hello! The answer is 42."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(server.model.tokenizer.encode(SCRIPTS[REASON]))
    s = stream_chat(server, model="tiny", messages=[user(REASON)], max_tokens=64)
    assert (s["reasoning"], s["content"], s["finish"]) == ("The user greets me.", msg.content, "stop")
    assert s["usage"].model_dump() == r.usage.model_dump()


def test_reasoning_effort_none_turns_thinking_off(server):
    r = client(server).chat.completions.create(model="tiny", messages=[user(STOP)], max_tokens=64,
                                               reasoning_effort="none")
    assert r.choices[0].message.content == "alpha beta STOP gamma"
    assert extra(r.choices[0].message, "reasoning_content") is None


def test_tool_call_qwen_format(server):
    r = client(server).chat.completions.create(model="tiny", messages=[user(TOOL)], tools=TOOLS, max_tokens=128)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert extra(choice.message, "reasoning_content") == "I need the weather."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": 'Paris, "FR"', "days": 3}
    s = stream_chat(server, model="tiny", messages=[user(TOOL)], tools=TOOLS, max_tokens=128)
    assert s["finish"] == "tool_calls" and s["arg_deltas"] > 2        # arguments arrive in pieces
    assert [(c["name"], c["arguments"]) for c in s["calls"].values()] == [("get_weather", call.function.arguments)]


def test_tool_choice(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client(server).chat.completions.create(model="tiny", messages=[user(NAMED)], tools=TOOLS, tool_choice=named,
                                               max_tokens=128)
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Rome"}
    s = stream_chat(server, model="tiny", messages=[user(REQUIRED)], tools=TOOLS, tool_choice="required",
                    max_tokens=128)
    assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"].values()] == [("get_weather", {"city": "Oslo"})]
    r = client(server).chat.completions.create(model="tiny", messages=[user(TOOL)], tools=TOOLS, tool_choice="none",
                                               max_tokens=128)
    assert r.choices[0].message.tool_calls is None and "<function=get_weather>" in r.choices[0].message.content


def test_tool_results_in_history(server):
    history = [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": json.dumps({"city": "Rome"})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, user(REASON)]
    short = client(server).chat.completions.create(model="tiny", messages=[user(REASON)], max_tokens=64)
    r = client(server).chat.completions.create(model="tiny", messages=history, max_tokens=64)
    assert r.choices[0].message.content == "Hello! The answer is 42."
    assert r.usage.prompt_tokens > short.usage.prompt_tokens + 20      # the call and its result are in the prompt


def test_stop_sequences(server):
    kwargs = dict(model="tiny", messages=[user(STOP)], max_tokens=64, reasoning_effort="none", stop=["STOP", "zzz"])
    r = client(server).chat.completions.create(**kwargs)
    assert r.choices[0].message.content == "alpha beta " and r.choices[0].finish_reason == "stop"
    s = stream_chat(server, **kwargs)
    assert s["content"] == "alpha beta " and s["finish"] == "stop"


def test_the_engine_ends_each_choice_at_a_stop_string(server):
    """Completions, two choices, streamed and not: each ends right before "STOP" (the space before it,
    in the same token " S", kept) with finish "stop"; the usage counts each choice's tokens up to the
    one that completed the stop string ("alpha beta STOP": 11)."""
    c = client(server)
    kwargs = dict(model="tiny", prompt=say(STOP), max_tokens=64, n=2, stop=["STOP"], temperature=0)
    r = c.completions.create(**kwargs)
    assert [(ch.text, ch.finish_reason) for ch in r.choices] == [("alpha beta ", "stop")] * 2
    assert r.usage.completion_tokens == 2 * len(server.model.tokenizer.encode("alpha beta STOP")) == 22
    texts, finishes = ["", ""], [None, None]
    for chunk in c.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    assert texts == ["alpha beta "] * 2 and finishes == ["stop"] * 2


def test_completions_stream_and_not(server):
    c = client(server)
    r = c.completions.create(model="tiny", prompt="Hello, zoo", max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == len(server.model.tokenizer.encode("Hello, zoo"))
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 8
    text, finish, usage = "", None, None
    for chunk in c.completions.create(model="tiny", prompt="Hello, zoo", max_tokens=8, temperature=0, stream=True,
                                      stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    assert (text, finish, usage.model_dump()) == (r.choices[0].text, r.choices[0].finish_reason, r.usage.model_dump())


def test_seed_reproducibility(server):
    def sample(seed):
        return client(server).completions.create(model="tiny", prompt="Once upon", max_tokens=12, temperature=1.0,
                                                 seed=seed).choices[0].text
    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_concurrent_streams_match_solo(server):
    prompts = [[user(f"n{i} {'zoo ' * (i % 3)}")] for i in range(16)]

    def run(messages):
        s = stream_chat(server, model="tiny", messages=messages, max_tokens=12, temperature=0)
        return s["reasoning"], s["content"], s["finish"], s["usage"].completion_tokens

    solo = [run(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, prompts))
    assert together == solo
    assert len(set(solo)) > 1


def test_keepalive_while_tool_value_is_buffered(server):
    body = {"model": "tiny", "messages": [user(SLOW)], "tools": TOOLS, "max_tokens": MAX, "stream": True,
            "reasoning_effort": "none"}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert ": keep-alive" in lines and lines[-1] == "data: [DONE]", lines[-20:]
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    args = "".join(tc["function"].get("arguments", "") for c in chunks for ch in c["choices"]
                   for tc in ch["delta"].get("tool_calls") or [])
    assert json.loads(args) == {"days": int("1" * 300)}


def test_errors(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=[user("hi")], max_tokens=4)
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    c = client(server)
    cases = [dict(messages=[]), dict(messages=[user("hi")], temperature=5), dict(messages=[user("hi")], n=0),
             dict(messages=[{"role": "robot", "content": "hi"}]),
             dict(messages=[user("hi")], tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
             dict(messages=[user("hi")], max_tokens=0)]
    for case in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", **case)
        assert set(e.value.body) >= {"message", "type", "param", "code"}, case
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"



def test_values_the_engine_cannot_hold_are_400_and_it_keeps_serving(server):
    """A top_k past int32 and prompt token ids outside the vocabulary used to kill the engine thread
    (OverflowError; every later request 503): now each is a 400 naming the field, and the engine serves on."""
    auth = {"Authorization": f"Bearer {KEY}"}
    vocab = server.app.state.service.engine.generator.vocab
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth,
                   json={"model": "tiny", "messages": [user("hi")], "max_tokens": 2, "top_k": 2**40})
    assert r.status_code == 400 and "top_k" in r.json()["error"]["message"]
    for prompt in ([2**40], [-1], [vocab], [5, vocab + 7]):
        r = httpx.post(server.url + "/v1/completions", headers=auth, json={"model": "tiny", "prompt": prompt,
                                                                            "max_tokens": 2})
        assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"], (prompt, r.text)
    for prompt, param, message in (([5, vocab + 7], "prompt", f"prompt[1]: token id {vocab + 7} is not"),
                                   ([[5], [6, 7, vocab]], "prompt[1]", f"prompt[1][2]: token id {vocab} is not")):
        r = httpx.post(server.url + "/v1/completions", headers=auth, json={"model": "tiny", "prompt": prompt,
                                                                            "max_tokens": 2})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and error["message"].startswith(message), error
    ok = client(server).chat.completions.create(model="tiny", messages=[user("hi")], max_tokens=2,
                                                extra_body={"top_k": vocab + 1000})     # as many as there are
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_metrics_parse(server):
    r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    value = {f: sum(s.value for s in families[f].samples if s.name == f + "_total") for f in
             ("zoo_generation_tokens", "zoo_prompt_tokens", "zoo_requests")}
    assert all(v > 0 for v in value.values()), value
    assert {"zoo_time_to_first_token_seconds", "zoo_queue_depth", "zoo_spec_draft_tokens",
            "zoo_decode_tokens_per_second", "zoo_http_requests"} <= set(families)


def test_thinking_budget_closes_the_reasoning(server):
    """The zoo extension ``thinking_budget`` (and the server-wide default, ``zoo serve
    --thinking-budget``): after that many reasoning tokens "</think>" is forced and the answer follows.
    The template opened the reasoning in the prompt, so it counts from the first output token."""
    tok = server.model.tokenizer
    ids = tok.encode(SCRIPTS[REASON])
    budget = 3
    expected = tok.decode(ids[:budget]).strip()
    assert expected and "The user greets me.".startswith(expected) and expected != "The user greets me."
    r = client(server).chat.completions.create(model="tiny", messages=[user(REASON)], max_tokens=64,
                                               extra_body={"thinking_budget": budget})
    msg = r.choices[0].message
    assert extra(msg, "reasoning_content") == expected and msg.content.endswith("The answer is 42.")
    service = server.app.state.service
    service.thinking_budget = budget
    try:
        s = stream_chat(server, model="tiny", messages=[user(REASON)], max_tokens=64)
        assert (s["reasoning"], s["content"]) == (expected, msg.content)
    finally:
        service.thinking_budget = None
    r = client(server).chat.completions.create(model="tiny", messages=[user(REASON)], max_tokens=64)
    assert extra(r.choices[0].message, "reasoning_content") == "The user greets me."
    with pytest.raises(openai.BadRequestError):
        client(server).chat.completions.create(model="tiny", messages=[user(REASON)], max_tokens=64,
                                               extra_body={"thinking_budget": 0})
