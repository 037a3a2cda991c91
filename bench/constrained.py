"""The cost of constrained decoding per step, against unconstrained decoding in the same run.

    PYTHONPATH=. .venv/bin/python bench/constrained.py [--model qwen38-tiny] [--tokens 96] [--spec 0]

For batch 1 and 8 (``--batches``): the engine decodes ``--tokens`` tokens per row (a) without a
constraint (the fused step), (b) every row under a JSON-schema grammar (strings of up to 10,000
characters, so rows do not finish early) and (c) under a regex. Printed per case: milliseconds per
decode step, the host's mask fill per step (llguidance, measured inside the engine), and the
ratio constrained / unconstrained. Each figure is the best of ``REPEATS`` runs (the machine may be
shared). ``--spec k``: the same with MTP speculation (masks for the k+1 verify positions).
"""

from __future__ import annotations

import argparse
import time

import zoo
from zoo.engine.constraint import OutputGrammar
from zoo.engine.generator import Generator
from zoo.server import grammar as G

REPEATS = 3
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "items"],
          "properties": {"title": {"type": "string", "maxLength": 10000},
                         "items": {"type": "array", "items": {"type": "integer"}}}}


class TimedFill:
    """Wraps the engine's mask fill (``MaskSchedule.fill``) and adds up the host time it takes."""

    def __init__(self, gen: Generator):
        self.seconds, self._inner = 0.0, gen.mask_schedule.fill
        gen.mask_schedule.fill = self

    def __call__(self, *args):
        t0 = time.perf_counter()
        self._inner(*args)
        self.seconds += time.perf_counter() - t0


def run(gen: Generator, timer: TimedFill, batch: int, tokens: int, grammar: OutputGrammar | None) -> dict:
    prompts = [[1, 5, 9 + i, 11] for i in range(batch)]
    best = None
    for rep in range(REPEATS + 1):                       # the first run compiles
        timer.seconds = 0.0
        steps0 = gen.steps
        t0 = time.perf_counter()
        out = gen.generate(prompts, max_new_tokens=tokens, temperature=1.0, seed=rep, grammar=grammar)
        dt = time.perf_counter() - t0
        steps = gen.steps - steps0
        if rep and (best is None or dt / steps < best["ms"] / 1e3):
            best = {"ms": 1e3 * dt / steps, "fill_ms": 1e3 * timer.seconds / steps,
                    "tokens": sum(len(o.tokens) for o in out) / batch}
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen38-tiny")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--spec", type=int, default=0)
    args = ap.parse_args()
    model = zoo.load(args.model, dtype="float32")
    cases = {"none": None, "json_schema": OutputGrammar(G.json_schema(SCHEMA)),
             "regex": OutputGrammar(G.regex("[a-z ]{0,10000}"))}
    print(f"{args.model}, {args.tokens} tokens per row, MTP k={args.spec}; ms per decode step, best of {REPEATS}")
    print(f"{'batch':>5} {'grammar':>12} {'ms/step':>8} {'fill ms':>8} {'tokens':>7} {'ratio':>6}")
    for batch in map(int, args.batches.split(",")):
        gen = Generator(model, spec_tokens=args.spec, max_batch=max(batch, 4))
        timer = TimedFill(gen)
        base = None
        for name, grammar in cases.items():
            r = run(gen, timer, batch, args.tokens, grammar)
            base = base or r["ms"]
            print(f"{batch:>5} {name:>12} {r['ms']:>8.2f} {r['fill_ms']:>8.3f} {r['tokens']:>7.1f} "
                  f"{r['ms'] / base:>6.2f}")


if __name__ == "__main__":
    main()
