"""``zoo serve``'s lifecycle, with the real CLI in a subprocess: a port in use fails at once (one
line, status 2, no model loaded), and SIGTERM drains: a running stream ends cleanly or with its
in-band error event (never a cut connection), then the process exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx2 as httpx

from tests.support.cli_serve import start_zoo_serve

DRAIN = 2.0


def test_port_in_use_fails_fast_without_loading_the_model():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "zoo", "serve", "--port", str(port)], capture_output=True,
                           text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    # that one line and nothing else: no "[zoo] loaded ..." line, no banner, no traceback
    assert r.stderr == f"zoo serve: cannot listen on 127.0.0.1:{port}: address already in use\n"
    assert r.stdout == ""


def test_sigterm_drains_a_running_stream_then_exits_0():
    proc, printed = start_zoo_serve("--port", "0", "--log-level", "warning", "--max-batch", "2",
                                    "--drain-seconds", str(DRAIN), env={"ZOO_API_KEY": "lifecycle-key"},
                                    stderr=subprocess.PIPE)
    try:
        events, t_signal = [], None
        body = {"model": "qwen38-tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3000,
                "temperature": 1.0, "seed": 1, "stream": True}         # sampled: it runs for a while
        with httpx.stream("POST", printed["OpenAI base URL"] + "/chat/completions", json=body, timeout=120,
                          headers={"Authorization": "Bearer lifecycle-key"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():                     # a cut connection raises here
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        t_signal = time.monotonic()
                        proc.send_signal(signal.SIGTERM)
        assert t_signal is not None and events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        if "error" in last:                                 # ended by the drain, in band
            assert "shutting down" in last["error"]["message"]
            assert time.monotonic() - t_signal > DRAIN - 0.5
        else:                                               # or it finished on its own meanwhile
            assert last["choices"][0]["finish_reason"] in ("stop", "length")
        assert proc.wait(DRAIN + 20) == 0, proc.stderr.read()
        assert time.monotonic() - t_signal < DRAIN + 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
