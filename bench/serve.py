"""What the HTTP server costs on top of the engine, on the embedded tiny model.

    PYTHONPATH=. .venv/bin/python bench/serve.py [--model qwen38-tiny] [--tokens 64] [--streams 8]

Baseline, in the same run: the engine alone (``Generator.generate``), for one stream and for
``--streams`` streams. Then the same prompts through ``zoo serve``'s app on 127.0.0.1 with the
``openai`` SDK (greedy streaming chat completions, ``max_tokens`` = ``--tokens``): time to first
token, decode tokens/s of one stream, aggregate tokens/s of all, and the ratio server / engine.
Each figure is the best of ``REPEATS`` runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time

import jax
import openai

import zoo
from zoo.engine.generator import Generator
from zoo.server.app import ServerThread, create_app

REPEATS = 3                  # best of: the machine may be shared


def engine_run(model, prompts, n_tokens: int) -> dict:
    gen = Generator(model)
    gen.generate(prompts, max_new_tokens=8)                 # compile
    best = None
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        gens = gen.generate(prompts, max_new_tokens=n_tokens)
        dt = time.perf_counter() - t0
        run = {"tok_s": sum(len(g.tokens) for g in gens) / dt,
               "ttft": statistics.median(g.stats["time_to_first_token"] for g in gens)}
        best = run if best is None or run["tok_s"] > best["tok_s"] else best
    return best


def client_run(client: openai.OpenAI, text: str, n_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], stream=True,
                                            max_tokens=n_tokens, temperature=0, stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.choices and (chunk.choices[0].delta.content or (chunk.choices[0].delta.model_extra or {}).get(
                "reasoning_content")):
            first = first or time.perf_counter()
        usage = chunk.usage or usage
    end = time.perf_counter()
    n = usage.completion_tokens
    return {"ttft": (first or end) - t0, "tokens": n, "seconds": end - t0,
            "decode_tok_s": (n - 1) / (end - first) if first and n > 1 and end > first else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen38-tiny")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=8)
    args = ap.parse_args()
    model = zoo.load(args.model)
    texts = [f"Stream {i}: tell me about zoos." for i in range(args.streams)]
    tok = model.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    print(f"{args.model}: jax {jax.__version__} on {jax.devices()[0].platform}; {args.tokens} tokens per stream")
    solo_e, many_e = engine_run(model, prompts[:1], args.tokens), engine_run(model, prompts, args.tokens)
    with ServerThread(create_app(model, api_key="bench")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="bench", max_retries=0)
        for _ in range(2):                                   # compile the programs and batch sizes
            client_run(client, texts[0], args.tokens)
            with concurrent.futures.ThreadPoolExecutor(args.streams) as pool:
                list(pool.map(lambda t: client_run(client, t, args.tokens), texts))
        solo = max((client_run(client, texts[0], args.tokens) for _ in range(REPEATS)),
                   key=lambda r: r["tokens"] / r["seconds"])
        many_tok_s, many = 0.0, []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.streams) as pool:
                runs = list(pool.map(lambda t: client_run(client, t, args.tokens), texts))
            tok_s = sum(r["tokens"] for r in runs) / (time.perf_counter() - t0)
            many_tok_s, many = max((many_tok_s, many), (tok_s, runs), key=lambda x: x[0])
    print(f"1 stream : engine {solo_e['tok_s']:7.1f} tok/s, ttft {solo_e['ttft'] * 1e3:6.1f} ms | server "
          f"{solo['tokens'] / solo['seconds']:7.1f} tok/s (decode {solo['decode_tok_s']:.1f}), ttft "
          f"{solo['ttft'] * 1e3:6.1f} ms | ratio {solo['tokens'] / solo['seconds'] / solo_e['tok_s']:.2f}")
    print(f"{args.streams} streams: engine {many_e['tok_s']:7.1f} tok/s | server {many_tok_s:7.1f} tok/s aggregate, "
          f"median ttft {statistics.median(r['ttft'] for r in many) * 1e3:.1f} ms | ratio "
          f"{many_tok_s / many_e['tok_s']:.2f}")


if __name__ == "__main__":
    main()
