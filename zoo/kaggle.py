"""Notebook helpers (the Kaggle notebooks in ``examples/kaggle/``): the caches a session has
attached, where a model's sources are, ``zoo serve`` in the background, and what it measures.

    on_kaggle() -> bool                          inside a Kaggle notebook session
    find_cache(model, quant, dtype, cache)       -> CacheLookup: the entry a load would restore (or
                                                 None), every candidate seen and why it does not serve
    plan_for(model, quant, devices, layout, gguf)  -> the memory plan (``zoo.tools.plan``): from the
                                                 config and the recipe, or from the GGUF's header
                                                 (local or read remotely) for a whole-GGUF recipe
    local_sources(model) -> Path | None          a registry model's checkpoint if on this machine
    fetch_sources(model, gguf=None) -> Path      download the checkpoint (huggingface_hub) and put the
                                                 recipe's GGUF (a split set: every file) beside it
    eval_text(path=None) -> str                  the text ``zoo eval`` scores: a file, or wikitext-2's test split
    zoo_command(*args, env=None) -> str          ``python -m zoo ARGS``, its output shown as it comes
                                                 (a notebook does not show a child's own output)
    ZooServer(*args).start()                     ``python -m zoo serve ARGS --port 0`` as a child process;
                                                 .base_url, .api_key, .openai(), .stop(); a context manager
    chat_speed(client, prompts, max_tokens, concurrency) -> dict
                                                 streamed chat completions, ``concurrency`` at a time:
                                                 tokens/s in all and per stream, time to first token

Nothing here touches an accelerator: the notebook kernel stays off the TPU, so that the server it
starts (a separate process) can take every chip; a TPU is held by one process at a time.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SEARCH_HELP = "/kaggle/input (every attached dataset), or $ZOO_CACHE_SEARCH"
LOADED = re.compile(r"\[zoo\] loaded (?P<model>\S+) from (?P<where>.+) in (?P<seconds>[0-9.]+)s")


def on_kaggle() -> bool:
    """True inside a Kaggle notebook session (Kaggle sets ``KAGGLE_KERNEL_RUN_TYPE``)."""
    return "KAGGLE_KERNEL_RUN_TYPE" in os.environ


# -- caches ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class CacheLookup:
    """What ``zoo.load(model, quant=, dtype=, cache=)`` would restore: ``entry`` (None: it would load
    from the sources), the size of that entry in bytes, the roots searched and, for every other entry
    of the same model, why it does not serve this request (another recipe, another zoo layout, other
    source files)."""
    entry: Path | None
    size_bytes: int
    roots: list[Path]
    rejected: list[str]

    def __str__(self) -> str:
        lines = [f"searched: {', '.join(map(str, self.roots)) or '(no root exists)'}"]
        lines += [f"  not usable: {why}" for why in self.rejected]
        lines.append(f"restores {self.entry} ({self.size_bytes / 1e9:.3f} GB)" if self.entry is not None
                     else "no matching cache: the model loads from its sources")
        return "\n".join(lines)


def entry_bytes(entry: Path) -> int:
    return sum(f.stat().st_size for f in Path(entry).rglob("*") if f.is_file())


def find_cache(model: str, quant: str | None = None, dtype: str = "bfloat16", cache: str | Path | None = None
               ) -> CacheLookup:
    """The cache entry a load of ``model`` would restore from ``cache`` or the search roots
    (``SEARCH_HELP``), matched by fingerprint (``zoo.weight_cache.store``: the request, and the
    source files' identities where the sources are on this machine)."""
    from zoo.weight_cache import store as weight_cache

    fp = weight_cache.request_fingerprint(model, quant, dtype)
    roots = weight_cache.search_roots(cache)
    entry, rejected = weight_cache.find(fp, roots)
    return CacheLookup(entry, 0 if entry is None else entry_bytes(entry), [r for r in roots if r.is_dir()], rejected)


# -- plan -----------------------------------------------------------------------------------------
def plan_for(model: str, quant: str | None, devices: int = 8, layout: str = "tp", gguf: str | None = None):
    """The per-chip memory plan of registry model ``model`` under ``quant``: from its config preset,
    or, when the recipe loads a whole GGUF (its per-tensor types are the file's), from ``gguf``'s
    header (a local path or ``hf://...``: only the header is read)."""
    from zoo import registry
    from zoo.models.recipe_lookup import get_recipe
    from zoo.tools.plan import plan, plan_gguf

    if quant is not None and get_recipe(quant, registry.get_spec(model).arch).whole_gguf is not None:
        if gguf is None:
            raise ValueError(f"recipe {quant!r} of {model} is a whole GGUF: give its file (gguf=...) to plan it")
        return plan_gguf(gguf, devices, layout=layout)
    return plan(model, quant=quant, devices=devices, layout=layout)


# -- sources --------------------------------------------------------------------------------------
def local_sources(model: str) -> Path | None:
    """The checkpoint directory of registry model ``model`` if it is on this machine (embedded, or in
    the Hugging Face cache), or ``model`` itself if it is a path; None if it must be downloaded."""
    from zoo import registry

    path = Path(model).expanduser()
    if path.exists():
        return path
    return registry.local_checkpoint(registry.get_spec(model))


def fetch_sources(model: str, gguf: str | None = None) -> Path:
    """Download registry model ``model``'s checkpoint (the files a text model needs) and, with
    ``gguf`` = ``hf://OWNER/REPO[@REV]/PATH.gguf`` (the first file of a split set), every file of that
    GGUF into the checkpoint directory, where the recipes look for it. Returns the directory."""
    from huggingface_hub import hf_hub_download, list_repo_files

    from zoo import registry
    from zoo.sources.remote import _HF_REF

    ckpt = registry.resolve_checkpoint(registry.get_spec(model))
    if gguf is None:
        return ckpt
    m = _HF_REF.match(gguf)
    if m is None:
        raise ValueError(f"gguf={gguf!r}: expected hf://OWNER/REPO[@REVISION]/PATH.gguf")
    repo, rev, path = m["repo"], m["rev"], m["path"]
    files = [path]
    if "-of-" in path:                                   # a split set: every file of it
        stem, _, rest = path.rpartition("-of-")
        prefix = stem.rsplit("-", 1)[0]
        files = sorted(f for f in list_repo_files(repo, revision=rev)
                       if f.startswith(prefix + "-") and f.endswith("-of-" + rest))
    for f in files:
        hf_hub_download(repo, f, revision=rev, local_dir=ckpt)
        if "/" in f:                                     # the recipes look in the directory itself
            target = ckpt / Path(f).name
            if not target.exists():
                target.symlink_to(ckpt / f)
    return ckpt


# -- commands -------------------------------------------------------------------------------------
def zoo_command(*args: str, env: dict | None = None, check: bool = True, ok: tuple[int, ...] = (0,),
                show_stdout: bool = True) -> str:
    """Run ``python -m zoo ARGS``, printing its stderr (and, with ``show_stdout``, its stdout) lines as
    they come (a notebook shows what this process prints, not what a child writes to the kernel's own
    streams); returns its stdout.
    ``check``: raise ``RuntimeError`` (with the last lines) on an exit status not in ``ok``."""
    proc = subprocess.Popen([sys.executable, "-m", "zoo", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})
    err: list[str] = []

    def pump_stderr():
        for line in proc.stderr:
            err.append(line)
            print(line, end="", file=sys.stderr, flush=True)

    reader = threading.Thread(target=pump_stderr, daemon=True)
    reader.start()
    out = []
    for line in proc.stdout:
        out.append(line)
        if show_stdout:
            print(line, end="", flush=True)
    proc.wait()
    reader.join()
    if check and proc.returncode not in ok:
        raise RuntimeError(f"zoo {' '.join(args)} exited with status {proc.returncode}:\n{''.join(err[-20:])}")
    return "".join(out)


# -- the server -----------------------------------------------------------------------------------
WIKITEXT = ("Salesforce/wikitext", "wikitext-2-raw-v1/test-00000-of-00001.parquet")


def eval_text(path: str | Path | None = None, out: str | Path = "/tmp/zoo-eval-text.txt") -> str:
    """The text ``zoo eval`` scores: ``path`` itself when given; otherwise wikitext-2's test split (the
    text llama.cpp's users score, ``wiki.test.raw``: its lines in order) downloaded from the Hugging
    Face Hub and written to ``out``. Returns the file's path."""
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"no evaluation text at {path}")
        return str(path)
    import pyarrow.parquet as pq  # in Kaggle's images; pip install pyarrow elsewhere
    from huggingface_hub import hf_hub_download

    parquet = hf_hub_download(WIKITEXT[0], WIKITEXT[1], repo_type="dataset")
    Path(out).write_text("".join(pq.read_table(parquet, columns=["text"]).column("text").to_pylist()),
                         encoding="utf-8")
    return str(out)


