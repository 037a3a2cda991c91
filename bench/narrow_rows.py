"""The narrow decode programs where they did not apply before: a stream left in a high row, and
grammar-constrained streams.

    PYTHONPATH=. .venv/bin/python bench/narrow_rows.py [--model qwen38-tiny] [--rows 16] [--narrow 4]
                                                       [--tail 200] [--repeat 3]

Two engines over the same model, warmed up (nothing compiles while measuring), runs alternated
``--repeat`` times, EOS off (every request runs to its length):

    whole     narrow_rows=0: every step computes every row                        -> T0
    narrow    narrow_rows=N                                                        -> T1

on two workloads:

    left in a high row   ``--rows`` requests start together, one per row; all but the one in the last
                         row end after 4 tokens, and that one goes on for ``--tail`` tokens alone. The
                         narrow engine moves it into row 0 (row compaction, ``Generator._compact``).
    constrained          2 requests under a JSON-schema grammar (strings up to 10,000 characters: they
                         do not finish early), ``--tail`` tokens each: every step is split around the
                         token masks (``masked_step``), on N rows in the narrow engine.

Printed per workload and engine: the median seconds of a run, decode steps, narrow steps and rows
moved; the ratio T0 / T1. Before this bench's changes the narrow engine stepped as the whole one on
both workloads (a row past N, a constrained row: full width).
"""

from __future__ import annotations

import argparse
import statistics
import time

import zoo
from zoo.engine.constraint import OutputGrammar
from zoo.engine.generator import Generator
from zoo.server import grammar as G

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "items"],
          "properties": {"title": {"type": "string", "maxLength": 10000},
                         "items": {"type": "array", "items": {"type": "integer"}}}}


def run(gen: Generator, requests: list[dict]) -> tuple[float, int, int, int]:
    """Seconds, decode steps, narrow steps and rows moved of one run of ``requests`` (make_request's
    keywords each)."""
    before = gen.steps, gen.narrow_steps, gen.moved_rows
    t0 = time.perf_counter()
    reqs = [gen.submit(gen.make_request(**kw)) for kw in requests]
    while not all(r.done.is_set() for r in reqs):
        gen.step()
    seconds = time.perf_counter() - t0
    for r, kw in zip(reqs, requests):
        assert r.finish_reason == "length" and len(r.tokens) == kw["max_new_tokens"], (r.finish_reason, r.tokens)
    return (seconds,) + tuple(a - b for a, b in zip((gen.steps, gen.narrow_steps, gen.moved_rows), before))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen38-tiny")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--narrow", type=int, default=4)
    ap.add_argument("--tail", type=int, default=200)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    model = zoo.load(args.model, dtype="float32")
    tok = model.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a long story."}]))
    grammar = OutputGrammar(G.json_schema(SCHEMA, strict=True))
    workloads = {
        "left in a high row": [{"prompt": prompt, "max_new_tokens": args.tail if i == args.rows - 1 else 4}
                               for i in range(args.rows)],
        "constrained": [{"prompt": prompt, "max_new_tokens": args.tail, "grammar": grammar, "seed": i,
                         "temperature": 1.0} for i in range(2)],
    }
    engines = {name: Generator(model, max_batch=args.rows, context=args.context, prefix_cache=0, narrow_rows=n)
               for name, n in (("whole", 0), ("narrow", args.narrow))}
    for gen in engines.values():
        gen.eos_token_ids = frozenset()            # every request runs to its length
        gen.warmup()
        for requests in workloads.values():        # the first steps' host paths
            run(gen, [{**kw, "max_new_tokens": 8} for kw in requests])
    print(f"{args.model}: {args.rows} rows, narrow width {args.narrow}, {args.tail} tokens; median of {args.repeat}")
    for workload, requests in workloads.items():
        results = {name: [] for name in engines}
        for _ in range(args.repeat):
            for name, gen in engines.items():
                results[name].append(run(gen, requests))
        med = {name: statistics.median(r[0] for r in runs) for name, runs in results.items()}
        print(f"  {workload}:")
        for name, runs in results.items():
            _, steps, narrow, moved = runs[-1]
            print(f"    {name:7s} {med[name]:7.3f} s   steps {steps}, narrow steps {narrow}, rows moved {moved}")
        print(f"    whole / narrow: {med['whole'] / med['narrow']:.2f}x")


if __name__ == "__main__":
    main()
