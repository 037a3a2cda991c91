"""The real agent clients, Claude Code and Codex CLI, for tests that run them against ``zoo serve``.

``NpmClient.install()`` returns a client's executable, installed with ``npm install --prefix`` into a
cache outside the repository on first use and reused afterwards:
``$ZOO_AGENT_CLIENTS_DIR``, else ``$XDG_CACHE_HOME/zoo-agent-clients``, else
``~/.cache/zoo-agent-clients``, one folder per pinned version. A client that cannot be installed
or run fails the test with the reason (never a skip). ``claude_env`` / ``codex_home`` are the
settings the README gives users (base URL, key, no telemetry or update checks). ``RecordRequests``
wraps an ASGI app and keeps every HTTP exchange (path, query, headers, JSON body, status, response
text), so a test can compare what a client printed with what the server sent.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

INSTALL_TIMEOUT_S = 900


def cache_root() -> Path:
    if os.environ.get("ZOO_AGENT_CLIENTS_DIR"):
        return Path(os.environ["ZOO_AGENT_CLIENTS_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "zoo-agent-clients"


@dataclass(frozen=True)
class NpmClient:
    package: str
    version: str
    command: str

    @property
    def prefix(self) -> Path:
        return cache_root() / f"{self.package.rsplit('/', 1)[-1]}-{self.version}"

    @property
    def executable(self) -> Path:
        return self.prefix / "node_modules" / ".bin" / self.command

    def reported_version(self) -> str | None:
        """What ``COMMAND --version`` prints, or None if it does not run."""
        try:
            out = subprocess.run([str(self.executable), "--version"], capture_output=True, text=True, timeout=60,
                                 stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    def install(self) -> Path:
        """The executable of this exact version, installed first if needed (fails the test if it cannot be)."""
        self.prefix.mkdir(parents=True, exist_ok=True)
        with open(self.prefix.with_name(self.prefix.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)                      # parallel test workers install once
            if self.version not in (self.reported_version() or ""):
                self._npm_install()
            reported = self.reported_version()
        if self.version not in (reported or ""):
            pytest.fail(f"{self.package}@{self.version} was installed in {self.prefix} but "
                        f"`{self.command} --version` printed {reported!r}")
        return self.executable

    def _npm_install(self) -> None:
        npm = shutil.which("npm")
        if npm is None:
            pytest.fail(f"cannot install {self.package}@{self.version}: npm is not on PATH (install Node.js >= 20)")
        cmd = [npm, "install", "--prefix", str(self.prefix), "--no-audit", "--no-fund", "--loglevel=error",
               f"{self.package}@{self.version}"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                                 stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`{' '.join(cmd)}` took more than {INSTALL_TIMEOUT_S}s")
        if out.returncode != 0:
            pytest.fail(f"`{' '.join(cmd)}` failed ({out.returncode}):\n{(out.stdout + out.stderr)[-3000:]}")


CLAUDE_CODE = NpmClient("@anthropic-ai/claude-code", "2.1.332", "claude")
CODEX = NpmClient("@openai/codex", "0.171.0", "codex")


def _base_env(home: Path) -> dict[str, str]:
    """A clean environment: nothing of the caller's (keys, proxies, configs) but PATH and the locale."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb",
            "NO_COLOR": "1"}


def claude_env(base_url: str, key: str, home: Path) -> dict[str, str]:
    """Claude Code pointed at ``zoo serve`` (README): base URL and key; no telemetry, error
    reports or update checks (``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC``)."""
    return {**_base_env(home), "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": key,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


CODEX_CONFIG = """\
model = "{model}"
model_provider = "zoo"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[history]
persistence = "none"

[model_providers.zoo]
name = "zoo serve"
base_url = "{base_url}/v1"
env_key = "ZOO_API_KEY"
wire_api = "responses"
"""


def codex_home(base_url: str, model: str, home: Path) -> Path:
    """A ``CODEX_HOME`` whose ``config.toml`` points Codex at ``zoo serve`` (README)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(CODEX_CONFIG.format(model=model, base_url=base_url))
    return home


def codex_env(key: str, home: Path) -> dict[str, str]:
    return {**_base_env(home / "home"), "CODEX_HOME": str(home), "ZOO_API_KEY": key}


def run_client(cmd: list, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run a client to completion (stdin closed); a hang fails the test with what it printed."""
    cwd.mkdir(parents=True, exist_ok=True)
    try:
        return subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{cmd[0]} did not finish within {timeout}s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")


@dataclass
class Exchange:
    """One HTTP request and its answer, as the server saw them."""
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    status: int | None = None
    response: bytearray = field(default_factory=bytearray)

    def json(self):
        return json.loads(self.body) if self.body else None

    def sse(self) -> list[tuple[str | None, dict]]:
        """The response as server-sent events: [(event name, data)] (comments and [DONE] left out)."""
        events, name = [], None
        for line in self.response.decode().splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append((name, json.loads(line[5:])))
                name = None
        return events


class RecordRequests:
    """An ASGI wrapper that records every HTTP exchange of the app it wraps (``exchanges``)."""

    def __init__(self, app):
        self.app = app
        self.exchanges: list[Exchange] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body, first = b"", []
        while True:
            message = await receive()
            first.append(message)
            body += message.get("body", b"")
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        exchange = Exchange(scope["method"], scope["path"], scope.get("query_string", b"").decode(),
                            {k.decode(): v.decode() for k, v in scope["headers"]}, body)
        self.exchanges.append(exchange)

        async def replay():
            return first.pop(0) if first else await receive()

        async def record(message):
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            elif message["type"] == "http.response.body":
                exchange.response += message.get("body", b"")
            await send(message)

        await self.app(scope, replay, record)
