"""``zoo compile``: compile the engine's programs for a target chip ahead of time (``zoo.serving.aot``)."""

from __future__ import annotations

import argparse
import json


def _compile(args: argparse.Namespace) -> int:
    from zoo.serving.aot import compile_report, table

    programs = tuple(args.programs.split(","))
    report = compile_report(args.model, quant=args.quant, target=args.target, layout=args.layout, batch=args.batch,
                            context=args.context, spec_tokens=args.spec, prefill_chunk=args.prefill_chunk,
                            dtype=args.dtype, programs=programs)
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0 if all(p["fits"] for p in report["programs"]) else 1


def add_commands(sub) -> None:
    from zoo.serving.aot import TARGETS

    p = sub.add_parser("compile", help="compile the decode step and the prefill chunk for a target chip (no TPU "
                                       "needed); per-chip memory from the compiler")
    p.add_argument("model", help="registry name, checkpoint directory or GGUF (nothing is read but its config)")
    p.add_argument("--quant", default=None, help="recipe (see zoo plan)")
    p.add_argument("--target", default="v5e-8", choices=sorted(TARGETS))
    p.add_argument("--layout", default="tp", choices=["tp", "ep"])
    p.add_argument("--batch", type=int, default=1, help="decode rows")
    p.add_argument("--context", type=int, default=4096, help="cache slots per row")
    p.add_argument("--spec", type=int, default=0, help="MTP draft tokens per step (0: plain decode)")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--programs", default="decode,prefill", help="comma-separated: decode, prefill")
    p.add_argument("--json", action="store_true", help="the whole report as JSON")
    p.set_defaults(fn=_compile)
