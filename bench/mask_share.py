"""What one constrained row with a heavy or slow grammar costs the unconstrained rows beside it.

    PYTHONPATH=. .venv/bin/python bench/mask_share.py [--model qwen38-tiny] [--tokens 96] [--properties 3500]

One engine (``Generator``, 2 rows, warmed up), driven by its own thread as the server drives it. An
unconstrained stream decodes ``--tokens`` tokens, beside:

    alone        nothing                                                            -> G0
    light        a row under a small JSON schema (one string property)              -> G1
    heavy        a row under a schema of ``--properties`` required integer
                 properties (the size the server's 128 KiB cap on grammar text
                 still admits), compiled before the stream starts                  -> G2
    slow, wait   a row under an ambiguous Lark grammar whose masks grow with its
                 output (Earley items: ~1 ms at 30 tokens, ~10 ms at 200; within
                 llguidance's per-mask limits), ``--head-start`` tokens ahead of
                 the stream, every step waiting for its mask                       -> G3
    slow         the same with the engine's rule (``zoo.engine.mask_schedule``):
                 a step waits for a late mask at most a share of a step's time,
                 then the row sits the step out                                    -> G4

Printed: the stream's median gap between tokens in each case, the ratios to G0, and for the slow
cases the tokens the slow row produced meanwhile and the steps it sat out. Each figure is the
median of ``--repeat`` runs.
"""


from __future__ import annotations

import argparse
import statistics
import time

import zoo
from bench.engine_loop import arrival_clock, engine_running
from zoo.engine.constraint import OutputGrammar
from zoo.engine.generator import Generator
from zoo.engine.mask_schedule import MASK_SHARE
from zoo.server import grammar as G


def stream_gap(gen: Generator, tokens: int, neighbour: OutputGrammar | None, seed: int,
               head_start: int = 0) -> tuple[float, int, int]:
    """The stream's median gap, and the tokens the neighbour made and the steps it sat out meanwhile
    (it starts ``head_start`` tokens ahead of the stream)."""
    times: list[float] = []
    other = None
    if neighbour is not None:                # its grammar compiled here, before the stream starts
        other = gen.make_request([7, 8, 9], max_new_tokens=head_start + 4 * tokens, grammar=neighbour)
    stream = gen.make_request([11 + seed, 22, 33, 44], max_new_tokens=tokens, on_tokens=arrival_clock(times))
    with engine_running(gen):
        made = waits = 0
        if other is not None:
            gen.submit(other)
            while len(other.tokens) < head_start and not other.done.is_set():
                time.sleep(0.005)
            made, waits = -len(other.tokens), -other.stats.get("mask_waits", 0)
        gen.submit(stream)
        stream.done.wait()
        if other is not None:
            made, waits = made + len(other.tokens), waits + other.stats.get("mask_waits", 0)
            gen.cancel(other)
            other.done.wait()
    return statistics.median(b - a for a, b in zip(times[1:], times[2:])), made, waits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen38-tiny")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--properties", type=int, default=3500)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--head-start", type=int, default=150, help="tokens the slow row makes before the stream")
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
    slow = G.lark('start: x "!"\nx: x x | x x x | "a" | "aa"')
    cases = (("alone", None, MASK_SHARE), ("light", OutputGrammar(light), MASK_SHARE),
             ("heavy", OutputGrammar(heavy), MASK_SHARE), ("slow, wait", OutputGrammar(slow), None),
             ("slow", OutputGrammar(slow), MASK_SHARE))
    results = {}
    for name, grammar, share in cases:
        gen.mask_schedule.share = share
        t0 = time.perf_counter()
        head = args.head_start if name.startswith("slow") else 0
        runs = sorted(stream_gap(gen, args.tokens, grammar, i, head) for i in range(args.repeat))
        results[name] = runs[len(runs) // 2][0]
        made, waits = runs[len(runs) // 2][1:]
        extra = f"   the constrained row: {made} tokens, {waits} steps sat out" if grammar is not None else ""
        print(f"  {name:10s} median gap {results[name] * 1e3:7.2f} ms   ({time.perf_counter() - t0:.1f} s){extra}")
    for name in results:
        if name != "alone":
            print(f"  ratio {name + ' / alone':18s} {results[name] / results['alone']:6.2f}")

if __name__ == "__main__":
    main()
