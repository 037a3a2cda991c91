"""A running stream's largest gap between two tokens while a long prompt is admitted.

    PYTHONPATH=. .venv/bin/python bench/interleave.py [--model qwen38-tiny] [--prompt-tokens 4000]
                                                      [--spec 0] [--chunk 1024] [--repeat 3]
                                                      [--interleave-ratio 3]

One engine (``Generator``, warmed up: nothing compiles while measuring), driven by its own thread as
the server drives it; a stream of ``--stream-tokens`` tokens, each token's arrival time taken in its
``on_tokens`` callback. Four runs, each repeated ``--repeat`` times (the largest gap and the 99th
percentile gap of each, the median of those printed):

    alone         the stream alone                                    -> G0
    interleaved   a prompt of N tokens submitted after the stream's
                  8th token, prefilled between decode steps within
                  the time budget (``--interleave-ratio``, as zoo
                  serve: ``zoo.engine.prefill_pace``)                  -> G1
    chunk a step  the same, one chunk per step whatever it takes
                  (``interleave_ratio`` None: the Python API's default) -> G2
    whole prompt  the same, the prompt prefilled in one go before the
                  next step (``prefill_budget = None``: the engine as
                  it was before interleaving)                          -> G3

Printed: the gaps and the ratios to G0 (the goal for G1/G0: <= 3), and the long prompt's time to
its first token (interleaving shares the steps, so it may take a little longer).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import zoo
from bench.engine_loop import arrival_clock, engine_running
from zoo.engine.generator import Generator
from zoo.engine.prefill_pace import INTERLEAVE_RATIO


def run(gen: Generator, stream_tokens: int, long_prompt: list[int] | None, seed: int
        ) -> tuple[float, float, float | None]:
    """(the stream's largest inter-token gap, its 99th percentile gap, the long prompt's seconds to
    its first token)."""
    times: list[float] = []
    first = threading.Event()
    stream = gen.make_request([11 + seed, 22, 33, 44], max_new_tokens=stream_tokens, on_tokens=arrival_clock(times))
    ttft = None
    with engine_running(gen):
        gen.submit(stream)
        if long_prompt is not None:
            while len(times) < 8:
                time.sleep(0.001)
            t0 = time.perf_counter()
            long = gen.make_request(long_prompt, max_new_tokens=1,
                                    on_tokens=lambda r, toks: first.set())
            gen.submit(long)
            first.wait()
            ttft = time.perf_counter() - t0
        stream.done.wait()
    gaps = [b - a for a, b in zip(times[1:], times[2:])]     # from the 2nd token: the first waits for its prefill
    return max(gaps), statistics.quantiles(gaps, n=100)[98], ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen38-tiny")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--stream-tokens", type=int, default=96)
    ap.add_argument("--spec", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--small", type=int, default=None, help="the small prefill width (default: the device's)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--interleave-ratio", type=float, default=INTERLEAVE_RATIO)
    args = ap.parse_args()
    model = zoo.load(args.model)
    context = args.prompt_tokens + args.stream_tokens + 64
    gen = Generator(model, spec_tokens=args.spec, max_batch=4, context=context, prefill_chunk=args.chunk,
                    prefix_cache=0, interleave_ratio=args.interleave_ratio, narrow_rows=None,
                    prefill_small=args.small)
    gen.eos_token_ids = frozenset()         # every stream runs its full length
    t0 = time.perf_counter()
    gen.warmup()
    print(f"{args.model}: warmup {time.perf_counter() - t0:.1f} s, context {gen.context}, rows {gen.rows}, "
          f"chunk {gen.prefill_chunk}, small {gen.prefill_small}, narrow rows {gen.narrow_rows}, spec {args.spec}")
    vocab = int(model.config.vocab_size)

    def prompt(seed: int) -> list[int]:
        return [(seed * 7919 + i * 31) % (vocab - 10) + 5 for i in range(args.prompt_tokens)]

    results = {}
    ratio = gen.pace.ratio
    for name, budget, pace, long in (("alone", gen.prefill_chunk, ratio, False),
                                     ("interleaved", gen.prefill_chunk, ratio, True),
                                     ("chunk a step", gen.prefill_chunk, None, True),
                                     ("whole prompt", None, None, True)):
        gen.prefill_budget, gen.pace.ratio = budget, pace
        runs = [run(gen, args.stream_tokens, prompt(i + len(results) * 10) if long else None, i)
                for i in range(args.repeat)]
        gap = statistics.median(g for g, _, _ in runs)
        p99 = statistics.median(p for _, p, _ in runs)
        ttft = statistics.median(t for _, _, t in runs) if long else None
        results[name] = gap
        print(f"  {name:13s} largest gap {gap * 1e3:8.1f} ms  p99 {p99 * 1e3:7.1f} ms" + (
            "" if ttft is None else f"   long prompt's first token {ttft:6.2f} s"))
    g0 = results["alone"]
    print(f"  ratio interleaved / alone   {results['interleaved'] / g0:6.2f}  (goal <= 3)")
    print(f"  ratio chunk a step / alone  {results['chunk a step'] / g0:6.2f}")
    print(f"  ratio whole prompt / alone  {results['whole prompt'] / g0:6.2f}")


if __name__ == "__main__":
    main()
