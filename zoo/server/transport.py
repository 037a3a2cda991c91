"""The HTTP transport's limits and the server's lifecycle, under the app (``server.create_app``).

Three pieces, each small on top of uvicorn 0.54 (h11 protocol):

``BodyLimit`` (pure ASGI middleware, streaming-safe): a request body over ``max_body_bytes`` gets
413 in the API's own error schema: at once when its ``Content-Length`` says so (the app never runs,
nothing of the body is read into memory), else as soon as the bytes counted while a chunked body
streams in pass the limit (the app gets no more of it). A body that stalls (no byte for
``body_timeout_s``) gets 408 and the connection is closed; if a response had already started, the
connection is closed without one.

``DeadlineH11Protocol`` (uvicorn's ``H11Protocol`` plus two deadlines; ``protocol_class`` makes one
for a timeout): a connection must deliver a complete request head within ``header_timeout_s`` of
its opening or of the first byte of the head (slowloris, half-open clients), else it is closed.
When a response was sent before the request body was read (413, any early answer), the rest of the
body is discarded for up to the same time, then the connection is closed: the client can read the
answer before the close (a close with unread input resets the connection and can destroy the
answer in flight). Idle keep-alive connections close after uvicorn's ``timeout_keep_alive``.

``DrainingServer`` (``uvicorn.Server``): the first SIGTERM or SIGINT (or ``drain()`` from any
thread) does not stop the server; it runs ``drain(drain_seconds)`` on the event loop (the engine's
``EngineThread.drain``: new generation requests get 503 ``shutting_down``, running ones may finish
for ``drain_seconds``, then each remaining one ends with an in-band error in its API's format),
lets the responses write their last bytes (up to ``FINISH_GRACE_S``), and only then sets
``should_exit``, so uvicorn's own shutdown finds nothing left to cut. A second signal exits at once.
The process then exits normally (status 0): uvicorn does not re-raise the signal.

``bind`` makes the listening socket (cheap to import: the CLI binds before it loads a model).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Awaitable, Callable

import h11
import uvicorn
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from zoo.server.validation import ApiError

log = logging.getLogger("zoo.serve")

MAX_BODY_BYTES = 32 << 20       # a request body larger than this gets 413
BODY_TIMEOUT_S = 30.0           # no byte of a request body for this long: 408, connection closed
HEADER_TIMEOUT_S = 30.0         # a request head must arrive within this (from the connection or its first byte)
KEEPALIVE_TIMEOUT_S = 5.0       # an idle keep-alive connection is closed after this
DRAIN_SECONDS = 30.0            # on SIGTERM, running requests may finish for this long
FINISH_GRACE_S = 5.0            # after the drain, responses may take this long to write their last event


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free port); connections wait in its backlog
    until the server runs. Raises ``OSError`` (e.g. the port is in use)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def error_response(path: str, err: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    """``err`` in the error schema of the API ``path`` belongs to: Anthropic's under
    ``/v1/messages``, OpenAI's elsewhere."""
    body = err.anthropic_body() if path.startswith("/v1/messages") else err.openai_body()
    return JSONResponse(body, status_code=err.status, headers={**err.headers, **(headers or {})})


class _Answered(Exception):
    """Raised into the app by ``BodyLimit``'s receive once it answered the request itself."""


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimit:
    """ASGI middleware: 413 for a request body over ``max_body_bytes``, 408 for one that stalls
    for ``body_timeout_s`` (None: no limit) between two of its chunks (see the module docstring).
    The answers are in the API's error schema; once one is sent, the app's own response is dropped."""

    def __init__(self, app, max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float | None = BODY_TIMEOUT_S):
        if max_body_bytes < 0:
            raise ValueError(f"max_body_bytes must be >= 0, got {max_body_bytes}")
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than the server's limit of {self.max_body_bytes} bytes",
                        code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            # answered before the body is read; the protocol discards it (``DeadlineH11Protocol``)
            return await error_response(path, self._too_large())(scope, receive, send)
        started = answered = body_done = False
        size = 0

        async def answer(err: ApiError, close: bool) -> None:
            nonlocal answered
            if not started:
                await error_response(path, err, {"connection": "close"} if close else None)(scope, receive, send)
            answered = True

        async def limited_receive():
            nonlocal size, body_done
            if answered:
                return {"type": "http.disconnect"}
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except TimeoutError:
                log.info("%s: no byte of the request body for %gs; closing", path, self.body_timeout_s)
                await answer(ApiError(408, f"the request body stalled for {self.body_timeout_s:g}s",
                                      code="request_timeout"), close=True)
                raise _Answered from None
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if size > self.max_body_bytes:
                    await answer(self._too_large(), close=False)
                    raise _Answered
            else:
                body_done = True
            return message

        async def guarded_send(message):
            nonlocal started
            if answered:                     # the app's answer to a request already answered here
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not answered:                 # (answered with a response under way: uvicorn closes the connection)
                raise


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline and a bounded discard of a request body
    answered early (see the module docstring). ``header_timeout_s`` is a class attribute:
    ``protocol_class`` makes a subclass for another value (uvicorn builds one protocol per
    connection from the class it is given as ``Config(http=...)``)."""

    header_timeout_s: float = HEADER_TIMEOUT_S

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer = self._cancel(self._head_timer)
        self._linger_timer = self._cancel(self._linger_timer)
        super().connection_lost(exc)

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()

    def _watch(self) -> None:
        """Arm or cancel the deadlines for the connection's state now."""
        if self.transport.is_closing():
            self._head_timer = self._cancel(self._head_timer)
            self._linger_timer = self._cancel(self._linger_timer)
            return
        theirs = self.conn.their_state
        # a request head is due: on a new connection, or once the next one's first bytes are here
        if theirs is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0]):
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.header_timeout_s, self._expire, "a complete request head")
        else:
            self._head_timer = self._cancel(self._head_timer)
            if theirs is h11.IDLE and self.timeout_keep_alive_task is None:
                # between requests (uvicorn arms this after a response, but a body discarded after
                # the response cancels it): the keep-alive deadline
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)
        # a body the app did not wait for: discarded (uvicorn drops it unbuffered) until the deadline
        if theirs is h11.SEND_BODY and self.cycle is not None and self.cycle.response_complete:
            if self._linger_timer is None:
                self._linger_timer = self.loop.call_later(self.header_timeout_s, self._expire,
                                                          "the rest of an answered request body")
        else:
            self._linger_timer = self._cancel(self._linger_timer)

    def _expire(self, what: str) -> None:
        self._head_timer = self._linger_timer = None
        if not self.transport.is_closing():
            log.info("%s: no %s within %gs; closing the connection", self._peer(), what, self.header_timeout_s)
            self.transport.close()

    def _peer(self) -> str:
        return "%s:%d" % self.client if self.client else "a client"


