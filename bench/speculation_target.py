"""Speculation on the target: plain decoding against fixed MTP drafts against the auto policy, in
tokens per second estimated by ``zoo compile`` for a TPU v5e-8 (the real TPU compiler, no TPU).

    JAX_PLATFORMS=cpu TPU_ACCELERATOR_TYPE=v5litepod-8 TPU_WORKER_HOSTNAMES=localhost \
        PYTHONPATH=. .venv/bin/python bench/speculation_target.py [--only qwen38-27b] [--batches 1 3 8]
        [--context 32768] [--json OUT]

Per model and batch size, ``compile_report`` compiles the server's three decode programs (plain; the
K-draft step; the step with drafting off) and estimates each step's time (the Pallas kernels'
estimate plus XLA's cost model, per chip). With acceptance by draft position a_1..a_K, a row
drafting d tokens emits 1 + a_1 + a_1 a_2 + ... tokens per step on average. Printed per batch size:

    plain   rows / t(plain step)
    fixed   rows * E(K drafts) / t(K-draft step)
    auto    the better of drafting off (rows / t(off)) and drafting (rows * E(K) / t(K-draft step)):
            the policy's choice when its timings are these estimates. A step drafting
            d < K costs less than the K-draft estimate on the device (chained MTP drafts past d are
            skipped, masked verify positions route no experts) but the static estimate cannot see
            it, so auto's figure is a lower bound.

The acceptance is an input: by default what ``bench/speculation.py`` measured on the embedded demo
models (bench/results/speculation-2026-12-05.txt: MTP drafts on chat; prompt-lookup drafts of
4-gram matches on the re-asked questions). The baseline in the same run is the plain step.
"""

from __future__ import annotations

import argparse
import json

from zoo.engine.spec_policy import Acceptance, reach
from zoo.tools.compile_report import compile_report

# Acceptance by draft position, measured by bench/speculation.py on the demo models (2026-12-05).
ACCEPTANCE = {
    "mtp": {"glm53-flash": [0.87, 0.34, 0.26], "qwen38-27b": [0.93, 0.40, 0.38]},
    "lookup": {"glm53-flash": [0.85, 0.82, 0.90], "qwen38-27b": [0.88, 0.92, 0.90]},
}
CASES = [("glm53-flash", "UD-IQ3_XXS"), ("qwen38-27b", "bf16")]


def expected_tokens(acceptance: list[float], drafts: int) -> float:
    """Tokens a row emits per step drafting ``drafts`` tokens: 1 + a_1 + a_1 a_2 + ... (the policy's
    own ``reach``, with no counts of the row's own: the given rates)."""
    return reach(Acceptance(len(acceptance)), acceptance, drafts)[-1]


def step_seconds(program: dict) -> float | None:
    """The step's estimate (None: the program does not fit the chips' memory)."""
    if "roofline" not in program:
        return None
    r = program["roofline"]
    return r["pallas"]["estimate_s"] + r["xla"]["estimate_s"]


def estimate(model: str, quant: str, batch: int, context: int, k: int) -> dict:
    report = compile_report(model, quant=quant, target="v5e-8", batch=batch, context=context, spec_tokens=k,
                            programs=("decode",))
    plain, drafts, off = report["programs"]
    assert "MTP" not in plain["name"] and f"MTP k={k}" in drafts["name"] and "drafts off" in off["name"], report
    return {"model": model, "quant": quant, "batch": batch, "context": context, "k": k,
            "seconds": {"plain": step_seconds(plain), "drafts": step_seconds(drafts), "off": step_seconds(off)},
            "must_read": {key: p["roofline"]["must_read"]["total"] if "roofline" in p else None
                          for key, p in (("plain", plain), ("drafts", drafts), ("off", off))},
            "fits": {"plain": plain["fits"], "drafts": drafts["fits"], "off": off["fits"]}}


def rates(est: dict, acceptance: list[float]) -> dict:
    """Tokens per second of plain, fixed and auto for one batch size (module doc); a program that
    does not fit counts 0 (auto then never runs it). With every d costed as the K-draft program, the
    best d is K: auto's drafting is fixed's."""
    b, k, t = est["batch"], est["k"], est["seconds"]
    per_s = lambda tokens, seconds: 0.0 if seconds is None else tokens / seconds          # noqa: E731
    fixed = per_s(b * expected_tokens(acceptance, k), t["drafts"])
    return {"plain": per_s(b, t["plain"]), "fixed": fixed, "auto": max(per_s(b, t["off"]), fixed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="only this model (glm53-flash or qwen38-27b)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 3, 8])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--spec", type=int, default=3)
    ap.add_argument("--json", help="write the estimates here")
    args = ap.parse_args()
    out = []
    for model, quant in [c for c in CASES if not args.only or c[0] == args.only]:
        print(f"\n{model} / {quant} on v5e-8, {args.context}-token window, MTP k={args.spec}; step estimates "
              "(ms per step, Pallas + XLA per chip) and tokens/s by acceptance source", flush=True)
        print(f"{'rows':>4s} {'plain':>7s} {'K-draft':>7s} {'off':>7s} {'read GiB p/K':>12s} | {'source':7s} "
              f"{'plain':>7s} {'fixed':>7s} {'auto':>7s} {'fixed/plain':>11s} {'auto/plain':>10s}")
        for b in args.batches:
            est = estimate(model, quant, b, args.context, args.spec)
            t, read = est["seconds"], est["must_read"]
            ms = lambda s: f"{'-':>7s}" if s is None else f"{1e3 * s:7.2f}"                  # noqa: E731
            gib = lambda n: f"{'-':>5s}" if n is None else f"{n / 2**30:5.2f}"               # noqa: E731
            head = (f"{b:4d} {ms(t['plain'])} {ms(t['drafts'])} {ms(t['off'])} "
                    f"{gib(read['plain'])}/{gib(read['drafts'])}")
            for source, by_model in ACCEPTANCE.items():
                r = rates(est, by_model[model])
                est[source] = r
                unfit = [name for name, ok in est["fits"].items() if not ok]
                ratio = lambda x: f"{x / r['plain']:10.2f}x" if r["plain"] else f"{'-':>11s}"   # noqa: E731
                print(f"{head if source == 'mtp' else ' ' * len(head)} | {source:7s} {r['plain']:7.1f} "
                      f"{r['fixed']:7.1f} {r['auto']:7.1f} {ratio(r['fixed'])} {ratio(r['auto'])[1:]}"
                      + (f"  (does not fit: {', '.join(unfit)})" if unfit else ""), flush=True)
            out.append(est)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
