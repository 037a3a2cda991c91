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
