"""Operations of the server under load, on one batch row: a full queue answers 429 with Retry-After,
a request that waits too long 503, and a client that disconnects mid-stream frees its row. On two
rows: a client that leaves a fan-out (prompts x n) ends every choice, waiting or running; the
running gauge counts rows; prompt lists are capped."""

from __future__ import annotations

import concurrent.futures
import time

import httpx2 as httpx
import openai
import pytest

from tests.support.metrics import metric_total
from tests.support.server_helpers import QWEN_TEMPLATE, say, scripted_model
from zoo.server.app import ServerThread, create_app
from zoo.server.protocols.openai_api import MAX_PROMPTS

KEY = "limits-key"
LONG = 4000                  # tokens of the long answer that holds the only row (seconds even on a fast CPU)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = scripted_model(tmp_path_factory.mktemp("limits-ckpt"), QWEN_TEMPLATE, ["tick " * LONG])
    app = create_app(model, api_key=KEY, max_batch=1, max_queue=1, queue_timeout_s=1.5, keepalive_s=0.25,
                     model_name="limits")
    with ServerThread(app) as s:
        yield s


def metric(server, name: str, **labels) -> float:
    return metric_total(httpx.get(server.url + "/metrics", headers={"x-api-key": KEY}).text, name, **labels)


def test_queue_full_429_wait_503_and_disconnect_frees_the_row(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    short = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    stream = c.chat.completions.create(model="m", messages=[{"role": "user", "content": say(0)}], max_tokens=LONG,
                                       stream=True)
    chunks = iter(stream)
    for _ in range(8):                                         # the long answer holds the only row, decoding
        next(chunks)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(c.chat.completions.create, **short)
        deadline = time.monotonic() + 10
        while metric(server, "zoo_queue_depth") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError) as e:        # the queue (1) is full
            c.chat.completions.create(**short)
        assert int(e.value.response.headers["retry-after"]) >= 1
        with pytest.raises(openai.InternalServerError) as e:   # waited longer than queue_timeout_s
            waiting.result()
        assert e.value.status_code == 503 and e.value.body["code"] == "overloaded"
    stream.close()                                             # disconnect mid-stream: the row is freed
    deadline = time.monotonic() + 10                           # (bounded; under load a step may take a while)
    while metric(server, "zoo_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    r = c.chat.completions.create(**short)                     # so the next request is served, not timed out
    assert r.choices[0].finish_reason in ("stop", "length")
    assert metric(server, "zoo_requests_total", finish_reason="cancelled") >= 2      # the 503 and the disconnect
    assert metric(server, "zoo_http_requests_total", route="/v1/chat/completions", status="429") == 1
    assert metric(server, "zoo_requests_running") == 0 and metric(server, "zoo_queue_depth") == 0


def test_health_needs_no_key(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "model": "limits"}
    assert httpx.get(server.url + "/metrics").status_code == 401


@pytest.fixture(scope="module")
def two_rows(tmp_path_factory):
    model = scripted_model(tmp_path_factory.mktemp("fanout-ckpt"), QWEN_TEMPLATE, ["tick " * LONG])
    app = create_app(model, api_key=KEY, max_batch=2, max_queue=8, model_name="fanout")
    with ServerThread(app) as s:
        yield s


def test_a_client_leaving_a_fan_out_ends_every_choice_waiting_or_running(two_rows):
    """3 prompts x n=2 on 2 rows: one prompt's two choices run, four wait. The client gives up after
    2 s; within a few seconds nothing runs or waits, all six ended as cancelled, and the running gauge
    never counted more than the rows (it counts rows, not choices)."""
    body = {"model": "m", "prompt": [say(0)] * 3, "n": 2, "max_tokens": LONG, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(two_rows.url + "/v1/completions", json=body, headers={"x-api-key": KEY}, timeout=2)
    deadline, running = time.monotonic() + 15, []
    while time.monotonic() < deadline:
        running.append(metric(two_rows, "zoo_requests_running"))
        if running[-1] == 0 and metric(two_rows, "zoo_queue_depth") == 0:
            break
        time.sleep(0.1)
    assert running[-1] == 0 and metric(two_rows, "zoo_queue_depth") == 0, running[-5:]
    assert max(running) <= 2, max(running)
    assert metric(two_rows, "zoo_requests_total", finish_reason="cancelled") == 6
    generated = metric(two_rows, "zoo_generation_tokens_total")
    time.sleep(0.5)
    assert metric(two_rows, "zoo_generation_tokens_total") == generated        # nothing runs for it
    assert metric(two_rows, "zoo_http_requests_total", route="/v1/completions", status="499") == 1


def test_prompt_lists_are_capped(two_rows):
    c = openai.OpenAI(base_url=two_rows.url + "/v1", api_key=KEY, max_retries=0)
    for prompt, n, why in [([[1]] * (MAX_PROMPTS + 1), 1, f"{MAX_PROMPTS + 1} prompts; at most {MAX_PROMPTS}"),
                           (["a"] * 3, 3, "3 prompts x n=3 are 9 choices; this server queues at most 8")]:
        with pytest.raises(openai.BadRequestError, match=why) as e:
            c.completions.create(model="m", prompt=prompt, n=n, max_tokens=1)
        assert e.value.body["param"] == "prompt"
