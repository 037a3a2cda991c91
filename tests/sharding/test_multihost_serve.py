"""``zoo serve`` over several processes (``zoo.cli.serve``, ``zoo.engine.replica``): the real command
on 2 processes of one CPU device each (gloo collectives) against 1 process on 1 device.

Process 0 serves HTTP and drives the engine; process 1 replays its steps. The same conversation
through both SDKs (greedy and sampled chat, two choices, an output grammar, a tool call, a stream
the client drops, a prefix-cache hit from host RAM, MTP drafts) gets the same answers as one
process. A follower killed mid-stream ends that stream with an error naming it and process 0
exits with status 3; a follower given another model is a clear error on both. Every process a
test starts is ended by the test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import anthropic
import openai
import pytest

from tests.support.multihost import free_port, start, tail, wait_all
from zoo.train import corpus

KEY = "multihost-key"
# One device per process: what this file adds to ``test_multihost`` (whose engine session runs on 2 x 4
# devices) is the HTTP surfaces and every request option over the replica channel, which do not depend
# on a process's device count; 4 devices each with gloo collectives on 2 cores made the conversation
# take 2.5x as long (181 s against 72 s, alone).
DEVICES = 1
# float32: 1 x 8 and 2 x 4 devices reduce in other orders; the answers must not hinge on a bf16 tie.
# A prefix-cache device tier of ~0.1 MB moves every entry to host RAM at once: hits restore from there.
# Small fixed shapes (the engine's programs are compiled for them); the conversation warms up every
# process (their warmups' collectives pair up), the other tests compile what they use.
ARGS = ["serve", "--port", "0", "--log-level", "warning", "--follower-timeout", "5", "--context", "512",
        "--max-batch", "4", "--prefill-chunk", "64"]
LAZY = ["--no-warmup"]
# Fixed MTP drafts: sampled answers then do not depend on the speculation policy's timings, so the two
# servers must give the same (the auto policy over two processes is ``test_multihost``'s engine session).
# No prefill time budget: its narrowed pieces follow each server's own timings (the processes of one job
# decide alike from the leader's table, ``test_replica``), and other widths round otherwise.
EXACT = ["--dtype", "float32", "--spec", "2", "--spec-policy", "fixed", "--prefix-cache-gb", "0.0001",
         "--prefix-cache-host-gb", "1", "--interleave-ratio", "0"]
TWO = ("--model", "qwen38-tiny", "--mesh", "tp", *EXACT)      # the two-process servers (the same programs)
TOOLS = [corpus.TOOLS[n] for n in ("get_weather", "add")]     # the demo model's own tools
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}


@contextlib.contextmanager
def zoo_serve(logs, processes: int, devices: int, args=("--mesh", "tp"), timeout: float = 240):
    """``zoo serve`` as ``processes`` x ``devices``; yields (processes, OpenAI base URL) once process 0
    printed its banner. On the way out every process still running gets SIGTERM (process 0) and is
    killed past the drain."""
    procs = start("zoo", [*ARGS, *args], processes, devices, logs, env={"ZOO_API_KEY": KEY})
    try:
        banner = logs / "process-0.log"
        deadline = time.monotonic() + timeout
        while "API key" not in banner.read_text():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), tail(logs)
            time.sleep(0.2)
        yield procs, re.search(r"OpenAI base URL:\s+(\S+)", banner.read_text()).group(1)
    finally:
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)
        wait_all(procs, 60)


def conversation(base_url: str) -> list:
    """The same requests, in the same order, through both SDKs: what each answered."""
    oa = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=600)
    an = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=KEY, max_retries=0, timeout=600)
    ask = [{"role": "user", "content": "What is 12+35?"}]
    out = []

    def chat(**kw):
        r = oa.chat.completions.create(model="m", messages=kw.pop("messages", ask), max_tokens=kw.pop("max_tokens", 40),
                                       **kw)
        out.append([(c.message.content, getattr(c.message, "reasoning_content", None), c.finish_reason,
                     [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []])
                    for c in r.choices] + [r.usage.model_dump()])

    chat(temperature=0)
    chat(temperature=0.9, top_p=0.95, seed=7, n=2)
    chat(temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    chat(temperature=0, tools=TOOLS, max_tokens=128,
         messages=[{"role": "user", "content": "What's the weather in Paris?"}])
    with oa.chat.completions.create(model="m", messages=ask, max_tokens=200, temperature=0, stream=True) as s:
        for i, _ in enumerate(s):                    # dropped after 3 chunks: its cancel is replayed too
            if i == 2:
                break
    system = [{"type": "text", "text": "You are a careful calculator. Think, then answer with the number.",
               "cache_control": {"type": "ephemeral"}}]
    for question in ("What is 7+8?", "What is 30+4?"):     # the second restores the system prompt's state
        m = an.messages.create(model="m", max_tokens=40, system=system, extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": question}])
        out.append(([(b.type, getattr(b, "text", None) or getattr(b, "thinking", None)) for b in m.content],
                    m.stop_reason, m.usage.model_dump()))
    with an.messages.stream(model="m", max_tokens=40, extra_body={"temperature": 0},
                            messages=[{"role": "user", "content": "Hi!"}]) as s:
        out.append("".join(s.text_stream))
    return out


def test_a_conversation_through_process_0_equals_one_process(tmp_path):
    """Qwen on "tp" (a multi-process engine does not depend on the model: GLM on "ep" over two
    processes is ``test_multihost``'s). The two processes warm up before they serve (their warmups'
    collectives pair up); the reference is one process on one device, compiling what the
    conversation uses (``--no-warmup``: warming one process is ``test_compile_once``'s). float32
    answers do not depend on the reduction order: 1 x 8 devices gave the same as 1 x 1."""
    with zoo_serve(tmp_path / "one", 1, 1, ("--model", "qwen38-tiny", *EXACT, *LAZY)) as (procs, url):
        want = conversation(url)
    assert wait_all(procs, 1) == [0]
    with zoo_serve(tmp_path / "two", 2, DEVICES, TWO) as (procs, url):
        got = conversation(url)
        procs[0].send_signal(signal.SIGTERM)             # the drain, then the followers are told to stop
        codes = wait_all(procs, 60)
    assert codes == [0, 0], tail(tmp_path / "two")
    assert got == want
    anthropic_pair = want[-3:-1]
    cached = [r[2]["cache_read_input_tokens"] for r in anthropic_pair]
    assert cached[0] == 0 and cached[1] > 0, cached     # a prefix restored from host RAM
    assert any(c[3] for c in want[3][:-1]), want[3]      # the tool call the model made
    assert "process 1 of 2" in (tmp_path / "two" / "process-1.log").read_text()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_follower_lost_mid_stream_ends_it_with_an_error_and_process_0_exits_3(tmp_path, how):
    """A follower killed (dies) or stopped (SIGSTOP: hangs) while a stream runs: the stream ends with
    an error naming it, process 0 exits with status 3 within --follower-timeout (5 s) and a grace.
    The conversation's settings, compiling lazily: its warmed programs come from the compile cache."""
    with zoo_serve(tmp_path, 2, DEVICES, (*TWO, *LAZY)) as (procs, url):
        oa = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=600)
        chunks, error = 0, None
        try:
            for _ in oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "Tell a story."}],
                                                max_tokens=2000, temperature=0.7, stream=True):
                chunks += 1
                if chunks == 3:
                    procs[1].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
                    t_lost = time.monotonic()
        except openai.APIError as e:
            error = str(e)
        assert chunks >= 3 and error is not None, (chunks, tail(tmp_path))
        assert "the server lost a process: process 1 of 2 stopped responding" in error, error
        code = wait_all(procs[:1], 30)[0]
        took = time.monotonic() - t_lost
        procs[1].kill()                                    # a stopped follower stays stopped
    assert code == 3, tail(tmp_path)
    assert took < 30
    assert "ending the requests in flight" in (tmp_path / "process-0.log").read_text()


