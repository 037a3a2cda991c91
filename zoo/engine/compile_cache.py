"""JAX's persistent compilation cache for the engine's programs, and counts of what was compiled.

    use_compile_cache(directory) -> CompileCache     turn it on (before the first compile), say where
    compile_cache_dir(flag, disabled)                 which directory a command should use (or None)
    trust_compile_cache(source, directory)            copy programs the user vouches for into it
    CompileCounter()                                  programs compiled / loaded from the cache since made

A compiled program written to the cache is reused by a later process when everything JAX keys an
entry on is the same (``jax._src.cache_key.get``): the program's HLO, the jaxlib version, the
backend's platform and version (libtpu's on a TPU), the XLA flags (``XLA_FLAGS``,
``LIBTPU_INIT_ARGS``), the compile options with the device assignment, and the chips' topology
fingerprint. Another version therefore never matches: its entries are simply not found. A version
file in the directory (``VERSION_FILE``) lets the first start after an upgrade say so in one line.

A compile cache is code: whoever can write to it can run code in the process that loads it. It is
therefore only read from a directory the user named (``--compile-cache`` / ``ZOO_COMPILE_CACHE``) or
their own cache directory (``default_dir``), never from a dataset found by looking around.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.extend

log = logging.getLogger("zoo.compile_cache")
VERSION_FILE = "zoo-compile-cache.json"
ENV = "ZOO_COMPILE_CACHE"
_COMPILED = "/jax/core/compile/backend_compile_duration"
_HIT = "/jax/compilation_cache/cache_hits"


def default_dir() -> Path:
    """The user's own compile cache: ``$XDG_CACHE_HOME/zoo/compile`` (``~/.cache/zoo/compile``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zoo" / "compile"


def compile_cache_dir(flag: str | None = None, disabled: bool = False) -> Path | None:
    """The directory a command uses: none when ``disabled``, else ``flag``, else ``$ZOO_COMPILE_CACHE``,
    else ``$JAX_COMPILATION_CACHE_DIR``, else ``default_dir()``."""
    if disabled:
        return None
    chosen = flag or os.environ.get(ENV) or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return Path(chosen).expanduser() if chosen else default_dir()


def versions() -> dict:
    """The versions an entry's reuse depends on (the rest of its key: the module doc)."""
    import jaxlib

    backend = jax.extend.backend.get_backend()
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "platform": backend.platform,
            "platform_version": backend.platform_version}


@dataclass
class CompileCache:
    directory: Path
    note: str            # one line for the console: where programs come from, or why old ones are not reused


def use_compile_cache(directory: str | os.PathLike) -> CompileCache:
    """Turn JAX's persistent compilation cache on in ``directory`` (made if missing) for every
    program however fast it compiles, and record this process's versions there. Call before the
    first compile. A directory written by other versions is kept (its entries just do not match)
    and the note says so."""
    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    mine = versions()
    stamp = path / VERSION_FILE
    note = f"compile cache: {path}"
    try:
        before = json.loads(stamp.read_text()) if stamp.exists() else None
    except (OSError, ValueError):
        before = None
    if before is not None and before != mine:
        changed = ", ".join(f"{k} {before.get(k)!r} -> {v!r}" for k, v in mine.items() if before.get(k) != v)
        note = f"compile cache: {path} was written by other versions ({changed}); its programs are not reused"
    try:
        tmp = stamp.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(mine, indent=1))
        os.replace(tmp, stamp)
    except OSError as e:                      # a read-only cache still serves its entries
        log.warning("could not write %s: %s", stamp, e)
    return CompileCache(path, note)


def trust_compile_cache(source: str | os.PathLike, directory: str | os.PathLike) -> str:
    """Copy the entries of ``source`` (a compile cache the user named, e.g. published with their
    weights: ``zoo cache push --compile-cache``) that ``directory`` lacks into it; the source may be
    read-only (a Kaggle dataset). Returns one line saying what was copied from where."""
    src, dst = Path(source).expanduser().resolve(), Path(directory).expanduser().resolve()
    if not src.is_dir():
        raise FileNotFoundError(f"--trust-compile-cache: {src} is not a directory")
    dst.mkdir(parents=True, exist_ok=True)
    copied = 0
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name != VERSION_FILE and not (dst / f.name).exists():
            tmp = dst / f".{f.name}.{os.getpid()}.tmp"
            shutil.copyfile(f, tmp)
            os.replace(tmp, dst / f.name)
            copied += 1
    return f"compile cache: {copied} programs copied from {src} (trusted: you named it) into {dst}"


class CompileCounter:
    """Counts, from its making on, the programs XLA compiled and those loaded from the persistent
    cache (``jax.monitoring`` events, every thread of the process: JAX times every program it gets
    from XLA, ``loaded`` ones included, and counts the cache's hits)."""

    _lock = threading.Lock()
    _live: list["CompileCounter"] = []
    _registered = False

    def __init__(self):
        self.programs = 0               # compiled or loaded
        self.loaded = 0
        with CompileCounter._lock:
            if not CompileCounter._registered:
                jax.monitoring.register_event_duration_secs_listener(CompileCounter._on_duration)
                jax.monitoring.register_event_listener(CompileCounter._on_event)
                CompileCounter._registered = True
            CompileCounter._live.append(self)

    @property
    def compiled(self) -> int:
        return self.programs - self.loaded

    def close(self) -> None:
        with CompileCounter._lock:
            if self in CompileCounter._live:
                CompileCounter._live.remove(self)

    def __enter__(self) -> "CompileCounter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _on_duration(event: str, seconds: float, **kw) -> None:
        if event == _COMPILED:
            for c in list(CompileCounter._live):
                c.programs += 1

    @staticmethod
    def _on_event(event: str, **kw) -> None:
        if event == _HIT:
            for c in list(CompileCounter._live):
                c.loaded += 1
