"""Launch a multi-process JAX job on this machine's CPU (``tests.support.multihost_checks``): N
processes of D virtual devices each, joined through a coordinator on a free loopback port, every
process ended by the time ``run_job`` returns (killed at the deadline or when another one failed)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.support.paths import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(module: str, argv: list[str], processes: int, devices: int, logs: Path, env: dict | None = None,
          num_processes: int | None = None, coordinator: str | None = None) -> list[subprocess.Popen]:
    """``python -m module *argv`` as ``processes`` processes of ``devices`` CPU devices each (one process:
    no coordinator); ``num_processes`` / ``coordinator`` override what they are told (error cases).
    Their output goes to ``logs/process-<i>.log``."""
    logs.mkdir(parents=True, exist_ok=True)
    coordinator = coordinator or f"127.0.0.1:{free_port()}"
    flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    procs = []
    for i in range(processes):
        job = {} if processes == 1 and num_processes is None else {
            "ZOO_COORDINATOR": coordinator, "ZOO_NUM_PROCESSES": str(num_processes or processes),
            "ZOO_PROCESS_ID": str(i)}
        penv = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), **job, **(env or {})}
        with open(logs / f"process-{i}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-u", "-m", module, *argv], cwd=ROOT, env=penv,
                                          stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Each process's exit code; a process still running at the deadline, or after another one
    failed (plus a grace of 20 s), is killed and reported as None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + 20)
        time.sleep(0.2)
    codes = []
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
            codes.append(None)
        else:
            codes.append(p.returncode)
    return codes


def tail(logs: Path, n: int = 3000) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-n:]}" for f in sorted(logs.glob("process-*.log")))


def run_job(check: str, args: dict, out: Path, processes: int, devices: int, timeout: float = 600) -> list[dict]:
    """Run ``multihost_checks CHECK`` as ``processes`` x ``devices``; every process must succeed. Returns
    per process its JSON measurements with its arrays under ``"arrays"``."""
    out.mkdir(parents=True, exist_ok=True)
    procs = start("tests.support.multihost_checks", [check, json.dumps({**args, "out": str(out)})],
                  processes, devices, out)
    codes = wait_all(procs, timeout)
    assert codes == [0] * processes, f"exit codes {codes}\n{tail(out)}"
    results = []
    for i in range(processes):
        r = json.loads((out / f"process-{i}.json").read_text())
        with np.load(out / f"process-{i}.npz") as z:
            r["arrays"] = {k: z[k] for k in z.files}
        results.append(r)
    return results
