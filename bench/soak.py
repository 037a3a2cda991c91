"""Soak: minutes of mixed load with cancellations against the real ``zoo serve`` (issue 21: one
request must never take the server down).

    JAX_PLATFORMS=cpu PYTHONPATH=. .venv/bin/python bench/soak.py [--minutes 5] [--clients 8] \
        [--model qwen38-tiny] [--warmup 30] [--seed 0] [--out /tmp/soak.json] [--log /tmp/soak-server.log]

Runs ``python -m zoo serve`` in a subprocess (stderr to ``--log``; ``JAX_LOG_COMPILES`` on, so that
compilations can be counted) and warms it up: ``prime`` (the batch takes its largest shape), then the
load until nothing new compiles (at least ``--warmup`` s). Then ``--clients`` threads send a seeded
random mix for ``--minutes``: OpenAI chat completions (``openai`` SDK; streamed or not, temperature 0
or 0.8, n=2 at times), completions, Anthropic messages (``anthropic`` SDK), the Responses API,
requests with tools, multi-turn conversations that grow (the prefix cache), streams closed after a
few events, requests whose client timeout fires, invalid requests (4xx expected: "rejected") and
GETs of /health, /metrics, /v1/models. An error is a 5xx, an in-band error event, a stream without
its terminal event, an unexpected exception or a hang (every call has a timeout). Every
``SAMPLE_S`` s: the server's RSS (/proc), requests, tokens, errors, /health latency (polled every
250 ms), the prefix cache's bytes and the compilations so far.

Then /health is polled every 20 ms while two bodies just under ``--max-body-mb`` are sent (400
context_length_exceeded expected: the tiny model's context is 4096 tokens), then two over it (413);
last, SIGTERM while four streams run: exit status, time to exit, how each stream ended.

Baselines from the same run: tokens/s of the first minute of load against the last (windows of
min(60 s, half the load)), RSS after the warm-up against RSS at the end (growth, slope per minute),
/health latency on the idle server against under load and with the large bodies. The summary is
printed and written as JSON to ``--out``; RSS growth is shown next to the compilations and the
prefix cache's growth, which explain some of it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx2 as httpx
import openai

KEY = "soak-key"
SAMPLE_S = 5.0                 # the sampler's period
WARM_ROUND_S = 10.0            # the warm-up: rounds of this until two in a row compile nothing
TIMEOUT_S = 120.0              # every call's limit: one that takes longer is a hang
MAX_BATCH = 16                 # the server's --max-batch
PRIME_TOKENS = 3000            # more slots than any request of the mix needs (prompt and answer)
MIB = 1 << 20
WORDS = ("read write list search file path line branch commit test build module class function value error "
         "result return index offset buffer stream socket token parser schema field zoo lion tiger").split()
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": PARAMS}}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The weather.", "input_schema": PARAMS}
MSG = [{"role": "user", "content": "hello"}]


class Unexpected(Exception):
    """A wrong answer: a stream without its terminal event, an in-band error, an invalid request accepted."""


class Stats:
    """Latencies by (kind, outcome), completions as (time, tokens), errors, notes; thread-safe."""

    def __init__(self):
        self.lock, self.done, self.errors = threading.Lock(), [], []
        self.seconds, self.notes = defaultdict(list), defaultdict(int)

    def record(self, kind: str, outcome: str, seconds: float, tokens: int = 0) -> None:
        with self.lock:
            self.seconds[kind, outcome].append(seconds)
            self.done.append((time.monotonic(), tokens))

    def error(self, kind: str, detail: str, seconds: float = 0.0) -> None:
        with self.lock:
            self.seconds[kind, "error"].append(seconds)
            self.errors.append({"time": time.strftime("%H:%M:%S"), "kind": kind, "detail": detail})


class Clients:
    def __init__(self, base: str):
        self.base = base
        self.oai = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)
        self.ant = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=TIMEOUT_S)
        self.http = httpx.Client(base_url=base, headers={"x-api-key": KEY}, timeout=TIMEOUT_S)


class Worker:
    def __init__(self, stats: Stats, seed: str):
        self.stats, self.rng, self.conv = stats, random.Random(seed), []


def say(rng: random.Random, lo: int, hi: int) -> list[dict]:
    return [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))}]


def latency(xs: list[float]) -> dict:
    n, xs = len(xs), sorted(xs) or [float("nan")]
    rank = lambda q: xs[max(0, math.ceil(q * len(xs)) - 1)] * 1e3             # nearest rank
    return {"n": n, "p50_ms": rank(0.5), "p99_ms": rank(0.99), "max_ms": xs[-1] * 1e3}


# ---- the server

def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "zoo", "serve", "--model", args.model, "--port", "0", "--api-key", KEY,
           "--drain-seconds", str(args.drain), "--max-body-mb", str(args.max_body_mb), "--log-level", "warning",
           "--max-batch", str(MAX_BATCH)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(args.log, "w"), text=True,
                            env={**os.environ, "JAX_LOG_COMPILES": "1"})
    base = None
    for line in proc.stdout:
        base = (m := re.search(r"Anthropic base URL:\s*(\S+)", line)) and m[1] or base
        if line.strip().startswith("API key:"):             # the banner's last line: listening
            threading.Thread(target=proc.stdout.read, daemon=True).start()     # never let the pipe fill
            return proc, base
    raise RuntimeError(f"the server exited ({proc.wait()}) before it listened; see {args.log}")


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status)[1]) / 1024


def compiles(log: str) -> tuple[int, float]:
    """XLA compilations the server logged so far (``JAX_LOG_COMPILES``) and their seconds."""
    secs = re.findall(r"Finished XLA compilation of .* in (\S+) sec", Path(log).read_text(errors="replace"))
    return len(secs), sum(map(float, secs))


# ---- request kinds: fn(clients, worker) -> (outcome, tokens)

def read_stream(stream, n: int = 1) -> int:
    """Read an OpenAI (``n`` choices, usage included), Anthropic or Responses stream to its end: the
    tokens its usage counts; Unexpected if its terminal event never comes."""
    finished, tokens, done = set(), 0, False
    for ev in stream:
        kind = getattr(ev, "type", "")                     # OpenAI chunks have none
        if kind == "response.failed":
            raise Unexpected(f"response.failed: {ev.response.error}")
        if kind in ("response.completed", "response.incomplete"):
            tokens, done = ev.response.usage.output_tokens, True
        elif kind in ("message_delta", "message_stop"):
            tokens, done = ev.usage.output_tokens if kind == "message_delta" else tokens, kind == "message_stop"
        elif not kind:
            finished.update(ch.index for ch in ev.choices if ch.finish_reason)
            tokens, done = (ev.usage.completion_tokens, len(finished) == n) if ev.usage else (tokens, False)
    if not done:
        raise Unexpected(f"the stream ended without its terminal event ({len(finished)}/{n} choices finished)")
    return tokens


def chat(c, w):
    n = 2 if w.rng.random() < 0.15 else 1
    kw = dict(model="m", messages=say(w.rng, 3, 60), max_tokens=w.rng.randint(8, 128), n=n,
              temperature=w.rng.choice([0, 0.8]))
    if w.rng.random() < 0.5:
        return "ok", c.oai.chat.completions.create(**kw).usage.completion_tokens
    stream = c.oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    return "ok", read_stream(stream, n)


def completions(c, w):
    kw = dict(model="m", prompt=say(w.rng, 3, 60)[0]["content"], max_tokens=w.rng.randint(8, 128),
              temperature=w.rng.choice([0, 0.8]))
    if w.rng.random() < 0.5:
        return "ok", c.oai.completions.create(**kw).usage.completion_tokens
    return "ok", read_stream(c.oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))


def messages(c, w):
    kw = dict(model="m", messages=say(w.rng, 3, 60), max_tokens=w.rng.randint(8, 128),
              extra_body={"temperature": w.rng.choice([0, 0.8])})       # the SDK has no temperature argument
    if w.rng.random() < 0.5:
        return "ok", c.ant.messages.create(**kw).usage.output_tokens
    return "ok", read_stream(c.ant.messages.create(**kw, stream=True))


def responses(c, w):
    kw = dict(model="m", input=say(w.rng, 3, 60), max_output_tokens=w.rng.randint(16, 128),
              temperature=w.rng.choice([0, 0.8]))
    if w.rng.random() < 0.5:
        r = c.oai.responses.create(**kw)
        if r.status == "failed":
            raise Unexpected(f"response failed: {r.error}")
        return "ok", r.usage.output_tokens
    return "ok", read_stream(c.oai.responses.create(**kw, stream=True))


def tools(c, w):
    msgs, n = say(w.rng, 3, 30), w.rng.randint(16, 128)
    if w.rng.random() < 0.6:
        r = c.oai.chat.completions.create(model="m", messages=msgs, max_tokens=n, tools=[WEATHER], temperature=0.8)
        return ("ok+tool_call" if r.choices[0].message.tool_calls else "ok"), r.usage.completion_tokens
    m = c.ant.messages.create(model="m", messages=msgs, max_tokens=n, tools=[ANTHROPIC_WEATHER])
    return ("ok+tool_call" if m.stop_reason == "tool_use" else "ok"), m.usage.output_tokens


def multi_turn(c, w):
    """One more turn of this worker's conversation (a system prompt, then 6 growing turns: the prefix cache)."""
    if len(w.conv) > 12:
        w.conv.clear()
    w.conv += [{"role": "system", "content": say(w.rng, 60, 100)[0]["content"]}] if not w.conv else []
    w.conv += say(w.rng, 10, 60)
    r = c.oai.chat.completions.create(model="m", messages=w.conv, max_tokens=w.rng.randint(16, 96), temperature=0)
    w.conv.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    with w.stats.lock:
        w.stats.notes["multi_turn prompt tokens"] += r.usage.prompt_tokens
        w.stats.notes["multi_turn cached tokens"] += getattr(r.usage.prompt_tokens_details, "cached_tokens", 0) or 0
    return "ok", r.usage.completion_tokens


