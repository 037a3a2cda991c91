"""``zoo serve`` in a subprocess, for tests of the real command line."""

from __future__ import annotations

import os
import subprocess
import sys


def start_zoo_serve(*args: str, env: dict | None = None, stderr=subprocess.DEVNULL
                    ) -> tuple[subprocess.Popen, dict[str, str]]:
    """Run ``python -m zoo serve ARGS`` and wait until it printed its banner: (the process, the
    banner's ``key: value`` lines, e.g. "OpenAI base URL", "API key"). ``env``: added to ours."""
    proc = subprocess.Popen([sys.executable, "-m", "zoo", "serve", *args], stdout=subprocess.PIPE, stderr=stderr,
                            text=True, env={**os.environ, **(env or {})})
    printed = {}
    for line in proc.stdout:
        key, _, value = line.strip().partition(": ")
        printed[key] = value.strip()
        if key == "API key":
            break
    return proc, printed
