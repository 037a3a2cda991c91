"""Full-size ahead-of-time compiles for a TPU v5e-8 with the real TPU compiler (libtpu's topology; no
TPU needed), exactly what ``zoo compile`` runs: per program and per chip, weights resident, batch
state, temporaries, the compiler's peak against its usable HBM and the margin, the prefill chunk
chosen from the memory left, and the roofline (bytes a step must read over HBM bandwidth, the Pallas
kernels' grid steps and estimated time, XLA's cost-model estimate and bytes accessed). The baseline
check is the planner's per-chip weight bytes beside the compiler's (ratio 1.000 when the planner is
right). Each GLM-5.3-Flash compile takes ~1-2 minutes and ~3 GB of RAM (several compiling processes
may run at once on a machine without a TPU: ``zoo.tools.compile_report`` sets ALLOW_MULTIPLE_LIBTPU_LOAD). From
the repo root:

    JAX_PLATFORMS=cpu PYTHONPATH=. .venv/bin/python bench/compile_tpu.py [--quick] [--search] \
        [--json OUT] [--hlo-dir DIR]
"""

from __future__ import annotations

import argparse
import json

from zoo.tools.compile_report import GiB, compile_report, largest_batch, table
from zoo.tools.plan import plan

MARGIN = GiB // 2
# (model, recipe, batch, context, MTP drafts (None: 3 where the model has an MTP layer), prefill chunk (None: chosen))
CASES = [
    ("glm53-flash", "UD-IQ3_XXS", 3, 32768, None, None),          # the goal: `zoo compile` with its defaults
    ("glm53-flash", "UD-IQ3_XXS", 1, 4096, 0, 512),
    ("qwen38-27b", "bf16", 3, 32768, None, None),
    ("qwen38-27b", "int8", 3, 32768, None, None),
    ("qwen38-27b", "Q8_0", 3, 32768, None, None),
]
SEARCH = [("glm53-flash", "UD-IQ3_XXS", 32768), ("glm53-flash", "UD-IQ3_XXS", 131072)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the first case")
    ap.add_argument("--only", default="", help="only the cases of this model (e.g. qwen38-27b)")
    ap.add_argument("--search", action="store_true", help="also the largest batch at 32k and 128k (GLM, ~8 compiles)")
    ap.add_argument("--json", help="write every report here")
    ap.add_argument("--hlo-dir", help="write each compiled program's HLO here (bench/hlo_traffic.py reads it)")
    args = ap.parse_args()
    reports = []
    cases = [c for c in CASES if not args.only or c[0] == args.only]
    for model, quant, batch, context, k, chunk in cases[:1] if args.quick else cases:
        report = compile_report(model, quant=quant, target="v5e-8", batch=batch, context=context, spec_tokens=k,
                                prefill_chunk=chunk, min_margin=MARGIN,
                                hlo_dir=args.hlo_dir and f"{args.hlo_dir}/{model}-{quant}")
        print(table(report))
        planner = plan(model, quant=quant, devices=8).per_device_bytes
        compiled = [p for p in report["programs"] if "error" not in p]
        if compiled:
            compiler = compiled[0]["arguments"] - compiled[0]["batch_state"]
            print(f"planner {planner / GiB:.3f} GiB per chip, compiler arguments less batch state "
                  f"{compiler / GiB:.3f} GiB: ratio {compiler / planner:.4f}")
        print(f"all programs fit with {MARGIN / GiB:.1f} GiB to spare: {report['ok']}\n", flush=True)
        reports.append(report)
    if args.search and (not args.only or args.only == SEARCH[0][0]):
        for model, quant, context in SEARCH:
            found = largest_batch(model, quant=quant, context=context, spec_tokens=3, min_margin=MARGIN)
            above = "-" if found["next_margin"] is None else f"{found['next_margin'] / GiB:.2f}"
            print(f"{model} {quant} MTP k=3: largest batch at L={context}: {found['batch']} rows (margin "
                  f"{found['margin'] / GiB:.2f} GiB; one row more: {above} GiB; {found['compiles']} compiles)",
                  flush=True)
            reports.append(found)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)


if __name__ == "__main__":
    main()
