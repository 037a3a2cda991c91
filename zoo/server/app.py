"""The bundled OpenAI- and Anthropic-compatible server.

``create_app(model, ...)`` builds a FastAPI app over one ``Generator``: its engine thread starts and
stops with the app; the OpenAI (``openai_api``) and Anthropic (``anthropic_api``) surfaces are
thin adapters over ``service.Service``; ``tokenize_api`` adds vLLM's ``/tokenize`` and ``/detokenize``.
The app also answers ``GET``/``HEAD /health`` (no key needed; 503 while draining or once the engine
stopped) and ``GET /metrics`` (Prometheus text). Request bodies are limited in size and in how long
they may stall (``transport.BodyLimit``). ``serve`` runs the app with uvicorn (``transport``: request-head
and keep-alive deadlines, a drain on SIGTERM); ``ServerThread`` runs it in a background thread (tests,
notebooks).
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from zoo.engine.generator import PREFILL_CHUNK, Generator
from zoo.models.architectures import ARCHITECTURES
from zoo.server import transport
from zoo.server.engine_thread import EngineThread
from zoo.server.image_inputs import ImagePolicy, VisionInputs
from zoo.server.metrics import CountRequests, Metrics
from zoo.server.protocols import anthropic_api, openai_api, responses_api, tokenize_api
from zoo.server.service import Service
from zoo.server.transport import BodyLimit, DrainingServer, bind, error_response
from zoo.server.validation import ApiError
from zoo.text.tool_calls import FORMATS, ToolCallFormat, detect_format

log = logging.getLogger("zoo.serve")


def _error_response(request: Request, err: ApiError) -> JSONResponse:
    """``err`` in the error schema of the API the path belongs to."""
    return error_response(request.url.path, err)


def _require_key(api_key: str | None):
    """A dependency: the request carries ``api_key`` as ``Authorization: Bearer`` or ``x-api-key``."""
    expected = (api_key or "").encode()

    async def check(request: Request) -> None:
        if not api_key:
            return
        auth = request.headers.get("authorization", "")
        given = [request.headers.get("x-api-key", ""), auth[7:].strip() if auth[:7].lower() == "bearer " else ""]
        if not any(hmac.compare_digest(g.encode(), expected) for g in given):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                           code="invalid_api_key")
    return check


def tool_format_of(arch: str | None, chat_template: str | None) -> str | None:
    """The name of the tool-call format a model writes: from its chat template's markers, else its
    architecture's row of the table (None: unknown, tool calls are not parsed)."""
    known = ARCHITECTURES.get(arch or "")
    return detect_format(chat_template) or (known.tool_format if known is not None else None)


def _tool_call_format(tool_format: str | None, model) -> ToolCallFormat | None:
    """``create_app``'s ``tool_format`` -> the format (``ValueError`` naming the choices for an unknown name)."""
    if tool_format == "auto":
        tool_format = tool_format_of(getattr(model.config, "arch", None), model.tokenizer.chat_template)
    if tool_format is None:
        return None
    if tool_format not in FORMATS:
        raise ValueError(f"unknown tool format {tool_format!r}; use one of {sorted(FORMATS)}, 'auto' or None")
    return FORMATS[tool_format]


