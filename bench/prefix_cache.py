"""Prefix caching on an agent-like conversation: prefilled tokens and time to first token per turn,
with and without the cache, in one run.

    JAX_PLATFORMS=cpu PYTHONPATH=. .venv/bin/python bench/prefix_cache.py [--model qwen38-tiny] [--turns 8] \
        [--first 4000] [--new 200] [--spec 0]

The conversation is what an agent client sends: a system prompt with ~40 tool definitions (a first
prompt of about ``--first`` tokens), then per turn the whole conversation again with the model's
last answer and ~``--new`` tokens of new user text (a tool result), rendered by the model's chat
template and tokenized, as the server does. Each turn runs on a generator with the prefix cache
and on one without it (same model, same prompts, greedy: the answers are checked equal). Printed per
turn: prompt tokens, new tokens (prompt growth since the last turn), tokens prefilled and time to
first token (prefill) with and without the cache, and the ratio. The goal (issue 15): from turn 2,
prefilled <= new + one block and the time to first token >= 10x lower.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import zoo
from zoo.engine.generator import PREFIX_BLOCK, Generator

WORDS = ("read write list search file path line column branch commit test build module class function "
         "value error result return index offset buffer stream socket token parser schema field").split()


def text(rng: np.random.Generator, n_words: int) -> str:
    return " ".join(rng.choice(WORDS, n_words))


def tools(rng: np.random.Generator, n: int) -> list[dict]:
    out = []
    for i in range(n):
        props = {f"{w}_{j}": {"type": rng.choice(["string", "integer", "boolean"]).item(), "description": text(rng, 8)}
                 for j, w in enumerate(rng.choice(WORDS, 4))}
        out.append({"type": "function", "function": {"name": f"tool_{i}_{rng.choice(WORDS)}",
                                                      "description": text(rng, 25),
                                                      "parameters": {"type": "object", "properties": props}}})
    return out


def conversation(tok, first: int, new: int, seed: int = 0):
    """(render: messages -> prompt ids, user_text: () -> ~``new`` tokens of text), with a system prompt
    carrying tool definitions (as JSON in its text, and as the template's ``tools`` where the template
    renders them), enough of them that the first prompt has about ``first`` tokens."""
    rng = np.random.default_rng(seed)
    intro = "You are a coding agent. " + text(rng, 60)

    def render_with(n_tools, messages):
        defs = tools(np.random.default_rng(seed), n_tools)
        system = intro + "\n\n# Tools\n" + "\n".join(json.dumps(d) for d in defs)
        chat = tok.apply_chat_template([{"role": "system", "content": system}] + messages, tools=defs,
                                       add_generation_prompt=True)
        return tok.encode(chat)

    n_tools = 1
    while len(render_with(n_tools, [])) < first:
        n_tools += 1

    tokens_per_word = len(tok.encode(text(rng, 200))) / 200
    return (lambda messages: render_with(n_tools, messages)), lambda: text(rng, max(1, int(new / tokens_per_word)))


def warm(gen: Generator, longest: int, chunk: int, vocab: int) -> None:
    """Compile what the timed turns run: the batch at its final length (it only grows), every
    prefill piece width, the decode step, and with a cache its restore and snapshot programs."""
    rng = np.random.default_rng(1)
    gen.generate([rng.integers(3, vocab, longest).tolist()], max_new_tokens=1)
    width = 16
    while width <= chunk:
        gen.generate([rng.integers(3, vocab, width).tolist()], max_new_tokens=2)
        width *= 2
    if gen.prefix is not None:
        base = rng.integers(3, vocab, 300).tolist()
        out = gen.generate([base], max_new_tokens=4)[0]
        gen.generate([base + out.tokens + rng.integers(3, vocab, 40).tolist()], max_new_tokens=4)
        gen.prefix.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen38-tiny")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--first", type=int, default=4000, help="tokens of the first prompt")
    ap.add_argument("--new", type=int, default=200, help="new tokens per turn (about)")
    ap.add_argument("--answer", type=int, default=24, help="tokens generated per turn")
    ap.add_argument("--spec", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    args = ap.parse_args()

    model = zoo.load(args.model, dtype="float32")
    tok = model.tokenizer
    with_cache = Generator(model, spec_tokens=args.spec, prefill_chunk=args.chunk)
    without = Generator(model, spec_tokens=args.spec, prefill_chunk=args.chunk, prefix_cache=0)
    render, user_text = conversation(tok, args.first, args.new)
    longest = args.first + args.turns * (args.new + args.answer + 64)
    for name, gen in (("cache", with_cache), ("no cache", without)):
        t0 = time.perf_counter()
        warm(gen, longest, args.chunk, min(tok.vocab_size, model.config.vocab_size))
        print(f"warmed the generator with {name} in {time.perf_counter() - t0:.0f} s", flush=True)

    messages = [{"role": "user", "content": user_text()}]
    rows, last_len = [], 0
    for turn in range(1, args.turns + 1):
        ids = render(messages)
        runs = {}
        for name, gen in (("cache", with_cache), ("none", without)):
            t0 = time.perf_counter()
            out = gen.generate([ids], max_new_tokens=args.answer)[0]
            runs[name] = (out, time.perf_counter() - t0)
        (hit, _), (miss, _) = runs["cache"], runs["none"]
        assert hit.tokens == miss.tokens, f"turn {turn}: the cached run answered differently"
        cached = hit.stats["cached_tokens"]
        rows.append(dict(turn=turn, prompt=len(ids), new=len(ids) - last_len, cached=cached,
                         prefilled=len(ids) - cached, prefilled_none=len(ids),
                         ttft=hit.stats["time_to_first_token"], ttft_none=miss.stats["time_to_first_token"]))
        last_len = len(ids)
        print(f"turn {turn}: {rows[-1]}", flush=True)
        answer = tok.decode(hit.tokens)
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"Tool result: {user_text()}"}]

    block = with_cache.prefix.block if with_cache.prefix else PREFIX_BLOCK
    print(f"{args.model} (float32, spec {args.spec}, prefill chunk {args.chunk}, block {block}): "
          f"{args.turns} turns, answers of {args.answer} tokens")
    print(f"{'turn':>4} {'prompt':>7} {'new':>5} {'cached':>7} {'prefilled':>9} {'no-cache':>8} "
          f"{'ttft ms':>8} {'no-cache':>8} {'speedup':>8}  goal (prefilled <= new + block)")
    for r in rows:
        ok = "" if r["turn"] == 1 else ("ok" if r["prefilled"] <= r["new"] + block else "MISSED")
        print(f"{r['turn']:>4} {r['prompt']:>7} {r['new']:>5} {r['cached']:>7} {r['prefilled']:>9} "
              f"{r['prefilled_none']:>8} {1e3 * r['ttft']:>8.1f} {1e3 * r['ttft_none']:>8.1f} "
              f"{r['ttft_none'] / r['ttft']:>7.1f}x  {ok}")
    later = rows[1:]
    if later:
        hit_rate = sum(r["cached"] for r in later) / sum(r["prompt"] for r in later)
        speed = sum(r["ttft_none"] for r in later) / sum(r["ttft"] for r in later)
        print(f"turns 2..{args.turns}: hit rate {hit_rate:.3f} of prompt tokens; prefilled "
              f"{sum(r['prefilled'] for r in later)} vs {sum(r['prefilled_none'] for r in later)} tokens; "
              f"time to first token {speed:.1f}x lower (ratio of sums)")
    st = with_cache.prefix.stats
    print(f"cache: {with_cache.prefix.entries}, device {with_cache.prefix.device_used / 2**20:.1f} MiB, "
          f"host {with_cache.prefix.host_used / 2**20:.1f} MiB, demoted {st.demoted}, evicted {st.evicted}")


if __name__ == "__main__":
    main()