def cancel(c, w):
    """A stream the client closes after 1..6 events (the server sees a disconnect)."""
    k, kw = w.rng.randint(1, 6), dict(model="m", messages=say(w.rng, 3, 30), max_tokens=512, stream=True)
    stream = (c.oai.chat.completions.create(**kw, temperature=0.8) if w.rng.random() < 0.6 else
              c.ant.messages.create(**kw))
    for i, _ in enumerate(stream, 1):
        if i == k:
            stream.close()
            return "cancelled", i
    return "finished first", 0


def timeout(c, w):
    """A request whose client timeout (50..500 ms) fires (the server sees a disconnect)."""
    client = c.oai.with_options(timeout=w.rng.uniform(0.05, 0.5))
    r = client.chat.completions.create(model="m", messages=say(w.rng, 3, 30), max_tokens=256, temperature=0.8)
    return "finished in time", r.usage.completion_tokens


INVALID = {
    "temperature 5": lambda c: c.oai.chat.completions.create(model="m", messages=MSG, temperature=5),
    "n 99": lambda c: c.oai.chat.completions.create(model="m", messages=MSG, n=99),
    "max_tokens 0": lambda c: c.oai.chat.completions.create(model="m", messages=MSG, max_tokens=0),
    "bad tool schema": lambda c: c.oai.chat.completions.create(model="m", messages=MSG, tools=[
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]),
    "anthropic max_tokens 0": lambda c: c.ant.messages.create(model="m", max_tokens=0, messages=MSG),
    "wrong key": lambda c: c.http.post("/v1/chat/completions", headers={"x-api-key": "wrong"},
                                       json={"model": "m", "messages": MSG}),
    "not JSON": lambda c: c.http.post("/v1/messages", content=b'{"model": "m", "messages": [',
                                      headers={"content-type": "application/json"}),
    "unknown route": lambda c: c.http.get("/v1/nope"),
}


