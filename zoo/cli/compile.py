"""``zoo compile``: compile the engine's programs for a target chip ahead of time (``zoo.tools.compile_report``)."""

from __future__ import annotations

import argparse
import json

GiB = 2 ** 30


def _compile(args: argparse.Namespace) -> int:
    from zoo.tools.compile_report import compile_report, largest_batch, table

    programs = tuple(p for p in args.programs.split(",") if p)
    chunk = None if args.prefill_chunk == "auto" else int(args.prefill_chunk)
    min_margin = int(args.min_margin * GiB)
    report = compile_report(args.model, quant=args.quant, target=args.target, layout=args.layout, batch=args.batch,
                            context=args.context, spec_tokens=args.spec, prefill_chunk=chunk, dtype=args.dtype,
                            programs=programs, min_margin=min_margin, hlo_dir=args.hlo_dir, fill=args.fill)
    searches = [largest_batch(args.model, quant=args.quant, target=args.target, layout=args.layout,
                              context=int(c), spec_tokens=report["spec_tokens"], min_margin=min_margin,
                              dtype=args.dtype)
                for c in args.search_batch.split(",") if c] if args.search_batch else []
    if searches:
        report["largest_batch"] = searches
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(table(report))
        for s in searches:
            print(f"largest batch at L={s['context']}: {s['batch']} rows (margin {s['margin'] / GiB:.2f} GiB, "
                  f"{s['compiles']} compiles)")
    return 0 if report["ok"] else 1


def add_commands(sub) -> None:
    from zoo.tools.targets import TARGETS

    p = sub.add_parser("compile", help="compile the server's program set for a target chip (no TPU needed): the "
                                       "decode steps, the prefill widths, the masked step parts; per-chip memory "
                                       "and a roofline from the compiler")
    p.add_argument("model", help="registry name, checkpoint directory or GGUF (nothing is read but its config)")
    p.add_argument("--quant", default=None, help="recipe (see zoo plan)")
    p.add_argument("--target", default="v5e-8", choices=sorted(TARGETS))
    p.add_argument("--layout", default="tp", choices=["tp", "ep"])
    p.add_argument("--batch", type=int, default=3, help="decode rows (default 3)")
    p.add_argument("--context", type=int, default=32768, help="cache slots per row (default 32768)")
    p.add_argument("--spec", type=int, default=None,
                   help="MTP draft tokens per step; the decode step is compiled without drafts and with them "
                        "(default 3 where the model has an MTP layer, else 0)")
    p.add_argument("--prefill-chunk", default="auto",
                   help="tokens per prefill chunk, or 'auto': the largest of 1024/512/256/128 that leaves the margin")
    p.add_argument("--min-margin", type=float, default=0.5, help="GiB per chip a program must leave free (default 0.5)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--programs", default="decode,prefill,masked",
                   help="comma-separated: decode, prefill, masked (the decode step split around grammar token "
                        "masks: the programs a batch with a constrained row runs); default all three")
    p.add_argument("--search-batch", default="", metavar="CONTEXTS",
                   help="comma-separated contexts: also find the most decode rows that fit at each")
    p.add_argument("--fill", type=int, default=None,
                   help="the roofline counts the cache at this many tokens per row (default: the whole context)")
    p.add_argument("--hlo-dir", default=None, help="also write each compiled program's HLO text here")
    p.add_argument("--json", action="store_true", help="the whole report as JSON")
    p.set_defaults(fn=_compile)
