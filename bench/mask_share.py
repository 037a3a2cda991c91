"""What one constrained row with a heavy grammar costs the unconstrained rows beside it.

    PYTHONPATH=. .venv/bin/python bench/mask_share.py [--model qwen38-tiny] [--tokens 96] [--properties 3500]

One engine (``Generator``, 2 rows, warmed up), driven by its own thread as the server drives it. An
unconstrained stream decodes ``--tokens`` tokens, three ways:

    alone        by itself                                                         -> G0
    light        beside a row under a small JSON schema (one string property)      -> G1
    heavy        beside a row under a schema of ``--properties`` required integer
                 properties (the size the server's 128 KiB cap on grammar text
                 still admits), compiled before the stream starts                  -> G2

Printed: the stream's median gap between tokens in each case, and G1 / G0, G2 / G0. A batch with a
constrained row runs the split step (the host fills the masks while the device runs the forward),
so some ratio above 1 is the split itself; llguidance's per-mask limits
(``zoo.engine.constraint.LIMITS``) bound what a grammar adds on top. Each figure is the median of
``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import zoo
from bench.engine_loop import arrival_clock, engine_running
from zoo.engine.constraint import OutputGrammar
from zoo.engine.generator import Generator
from zoo.server import grammar as G


def stream_gap(gen: Generator, tokens: int, neighbour: OutputGrammar | None, seed: int) -> float:
    times: list[float] = []
    other = None
    if neighbour is not None:                # its grammar compiled here, before the stream starts
        other = gen.submit(gen.make_request([7, 8, 9], max_new_tokens=4 * tokens, grammar=neighbour))
    stream = gen.make_request([11 + seed, 22, 33, 44], max_new_tokens=tokens, on_tokens=arrival_clock(times))
    with engine_running(gen):
        gen.submit(stream)
        stream.done.wait()
        if other is not None:
            gen.cancel(other)
            other.done.wait()
    return statistics.median(b - a for a, b in zip(times[1:], times[2:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen38-tiny")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--properties", type=int, default=3500)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    model = zoo.load(args.model)
    gen = Generator(model, max_batch=2, context=2048, prefix_cache=0)
    gen.eos_token_ids = frozenset()
    gen.warmup()
    names = [f"p{i}" for i in range(args.properties)]
    heavy = G.json_schema({"type": "object", "properties": {k: {"type": "integer"} for k in names}, "required": names,
                           "additionalProperties": False})
    light = G.json_schema({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    print(f"{args.model}: heavy grammar {len(G.check_size(heavy).encode()) / 1024:.0f} KiB of text, "
          f"{args.properties} properties")
    results = {}
    for name, grammar in (("alone", None), ("light", OutputGrammar(light)), ("heavy", OutputGrammar(heavy))):
        t0 = time.perf_counter()
        results[name] = statistics.median(stream_gap(gen, args.tokens, grammar, i) for i in range(args.repeat))
        print(f"  {name:6s} median gap {results[name] * 1e3:7.2f} ms   ({time.perf_counter() - t0:.1f} s)")
    print(f"  ratio light / alone  {results['light'] / results['alone']:6.2f}")
    print(f"  ratio heavy / alone  {results['heavy'] / results['alone']:6.2f}")


if __name__ == "__main__":
    main()
