"""A short stream's decode steps before and after a long request has come and gone in another row.

    PYTHONPATH=. .venv/bin/python bench/idle_rows.py [--model qwen38-tiny] [--prompt-tokens 12000]
                                                     [--stream-tokens 160] [--repeat 3]

An engine (``Generator``, 2 rows, warmed up: nothing compiles while measuring; a new one for each
run, so no run starts with an earlier run's idle row) with a window of ``--prompt-tokens`` + 1024
slots rounded up to whole 512-slot key blocks, driven by its own thread as the server drives it. A stream decodes;
after its 16th token a request with a long prompt and one new token arrives in another row, is
prefilled (interleaved) and finishes; its row is then idle, its write index at the end of the long
prompt. The stream's median gap between tokens:

    before   tokens 2..16, before the long request arrives                  -> G0
    after    the tokens after the long request finished                     -> G1

Printed: G0, G1 and G1 / G0. Attention reads key blocks up to the last slot a *live* row holds
(``zoo.models.shared.filled_blocks``), so the goal is ~1: the idle row must not make every later step
read its window. Before idle rows were left out, G1 / G0 grew with the long prompt (the steps read
its ~24 blocks instead of the stream's one).
"""

from __future__ import annotations

import argparse
import statistics
import time

import zoo
from bench.engine_loop import arrival_clock, engine_running
from zoo.engine.generator import Generator


def run(gen: Generator, stream_tokens: int, long_prompt: list[int], seed: int) -> tuple[float, float]:
    """(the stream's median gap before the long request, after it finished)."""
    times: list[float] = []
    stream = gen.make_request([11 + seed, 22, 33, 44], max_new_tokens=stream_tokens, on_tokens=arrival_clock(times))
    with engine_running(gen):
        gen.submit(stream)
        while len(times) < 16:
            time.sleep(0.001)
        arrived = len(times)
        long = gen.make_request(long_prompt, max_new_tokens=1)
        gen.submit(long)
        long.done.wait()
        ended = len(times) + 1               # the step that finished it may still be in the list
        stream.done.wait()
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert ended + 16 < len(times), "the stream ended too soon after the long request: raise --stream-tokens"
    return statistics.median(gaps[1:arrived - 1]), statistics.median(gaps[ended:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen38-tiny")
    ap.add_argument("--prompt-tokens", type=int, default=12000)
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    model = zoo.load(args.model)
    vocab = int(model.config.vocab_size)
    runs = []
    for i in range(args.repeat):
        context = -(-(args.prompt_tokens + 1024) // 512) * 512      # whole key blocks (filled_blocks.key_block)
        gen = Generator(model, max_batch=2, context=context, prefill_chunk=args.chunk, prefix_cache=0)
        gen.eos_token_ids = frozenset()         # every stream runs its full length
        t0 = time.perf_counter()
        gen.warmup()
        if i == 0:
            print(f"{args.model}: warmup {time.perf_counter() - t0:.1f} s, context {gen.context}, "
                  f"rows {gen.rows}, long prompt {args.prompt_tokens} tokens")
        prompt = [(i * 7919 + j * 31) % (vocab - 10) + 5 for j in range(args.prompt_tokens)]
        runs.append(run(gen, args.stream_tokens, prompt, i))
    g0 = statistics.median(a for a, _ in runs)
    g1 = statistics.median(b for _, b in runs)
    print(f"  before the long request   median gap {g0 * 1e3:7.2f} ms")
    print(f"  after it finished         median gap {g1 * 1e3:7.2f} ms")
    print(f"  ratio after / before      {g1 / g0:6.2f}  (goal ~1)")


if __name__ == "__main__":
    main()