def invalid(c, w):
    name = w.rng.choice(sorted(INVALID))
    try:
        status = getattr(INVALID[name](c), "status_code", 200)
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        status = e.status_code
    if 400 <= status < 500:
        return "rejected", 0
    raise Unexpected(f"the invalid request {name!r} got {status}")


def probe(c, w):
    path = w.rng.choice(["/health", "/metrics", "/v1/models"])
    if (status := c.http.get(path).status_code) != 200:
        raise Unexpected(f"GET {path}: {status}")
    return "ok", 0


KINDS = {"chat": (20, chat), "completions": (8, completions), "messages": (12, messages), "responses": (8, responses),
         "tools": (8, tools), "multi_turn": (10, multi_turn), "cancel": (10, cancel), "timeout": (5, timeout),
         "invalid": (5, invalid), "probe": (4, probe)}        # name: (weight, fn)


# ---- the load

def run_one(c: Clients, w: Worker, kind: str) -> None:
    t0 = time.monotonic()
    try:
        outcome, tokens = KINDS[kind][1](c, w)
    except (openai.APITimeoutError, anthropic.APITimeoutError, httpx.TimeoutException) as e:
        if kind != "timeout":
            return w.stats.error(kind, f"hang: no answer within {TIMEOUT_S:.0f}s ({type(e).__name__})", TIMEOUT_S)
        outcome, tokens = "timed out", 0
    except (openai.APIStatusError, anthropic.APIStatusError) as e:     # a status < 400: an in-band error event
        return w.stats.error(kind, f"HTTP {e.status_code}: {str(e.message)[:300]}", time.monotonic() - t0)
    except Exception as e:
        return w.stats.error(kind, f"{type(e).__name__}: {str(e)[:300]}", time.monotonic() - t0)
    w.stats.record(kind, outcome, time.monotonic() - t0, tokens)