@pytest.mark.parametrize("case", ["model", "leader"])
def test_a_follower_given_another_model_or_losing_its_leader_ends(tmp_path, case):
    """A follower started with another model says so and exits 3, and process 0 names it and exits 3;
    a follower whose process 0 is killed ends too (bounded)."""
    follower = ["--model", "glm53-tiny"] if case == "model" else []
    coordinator = f"127.0.0.1:{free_port()}"
    procs = start("zoo", [*ARGS, "--mesh", "tp", *LAZY], 1, DEVICES, tmp_path, num_processes=2, coordinator=coordinator,
                  env={"ZOO_API_KEY": KEY})
    logs1 = tmp_path / "one"        # process 1, with its own command line
    procs += start("zoo", [*ARGS, "--mesh", "tp", *LAZY, *follower], 1, DEVICES, logs1, num_processes=2,
                   coordinator=coordinator,
                   env={"ZOO_PROCESS_ID": "1"})
    try:
        if case == "leader":
            deadline = time.monotonic() + 240
            while "replaying" not in (logs1 / "process-0.log").read_text():
                assert time.monotonic() < deadline and procs[1].poll() is None, tail(logs1)
                time.sleep(0.2)
            procs[0].kill()
        codes = wait_all(procs, 120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    follower_log = (logs1 / "process-0.log").read_text()
    if case == "model":
        assert codes == [3, 3], tail(tmp_path) + tail(logs1)
        assert "another model than process 0: --model 'glm53-tiny' (process 0: 'qwen38-tiny')" in follower_log
        assert "process 1 of 2 failed: ValueError: this process was given another model" in \
            (tmp_path / "process-0.log").read_text()
    else:
        assert codes[1] not in (0, None), follower_log[-3000:]


def test_bad_job_arguments_are_one_clear_line_before_anything_loads():
    for argv, why in [(["--process-id", "1"], "give the coordinator address, the number of processes"),
                      (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"],
                       "coordinator address must be HOST:PORT, got 'nohost'"),
                      (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
                       "process id 2 is outside 0..1")]:
        r = subprocess.run([sys.executable, "-m", "zoo", "serve", *argv], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert r.returncode == 2 and r.stderr.startswith("zoo serve: ") and why in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and "loaded" not in r.stderr


def test_a_cluster_jax_detects_needs_no_arguments(monkeypatch):
    """Where JAX detects a cluster (here SLURM's variables), ``zoo serve`` joins it with no flags."""
    from zoo.cli.serve import _job
    from zoo.distributed import cluster_size

    args = argparse.Namespace(coordinator=None, num_processes=None, process_id=None)
    for var in ("ZOO_COORDINATOR", "ZOO_NUM_PROCESSES", "ZOO_PROCESS_ID", "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri"):
        monkeypatch.delenv(var, raising=False)
    assert cluster_size() == 1 and _job(args) is None
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[1-4]")
    assert cluster_size() == 4 and _job(args) == {}
