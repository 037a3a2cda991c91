"""The engine thread and the bounded queue in front of it; each request is an async ``Job``.

One thread runs ``Generator.run_forever`` and owns the device. HTTP handlers run on the asyncio
loop: ``EngineThread.submit`` hands a request (prompt ids and the ``RequestOptions`` the service
built, passed on unchanged) to the generator (or answers 429 when ``max_queue`` requests already
wait for a batch row); the engine's callbacks (engine thread) reach the job through
``loop.call_soon_threadsafe`` into an ``asyncio.Queue``: the tokens of each step, their logprob
records and the text the engine decoded of them (cut before a stop string, which ends the request
in the engine). A job is *admitted* when the engine gives it a batch row (its prefill starts);
``Job.admitted`` gives up after ``queue_timeout_s`` with 503, so the wait limit counts queueing
only, never prefill or compilation.

Failures: a request the engine fails (``Generator`` isolates each request's faults) ends with the
engine's error; if the engine thread itself dies, every job ends at once with that error, and a job
still waiting notices within one tick (``Job.next``) even if a callback was lost. ``drain`` (SIGTERM)
stops admitting, lets running requests finish for a while, then ends the rest with an error each API
renders in its own format (``error_status`` 503).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Sequence

from zoo.engine.options import RequestOptions
from zoo.server.metrics import Metrics
from zoo.server.validation import ApiError

log = logging.getLogger("zoo.serve")
TICK = object()     # ``Job.next``: nothing arrived within the tick


class Job:
    """One generation request as seen from the event loop."""

    def __init__(self, engine: "EngineThread", loop: asyncio.AbstractEventLoop):
        self.engine, self._loop = engine, loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._settled = asyncio.Event()     # admitted to a row, or finished while waiting
        self.req = None                     # the engine's Request
        self.admitted_to_row = False
        self.received = 0                   # tokens received so far
        self._text_seen = 0                 # engine thread: characters of ``req.text`` passed on
        self.logprobs: list = []            # their TokenLogprob records, if the request asked for them
        self.finished = False               # the engine is done with it (or the engine failed)
        self.error: str | None = None       # set when the server ends the request (engine down, shutdown)
        self.error_status = 500             # the HTTP status that error maps to
        self.reason = "cancelled"           # the finish reason if the server stops it (see ``cancel``)
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.t_tokens: float | None = None  # engine thread: when its last tokens were delivered

    # engine thread -> loop
    def on_admit(self, req) -> None:
        self._call(self._admit)

    def on_tokens(self, req, tokens: list[int]) -> None:
        now = time.perf_counter()
        if self.t_tokens is not None:
            self.engine.metrics.inter_token.observe(now - self.t_tokens)
        self.t_tokens = now
        # the engine appended these tokens' records and text just before calling (same thread): take them now
        recs = req.token_logprobs[len(req.token_logprobs) - len(tokens):] if req.options.logprobs is not None else []
        self._call(self._arrive, (list(tokens), recs, self._new_text(req)))

    def on_finish(self, req) -> None:
        held = self._new_text(req)          # text the engine held back (a partial stop string), if any
        if held:
            self._call(self._arrive, ([], [], held))
        self._call(self._arrive, None)

    def _new_text(self, req) -> str:
        text = req.text[self._text_seen:]
        self._text_seen = len(req.text)
        return text

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:                # the loop is closed: the server is shutting down
            pass

    def _admit(self) -> None:
        if not self.finished and not self.admitted_to_row:
            self.admitted_to_row = True
            self._settled.set()
            self.engine._on_admitted(self)

    def _arrive(self, item) -> None:
        if self.finished:                   # cancelled here; the engine has not seen it yet
            return
        if item is not None and self.t_first is None:
            self.t_first = time.perf_counter()
            self.engine._on_first_token(self)
        self._settled.set()
        self._queue.put_nowait(item)

    # loop side
    async def admitted(self) -> None:
        """Wait for a batch row; 503 (and cancel) after the engine's queue timeout."""
        try:
            while self.engine.warming is not None and not self._settled.is_set():   # the wait starts once ready
                await asyncio.sleep(0.05)
            await asyncio.wait_for(self._settled.wait(), self.engine.queue_timeout_s)
        except TimeoutError:
            self.cancel()
            raise ApiError(503, f"the server is busy: the request waited {self.engine.queue_timeout_s:g}s "
                                "for a slot", code="overloaded", headers={"Retry-After": "5"}) from None

    async def next(self, tick: float):
        """The tokens and text that arrived since the last call (waiting up to ``tick`` s) and whether
        the request is finished: ``(tokens, text, done)``, or ``TICK`` when nothing arrived. Their
        logprob records (if asked for) are appended to ``logprobs``."""
        try:
            item = await asyncio.wait_for(self._queue.get(), tick)
        except TimeoutError:
            if self.finished or self.engine.alive:
                return TICK
            self.end(self.engine.error or "the engine is not running")   # the engine died meanwhile
            item = await self._queue.get()
        tokens, text, done = [], [], False
        while True:
            if item is None:
                done = True
            else:
                tokens += item[0]
                self.logprobs += item[1]
                text.append(item[2])
            if self._queue.empty():
                break
            item = self._queue.get_nowait()
        self.received += len(tokens)
        if done:
            self._done()
        return tokens, "".join(text), done

    def end(self, message: str, status: int = 500) -> None:
        """End the request now with ``message`` (its consumer gets a ``Finish`` with the error);
        the engine is asked to free its row."""
        if self.finished or self.error is not None:
            return
        self.error, self.error_status = message, status
        if self.req is not None:
            self.engine.generator.cancel(self.req)
        self._arrive(None)

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the request (client gone, queue timeout); frees its batch row."""
        if not self.finished:
            self.reason = reason
            self.engine.generator.cancel(self.req)
            self._done()

    def _done(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine._on_finished(self)

    @property
    def finish_reason(self) -> str:
        return self.req.finish_reason or self.reason


class EngineThread:
    """The generator's thread, the admission limit, and the metrics of the requests."""

    def __init__(self, generator, metrics: Metrics, *, max_queue: int = 64, queue_timeout_s: float = 60.0,
                 warmup: bool = True, on_progress=None):
        """``warmup``: the thread first compiles the engine's programs (``Generator.warmup``); until
        then ``/health`` says "warming up" and requests wait (their queue timeout starts once ready).
        ``on_progress(name, seconds, done, total)`` after each program."""
        self.generator, self.metrics = generator, metrics
        self.warming: dict | None = {"programs_compiled": 0} if warmup else None
        self.warmup_seconds: list[tuple[str, float]] = []
        self._on_progress = on_progress
        self.max_queue, self.queue_timeout_s = max_queue, queue_timeout_s
        self.error: str | None = None        # why the engine thread stopped (None: it runs)
        self.draining = False                 # shutting down: no new requests
        self._jobs: set[Job] = set()
        self._waiting = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="zoo-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            self.generator.cancel(job.req)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            if self.warming is not None:
                self.warmup_seconds = self.generator.warmup(self._progress)
                self.warming = None
            self.generator.run_forever(self._stop)
        except BaseException as e:          # the device state is unknown now: fail every request
            log.exception("the engine thread failed")
            self.fail_all(f"the engine failed: {type(e).__name__}: {e}")

    def _progress(self, name: str, seconds: float, done: int, total: int) -> None:
        self.warming = {"programs_compiled": done, "programs": total, "last": name}
        if self._on_progress is not None:
            self._on_progress(name, seconds, done, total)

    def fail_all(self, message: str, status: int = 500) -> None:
        """The engine cannot go on (any thread): it is marked down with ``message`` (new requests get
        503, ``/health`` says so) and each waiting or streaming request ends now with that error."""
        if self.error is None:
            self.error = message
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job._call(job.end, message, status)

    async def drain(self, seconds: float, poll: float = 0.05) -> None:
        """Shut down gracefully (call from the event loop): admit no new request (503 ``shutting_down``),
        wait up to ``seconds`` for the requests in flight to finish, then end the rest with the error
        "the server is shutting down" (503), and return once their consumers have seen it (or after
        a further ``poll``-bounded grace of 5 s)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self._jobs and loop.time() < deadline:
            await asyncio.sleep(poll)
        with self._lock:
            jobs = list(self._jobs)
        if jobs:
            log.warning("drain: ending %d request(s) still running after %gs", len(jobs), seconds)
        for job in jobs:
            job.end("the server is shutting down", status=503)
        grace = loop.time() + 5.0
        while self._jobs and loop.time() < grace:
            await asyncio.sleep(poll)

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) for ``/health``: 200 "ok" while the engine serves (with the faults it
        recovered from, if any), 503 "warming up" while it compiles its programs (how many so far),
        503 "draining" while shutting down, 503 "error" once it stopped."""
        faults = dict(self.generator.faults)
        if not self.alive:
            return 503, {"status": "error", "error": self.error or "the engine is not running", "faults": faults}
        if self.draining:
            return 503, {"status": "draining", "running": len(self._jobs)}
        warming = self.warming
        if warming is not None:
            return 503, {"status": "warming up", **warming}
        body = {"status": "ok"}
        if faults["failed_requests"] or faults["failed_steps"]:
            body["faults"] = faults
        return 200, body

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def submit(self, prompt: list[int], options: RequestOptions, **kwargs) -> Job:
        """Queue a request (call from the event loop); 429 when the queue is full, 503 if the engine died."""
        return self.submit_choices(prompt, options, **kwargs)[0]

    def submit_choices(self, prompt: list[int], options: RequestOptions, *, constraints=None,
                       images: Sequence = ()) -> list[Job]:
        """``submit`` with ``options.n`` choices of one prompt (prefilled once; ``Generator.make_request``,
        which checks ``options``: a ``ValueError`` for what it cannot serve), a job each;
        ``constraints``: a ``Constraint`` per choice, compiled from ``options.grammar`` (a replicated
        engine sends the grammar to the other processes); ``images``: the prompt's ``ImageInput``s in
        order (passed on only when there are some)."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
        if not self.alive:
            raise ApiError(503, self.error or "the engine is not running", code="engine_down")
        if self._waiting >= self.max_queue:
            raise ApiError(429, f"too many requests waiting ({self._waiting}); retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        extra = {"images": tuple(images)} if images else {}
        try:
            first = self.generator.make_request(prompt, options, constraints=constraints, **extra)
        except TypeError as e:
            if images and "images" in str(e):
                raise ApiError(501, "this server's engine does not take images") from None
            raise
        jobs = []
        for req in [first] + first.forks:
            job = Job(self, asyncio.get_running_loop())
            job.req = req
            req.on_tokens, req.on_finish, req.on_admit = job.on_tokens, job.on_finish, job.on_admit
            jobs.append(job)
        with self._lock:
            self._jobs.update(jobs)
        self._waiting += len(jobs)
        self.metrics.queue_depth.set(self._waiting)
        try:
            self.generator.submit(first)            # ValueError: refused (its images), never queued
        except BaseException:
            with self._lock:
                self._jobs.difference_update(jobs)
            self._waiting -= len(jobs)
            self.metrics.queue_depth.set(self._waiting)
            raise
        return jobs

    def _on_admitted(self, job: Job) -> None:
        self._waiting -= 1
        self.metrics.queue_depth.set(self._waiting)
        self.metrics.running.inc()
        self.metrics.prompt_tokens.inc(len(job.req.prompt))

    def _on_first_token(self, job: Job) -> None:
        self.metrics.ttft.observe(job.t_first - job.t_submit)

    def _on_finished(self, job: Job) -> None:
        with self._lock:
            self._jobs.discard(job)
        if job.admitted_to_row:
            self.metrics.running.dec()
        else:
            self._waiting -= 1
            self.metrics.queue_depth.set(self._waiting)
        if job.t_first is not None:
            elapsed = time.perf_counter() - job.t_first
            if job.received > 1 and elapsed > 0:
                self.metrics.decode_rate.observe((job.received - 1) / elapsed)
        stats = job.req.stats
        self.metrics.requests.labels(job.finish_reason).inc()
        self.metrics.generation_tokens.inc(job.received)
        self.metrics.drafted.inc(stats.get("drafted", 0))
        self.metrics.accepted.inc(stats.get("accepted", 0))
        self.metrics.count_speculation(stats)
