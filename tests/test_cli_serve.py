"""``zoo serve`` with no model arguments: the embedded tiny model on 127.0.0.1, a free port with
``--port 0``, a generated API key; both printed, and both work with the official SDKs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import anthropic
import openai


def test_zoo_serve_tiny_model():
    proc = subprocess.Popen([sys.executable, "-m", "zoo", "serve", "--port", "0", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "ZOO_API_KEY": ""})
    try:
        printed = {}
        for line in proc.stdout:
            key, _, value = line.strip().partition(": ")
            printed[key] = value.strip()
            if key == "API key":
                break
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
