"""Speculation that pays: plain decoding against fixed MTP drafts against the auto policy.

    PYTHONPATH=. .venv/bin/python bench/speculation.py [--models qwen38-tiny glm53-tiny] [--spec 3]
                                                       [--streams 1 4 16] [--tokens 64] [--repeat 3]
                                                       [--narrow-rows N]

Per model, three engines (``Generator``, warmed up: nothing compiles while measuring), all greedy in
float32, so every configuration emits the same tokens and only the time differs:

    plain   no drafts (``spec_tokens`` 0)
    fixed   ``--spec`` K MTP drafts every step (the engine before ``zoo.engine.spec_policy``)
    auto    up to K drafts per row and step, MTP or prompt lookup, chosen from timed step costs and
            running acceptance (``zoo serve --spec K --spec-policy auto``)

Two tasks of 16 prompts each, at 1, 4 and 16 concurrent streams (the prompts in batches of that
many requests, one batch after the other, each stepped to its end; the auto engine keeps what it
learned between runs, as a server does):

    chat    questions from the demo corpus's families (arithmetic, spelling, weather, definitions)
    reask   the same questions asked again in a second turn, after the model's own first answer:
            the new answer re-emits spans of its context, which prompt lookup proposes for free
            (the tiny demo models cannot rewrite a 40-line text: they were not trained to copy)

Configurations are interleaved (rotating order, ``--repeat`` rounds); printed per task and stream
count: tokens/s of each in the decode phase (from the step after every request has its first token:
what speculation changes) and the ratios fixed/plain and auto/plain (goals: auto >= 0.97x plain
everywhere, >= 1.3x at one stream), the same ratios end to end (prefills included), then each auto
engine's choices, acceptance by source and timed step costs.
"""

from __future__ import annotations

import argparse
import time

import zoo
from zoo.engine.generator import Generator

QUESTIONS = ["What is 123 + 456?", "Spell the word 'strawberry'.", "What's the weather in Paris?",
             "What is 905 - 387?", "Reverse the word 'banana'.", "Define the word 'melon'.",
             "Which is larger, 41 or 14?", "How many r's are in 'cherry'?", "Convert 5 km to meters.",
             "What is the sum of 77 and 18?", "Tell me the weather in Tokyo.", "Spell 'orange' letter by letter.",
             "What is 640 - 99?", "Write 'peach' backwards.", "What does 'grape' mean?", "Add 250 and 250."]
CONFIGS = ("plain", "fixed", "auto")


def chat_ids(tok, messages) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages))


def tasks(model, tokens: int) -> dict[str, list[list[int]]]:
    """The prompts of each task (token ids): the questions, and the questions again after the
    model's own greedy answer."""
    tok = model.tokenizer
    first = [[{"role": "user", "content": q}] for q in QUESTIONS]
    chat = [chat_ids(tok, m) for m in first]
    answers = Generator(model, max_batch=16, prefix_cache=0).generate(chat, max_new_tokens=tokens)
    reask = [chat_ids(tok, m + [{"role": "assistant", "content": tok.decode(a.tokens)}, m[0]])
             for m, a in zip(first, answers)]
    return {"chat": chat, "reask": reask}


def run(gen: Generator, prompts: list[list[int]], tokens: int) -> tuple[float, int, float, int]:
    """``prompts`` submitted at once and stepped until every one is done: (seconds, tokens) of the
    decode phase (from the step after every request has its first token: no prefill in it) and of
    the whole run."""
    t0 = time.perf_counter()
    reqs = [gen.submit(gen.make_request(p, max_new_tokens=tokens)) for p in prompts]
    while not all(r.tokens or r.done.is_set() for r in reqs):
        gen.step()
    t1, before = time.perf_counter(), sum(len(r.tokens) for r in reqs)
    while not all(r.done.is_set() for r in reqs):
        gen.step()
    end, total = time.perf_counter(), sum(len(r.tokens) for r in reqs)
    return end - t1, total - before, end - t0, total


