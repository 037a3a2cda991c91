"""Full-size ahead-of-time compiles for a TPU v5e-8 with the real TPU compiler (libtpu's topology; no
TPU needed): per program and per chip, weights resident, batch state, temporaries, total against the
compiler's usable HBM, and the margin; the planner's per-chip weight bytes beside the compiler's
(their ratio is the baseline check: 1.000 when the planner is right). Each GLM-5.3-Flash compile takes
~1-2 minutes and ~3 GB of RAM; run one compiling process at a time. From the repo root:

    JAX_PLATFORMS=cpu PYTHONPATH=. .venv/bin/python bench/compile_tpu.py [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import json

from zoo.serving.aot import GiB, compile_report, table
from zoo.tools.plan import plan

# (model, recipe, batch, context, MTP drafts, prefill chunk, programs)
CASES = [
    ("glm53-flash", "UD-IQ3_XXS-bf16", 1, 4096, 0, 512, ("decode",)),
    ("glm53-flash", "UD-IQ3_XXS", 1, 4096, 0, 512, ("decode", "prefill")),
    ("glm53-flash", "UD-IQ3_XXS", 3, 32768, 3, 512, ("decode", "prefill")),
    ("qwen38-27b", "bf16", 1, 4096, 0, 512, ("decode", "prefill")),
    ("qwen38-27b", "int8", 1, 32768, 3, 512, ("decode", "prefill")),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the first case")
    ap.add_argument("--json", help="write every report here")
    args = ap.parse_args()
    reports = []
    for model, quant, batch, context, k, chunk, programs in CASES[:1] if args.quick else CASES:
        report = compile_report(model, quant=quant, target="v5e-8", batch=batch, context=context, spec_tokens=k,
                                prefill_chunk=chunk, programs=programs)
        print(table(report))
        planner = plan(model, quant=quant, devices=8).per_device_bytes
        compiled = [p for p in report["programs"] if "error" not in p]
        if compiled:
            compiler = compiled[0]["arguments"] - compiled[0]["batch_state"]
            print(f"planner {planner / GiB:.3f} GiB per chip, compiler arguments less batch state "
                  f"{compiler / GiB:.3f} GiB: ratio {compiler / planner:.4f}")
        print()
        reports.append(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)


if __name__ == "__main__":
    main()