def create_app(model, *, api_key: str | None = None, spec_tokens: int = 0, spec_policy: str = "auto",
               max_batch: int = 16,
               context: int | None = None, prefill_chunk: int = PREFILL_CHUNK, warmup: bool = False,
               on_warmup=None,
               max_queue: int = 64, queue_timeout_s: float = 60.0, keepalive_s: float = 15.0,
               model_name: str | None = None, tool_format: str | None = "auto", default_max_tokens: int = 4096,
               memory_budget: int | None = None, thinking_budget: int | None = None,
               prefix_cache_gb: float | None = None, prefix_cache_host_gb: float | None = None,
               max_body_bytes: int = transport.MAX_BODY_BYTES,
               body_timeout_s: float | None = transport.BODY_TIMEOUT_S, replica=None,
               image_policy: ImagePolicy | None = None, max_image_tokens: int = 1024,
               interleave_ratio: float | None = None, narrow_rows: int | None = 0) -> FastAPI:
    """A FastAPI app serving ``model`` (a ``zoo.Model`` with a tokenizer).

    api_key: required on every route but ``/health`` (None: no authentication). spec_tokens: MTP drafts
    per step at most; spec_policy: "auto" (each step's draft lengths and sources chosen from costs and
    acceptance, ``zoo.engine.spec_policy``) or "fixed" (spec_tokens MTP drafts every step).
    max_batch: rows decoded together (fewer if the memory holds fewer). context: tokens per request,
    prompt and output (None: ``Generator``'s default). prefill_chunk: prompt tokens per prefill program
    (a power of two; ``zoo compile`` reports the largest a target chip leaves room
    for). warmup: the engine compiles all its programs before it serves (``/health`` says "warming
    up" until then; requests wait; ``zoo serve`` does; off, each program compiles when a request
    first needs it); ``on_warmup(name, seconds, done, total)`` after each. max_queue: requests that
    may wait for a row (more: 429); queue_timeout_s: how long one may wait (then 503). keepalive_s:
    silence after which a stream gets a keep-alive comment / ping. tool_format: a key of
    ``zoo.text.tool_calls.FORMATS``, None (tool calls are not parsed) or "auto" (from the chat
    template, else the architecture table's row of ``model.config.arch``).
    thinking_budget: reasoning tokens after which "</think>" is forced into a chat request's output
    (None: unlimited); an Anthropic ``thinking.budget_tokens`` or OpenAI ``thinking_budget`` field
    of a request takes its place. prefix_cache_gb / prefix_cache_host_gb: the prefix cache's device
    and host-RAM tiers in GiB (None: the defaults of ``Generator``; ``prefix_cache_gb`` 0: off).
    max_body_bytes: a larger request body gets 413 (in the API's error schema); body_timeout_s: a
    request body that sends nothing for this long gets 408 (None: no limit). replica: for process 0
    of a multi-process job, builds the engine the server drives from the ``Generator``
    (``zoo.engine.replica.Leader``). image_policy: the limits on images in requests
    (``zoo.server.image_inputs.ImagePolicy``; None: its defaults) for a model with a vision tower;
    a text-only model answers an image with 400. max_image_tokens: merged rows (placeholder tokens) per
    image at most: images are resized to at most ``max_image_tokens * (patch * merge)**2`` pixels, and
    the engine's tower compiles one program per bucket 256, 512, ... up to it
    (``zoo.engine.image_prefill.image_buckets``). interleave_ratio: while rows decode, a step's prefill
    keeps a stream waiting at most about this many decode steps (``zoo.engine.prefill_pace``; None:
    one chunk per step, and outputs reproducible run to run; ``zoo serve``'s default is
    ``prefill_pace.INTERLEAVE_RATIO``). narrow_rows: the narrow decode programs' rows (``Generator``'s;
    None: ``zoo.engine.rows.narrow_width``'s default). The engine is ``app.state.service.engine``;
    ``serve`` drains it on SIGTERM.
    """
    if thinking_budget is not None and thinking_budget < 1:
        raise ValueError(f"thinking_budget must be >= 1, got {thinking_budget}")
    if model.tokenizer is None:
        raise ValueError("serving needs a tokenizer; this model has none")
    calls = _tool_call_format(tool_format, model)
    image_policy = image_policy or ImagePolicy()
    vision = VisionInputs.from_model(model, image_policy, max_image_tokens)        # None: text only
    generator = Generator(model, spec_tokens=spec_tokens, spec_policy=spec_policy, max_batch=max_batch, context=context,
                          memory_budget=memory_budget, prefill_chunk=prefill_chunk, prefix_cache=prefix_cache_gb,
                          prefix_cache_host_gb=prefix_cache_host_gb, max_image_tokens=max_image_tokens,
                          interleave_ratio=interleave_ratio, narrow_rows=narrow_rows)
    context, rows = generator.context, generator.rows
    metrics = Metrics()
    metrics.watch_engine(generator)
    if generator.prefix is not None:
        metrics.watch_prefix_cache(generator.prefix)
    if replica is not None:
        generator = replica(generator)
    engine = EngineThread(generator, metrics, max_queue=max_queue, queue_timeout_s=queue_timeout_s, warmup=warmup,
                          on_progress=on_warmup)
    name = model_name or Path(str(model.load_info.get("path", "zoo"))).name
    service = Service(engine, model.tokenizer, name, calls, context, default_max_tokens, keepalive_s,
                      thinking_budget, vision=vision, image_policy=image_policy)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        log.info("serving %s (tool format %s, %d rows of %d tokens, spec %d, %s)", name, calls and calls.name, rows,
                 context, spec_tokens, "text only" if vision is None else f"images: {vision.spec.family}")
        yield
        engine.stop()

    app = FastAPI(title="zoo", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    auth = [Depends(_require_key(api_key))]
    app.include_router(openai_api.router, dependencies=auth)
    app.include_router(anthropic_api.router, dependencies=auth)
    app.include_router(responses_api.router, dependencies=auth)
    app.include_router(tokenize_api.router, dependencies=auth)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        status, body = engine.health()
        return JSONResponse({**body, "model": name} if status == 200 else body, status)

    @app.get("/metrics", dependencies=auth)
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_exception_handler(ApiError, _error_response)
    app.add_exception_handler(HTTPException, lambda request, e: _error_response(
        request, ApiError(e.status_code, str(e.detail))))
    app.add_exception_handler(RequestValidationError, lambda request, e: _error_response(
        request, ApiError(400, str(e.errors()[0].get("msg", e)))))

    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return _error_response(request, ApiError(500, f"internal error: {type(e).__name__}: {e}"))
    app.add_exception_handler(Exception, internal_error)
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    app.add_middleware(CountRequests, metrics=metrics)     # outermost: it counts BodyLimit's answers too
    return app


def _server(app: FastAPI, log_level: str, header_timeout_s: float, keepalive_timeout_s: float,
            drain_seconds: float) -> DrainingServer:
    service = getattr(getattr(app, "state", None), "service", None)    # None: an app wrapped by middleware
    return transport.make_server(app, log_level=log_level, header_timeout_s=header_timeout_s,
                                 keepalive_timeout_s=keepalive_timeout_s, drain_seconds=drain_seconds,
                                 drain=service.engine.drain if service is not None else None)


def serve(app: FastAPI, sock: socket.socket, *, log_level: str = "info",
          header_timeout_s: float = transport.HEADER_TIMEOUT_S,
          keepalive_timeout_s: float = transport.KEEPALIVE_TIMEOUT_S,
          drain_seconds: float = transport.DRAIN_SECONDS) -> None:
    """Serve ``app`` on ``sock`` (from ``bind``) until SIGTERM or SIGINT, then drain: new generation
    requests get 503, running ones may finish for ``drain_seconds``, the rest end with an in-band
    error; returns once the server stopped (a second signal: at once). header_timeout_s: a
    connection must send a complete request head within this; keepalive_timeout_s: an idle
    keep-alive connection is closed after this (see ``zoo.server.transport``)."""
    _server(app, log_level, header_timeout_s, keepalive_timeout_s, drain_seconds).run(sockets=[sock])


class ServerThread:
    """Run ``app`` with uvicorn in a background thread: ``with ServerThread(app) as s: s.url``.
    The timeouts are those of ``serve``; ``drain()`` does what SIGTERM does to ``serve``."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", *,
                 header_timeout_s: float = transport.HEADER_TIMEOUT_S,
                 keepalive_timeout_s: float = transport.KEEPALIVE_TIMEOUT_S,
                 drain_seconds: float = transport.DRAIN_SECONDS):
        self._sock = bind(host, port)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._server = _server(app, log_level, header_timeout_s, keepalive_timeout_s, drain_seconds)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="zoo-uvicorn", daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server failed to start (see the log)")
            self._thread.join(0.02)
        return self

    def drain(self) -> None:
        """Start the drain of SIGTERM (returns at once; ``join`` waits for the server to stop)."""
        self._server.drain()

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s for the server to stop; whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()