def bench_model(name: str, k: int, streams: list[int], tokens: int, repeat: int, dtype: str,
                narrow: int = 0) -> None:
    model = zoo.load(name, dtype=dtype)
    work = tasks(model, tokens)
    rows = max(streams)
    common = {"max_batch": rows, "context": 1024, "prefix_cache": 0, "narrow_rows": narrow}
    gens = {"plain": Generator(model, **common),
            "fixed": Generator(model, spec_tokens=k, spec_policy="fixed", **common),
            "auto": Generator(model, spec_tokens=k, spec_policy="auto", **common)}
    configs = CONFIGS
    if narrow:                   # the baseline of the narrow programs: plain decoding without them
        gens["wide"] = Generator(model, **{**common, "narrow_rows": 0})
        configs = ("wide",) + CONFIGS
    for gen in gens.values():
        gen.warmup()
    print(f"\n{name} ({model.config.arch}, {dtype}), MTP k={k}, {tokens} greedy tokens per request, "
          f"{repeat} interleaved rounds, {rows} rows" + (f", narrow programs on rows 0..{narrow - 1}" if narrow else "")
          + "; decode phase (tok/s), then end to end with the prefills")
    print(f"{'task':6s} {'streams':>7s} " + " ".join(f"{c + ' tok/s':>12s}" for c in configs)
          + f" {'fixed/plain':>11s} {'auto/plain':>10s}" + (f" {'plain/wide':>10s}" if narrow else "")
          + f" | {'e2e fixed/plain':>15s} {'auto/plain':>10s}")
    for task, prompts in work.items():
        for n in streams:
            # every prompt of the task, n at a time (the same requests at every stream count)
            waves = [[prompts[(w * n + i) % len(prompts)] for i in range(n)] for w in range(max(1, len(prompts) // n))]
            acc = {c: [0.0, 0, 0.0, 0] for c in configs}
            for r in range(repeat):
                for c in configs[r % len(configs):] + configs[:r % len(configs)]:
                    for batch in waves:
                        acc[c] = [a + b for a, b in zip(acc[c], run(gens[c], batch, tokens))]
            assert len({a[3] for a in acc.values()}) == 1, acc      # greedy: the same tokens every way
            rate = {c: acc[c][1] / acc[c][0] for c in configs}
            e2e = {c: acc[c][3] / acc[c][2] for c in configs}
            print(f"{task:6s} {n:7d} " + " ".join(f"{rate[c]:12.1f}" for c in configs)
                  + f" {rate['fixed'] / rate['plain']:10.2f}x {rate['auto'] / rate['plain']:9.2f}x"
                  + (f" {rate['plain'] / rate['wide']:9.2f}x" if narrow else "") + " |"
                  f" {e2e['fixed'] / e2e['plain']:14.2f}x {e2e['auto'] / e2e['plain']:9.2f}x", flush=True)
    policy = gens["auto"].spec_policy
    print(f"auto's steps by option: {policy.chosen}")
    for source, acc in policy.pool.items():
        if acc.tried[0]:
            rates = ", ".join(f"{a / t:.2f}" if t else "-" for a, t in zip(acc.accepted, acc.tried))
            print(f"  {source:8s} drafts: acceptance by position [{rates}] over {int(acc.tried[0])} row-steps")
    print("  step seconds by option@rows[/narrow width]: " + ", ".join(f"{key} {v[0] * 1e3:.1f} ms"
                                                          for key, v in sorted(policy.table.items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen38-tiny", "glm53-tiny"])
    ap.add_argument("--spec", type=int, default=3)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", default="float32",
                    help="float32 (default): plain and speculative greedy decoding give the same tokens, so the "
                         "configurations do the same work; in bfloat16 a near tie may flip between them")
    ap.add_argument("--narrow-rows", type=int, default=0,
                    help="every engine with the narrow decode programs on that many rows (Generator's "
                         "narrow_rows), and a fourth one, wide: plain without them (the ratio plain/wide)")
    args = ap.parse_args()
    for name in args.models:
        bench_model(name, args.spec, args.streams, args.tokens, args.repeat, args.dtype, args.narrow_rows)


if __name__ == "__main__":
    main()
