"""Row compaction: a stream left in a high row by streams that finished, with and without narrow rows.

    PYTHONPATH=. .venv/bin/python bench/row_compaction.py [--model qwen38-tiny] [--rows 16] [--narrow 4]
                                                          [--tail 200] [--repeat 3]

``--rows`` requests start together, one per row; all but the one in the last row end after 4 tokens,
and that one goes on for ``--tail`` tokens alone. Two engines, warmed up (nothing compiles while
measuring), runs alternated ``--repeat`` times:

    whole     narrow_rows=0: every step computes every row                       -> T0
    narrow    narrow_rows=N: the last row's request moves into row 0 once the
              others are gone (``Generator._compact``), then steps on N rows      -> T1

Printed per engine: the median seconds of the run, decode steps, narrow steps and rows moved; the
ratio T0 / T1 (the speed-up of the tail). Before row compaction the narrow engine stepped like the
whole one here: its one request sat in the last row.
"""

from __future__ import annotations

import argparse
import statistics
import time

import zoo
from zoo.engine.generator import Generator


def run(gen: Generator, prompt: list[int], rows: int, tail: int) -> tuple[float, int, int, int]:
    """Seconds, decode steps, narrow steps and rows moved of one run."""
    before = gen.steps, gen.narrow_steps, gen.moved_rows
    t0 = time.perf_counter()
    reqs = [gen.submit(gen.make_request(prompt, max_new_tokens=tail if i == rows - 1 else 4))
            for i in range(rows)]
    while not all(r.done.is_set() for r in reqs):
        gen.step()
    seconds = time.perf_counter() - t0
    assert len(reqs[-1].tokens) == tail, len(reqs[-1].tokens)
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
    engines = {name: Generator(model, max_batch=args.rows, context=args.context, prefix_cache=0, narrow_rows=n)
               for name, n in (("whole", 0), ("narrow", args.narrow))}
    for gen in engines.values():
        gen.eos_token_ids = frozenset()            # every request runs to its length
        gen.warmup()
        run(gen, prompt, args.rows, 8)                              # the first steps' host paths
    results = {name: [] for name in engines}
    for _ in range(args.repeat):
        for name, gen in engines.items():
            results[name].append(run(gen, prompt, args.rows, args.tail))
    print(f"{args.model}: {args.rows} rows, one request of {args.tail} tokens in the last row, the others 4 "
          f"tokens; narrow width {args.narrow}; median of {args.repeat}")
    med = {}
    for name, runs in results.items():
        med[name] = statistics.median(r[0] for r in runs)
        _, steps, narrow, moved = runs[-1]
        print(f"  {name:7s} {med[name]:7.3f} s   steps {steps}, narrow steps {narrow}, rows moved {moved}")
    print(f"  whole / narrow: {med['whole'] / med['narrow']:.2f}x")


if __name__ == "__main__":
    main()
