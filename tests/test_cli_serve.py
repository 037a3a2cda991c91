"""``zoo serve`` with no model arguments: the embedded tiny model on 127.0.0.1, a free port with
``--port 0``, a generated API key; both printed, and both work with the official SDKs."""

from __future__ import annotations

import signal

import anthropic
import openai

from tests.support.cli_serve import start_zoo_serve


def test_zoo_serve_tiny_model():
    proc, printed = start_zoo_serve("--port", "0", "--log-level", "warning", env={"ZOO_API_KEY": ""})
    try:
        assert printed["OpenAI base URL"].startswith("http://127.0.0.1:") and len(printed["API key"]) >= 24
        client = openai.OpenAI(base_url=printed["OpenAI base URL"], api_key=printed["API key"], max_retries=0)
        assert [m.id for m in client.models.list()] == ["qwen38-tiny"]
        r = client.chat.completions.create(model="qwen38-tiny", messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=2)
        assert r.usage.completion_tokens <= 2 and r.choices[0].finish_reason in ("stop", "length")
        a = anthropic.Anthropic(base_url=printed["Anthropic base URL"], api_key=printed["API key"], max_retries=0)
        assert a.messages.count_tokens(model="qwen38-tiny", messages=[{"role": "user", "content": "Hello"}]
                                       ).input_tokens == r.usage.prompt_tokens
        bad = openai.OpenAI(base_url=printed["OpenAI base URL"], api_key="guess", max_retries=0)
        try:
            bad.models.list()
            raise AssertionError("a wrong key was accepted")
        except openai.AuthenticationError:
            pass
    finally:
        proc.send_signal(signal.SIGINT)
        proc.stdout.close()
        assert proc.wait(30) == 0


def test_a_second_start_loads_every_program_from_the_compile_cache(tmp_path):
    """``zoo serve --compile-cache DIR``: the first start compiles its programs before it answers
    (``/health`` says "warming up" until then) and keeps them in DIR; a second start of the same
    configuration, with another cache directory that takes DIR's programs (``--trust-compile-cache``,
    as a session restoring a published dataset does), compiles nothing and says so."""
    import time

    import httpx2 as httpx

    config = ("--port", "0", "--log-level", "warning", "--context", "512", "--prefill-chunk", "64",
              "--max-batch", "2", "--spec", "1")
    caches = [("--compile-cache", str(tmp_path / "programs")),
              ("--compile-cache", str(tmp_path / "restored"), "--trust-compile-cache", str(tmp_path / "programs"))]
    ready = []
    for run in range(2):
        log = tmp_path / f"stderr-{run}.txt"
        with open(log, "w") as err:
            proc, printed = start_zoo_serve(*config, *caches[run], env={"ZOO_API_KEY": "k"}, stderr=err)
        try:
            health = httpx.get(printed["OpenAI base URL"].removesuffix("/v1") + "/health")
            if run == 0:                                   # answering while it compiles
                assert health.status_code == 503 and health.json()["status"] == "warming up", health.text
            deadline = time.monotonic() + 600
            while "[zoo] ready:" not in log.read_text():
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                time.sleep(0.2)
            assert httpx.get(printed["OpenAI base URL"].removesuffix("/v1") + "/health").status_code == 200
            client = openai.OpenAI(base_url=printed["OpenAI base URL"], api_key="k", max_retries=0)
            r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
            assert r.choices[0].finish_reason in ("stop", "length")
        finally:
            proc.send_signal(signal.SIGINT)
            proc.stdout.close()
            assert proc.wait(30) == 0
        text = log.read_text()
        assert f"compile cache: {tmp_path / ('programs', 'restored')[run]}" in text, text
        ready.append(next(line for line in text.splitlines() if line.startswith("[zoo] ready:")))
    compiled = [int(line.split("(")[1].split(" compiled")[0]) for line in ready]
    assert compiled[0] > 0 and compiled[1] == 0, ready