def work(c: Clients, w: Worker, deadline: float) -> None:
    names, weights = list(KINDS), [k[0] for k in KINDS.values()]
    while time.monotonic() < deadline:
        run_one(c, w, w.rng.choices(names, weights)[0])


def poll_health(base: str, stop: threading.Event, period: float, out: list[float], stats: Stats) -> None:
    """GET /health every ``period`` s until ``stop``: latencies into ``out`` (anything but 200: an error)."""
    with httpx.Client(base_url=base, timeout=10) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                if (status := http.get("/health").status_code) != 200:
                    stats.error("health", f"GET /health: {status}")
            except Exception as e:
                stats.error("health", f"GET /health: {type(e).__name__}: {e}")
            out.append(dt := time.perf_counter() - t0)
            stop.wait(max(0.0, period - dt))


def sample(c: Clients, pid: int, stats: Stats, health: list[float], t0: float, stop: threading.Event,
           out: list[dict], log: str, quiet: bool) -> None:
    while not stop.wait(SAMPLE_S):
        with stats.lock:
            s = {"t_s": time.monotonic() - t0, "rss_mib": rss_mib(pid), "requests": len(stats.done) + len(stats.errors),
                 "tokens": sum(n for _, n in stats.done), "errors": len(stats.errors),
                 "health_ms": health[-1] * 1e3 if health else float("nan"), "compilations": compiles(log)[0]}
        try:
            metrics = c.http.get("/metrics", timeout=10).text
            s["server_tokens"] = float(re.search(r"^zoo_generation_tokens_total (\S+)", metrics, re.M)[1])
            s["cache_mib"] = sum(map(float, re.findall(r"^zoo_prefix_cache_bytes\S* (\S+)", metrics, re.M))) / MIB
        except Exception as e:
            stats.error("metrics", f"GET /metrics: {type(e).__name__}: {e}")
        out.append(s)
        if not quiet:
            print(f"  [{s['t_s']:4.0f}s] rss {s['rss_mib']:7.1f} MiB  requests {s['requests']:5d}  tokens "
                  f"{s['tokens']:7d}  errors {s['errors']}  /health {s['health_ms']:5.1f} ms  compilations "
                  f"{s['compilations']}", flush=True)