class ZooServer:
    """``zoo serve ARGS`` in a child process on a free loopback port (or ``--port`` if ARGS give one).

    ``start()`` returns once the server printed its banner (model loaded, port bound) and answers
    ``/health`` with 200 (after it compiled or loaded its programs); its stderr goes to ``log_path``
    (``log_tail()``). Without a ``log_path`` it writes a temporary file of its own (``zoo-serve-*.log``
    in the temporary directory), removed by ``stop()`` when a server that became ready exits cleanly
    (status 0) and kept, for reading, otherwise (a start that failed or timed out keeps it, even where
    the server it stopped drained and exited 0). ``load_seconds`` / ``loaded_from`` come from its "[zoo] loaded" line;
    ``started_at`` is when the process started (``time.time()``)."""

    def __init__(self, *args: str, env: dict | None = None, log_path: str | Path | None = None,
                 start_timeout_s: float = 3600.0):
        self.args = list(args)
        if "--port" not in self.args:
            self.args += ["--port", "0"]
        self.env = {**os.environ, **(env or {})}
        self.own_log = log_path is None
        if self.own_log:
            fd, log_path = tempfile.mkstemp(prefix="zoo-serve-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.banner: dict[str, str] = {}
        self.started_at = self.ready_at = None
        self.load_seconds: float | None = None
        self.loaded_from: str | None = None

    @property
    def base_url(self) -> str:
        return self.banner["Anthropic base URL"]

    @property
    def api_key(self) -> str:
        return self.banner["API key"]

    def start(self) -> "ZooServer":
        log = open(self.log_path, "w")
        self.started_at = time.time()
        self.proc = subprocess.Popen([sys.executable, "-m", "zoo", "serve", *self.args], stdout=subprocess.PIPE,
                                     stderr=log, text=True, env=self.env)
        log.close()
        done = threading.Event()
        threading.Thread(target=self._read_stdout, args=(done,), daemon=True).start()
        if not done.wait(self.start_timeout_s) or "API key" not in self.banner:
            self.stop(timeout_s=10)
            raise RuntimeError(f"zoo serve {' '.join(self.args)} did not start (exit status "
                               f"{self.proc.returncode}); its log ends with:\n{self.log_tail()}")
        deadline = self.started_at + self.start_timeout_s     # it compiles its programs before it is healthy
        while not _healthy(f"{self.base_url}/health"):
            if time.time() > deadline or self.proc.poll() is not None:
                self.stop(timeout_s=10)
                raise RuntimeError(f"zoo serve is not healthy; its log ends with:\n{self.log_tail()}")
            time.sleep(0.2)
        self.ready_at = time.time()
        m = LOADED.search(self.log_path.read_text())
        if m:
            self.load_seconds, self.loaded_from = float(m["seconds"]), m["where"]
        return self

    def _read_stdout(self, done: threading.Event) -> None:
        """Read the banner's ``key: value`` lines, then keep draining stdout (a full pipe would block
        the server)."""
        for line in self.proc.stdout:
            if not done.is_set():
                key, _, value = line.strip().partition(": ")
                self.banner[key] = value.strip()
                if key == "API key":
                    done.set()
        done.set()                                       # the process ended before its banner

    def programs_line(self) -> str:
        """The server's line on its programs: how many, in how long, compiled or loaded from the
        compile cache (and where that came from)."""
        lines = [ln.removeprefix("[zoo] ") for ln in self._log_text().splitlines()
                 if ln.startswith(("[zoo] ready:", "[zoo] compile cache:"))]
        return "; ".join(lines) or "no warmup line (zoo serve --no-warmup?)"

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self._log_text().splitlines()[-lines:])

    def _log_text(self) -> str:
        """The log so far ("" once ``stop()`` removed a log of its own)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def openai(self, **kwargs):
        from openai import OpenAI
        return OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, **kwargs)

    def anthropic(self, **kwargs):
        from anthropic import Anthropic
        return Anthropic(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (the server drains and exits 0), then SIGKILL after ``timeout_s``; the exit status.
        A log of its own is removed after a clean exit (0) of a server that became ready, and kept
        otherwise."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.own_log and self.ready_at is not None and self.proc.returncode == 0:
            self.log_path.unlink(missing_ok=True)
        return self.proc.returncode

    def __enter__(self) -> "ZooServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status == 200
    except OSError:                                      # refused, or 503 while loading / draining
        return False


# -- measuring ------------------------------------------------------------------------------------
def _one_chat(client, model: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    """One streamed chat completion: its completion tokens, seconds to the first token and to the end."""
    t0 = time.perf_counter()
    first, usage, text = None, None, []
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, stream=True, temperature=0,
                                            stream_options={"include_usage": True}, **extra)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            piece = (delta.content or "") + (getattr(delta, "reasoning_content", None) or "")
            if piece and first is None:
                first = time.perf_counter() - t0
            text.append(delta.content or "")
    end = time.perf_counter() - t0
    tokens = usage.completion_tokens if usage is not None else 0
    return {"tokens": tokens, "ttft_s": first if first is not None else end, "seconds": end, "text": "".join(text)}


def chat_speed(client, prompts: list[str], max_tokens: int = 128, concurrency: int = 1, model: str = "zoo",
               extra: dict | None = None) -> dict:
    """Send ``prompts`` as streamed chat completions, ``concurrency`` at a time; returns
    ``{"batch", "requests", "tokens", "seconds", "tokens_per_s"`` (every completion token over the
    wall time), ``"stream_tokens_per_s"`` (mean over requests of tokens after the first over the
    time after the first), ``"ttft_s"`` (mean time to first token), ``"texts"}``."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        runs = list(pool.map(lambda p: _one_chat(client, model, p, max_tokens, extra or {}), prompts))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in runs)
    per_stream = [(r["tokens"] - 1) / (r["seconds"] - r["ttft_s"]) for r in runs
                  if r["tokens"] > 1 and r["seconds"] > r["ttft_s"]]
    return {"batch": concurrency, "requests": len(runs), "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "stream_tokens_per_s": sum(per_stream) / len(per_stream) if per_stream else 0.0,
            "ttft_s": sum(r["ttft_s"] for r in runs) / max(1, len(runs)), "texts": [r["text"] for r in runs]}
