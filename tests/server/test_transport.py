"""The HTTP transport's limits and the server's lifecycle (``zoo.server.transport``), on the wire:
413 for a body over the limit (by its Content-Length, before it is read, or counted as a chunked
body streams in), 408 for a body that stalls, request-head and keep-alive deadlines (raw sockets:
silent, half-sent and slow-drip clients are disconnected in bounded time while others are served),
HEAD /health, and the drain of SIGTERM (``ServerThread.drain``): a short stream finishes, long ones
end with their API's in-band error event, new requests get 503."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx2 as httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tests.support.server_helpers import QWEN_TEMPLATE, say, scripted_model
from zoo.server.app import ServerThread, create_app
from zoo.server.transport import BodyLimit

LIMIT = 1024                 # the stub app's body limit
T = 0.5                      # its body, request-head and keep-alive timeouts
KEY = "transport-key"


# ---- a stub app behind the transport: no model, fast ---------------------------------------------------------


@pytest.fixture(scope="module")
def stub():
    app = FastAPI()
    app.state.bodies = []                                 # the sizes of the bodies the routes read

    async def echo(request: Request):
        body = await request.body()
        app.state.bodies.append(len(body))
        return {"bytes": len(body)}

    app.add_api_route("/v1/chat/completions", echo, methods=["POST"])
    app.add_api_route("/v1/messages", echo, methods=["POST"])
    app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
    app.add_middleware(BodyLimit, max_body_bytes=LIMIT, body_timeout_s=T)
    with ServerThread(app, header_timeout_s=T, keepalive_timeout_s=T) as s:
        s.app = app
        yield s


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a Content-Length: (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed within a response body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed_after(sock: socket.socket, limit: float = 10.0) -> float:
    """Seconds until the server closes ``sock`` (reading and dropping what comes); fails after ``limit``."""
    t0 = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {limit}s")
    return time.monotonic() - t0


def head(path: str, **headers) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_content_length_over_the_limit_413_before_the_body_is_read(stub):
    r = httpx.post(stub.url + "/v1/chat/completions", content=b"x" * (LIMIT + 1))
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert str(LIMIT) in err["message"]
    r = httpx.post(stub.url + "/v1/messages", content=b"x" * (LIMIT + 1))
    assert r.status_code == 413 and r.json()["type"] == "error" and r.json()["error"]["type"] == "request_too_large"
    assert httpx.post(stub.url + "/v1/chat/completions", content=b"x" * LIMIT).json() == {"bytes": LIMIT}
    assert LIMIT + 1 not in stub.app.state.bodies

    with connect(stub) as sock:                             # a huge declared body: answered at once, unread
        sock.sendall(head("/v1/messages", content_length=10**12))
        status, _, body = read_response(sock)
        assert status == 413 and json.loads(body)["error"]["type"] == "request_too_large"
        t0 = time.monotonic()                               # what follows is discarded, for a bounded time
        try:
            while time.monotonic() - t0 < 10:
                sock.sendall(b"x" * 65536)
                time.sleep(0.01)
        except OSError:
            pass
        assert time.monotonic() - t0 < T + 3

    with connect(stub) as sock:                             # a small body over the limit, sent whole:
        sock.sendall(head("/v1/chat/completions", content_length=LIMIT + 1) + b"x" * (LIMIT + 1))
        assert read_response(sock)[0] == 413
        body = b'{"a": 1}'                                  # the connection serves the next request
        sock.sendall(head("/v1/chat/completions", content_length=len(body)) + body)
        assert read_response(sock)[0] == 200
        assert T / 2 < closed_after(sock) < T + 3           # then closes once idle for the keep-alive timeout


def test_chunked_body_over_the_limit_413_while_it_streams(stub):
    with connect(stub) as sock:
        sock.sendall(head("/v1/chat/completions", transfer_encoding="chunked"))
        piece = b"x" * 600
        sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) * 2)     # over the limit, and no end of the body
        status, _, body = read_response(sock)
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        assert closed_after(sock) < T + 3
    assert 1200 not in stub.app.state.bodies

    def pieces():
        for _ in range(4):
            yield b"y" * 512
    r = httpx.post(stub.url + "/v1/messages", content=pieces())     # an SDK-style chunked upload
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_stalled_body_408_and_closed(stub):
    with connect(stub) as sock:
        sock.sendall(head("/v1/chat/completions", content_length=100) + b'{"model": ')
        t0 = time.monotonic()
        status, headers, body = read_response(sock)
        assert T / 2 < time.monotonic() - t0 < T + 3
        assert status == 408 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert closed_after(sock) < 3
    with connect(stub) as sock:                             # Anthropic's schema on its path
        sock.sendall(head("/v1/messages", content_length=100) + b"{")
        status, _, body = read_response(sock)
        assert status == 408 and json.loads(body)["type"] == "error"


def test_slow_and_half_open_clients_are_cut_off_others_are_served(stub):
    silent, partial, drip = connect(stub), connect(stub), connect(stub)
    partial.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n")
    stop = threading.Event()

    def drip_bytes():                                       # one byte of a head every 0.1 s: never done
        try:
            for b in b"GET /health HTTP/1.1\r\nHost: " + b"x" * 10_000:
                if stop.wait(0.1):
                    return
                drip.send(bytes([b]))
        except OSError:
            pass
    dripper = threading.Thread(target=drip_bytes, daemon=True)
    dripper.start()
    try:
        assert httpx.get(stub.url + "/health").json() == {"status": "ok"}     # others are served meanwhile
        for sock in (silent, partial, drip):
            assert closed_after(sock) < T + 3
        assert httpx.get(stub.url + "/health").status_code == 200
    finally:
        stop.set()
        dripper.join(5)
        for sock in (silent, partial, drip):
            sock.close()


def test_idle_keep_alive_connection_closed(stub):
    with connect(stub) as sock:
        for _ in range(3):                                  # requests in time keep the connection
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
            assert read_response(sock)[0] == 200
            time.sleep(T / 4)
        assert closed_after(sock) < T + 3


def test_first_signal_drains_a_second_exits_now():
    app = FastAPI()

    async def slow(seconds: float):
        async def dots():
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                yield b"."
                await asyncio.sleep(0.05)
        return StreamingResponse(dots())
    app.add_api_route("/slow", slow, methods=["GET"])
    got = []

    def fetch(url):
        try:
            got.append(httpx.get(url, timeout=60))
        except httpx.HTTPError as e:
            got.append(e)

    with ServerThread(app, drain_seconds=30) as s:          # no engine: the drain waits for the requests
        client = threading.Thread(target=fetch, args=(s.url + "/slow?seconds=1",))
        client.start()
        time.sleep(0.3)
        s._server.handle_exit(signal.SIGTERM, None)         # uvicorn's signal handler
        client.join(10)
        assert got[-1].status_code == 200 and len(got[-1].content) > 5
        assert s.join(10)
    with ServerThread(app, drain_seconds=30) as s:
        client = threading.Thread(target=fetch, args=(s.url + "/slow?seconds=60",))
        client.start()
        time.sleep(0.3)
        s._server.handle_exit(signal.SIGTERM, None)
        assert not s.join(1.0)                              # draining: the request may run on
        s._server.handle_exit(signal.SIGINT, None)
        assert s.join(10)                                   # a second signal: at once
        client.join(10)


# ---- the real app: HEAD /health, the body limit in the API schema, the drain -------------------------------


MEDIUM, LONG = "tock " * 30, "tick " * 4000     # ~90 tokens; as many as the context (4096) holds
DRAIN = 6.0                  # seconds: the medium answer fits in it, the long one does not (see PACE)
PACE = 0.02                  # seconds each decode step is held back: ~90 tokens take >= 1.8 s (still running
                             # when the drain starts), 4000 take >= 80 s, however fast the machine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return scripted_model(tmp_path_factory.mktemp("transport-ckpt"), QWEN_TEMPLATE, [MEDIUM, LONG])


def test_head_health_and_413_in_the_apis_schema(model):
    app = create_app(model, api_key=KEY, max_batch=1, model_name="transport", max_body_bytes=4096)
    with ServerThread(app) as s:
        r = httpx.head(s.url + "/health")
        assert r.status_code == 200 and r.content == b""
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
        big = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 5000}]}
        r = httpx.post(s.url + "/v1/messages", json=big, headers={"x-api-key": KEY})
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        r = httpx.post(s.url + "/v1/chat/completions", json=big, headers={"x-api-key": KEY})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        metrics = httpx.get(s.url + "/metrics", headers={"x-api-key": KEY}).text
        assert 'route="/v1/messages",status="413"' in metrics


class Stream(threading.Thread):
    """A streaming request read off the wire in a thread: ``events`` [(time, SSE event name, data)]."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[tuple[float, str | None, object]] = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self):
        name = None
        try:
            with httpx.stream("POST", self.url, json={**self.body, "stream": True}, timeout=60,
                              headers={"x-api-key": KEY}) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: "):
                        data = line[6:]
                        self.events.append((time.monotonic(), name, data if data == "[DONE]" else json.loads(data)))
        except BaseException as e:              # a cut connection: the test fails on it
            self.error = e

    def wait_for_content(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.events) < 3 and self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.events) >= 3, (self.status, self.events, self.error)