def run_load(c: Clients, pid: int, stats: Stats, seconds: float, args, seed: str, quiet: bool = False) -> dict:
    t0 = time.monotonic()
    stop, health, samples = threading.Event(), [], []
    bg = [threading.Thread(target=poll_health, args=(c.base, stop, 0.25, health, stats)),
          threading.Thread(target=sample, args=(c, pid, stats, health, t0, stop, samples, args.log, quiet))]
    workers = [threading.Thread(target=work, args=(c, Worker(stats, f"{seed}:{i}"), t0 + seconds))
               for i in range(args.clients)]
    for t in bg + workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    for t in bg:
        t.join()
    return {"t0": t0, "end": t0 + seconds, "samples": samples, "health": health}


def prime(c: Clients, stats: Stats, rows: int) -> None:
    """``rows`` requests at once, one with a prompt of ``PRIME_TOKENS`` token ids: the batch only grows,
    and each new shape (rows, slots) compiles while every stream waits; this way it takes the largest
    shape the load needs before the load."""
    def one(n: int) -> None:
        try:
            c.oai.completions.create(model="m", prompt=[10 + i % 300 for i in range(n)], max_tokens=256)
        except Exception as e:
            stats.error("prime", f"{type(e).__name__}: {str(e)[:300]}")
    with ThreadPoolExecutor(rows) as pool:
        list(pool.map(one, [PRIME_TOKENS] + [8] * (rows - 1)))


def warm_up(c: Clients, pid: int, stats: Stats, args) -> float:
    """Load in ``WARM_ROUND_S`` rounds for at least ``--warmup`` s, until two rounds in a row compile
    nothing (or ``--warmup-max`` s); the seconds it took."""
    t0, quiet_rounds, i = time.monotonic(), 0, 0
    prime(c, stats, rows := min(MAX_BATCH, 2 * args.clients))       # at most 2 rows per client (n=2)
    print(f"  warm-up {time.monotonic() - t0:4.0f}s: {rows} requests at once, one of {PRIME_TOKENS} tokens: "
          f"{compiles(args.log)[0]} compilations, {len(stats.errors)} errors", flush=True)
    while True:
        n0 = compiles(args.log)[0]
        run_load(c, pid, stats, WARM_ROUND_S, args, f"{args.seed}:warm{i}", quiet=True)
        n1, took, i = compiles(args.log)[0], time.monotonic() - t0, i + 1
        quiet_rounds = quiet_rounds + 1 if n1 == n0 else 0
        print(f"  warm-up {took:4.0f}s: {n1 - n0:3d} compilations, rss {rss_mib(pid):7.1f} MiB, "
              f"{len(stats.done)} requests, {len(stats.errors)} errors", flush=True)
        if took >= args.warmup and quiet_rounds >= 2 or took >= args.warmup_max:
            return took


# ---- large bodies, shutdown

def post_body(c: Clients, body: bytes) -> dict:
    t0 = time.perf_counter()
    try:
        r = c.http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        err = r.json().get("error") or {}
        return {"status": r.status_code, "code": err.get("code"), "seconds": time.perf_counter() - t0}
    except Exception as e:
        return {"status": None, "code": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0}


