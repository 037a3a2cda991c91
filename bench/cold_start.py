"""Time to the first token of an agent-like prompt: a cold start, a start with the compile cache
warm, and a warm server (all in one run, on the embedded model).

    PYTHONPATH=. .venv/bin/python bench/cold_start.py [--prompt-tokens 12000] [--spec 3] [--workdir DIR]

Each start is ``zoo serve`` in a fresh process (``--compile-cache DIR``, the context sized for the
prompt). Measured from the process's start to the first streamed token of one chat request whose
prompt is ``--prompt-tokens`` tokens (a system prompt and tool definitions, as an agent sends);
then, in the same process, a second such prompt (different text: no prefix-cache hit). Printed:
seconds to the first token and the programs compiled / loaded from the compile cache at startup
(the server's "ready" line; a warmed server compiles nothing afterwards, which the suite asserts),
and the ratios against the cold start.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import openai

ROOT = Path(__file__).parents[1]


def agent_prompt(words: int, seed: int) -> list[dict]:
    system = "You are a coding agent. " + " ".join(f"rule{(i * 7 + seed) % 211}" for i in range(words))
    return [{"role": "system", "content": system}, {"role": "user", "content": f"Task {seed}: fix the failing test."}]


def start(workdir: Path, run: str, args: list[str]) -> tuple[subprocess.Popen, str, Path]:
    log = workdir / f"{run}.stderr"
    err = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "zoo", "serve", *args], stdout=subprocess.PIPE, stderr=err,
                            text=True, cwd=ROOT, env={**os.environ, "ZOO_API_KEY": "bench",
                                                      "PYTHONPATH": str(ROOT)})
    for line in proc.stdout:
        if line.startswith("  OpenAI base URL:"):
            return proc, line.split()[-1], log
    raise RuntimeError(f"zoo serve did not start:\n{log.read_text()[-3000:]}")


def first_token_s(url: str, messages: list[dict], t0: float) -> float:
    client = openai.OpenAI(base_url=url, api_key="bench", max_retries=0, timeout=3600)
    with client.chat.completions.create(model="m", messages=messages, max_tokens=8, stream=True) as stream:
        for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None and (delta.content or (delta.model_extra or {}).get("reasoning_content")):
                return time.perf_counter() - t0
    return time.perf_counter() - t0


def one_start(workdir: Path, run: str, args: list[str], words: int) -> dict:
    t0 = time.perf_counter()
    proc, url, log = start(workdir, run, args)
    try:
        first = first_token_s(url, agent_prompt(words, 1), t0)
        t1 = time.perf_counter()
        warm = first_token_s(url, agent_prompt(words, 2), t1)
    finally:
        proc.terminate()
        proc.wait(60)
    ready = re.search(r"ready: (\d+) programs in ([\d.]+)s \((\d+) compiled, (\d+) loaded", log.read_text())
    return {"first_token_s": first, "warm_first_token_s": warm, "programs": int(ready[1]),
            "warmup_s": float(ready[2]), "compiled": int(ready[3]), "loaded": int(ready[4])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=12000)
    ap.add_argument("--spec", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/zoo-bench-cold-start")
    a = ap.parse_args()
    workdir = Path(a.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    context = 1 << (a.prompt_tokens + 512).bit_length()
    args = ["--port", "0", "--log-level", "warning", "--spec", str(a.spec), "--context", str(context),
            "--max-batch", "4", "--compile-cache", str(workdir / "programs")]
    words = a.prompt_tokens * 2 // 11               # " ruleN" is about 5.5 tokens of the demo tokenizer
    cold = one_start(workdir, "cold", args, words)
    cached = one_start(workdir, "cached", args, words)
    print(f"prompt ~{a.prompt_tokens} tokens, context {context}, spec {a.spec}")
    print(f"{'':34s}{'first token':>12s}{'programs':>10s}{'compiled':>10s}{'loaded':>8s}")
    for name, r, key in [("cold start", cold, "first_token_s"), ("start with a warm compile cache", cached,
                                                                  "first_token_s"),
                         ("warm server (same process)", cold, "warm_first_token_s")]:
        compiled, loaded = (r["compiled"], r["loaded"]) if key == "first_token_s" else (0, 0)
        print(f"{name:34s}{r[key]:11.1f}s{r['programs']:10d}{compiled:10d}{loaded:8d}")
    print(f"ratio cold / cached start: {cold['first_token_s'] / cached['first_token_s']:.2f}; "
          f"cold / warm server: {cold['first_token_s'] / cold['warm_first_token_s']:.2f}")


if __name__ == "__main__":
    main()
