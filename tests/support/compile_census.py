"""Where the suite's XLA compilations go: a pytest plugin and its summary.

    pytest -p tests.support.compile_census ...        (ZOO_CENSUS_DIR: where each worker writes its JSON,
                                                       default /tmp/zoo-census)
    python -m tests.support.compile_census [DIR]      the summary of a run's files

Each xdist worker records, per test, every compilation of a jitted program in its own process
(``jax_log_compiles``: the program's name and XLA's seconds; a persistent compilation cache hit
counts as 0 s) and every ``Generator`` built (the model's graph, rows, cache slots, MTP drafts,
prefill widths, narrow rows, mesh size). Subprocesses (``zoo serve``, multi-process and sharding
jobs) are not seen. The summary prints compile seconds by program and by test file, and the engine
shapes the tests chose (a shape chosen by one file only is a program set that file compiles alone).
"""

from __future__ import annotations

import collections
import glob
import hashlib
import json
import logging
import os
import re
import sys

import pytest

OUT = os.environ.get("ZOO_CENSUS_DIR", "/tmp/zoo-census")
FINISHED = re.compile(r"Finished XLA compilation of jit\((.+?)\) in ([\d.e-]+) sec")
HIT = re.compile(r"Persistent compilation cache hit for 'jit_(.+?)'")
MISS = re.compile(r"PERSISTENT COMPILATION CACHE MISS for 'jit_(.+?)' with key '(.+?)'")

_current = {"test": None, "key": None}
_compiles: list[tuple] = []          # (test, program, seconds, cache hit, persistent-cache key or None)
_generators: list[dict] = []


class _Compiles(logging.Handler):
    def emit(self, record):
        message = record.getMessage()
        if m := FINISHED.match(message):
            _compiles.append((_current["test"], m[1], float(m[2]), False, _current["key"]))
            _current["key"] = None
        elif m := HIT.match(message):
            _compiles.append((_current["test"], m[1], 0.0, True, None))
        elif m := MISS.match(message):           # logged before the compilation it keys
            _current["key"] = m[2]


def _runs_tests(config) -> bool:
    """False in an xdist controller, which runs no test: it records nothing and imports nothing."""
    return hasattr(config, "workerinput") or getattr(config.option, "numprocesses", None) in (None, 0)


def pytest_configure(config):
    if not _runs_tests(config):
        return
    import jax

    from zoo.engine import generator

    jax.config.update("jax_log_compiles", True)
    handler = _Compiles(logging.DEBUG)
    logging.getLogger("jax").addHandler(handler)
    # the persistent cache's key of each compilation (a debug message): equal keys are the same program
    logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
    built = generator.Generator.__init__

    def recorded(self, model, **kw):
        built(self, model, **kw)
        mesh = getattr(model, "mesh", None)
        # the graph's digest, not hash(): Python salts hashes per process, and each worker is one
        graph = hashlib.sha256(repr(self._graphdef).encode()).hexdigest()[:12]
        _generators.append({"test": _current["test"], "graph": graph,
                            "rows": self._B, "slots": self._L, "k": self.k, "widths": list(self.prefill_widths),
                            "narrow": self.narrow_rows, "devices": None if mesh is None else int(mesh.devices.size)})

    generator.Generator.__init__ = recorded


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["test"] = item.nodeid
    yield


def pytest_unconfigure(config):
    if not _runs_tests(config):
        return
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"census-{os.getpid()}.json"), "w") as f:
        json.dump({"compiles": _compiles, "generators": _generators}, f)


def _file(test: str | None) -> str:
    return (test or "(outside a test)").split("::")[0]


def summary(directory: str = OUT) -> str:
    compiles, generators = [], []
    for path in glob.glob(os.path.join(directory, "census-*.json")):
        with open(path) as f:
            data = json.load(f)
        compiles += data["compiles"]
        generators += data["generators"]
    out = [f"{len(compiles)} compilations ({sum(c[3] for c in compiles)} persistent-cache hits), "
           f"{sum(c[2] for c in compiles):.0f} s of XLA; {len(generators)} generators"]
    by = collections.defaultdict(lambda: [0, 0.0])
    for _, program, seconds, *_ in compiles:
        by[program][0] += 1
        by[program][1] += seconds
    out.append("\nby program (compilations, seconds), the 15 largest:")
    out += [f"  {s:7.1f} s {n:5d}  {p}" for p, (n, s) in sorted(by.items(), key=lambda x: -x[1][1])[:15]]
    keyed = collections.defaultdict(list)
    for test, program, seconds, _, *key in compiles:
        if key and key[0]:
            keyed[key[0]].append((seconds, program, _file(test)))
    again = [(sum(s for s, *_ in v[1:]), len(v) - 1, v[0][1], sorted({f for *_, f in v})) for v in keyed.values()
             if len(v) > 1]
    out.append(f"\nthe same program compiled again (equal persistent-cache keys): {sum(a[1] for a in again)} "
               f"compilations, {sum(a[0] for a in again):.0f} s; the 15 largest:")
    out += [f"  {s:7.1f} s {n:5d}  {p}  {', '.join(fs)[:150]}" for s, n, p, fs in sorted(again, reverse=True)[:15]]
    files = collections.Counter()
    for test, _, seconds, *_ in compiles:
        files[_file(test)] += seconds
    out.append("\nby test file (seconds), the 25 largest:")
    out += [f"  {s:7.1f} s  {f}" for f, s in files.most_common(25)]
    shapes = collections.defaultdict(set)
    for g in generators:
        shapes[(g["rows"], g["slots"])].add(_file(g["test"]))
    configs = {(g["graph"], g["rows"], g["slots"], g["k"], tuple(g["widths"]), g["narrow"], g["devices"])
               for g in generators}
    out.append(f"\n{len(configs)} distinct generator configurations, {len(shapes)} (rows, slots) shapes; "
               "the files choosing each:")
    out += [f"  rows={r:3d} slots={s:8d}  {len(fs):2d} files  {', '.join(sorted(fs)[:4])}"
            for (r, s), fs in sorted(shapes.items(), key=lambda x: -len(x[1]))]
    return "\n".join(out)


if __name__ == "__main__":
    print(summary(*sys.argv[1:2]))
