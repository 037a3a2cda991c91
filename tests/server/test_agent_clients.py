"""Real agent clients end to end against ``zoo serve`` on 127.0.0.1: Claude Code (``claude -p``) on
``/v1/messages`` and Codex CLI (``codex exec``) on ``/v1/responses``, installed from npm at pinned
versions (``tests.support.agent_clients``: a client that cannot be installed or run fails the
test) and configured as the README tells users.

Both clients send prompts of over 10,000 tokens (system prompt, tools, environment), so the model
is a copy of the tiny model with a context of ``CONTEXT`` tokens; it answers the prompt's marker
(``say``) with a scripted reasoning and text. Each test checks that the client exits 0, that the
server answered every request it made with 200, and that what the client printed is exactly the
text the server streamed. ``ZOO_AGENT_REQUESTS_DIR=DIR`` also writes each client's requests there
(JSON lines), the record of what the clients send.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.agent_clients import (
    CLAUDE_CODE,
    CODEX,
    Exchange,
    RecordRequests,
    claude_env,
    codex_env,
    codex_home,
    run_client,
)
from tests.support.server_helpers import QWEN_TEMPLATE, say, scripted_model
from zoo.server.app import ServerThread, create_app

KEY = "agent-clients-key"
MODEL = "zoo-agent"
CONTEXT = 20480                 # the clients' prompts are 11-14k tokens with the tiny model's tokenizer
SCRIPT = "The user wants a greeting.\n</think>\n\nHello from zoo!"
ANSWER = "Hello from zoo!"
PROMPT = "Say hello. " + say(0)
CLIENT_TIMEOUT_S = 1500         # a long prompt's prefill on a slow, shared CPU


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = scripted_model(tmp_path_factory.mktemp("agent-ckpt"), QWEN_TEMPLATE, [SCRIPT], context=CONTEXT)
    app = create_app(model, api_key=KEY, model_name=MODEL, max_batch=2, prefill_chunk=4096, context=CONTEXT,
                     queue_timeout_s=CLIENT_TIMEOUT_S)
    recorder = RecordRequests(app)
    with ServerThread(recorder) as s:
        s.recorder = recorder
        yield s


def _record(client: str, exchanges: list[Exchange]) -> None:
    out = os.environ.get("ZOO_AGENT_REQUESTS_DIR")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    with open(Path(out) / f"{client}.jsonl", "w") as f:
        for x in exchanges:
            f.write(json.dumps({"method": x.method, "path": x.path, "query": x.query, "headers": x.headers,
                                "body": x.json(), "status": x.status}) + "\n")


def _failure(result, exchanges: list[Exchange]) -> str:
    seen = "\n".join(f"{x.method} {x.path}?{x.query} -> {x.status} {bytes(x.response[:300])!r}" for x in exchanges)
    return (f"exit status {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}\n"
            f"requests:\n{seen}")


def test_claude_code_print_mode_and_a_continued_turn(server, tmp_path):
    claude = CLAUDE_CODE.install()
    since = len(server.recorder.exchanges)
    result = run_client([claude, "-p", PROMPT, "--max-turns", "1"], claude_env(server.url, KEY, tmp_path / "home"),
                        tmp_path / "work", CLIENT_TIMEOUT_S)
    exchanges = server.recorder.exchanges[since:]
    _record("claude-code", exchanges)
    assert result.returncode == 0 and exchanges, _failure(result, exchanges)
    assert all(x.status == 200 for x in exchanges), _failure(result, exchanges)
    turns = [x for x in exchanges if x.path == "/v1/messages"]
    assert turns and turns[0].query == "beta=true" and "anthropic-beta" in turns[0].headers
    assert any(m["role"] == "system" for m in turns[0].json()["messages"])     # the request that used to get a 400
    events = turns[-1].sse()
    usage = events[0][1]["message"]["usage"]
    # Claude Code marks its system prompt and last message with cache_control: most of the >10k-token
    # prompt is written to (first turn) or read from (later turns) the prefix cache, the rest is input
    assert usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"] > 10_000
    assert usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"] > 10_000
    generated = "".join(d["delta"]["text"] for name, d in events
                        if name == "content_block_delta" and d["delta"]["type"] == "text_delta")
    assert events[-1][0] == "message_stop" and generated == ANSWER
    assert result.stdout.strip() == generated, _failure(result, exchanges)

    # a second turn of the same conversation (--continue): its prompt is the first one plus the turn,
    # and the prefix cache serves most of it (the system prompt and tools: over 10k tokens)
    since = len(server.recorder.exchanges)
    again = run_client([claude, "-p", "Say it again. " + say(0), "--continue", "--max-turns", "1"],
                       claude_env(server.url, KEY, tmp_path / "home"), tmp_path / "work", CLIENT_TIMEOUT_S)
    exchanges = server.recorder.exchanges[since:]
    assert again.returncode == 0 and exchanges and all(x.status == 200 for x in exchanges), _failure(again, exchanges)
    second = [x for x in exchanges if x.path == "/v1/messages"][-1]
    assert ANSWER in json.dumps([m for m in second.json()["messages"] if m["role"] == "assistant"])   # turn 1 replayed
    usage = second.sse()[0][1]["message"]["usage"]
    assert usage["cache_read_input_tokens"] > 10_000, usage
    assert usage["cache_read_input_tokens"] > 0.8 * (usage["input_tokens"] + usage["cache_read_input_tokens"]
                                                     + usage["cache_creation_input_tokens"]), usage
    assert again.stdout.strip() == ANSWER, _failure(again, exchanges)


def test_codex_exec(server, tmp_path):
    codex = CODEX.install()
    home = codex_home(server.url, MODEL, tmp_path / "codex-home")
    since = len(server.recorder.exchanges)
    result = run_client([codex, "exec", "--strict-config", "--skip-git-repo-check", "--ephemeral", PROMPT],
                        codex_env(KEY, home), tmp_path / "work", CLIENT_TIMEOUT_S)
    exchanges = server.recorder.exchanges[since:]
    _record("codex", exchanges)
    assert result.returncode == 0 and exchanges, _failure(result, exchanges)
    assert all(x.status == 200 for x in exchanges), _failure(result, exchanges)
    turns = [x for x in exchanges if x.path == "/v1/responses"]
    assert turns and turns[0].json()["stream"] is True
    events = turns[-1].sse()
    assert events[-1][0] == "response.completed"
    assert events[-1][1]["response"]["usage"]["input_tokens"] > 10_000
    generated = "".join(d["delta"] for name, d in events if name == "response.output_text.delta")
    assert generated == ANSWER
    assert result.stdout.strip() == generated, _failure(result, exchanges)
