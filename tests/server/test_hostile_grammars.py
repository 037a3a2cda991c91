"""A seeded fuzz of hostile structured-output requests against a live server (the random tiny model):
schemas of many properties (required or optional), deep nesting, ``$ref`` loops with and without a
base case, regex and Lark bombs, grammars with an empty language, choice lists past the cap, through
each surface that takes a constraint (chat ``response_format``, completions ``guided_*``, Responses
``text.format``, Anthropic ``output_config.format``), some with ``n`` choices.

Asserted per case: a status below 500, an answer within ``TIMEOUT_S`` (a hang otherwise), a 400 for
what the server must refuse before generating (over the size caps, an empty language llguidance can
tell, a limit hit on the first step), a 200 whose choices end normally or with finish_reason
"error" (a limit hit mid-output) otherwise; ``/health``, probed all along from another thread,
never stalls (``HEALTH_STALL_S``, a stall detector, not a latency target: the worst probe is
printed); and a normal request works afterwards.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx2 as httpx
import pytest

from tests.support.helpers import random_tiny_model
from zoo.server.app import ServerThread, create_app
from zoo.server.grammar import MAX_CHOICES, MAX_GRAMMAR_BYTES

KEY = "hostile-key"
HEADERS = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY, "anthropic-version": "2023-06-01"}
TIMEOUT_S = 30
HEALTH_STALL_S = 5.0          # a /health slower than this means the event loop was held
SEED = 20261204


def props(n: int, required: bool) -> dict:
    names = [f"p{i}" for i in range(n)]
    return {"type": "object", "properties": {k: {"type": "integer"} for k in names},
            **({"required": names} if required else {}), "additionalProperties": False}


def nested(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


LOOP_DEFS = {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}
NO_BASE = {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
           "$ref": "#/$defs/a"}


def cases(rng: random.Random) -> list[tuple[str, str, object, str]]:
    """(name, kind, value, expected) for the constraint kinds, the sizes drawn. expected: "400", "200",
    "error" (a 200 whose every choice ends with finish_reason "error" on OpenAI's surfaces, a 400 on
    Anthropic's and the Responses API), or "any" (what llguidance makes of it)."""
    over = MAX_GRAMMAR_BYTES // 20 + rng.randrange(2000)        # ~30 bytes a property: over the byte cap
    return [
        ("properties over the cap", "json", props(over, rng.random() < 0.5), "400"),
        ("properties, required", "json", props(rng.randrange(200, 1500), True), "any"),
        ("properties, optional", "json", props(rng.randrange(300, 1500), False), "any"),
        ("nested deep", "json", nested(rng.randrange(40, 120)), "any"),
        ("self $ref", "json", {"$ref": "#"}, "400"),
        ("mutual $ref", "json", {"$defs": LOOP_DEFS, "$ref": "#/$defs/a"}, "400"),
        ("$ref without a base case", "json", NO_BASE, "any"),
        ("not anything", "json", {"not": {}}, "any"),
        ("regex bomb", "regex", "(a{%d}){%d}" % (rng.randrange(500, 2000), rng.randrange(500, 2000)), "error"),
        ("empty regex class", "regex", "[a&&b]", "400"),
        ("lark alternatives over the cap", "grammar",
         "start: " + " | ".join(f'"w{i}"' for i in range(MAX_GRAMMAR_BYTES // 6 + rng.randrange(1000))), "400"),
        ("lark with an empty language", "grammar", 'start: a\na: a "x"', "400"),
        ("choices over the cap", "choice", [f"c{i}" for i in range(MAX_CHOICES + 1 + rng.randrange(5000))], "400"),
        ("choices at the cap", "choice", [f"c{i}" for i in range(MAX_CHOICES)], "200"),
    ]


def body(surface: str, kind: str, value, n: int) -> tuple[str, dict]:
    """The request carrying the constraint through ``surface`` (JSON schemas on every surface, the
    others through the OpenAI extension fields)."""
    user = [{"role": "user", "content": "Answer."}]
    if kind == "json" and surface == "responses":
        return "/v1/responses", {"model": "m", "input": "Answer.", "max_output_tokens": 12,
                                 "text": {"format": {"type": "json_schema", "name": "x", "schema": value}}}
    if kind == "json" and surface == "anthropic":
        return "/v1/messages", {"model": "m", "max_tokens": 12, "messages": user,
                                "output_config": {"format": {"type": "json_schema", "schema": value}}}
    if kind == "json" and surface == "chat":
        return "/v1/chat/completions", {"model": "m", "messages": user, "max_tokens": 12, "n": n,
                                        "response_format": {"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": value}}}
    field = {"json": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar", "choice": "guided_choice"}
    return "/v1/completions", {"model": "m", "prompt": "Answer:", "max_tokens": 12, "n": n, field[kind]: value}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = random_tiny_model(tmp_path_factory)
    with ServerThread(create_app(model, api_key=KEY, model_name="tiny", max_batch=4)) as s:
        yield s


class HealthProbe(threading.Thread):
    """Probes ``/health`` every 50 ms; ``worst``: the slowest answer seen."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.worst, self.stop = url, 0.0, threading.Event()

    def run(self):
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                assert c.get(self.url + "/health").status_code == 200
                self.worst = max(self.worst, time.perf_counter() - t0)
                time.sleep(0.05)


def test_hostile_constraints_answer_in_time_below_500_and_the_server_serves_on(server):
    rng = random.Random(SEED)
    probe = HealthProbe(server.url)
    probe.start()
    seen = []
    try:
        for name, kind, value, expected in cases(rng):
            surface = rng.choice(["chat", "completions", "responses", "anthropic"])
            n = rng.choice([1, 1, 2])
            path, payload = body(surface, kind, value, n)
            t0 = time.perf_counter()
            r = httpx.post(server.url + path, json=payload, headers=HEADERS, timeout=TIMEOUT_S)
            took = time.perf_counter() - t0
            seen.append((name, path, r.status_code, round(took, 2)))
            assert r.status_code < 500, (name, path, r.text[:500])
            openai_surface = path in ("/v1/chat/completions", "/v1/completions")
            want = {"error": "200" if openai_surface else "400"}.get(expected, expected)
            if want != "any":
                assert str(r.status_code) == want, (name, path, r.text[:500])
            if r.status_code == 400:
                message = json.dumps(r.json())
                assert len(message) < 2000 and "backtrace" not in message and "<state>" not in message, message
            elif openai_surface:
                reasons = [c["finish_reason"] for c in r.json()["choices"]]
                assert len(reasons) == n and set(reasons) <= {"stop", "length", "error"}, (name, reasons)
                if expected == "error":
                    assert set(reasons) == {"error"}, (name, r.json()["choices"])
    finally:
        probe.stop.set()
        probe.join()
    print("\n".join(map(str, seen)), f"\nworst /health {probe.worst:.3f} s")
    assert probe.worst < HEALTH_STALL_S, (probe.worst, seen)
    r = httpx.post(server.url + "/v1/chat/completions", headers=HEADERS, timeout=TIMEOUT_S, json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_limit_hit_mid_output_ends_that_choice_with_an_error_not_the_request(server):
    """A ``$ref`` without a base case compiles and starts, then runs past llguidance's Earley-item
    limit as the nesting grows: the choice ends with finish_reason "error" and the message, the
    answer is a 200 (streamed: the same, in band, and the stream ends with [DONE])."""
    payload = {"model": "m", "prompt": "Answer:", "max_tokens": 64, "n": 2, "guided_json": NO_BASE}
    r = httpx.post(server.url + "/v1/completions", json=payload, headers=HEADERS, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text[:500]
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "error", choice
        assert "broke the output grammar" in choice["error"]["message"], choice
    with httpx.stream("POST", server.url + "/v1/completions", json={**payload, "stream": True}, headers=HEADERS,
                      timeout=TIMEOUT_S) as s:
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    finals = [c for line in lines[:-1] for c in json.loads(line)["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in finals) == [0, 1] and all(c["finish_reason"] == "error" for c in finals)
