"""Engine faults seen from the HTTP surfaces: a decode step that fails (a device error, injected
around the real step program) ends every running request with an error in its API's format, an
OpenAI or Anthropic stream with an in-band error event, a non-streaming request with a 500, within
seconds; ``/health`` reports the fault and the next requests are served. If the engine thread itself
dies, every request in flight ends at once, ``/health`` says so and new requests get 503."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx2 as httpx
import pytest

from tests.support.server_helpers import QWEN_TEMPLATE, say, scripted_model
from zoo.server.app import ServerThread, create_app

KEY = "faults-key"
HEADERS = {"x-api-key": KEY}
LONG = 3000
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
ANY_CITY = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": True}}}}]      # `true`: any value (valid JSON Schema)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = scripted_model(tmp_path_factory.mktemp("faults-ckpt"), QWEN_TEMPLATE, ["tick " * LONG, "Hello there.",
                                                                                 CALL])
    app = create_app(model, api_key=KEY, max_batch=4, keepalive_s=0.25, model_name="faults")
    with ServerThread(app) as s:
        s.generator, s.service = app.state.service.engine.generator, app.state.service
        yield s


def chat(stream: bool, script: int = 0, max_tokens: int = LONG) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": say(script)}], "max_tokens": max_tokens,
            "stream": stream, "chat_template_kwargs": {"enable_thinking": False}}


def messages(script: int = 0) -> dict:
    return {"model": "m", "max_tokens": LONG, "stream": True, "messages": [{"role": "user", "content": say(script)}]}


def read_stream(client: httpx.Client, url: str, body: dict, started: threading.Event, out: list) -> None:
    """Each SSE ``(event, data)`` of a streaming POST into ``out``; ``started`` once tokens flow."""
    with client.stream("POST", url, json=body, headers=HEADERS, timeout=60) as r:
        assert r.status_code == 200
        event = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
                out.append((event, data if data == "[DONE]" else json.loads(data)))
                if len(out) > 3:
                    started.set()
                event = None


def running(server, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while sum(r is not None for r in server.generator._rows) < n:
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.02)


def test_a_failed_step_ends_every_running_request_with_an_error_and_the_server_goes_on(server):
    gen = server.generator
    real, armed = gen._step_fn, threading.Event()

    def step(*args, **kwargs):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected device fault")
        return real(*args, **kwargs)
    gen._step_fn = step
    client = httpx.Client(base_url=server.url, timeout=60)
    oa, an = [], []
    oa_on, an_on = threading.Event(), threading.Event()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(read_stream, client, "/v1/chat/completions", chat(True), oa_on, oa),
                   pool.submit(read_stream, client, "/v1/messages", messages(), an_on, an)]
        plain = pool.submit(client.post, "/v1/chat/completions", json=chat(False), headers=HEADERS, timeout=60)
        assert oa_on.wait(30) and an_on.wait(30)
        running(server, 3)
        t0 = time.monotonic()
        armed.set()
        for f in streams:
            f.result(timeout=20)
        response = plain.result(timeout=20)
        ended = time.monotonic() - t0
    gen._step_fn = real
    assert ended < 10
    errors = [d for _, d in oa if isinstance(d, dict) and "error" in d]
    assert len(errors) == 1 and "injected device fault" in errors[0]["error"]["message"]
    assert errors[0]["error"]["type"] == "server_error"
    assert [(e, d) for e, d in an if e == "error"] == [
        ("error", {"type": "error", "error": {"type": "api_error",
                                              "message": "RuntimeError: injected device fault"}})]
    assert response.status_code == 500
    assert "injected device fault" in response.json()["error"]["message"]
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["faults"]["failed_steps"] == 1
    assert health["faults"]["failed_requests"] == 3
    r = client.post("/v1/chat/completions", json=chat(False, script=1, max_tokens=20), headers=HEADERS)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello there."


def test_a_tool_property_of_any_type_is_parsed(server):
    body = {**chat(False, script=2, max_tokens=60), "tools": ANY_CITY}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_failure_while_rendering_the_output_is_an_error_of_that_request(server):
    """A bug in the output's rendering (injected) fails that request in its API's format (a 500, an
    in-band event in a stream, never a cut connection); the next request is served."""
    service, calls = server.service, []

    def broken(*args):
        calls.append(1)
        raise KeyError("injected rendering fault")
    service._render = broken
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json=chat(False, script=1, max_tokens=20),
                       headers=HEADERS, timeout=60)
        assert r.status_code == 500 and "injected rendering fault" in r.json()["error"]["message"]
        out, on = [], threading.Event()
        read_stream(httpx.Client(base_url=server.url), "/v1/messages", messages(script=1), on, out)
        assert out[-1][0] == "error" and "injected rendering fault" in out[-1][1]["error"]["message"]
    finally:
        del service._render
    assert calls
    r = httpx.post(server.url + "/v1/chat/completions", json=chat(False, script=1, max_tokens=20), headers=HEADERS,
                   timeout=60)
    assert r.json()["choices"][0]["message"]["content"] == "Hello there."


def test_a_dead_engine_ends_the_requests_in_flight_and_new_ones_get_503(server):
    """Last in this module: the engine does not come back."""
    gen = server.generator
    client = httpx.Client(base_url=server.url, timeout=60)
    out, on = [], threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stream = pool.submit(read_stream, client, "/v1/chat/completions", chat(True), on, out)
        plain = pool.submit(client.post, "/v1/chat/completions", json=chat(False), headers=HEADERS, timeout=60)
        assert on.wait(30)
        running(server, 2)
        t0 = time.monotonic()
        gen.step = lambda: (_ for _ in ()).throw(SystemError("injected engine crash"))
        stream.result(timeout=20)
        response = plain.result(timeout=20)
        assert time.monotonic() - t0 < 10
    assert any(isinstance(d, dict) and "injected engine crash" in d.get("error", {}).get("message", "")
               for _, d in out)
    assert response.status_code == 500 and "injected engine crash" in response.json()["error"]["message"]
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "error"
    late = client.post("/v1/chat/completions", json=chat(False, script=1, max_tokens=5), headers=HEADERS)
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_down"