def two_bodies(c: Clients, size: int, expect: int, stats: Stats) -> dict:
    """Two chat bodies of ``size`` bytes at once while /health is polled every 20 ms."""
    head, tail = b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "', b'"}]}'
    body = head + b"lorem ipsum dolor " * ((size - len(head) - len(tail)) // 18) + tail
    stop, health = threading.Event(), []
    poller = threading.Thread(target=poll_health, args=(c.base, stop, 0.02, health, stats))
    poller.start()
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: post_body(c, body), range(2)))
    stop.set()
    poller.join()
    for a in answers:
        if a["status"] != expect:
            stats.error("large body", f"{len(body) / MIB:.1f} MiB body: {a} (expected {expect})")
    return {"body_mib": len(body) / MIB, "expect": expect, "answers": answers, "health": latency(health)}


def large_bodies(c: Clients, max_mb: float, stats: Stats) -> dict:
    stop, idle = threading.Event(), []
    threading.Timer(2.0, stop.set).start()
    poll_health(c.base, stop, 0.02, idle, stats)             # the baseline: the idle server
    return {"idle": latency(idle), "under": two_bodies(c, int((max_mb - 0.5) * MIB), 400, stats),
            "over": two_bodies(c, int((max_mb + 1) * MIB), 413, stats)}


LONG = {"chat": lambda c: c.oai.chat.completions.create(model="m", messages=MSG, max_tokens=4000, temperature=0.8,
                                                        stream=True),
        "completions": lambda c: c.oai.completions.create(model="m", prompt="Once", max_tokens=4000, temperature=0.8,
                                                          stream=True),
        "messages": lambda c: c.ant.messages.create(model="m", messages=MSG, max_tokens=4000, stream=True,
                                                    extra_body={"temperature": 0.8}),
        "responses": lambda c: c.oai.responses.create(model="m", input=MSG, max_output_tokens=4000, temperature=0.8,
                                                      stream=True)}     # streams for the shutdown: they run > 5 s


def watch_stream(c: Clients, kind: str, started: threading.Semaphore, out: dict) -> None:
    """Read one long stream to its end; out[kind]: how it ended."""
    n, end = 0, "cut (no terminal event)"
    try:
        for ev in LONG[kind](c):
            if (n := n + 1) == 3:
                started.release()
            if getattr(ev, "type", "") == "response.failed":
                end = f"in-band error (response.failed: {ev.response.error.message})"
            elif getattr(ev, "type", "") in ("message_stop", "response.completed", "response.incomplete") or any(
                    ch.finish_reason for ch in getattr(ev, "choices", None) or []):
                end = "clean finish"
    except (openai.APIConnectionError, anthropic.APIConnectionError) as e:
        end = f"cut ({type(e).__name__})"
    except (openai.APIError, anthropic.APIError) as e:      # the SDKs raise on an error event
        body = e.body if isinstance(e.body, dict) else {}
        end = f"in-band error ({body.get('message') or body.get('error', {}).get('message') or e.message})"
    except Exception as e:
        end = f"cut ({type(e).__name__}: {e})"
    if n < 3:
        started.release()
    out[kind] = {"end": end, "events": n, "ended_at": time.monotonic()}


