"""Decode throughput with and without MTP speculation, on the embedded tiny model.

    PYTHONPATH=. .venv/bin/python bench/generate.py [--model glm53-tiny] [--tokens 128] [--streams 4] [--k 3]

Prints, per configuration: tokens per model step, decode tokens/s, the ratio against plain
decoding measured in the same run, and the device programs dispatched per decode step. Runs:
plain; MTP on the tiny model (random MTP head: acceptance ~0, the worst case); MTP on a "bigram"
variant whose MTP head agrees with the model (high acceptance); and the oracle ceiling, k+1 tokens
per speculative step at the measured speculative step time.
"""

from __future__ import annotations

import argparse
import time

import jax

import zoo
from tests.support.helpers import bigram_variant
from zoo.api import Model
from zoo.serving.generator import Generator


def run(model: Model, k: int, prompts, n_tokens: int) -> dict:
    gen = Generator(model, spec_tokens=k)
    calls = {"step": 0}
    step_fn = gen._step_fn

    def counted(*a, **kw):
        calls["step"] += 1
        return step_fn(*a, **kw)

    gen.generate(prompts, max_new_tokens=8)                 # compile every program once
    gen._step_fn = counted
    t0 = time.perf_counter()
    gens = gen.generate(prompts, max_new_tokens=n_tokens)
    jax.block_until_ready(gen._batch)
    dt = time.perf_counter() - t0
    tokens = sum(len(g.tokens) for g in gens)
    steps = max(g.stats["steps"] for g in gens)
    row_steps = sum(g.stats["steps"] + 1 for g in gens)        # + the prefill's token
    drafted = sum(g.stats["drafted"] for g in gens)
    return {"tok_s": tokens / dt, "tokens_per_step": tokens / row_steps,
            "step_s": dt / max(steps, 1),
            "acceptance": sum(g.stats["accepted"] for g in gens) / drafted if drafted else 0,
            "programs_per_step": calls["step"] / max(steps, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--model", default="qwen38-tiny", choices=["qwen38-tiny", "glm53-tiny"])
    args = ap.parse_args()
    tiny = zoo.load(args.model)
    bigram = bigram_variant(tiny)
    prompts = [[(7 * i + j) % 500 for j in range(24)] for i in range(args.streams)]
    print(f"{args.model}: jax {jax.__version__} on {jax.devices()[0].platform}; "
          f"{args.streams} streams x {args.tokens} tokens; k={args.k}")
    base = run(tiny, 0, prompts, args.tokens)
    rows = [("plain", base), ("mtp, random head", run(tiny, args.k, prompts, args.tokens)),
            ("mtp, bigram head", run(bigram, args.k, prompts, args.tokens))]
    spec_step = rows[-1][1]["step_s"]
    oracle = {"tok_s": args.streams * (args.k + 1) / spec_step, "tokens_per_step": args.k + 1, "step_s": spec_step,
              "acceptance": 1.0, "programs_per_step": rows[-1][1]["programs_per_step"]}
    rows.append(("mtp, oracle ceiling", oracle))
    for name, r in rows:
        print(f"{name:22s} tokens/step {r['tokens_per_step']:5.2f}  acceptance {r['acceptance']:4.2f}  "
              f"{r['tok_s']:8.1f} tok/s  ratio vs plain {r['tok_s'] / base['tok_s']:5.2f}x  "
              f"programs/step {r['programs_per_step']:.2f}")


if __name__ == "__main__":
    main()