def chat(i: int, max_tokens: int = 8000) -> dict:
    return {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": say(i)}]}


def test_drain_finishes_short_streams_ends_long_ones_in_band_and_refuses_new_requests(model):
    app = create_app(model, api_key=KEY, max_batch=3, keepalive_s=0.25, model_name="transport")
    gen = app.state.service.engine.generator
    real_step = gen._step_fn

    def paced_step(*args, **kwargs):
        time.sleep(PACE)
        return real_step(*args, **kwargs)
    gen._step_fn = paced_step
    with ServerThread(app, drain_seconds=DRAIN) as s:
        warm = httpx.post(s.url + "/v1/chat/completions", json=chat(0, 4), headers={"x-api-key": KEY}, timeout=120)
        assert warm.status_code == 200                      # compiled: the streams below run at decode speed
        long_openai = Stream(s.url + "/v1/chat/completions", chat(1))
        long_anthropic = Stream(s.url + "/v1/messages", chat(1))
        for st in (long_openai, long_anthropic):
            st.wait_for_content()
        medium = Stream(s.url + "/v1/chat/completions", chat(0))
        medium.wait_for_content()
        t_drain = time.monotonic()
        s.drain()
        time.sleep(0.3)
        r = httpx.post(s.url + "/v1/chat/completions", json=chat(0, 4), headers={"x-api-key": KEY})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        r = httpx.post(s.url + "/v1/messages", json=chat(0, 4), headers={"x-api-key": KEY})
        assert r.status_code == 503 and r.json()["type"] == "error"
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "draining"
        for st in (medium, long_openai, long_anthropic):
            st.join(DRAIN + 30)
            assert not st.is_alive() and st.error is None and st.status == 200
        assert s.join(15), "the server did not stop after the drain"
    t_stop = time.monotonic()

    # the medium stream was running when the drain began, and finished normally
    assert medium.events[-1][2] == "[DONE]" and medium.events[-2][0] > t_drain
    assert [e for _, _, e in medium.events if isinstance(e, dict) and "error" in e] == []
    assert medium.events[-2][2]["choices"][0]["finish_reason"] == "stop"
    # the long ones were ended after the drain time, each with its API's in-band error event
    t, _, last = long_openai.events[-2]
    assert "shutting down" in last["error"]["message"] and long_openai.events[-1][2] == "[DONE]"
    assert t_drain + DRAIN - 0.5 < t < t_stop
    t, name, last = long_anthropic.events[-1]
    assert name == "error" and last["type"] == "error" and "shutting down" in last["error"]["message"]
    assert t_drain + DRAIN - 0.5 < t < t_stop