def shut_down(c: Clients, proc: subprocess.Popen, drain: float) -> dict:
    """SIGTERM while four streams run: exit status, time to exit, how each stream ended."""
    started, ends = threading.Semaphore(0), {}
    threads = [threading.Thread(target=watch_stream, args=(c, k, started, ends)) for k in LONG]
    for t in threads:
        t.start()
    for _ in threads:
        started.acquire(timeout=60)
    t_sig = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        health = httpx.get(c.base + "/health", timeout=5).status_code
    except Exception as e:
        health = type(e).__name__
    try:
        status = proc.wait(drain + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        status = f"hung: killed after {drain + 30:.0f}s ({proc.wait()})"
    exit_s = time.monotonic() - t_sig
    for t in threads:
        t.join(TIMEOUT_S)
    streams = {k: {**v, "ended_at": v["ended_at"] - t_sig} for k, v in ends.items()}
    return {"exit_status": status, "exit_s": exit_s, "health_while_draining": health, "streams": streams}


# ---- the summary

def summarize(warm: Stats, load: Stats, final: Stats, run: dict, rss: list[float], comp: list[tuple]) -> dict:
    s, w = run["samples"], min(60.0, (run["end"] - run["t0"]) / 2)
    first = sum(n for t, n in load.done if t < run["t0"] + w) / w
    last = sum(n for t, n in load.done if run["end"] - w <= t <= run["end"]) / w
    served = [x for x in s if "server_tokens" in x]
    server = (served[-1]["server_tokens"] - served[0]["server_tokens"]) / (served[-1]["t_s"] - served[0]["t_s"]) \
        if len(served) > 1 else float("nan")
    slope = statistics.linear_regression([x["t_s"] / 60 for x in s], [x["rss_mib"] for x in s]).slope \
        if len(s) > 1 else float("nan")
    # RSS not held by the prefix cache, over the intervals in which nothing compiled: a leak shows here
    calm = [(b["rss_mib"] - b["cache_mib"] - a["rss_mib"] + a["cache_mib"], b["t_s"] - a["t_s"])
            for a, b in zip(served, served[1:]) if a["compilations"] == b["compilations"]]
    calm_slope = 60 * sum(d for d, _ in calm) / sum(t for _, t in calm) if calm else float("nan")
    errors = warm.errors + load.errors + final.errors
    return {"requests": {f"{k} {o}": {"n": len(v), "p50_s": statistics.median(v)}
                         for (k, o), v in sorted(load.seconds.items())},
            "warmup_requests": len(warm.done) + len(warm.errors), "notes": dict(load.notes),
            "tokens_per_s": {"first": first, "last": last, "last/first": last / first if first else float("nan"),
                             "window_s": w, "server_counted": server},
            "errors": {"count": len(errors), "warmup": len(warm.errors), "first": errors[:10]},
            "rss_mib": {"after_warmup": rss[0], "end": rss[1], "growth": rss[1] - rss[0],
                        "growth_%": 100 * (rss[1] / rss[0] - 1), "slope_per_min": slope, "after_large_bodies": rss[2],
                        "prefix_cache": [served[0]["cache_mib"], served[-1]["cache_mib"]] if served else [math.nan] * 2,
                        "calm_slope_per_min": calm_slope, "calm_s": sum(t for _, t in calm)},
            "compilations_during_load": {"n": comp[1][0] - comp[0][0], "seconds": comp[1][1] - comp[0][1]},
            "health_under_load": latency(run["health"]), "samples": s}


def report(r: dict) -> None:
    print("\nrequests by kind and outcome (load phase):")
    for key, v in r["requests"].items():
        print(f"  {key:28s} {v['n']:6d}   p50 {v['p50_s']:6.2f}s")
    t, m, cl = r["tokens_per_s"], r["rss_mib"], r["compilations_during_load"]
    print(f"tokens/s: first {t['window_s']:.0f}s {t['first']:.1f}, last {t['window_s']:.0f}s {t['last']:.1f}, "
          f"last/first {t['last/first']:.2f} (server's counter over the load: {t['server_counted']:.1f})")
    print(f"multi_turn: {r['notes'].get('multi_turn cached tokens', 0)} of "
          f"{r['notes'].get('multi_turn prompt tokens', 0)} prompt tokens from the prefix cache")
    print(f"errors: {r['errors']['count']} ({r['errors']['warmup']} in the warm-up)")
    for e in r["errors"]["first"][:5]:
        print(f"  {e['time']} {e['kind']}: {e['detail']}")
    print(f"RSS: {m['after_warmup']:.1f} MiB after the warm-up, {m['end']:.1f} MiB after the load: {m['growth']:+.1f} "
          f"MiB ({m['growth_%']:+.1f}%), slope {m['slope_per_min']:+.1f} MiB/min; {cl['n']} compilations during "
          f"the load ({cl['seconds']:.1f}s); {m['after_large_bodies']:.1f} MiB after the large bodies")
    print(f"     the prefix cache held {m['prefix_cache'][0]:.1f} -> {m['prefix_cache'][1]:.1f} MiB; RSS minus the "
          f"prefix cache, over the {m['calm_s']:.0f}s in which nothing compiled: {m['calm_slope_per_min']:+.1f} "
          "MiB/min")
    b, idle = r["large_bodies"], r["large_bodies"]["idle"]["p99_ms"]
    for name, h in [("idle", b["idle"]), ("under load", r["health_under_load"]),
                    (f"{b['under']['body_mib']:.1f} MiB bodies x2", b["under"]["health"]),
                    (f"{b['over']['body_mib']:.1f} MiB bodies x2", b["over"]["health"])]:
        print(f"/health {name:20s} p50 {h['p50_ms']:6.1f} ms  p99 {h['p99_ms']:6.1f} ms  max {h['max_ms']:6.1f} ms"
              f"  (n={h['n']}; p99 / idle p99: {h['p99_ms'] / idle:.1f}x)")
    for x in (b["under"], b["over"]):
        print(f"  {x['body_mib']:.1f} MiB bodies (expect {x['expect']}): "
              + ", ".join(f"{a['status']} {a['code']} in {a['seconds']:.2f}s" for a in x["answers"]))
    sd = r["shutdown"]
    print(f"SIGTERM: exit status {sd['exit_status']} after {sd['exit_s']:.2f}s; /health while draining: "
          f"{sd['health_while_draining']}")
    for k, v in sd["streams"].items():
        print(f"  {k:12s} {v['end']} after {v['events']} events, {v['ended_at']:.2f}s after SIGTERM")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--model", default="qwen38-tiny")
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds of load before the baseline, at least")
    ap.add_argument("--warmup-max", type=float, default=300.0, help="... at most (until nothing compiles)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drain", type=float, default=5.0, help="the server's --drain-seconds")
    ap.add_argument("--max-body-mb", type=float, default=32.0)
    ap.add_argument("--out", default="/tmp/soak.json")
    ap.add_argument("--log", default="/tmp/soak-server.log", help="the server's stderr")
    args = ap.parse_args()
    proc, base = start_server(args)
    print(f"zoo serve {args.model} at {base} (pid {proc.pid}, log {args.log}); warm-up, then "
          f"{args.minutes:g} min with {args.clients} clients", flush=True)
    try:
        c, warm, load, final = Clients(base), Stats(), Stats(), Stats()
        warm_s = warm_up(c, proc.pid, warm, args)
        rss, comp = [rss_mib(proc.pid)], [compiles(args.log)]
        run = run_load(c, proc.pid, load, args.minutes * 60, args, str(args.seed))
        rss.append(rss_mib(proc.pid))
        comp.append(compiles(args.log))
        bodies = large_bodies(c, args.max_body_mb, final)
        rss.append(rss_mib(proc.pid))
        shutdown = shut_down(c, proc, args.drain)
        for kind, v in shutdown["streams"].items():
            if v["end"].startswith("cut") or shutdown["exit_status"] != 0:
                final.error("shutdown", f"{kind} stream: {v['end']}; exit status {shutdown['exit_status']}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    r = {"args": vars(args), "warmup_s": warm_s, **summarize(warm, load, final, run, rss, comp),
         "large_bodies": bodies, "shutdown": shutdown,
         "server_log_tracebacks": Path(args.log).read_text(errors="replace").count("Traceback")}
    report(r)
    print(f"server log: {args.log} ({r['server_log_tracebacks']} tracebacks); summary: {args.out}")
    Path(args.out).write_text(json.dumps(r, indent=1, default=str))


if __name__ == "__main__":
    main()