def protocol_class(header_timeout_s: float = HEADER_TIMEOUT_S) -> type[DeadlineH11Protocol]:
    """``DeadlineH11Protocol`` with the request-head deadline ``header_timeout_s`` (> 0)."""
    if header_timeout_s <= 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"header_timeout_s": header_timeout_s})


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose signals (SIGTERM, SIGINT) drain before they stop it (see the module
    docstring). ``drain``: the coroutine function run with ``drain_seconds`` (None: just wait for
    the requests in flight, up to ``drain_seconds``). ``handle_exit`` replaces uvicorn's (and so
    sse_starlette's patch of it, which would end every stream at the first signal); sse_starlette
    still ends its streams once it sees ``should_exit``, by when they are over."""

    def __init__(self, config: uvicorn.Config, *, drain: Callable[[float], Awaitable[None]] | None = None,
                 drain_seconds: float = DRAIN_SECONDS):
        if drain_seconds < 0:
            raise ValueError(f"drain_seconds must be >= 0, got {drain_seconds}")
        super().__init__(config)
        self._drain_fn, self.drain_seconds = drain, drain_seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._lock = threading.Lock()
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        """uvicorn's signal handler: the first signal drains, a second one exits now. Unlike uvicorn
        it does not note the signal to re-raise it after shutting down: the process exits with 0."""
        if self._draining or self.should_exit:
            log.warning("second signal: exiting now")
            self.should_exit = self.force_exit = True
        else:
            self.drain()

    def drain(self) -> None:
        """Start the drain (from any thread, once; later calls do nothing); the server stops when
        it is over."""
        with self._lock:
            if self._draining:
                return
            self._draining = True
        if self._loop is None or not self.started:      # not serving yet: nothing to drain
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        log.warning("shutting down: running requests may finish for %gs (signal again to exit now)",
                    self.drain_seconds)
        try:
            if self._drain_fn is not None:
                await self._drain_fn(self.drain_seconds)
            else:
                await self._wait_for_tasks(loop.time() + self.drain_seconds)
        except Exception:
            log.exception("the drain failed")
        await self._wait_for_tasks(loop.time() + FINISH_GRACE_S)
        log.info("drained; stopping")
        self.should_exit = True

    async def _wait_for_tasks(self, deadline: float) -> None:
        """Until no request is being answered, the deadline, or an exit."""
        loop = asyncio.get_running_loop()
        while self.server_state.tasks and loop.time() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)


def make_server(app, *, log_level: str = "info", header_timeout_s: float = HEADER_TIMEOUT_S,
                keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S, drain_seconds: float = DRAIN_SECONDS,
                drain: Callable[[float], Awaitable[None]] | None = None) -> DrainingServer:
    """A ``DrainingServer`` for ``app`` with the h11 protocol and these deadlines (see the module
    docstring); ``drain``: the app's drain coroutine function (None: wait for requests)."""
    if keepalive_timeout_s <= 0:
        raise ValueError(f"keepalive_timeout_s must be > 0, got {keepalive_timeout_s}")
    config = uvicorn.Config(app, log_level=log_level, http=protocol_class(header_timeout_s),
                            timeout_keep_alive=keepalive_timeout_s, timeout_graceful_shutdown=FINISH_GRACE_S)
    return DrainingServer(config, drain=drain, drain_seconds=drain_seconds)
