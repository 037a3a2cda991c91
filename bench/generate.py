"""Decode throughput with and without MTP speculation, on an embedded demo model answering chat
questions.

    PYTHONPATH=. .venv/bin/python bench/generate.py [--model glm53-tiny] [--tokens 128] [--streams 4] [--k 3]
        [--path DIR]          a checkpoint of the same model instead of the embedded one (e.g. a new export)

The prompts are held-out questions of ``zoo.train.corpus`` (one per family in turn, ``--streams`` at
once) in the model's chat template, decoded greedily to their end of turn or ``--tokens``. Prints,
per configuration: tokens per model forward (each row's tokens over its decode steps plus the
prefill's), acceptance (overall and by draft position), tokens/s end to end (the whole
``generate``: admission with its prefill, then decoding) and decode tokens/s (the tokens after each
row's first over the time outside admission), each with its ratio against plain decoding measured
in the same run (each the fastest of ``--repeats`` identical runs, after one that compiles, the
configurations taking turns; speculation changes decoding only, and at these answer lengths
admission is about a third of the end-to-end time), the
device programs dispatched per decode step, and whether
the outputs equal plain decoding's. Runs: plain; MTP with the model's own head (trained with the
model: the real case); MTP on a "bigram" variant whose MTP head agrees with a degraded model (a
high-acceptance reference); and the oracle ceiling, k+1 tokens per speculative step at the
measured speculative step time.
"""

from __future__ import annotations

import argparse
import time

import jax

import zoo
from tests.support.helpers import bigram_variant
from zoo.api import Model
from zoo.engine.generator import Generator


class Config:
    """One configuration of the comparison: a generator over ``model`` drafting ``k`` tokens, its
    programs compiled by one untimed run, then timed by ``once`` (admission apart)."""

    def __init__(self, model: Model, k: int, prompts, n_tokens: int):
        self.gen, self.k, self.prompts, self.n_tokens = Generator(model, spec_tokens=k), k, prompts, n_tokens
        self.calls = {"step": 0, "prefill_s": 0.0}
        self.dt = self.decode_dt = float("inf")
        gen = self.gen
        gen.generate(prompts, max_new_tokens=n_tokens, temperature=0.0)     # every program and cache size
        step_fn, prefill_waiting = gen._step_fn, gen._prefill_waiting

        def counted(*a, **kw):
            self.calls["step"] += 1
            return step_fn(*a, **kw)

        def timed_prefill(*a, **kw):                        # admission: prefill + each row's first token
            t0 = time.perf_counter()
            prefill_waiting(*a, **kw)
            jax.block_until_ready(gen._batch)
            self.calls["prefill_s"] += time.perf_counter() - t0

        gen._step_fn, gen._prefill_waiting = counted, timed_prefill

    def once(self) -> None:
        """One timed run; keeps the fastest end-to-end and decode times seen."""
        self.calls["step"], self.calls["prefill_s"] = 0, 0.0
        t0 = time.perf_counter()
        self.gens = self.gen.generate(self.prompts, max_new_tokens=self.n_tokens, temperature=0.0)
        jax.block_until_ready(self.gen._batch)
        dt = time.perf_counter() - t0
        self.dt, self.decode_dt = min(self.dt, dt), min(self.decode_dt, dt - self.calls["prefill_s"])

    def result(self) -> dict:
        gens, k = self.gens, self.k
        tokens = sum(len(g.tokens) for g in gens)
        steps = max(g.stats["steps"] for g in gens)
        row_steps = sum(g.stats["steps"] + 1 for g in gens)        # + the prefill's token
        drafted = sum(g.stats["drafted"] for g in gens)
        spec_steps = drafted // k if k else 0
        by_pos = [sum(g.stats["accepted_by_position"][i] for g in gens) / max(1, spec_steps) for i in range(k)]
        return {"tok_s": tokens / self.dt, "decode_tok_s": (tokens - len(gens)) / self.decode_dt,
                "tokens_per_step": tokens / row_steps, "by_position": by_pos,
                "outputs": [g.tokens for g in gens],
                "step_s": self.dt / max(steps, 1),
                "acceptance": sum(g.stats["accepted"] for g in gens) / drafted if drafted else 0,
                "programs_per_step": self.calls["step"] / max(steps, 1)}


def measure(configs: list[Config], repeats: int) -> list[dict]:
    """Each configuration's fastest of ``repeats`` runs, the configurations taking turns run by run
    (a slow spell of the machine then slows every configuration, not only one)."""
    for _ in range(repeats):
        for c in configs:
            c.once()
    return [c.result() for c in configs]


def chat_prompts(model: Model, name: str, streams: int) -> list[list[int]]:
    """``streams`` held-out questions of the corpus (families in turn) in ``model``'s chat template."""
    from zoo.train import corpus
    fams = [f for f in corpus.FAMILIES if f != "chat"]
    exs = [corpus.examples(name, 1, 100 + i, (fams[i % len(fams)],), split="eval", tools=0.0, system=0.0)[0]
           for i in range(streams)]
    return [model.tokenizer.encode(corpus.prompt(ex, 0)) for ex in exs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per configuration (the fastest counts)")
    ap.add_argument("--model", default="qwen38-tiny", choices=["qwen38-tiny", "glm53-tiny"])
    ap.add_argument("--path", default=None, help="a checkpoint directory of --model to load instead")
    args = ap.parse_args()
    tiny = zoo.load(args.path or args.model)
    bigram = bigram_variant(tiny)
    prompts = chat_prompts(tiny, args.model, args.streams)
    print(f"{args.model}: jax {jax.__version__} on {jax.devices()[0].platform}; {args.streams} chat questions x "
          f"<= {args.tokens} tokens, greedy; k={args.k}")
    configs = [Config(tiny, 0, prompts, args.tokens), Config(tiny, args.k, prompts, args.tokens),
               Config(bigram, args.k, prompts, args.tokens)]
    base, own, ref = measure(configs, args.repeats)
    rows = [("plain", base), ("mtp, own head", own), ("mtp, bigram reference", ref)]
    spec_step = rows[-1][1]["step_s"]
    oracle = {"tok_s": args.streams * (args.k + 1) / spec_step, "decode_tok_s": args.streams * (args.k + 1) / spec_step,
              "tokens_per_step": args.k + 1, "step_s": spec_step,
              "acceptance": 1.0, "programs_per_step": rows[-1][1]["programs_per_step"],
              "by_position": [1.0] * args.k, "outputs": None}
    rows.append(("mtp, oracle ceiling", oracle))
    for name, r in rows:
        same = "" if r["outputs"] is None or name.startswith("mtp, bigram") else \
            f"  same output as plain {sum(a == b for a, b in zip(r['outputs'], base['outputs']))}/{len(prompts)}"
        print(f"{name:22s} tokens/forward {r['tokens_per_step']:5.2f}  acceptance {r['acceptance']:4.2f} "
              f"[{', '.join(f'{a:.2f}' for a in r['by_position'])}]  {r['tok_s']:7.1f} tok/s "
              f"({r['tok_s'] / base['tok_s']:4.2f}x plain)  decode {r['decode_tok_s']:7.1f} tok/s "
              f"({r['decode_tok_s'] / base['decode_tok_s']:4.2f}x plain)  programs/step "
              f"{r['programs_per_step']:.2f}{same}")
    text = tiny.tokenizer.decode(rows[1][1]["outputs"][0], skip_special_tokens=False)
    print(f"first answer (mtp): {text!r}")

if __name__ == "__main__":
    main()
