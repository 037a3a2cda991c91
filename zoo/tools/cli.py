"""The ``zoo plan`` and ``zoo audit`` subcommands (registered on ``zoo.cli``'s parser).

    zoo plan NAME --quant RECIPE [--devices N] [--layout tp|ep] [--budget-gb X] [--prefix-cache] [--json]
    zoo plan FILE.gguf [--quant RECIPE] [--devices N] [--budget-gb X] [--json]   header only
    (FILE.gguf and the audit's files may be remote: hf://OWNER/REPO[@REV]/PATH.gguf or https://...,
    read with HTTP range requests: see zoo.sources.remote)
    zoo audit QUANT.gguf REF.gguf --tensors PATTERN [PATTERN ...] [--experts 0,4-7] [--rows 0:256]
              [--json OUT]

``zoo plan`` exits 1 when a ``--budget-gb`` is given and the weights do not fit it per device.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _plan(args) -> int:
    from zoo.tools.plan import plan, plan_gguf

    if args.model.endswith(".gguf"):
        from zoo.sources.remote import is_remote
        where = args.model if is_remote(args.model) else Path(args.model).expanduser()
        result = plan_gguf(where, args.devices, args.quant, layout=args.layout)
    elif args.quant is None:
        raise ValueError(f"zoo plan {args.model}: --quant RECIPE is required (only a .gguf file is planned as stored)")
    else:
        result = plan(args.model, quant=args.quant, devices=args.devices, layout=args.layout)
    budget = None if args.budget_gb is None else int(args.budget_gb * 1e9)
    prefix = None
    if args.prefix_cache:
        if args.model.endswith(".gguf"):
            raise ValueError("zoo plan --prefix-cache takes a registry name (the cache's shapes come from its preset)")
        from zoo.tools.prefix_plan import prefix_cache_plan, summary
        prefix = prefix_cache_plan(args.model, args.devices, args.layout)
    if args.json:
        print(json.dumps({**result.to_dict(budget), **({"prefix_cache": prefix} if prefix else {})}, indent=2))
    else:
        print(result.summary())
        if prefix:
            print(summary(prefix))
        if budget is not None:
            print(f"  fits {args.budget_gb:g} GB per device: {'yes' if result.fits(budget) else 'no'}")
    return 0 if budget is None or result.fits(budget) else 1


def _audit(args) -> int:
    from zoo.tools.audit import audit, table, write_json

    rows = audit(args.quant, args.ref, args.tensors, experts=args.experts, rows=args.rows,
                 n_cols=args.cols, seed=args.seed)
    print(table(rows))
    if args.json:
        write_json(rows, args.json, args.quant, args.ref, args.cols, args.seed)
    return 0


def experts_arg(text: str) -> list[int]:
    """``"0,4-7"`` -> ``[0, 4, 5, 6, 7]``."""
    out = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"experts must look like 0,4-7, not {text!r}") from None
    return out


def rows_arg(text: str) -> tuple[int, int]:
    """``"0:256"`` -> ``(0, 256)``."""
    try:
        start, stop = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"rows must look like START:STOP, not {text!r}") from None
    return start, stop


def add_commands(sub) -> None:
    """Add ``plan`` and ``audit`` to the ``zoo`` command's subparsers."""
    p = sub.add_parser("plan", help="memory plan of a model x recipe x devices (no download), or of a GGUF header")
    p.add_argument("model", help="registry name, or a .gguf file (the first of a split set; local, "
                                 "hf://OWNER/REPO[@REV]/PATH.gguf or https://...)")
    p.add_argument("--quant", default=None, help="recipe (zoo.quant.recipe); a GGUF without it: as stored")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--layout", default="tp", choices=["tp", "ep"], help="mesh layout of the per-device bytes")
    p.add_argument("--budget-gb", type=float, default=None, help="per-device budget for the weights (1 GB = 1e9 B)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--prefix-cache", action="store_true",
                   help="also the bytes per chip of a prefix-cache block and snapshot (zoo.tools.prefix_plan)")
    p.set_defaults(fn=_plan)

    a = sub.add_parser("audit", help="weight-space error of a quantized GGUF against a bf16/f32 GGUF")
    a.add_argument("quant", help="the quantized .gguf")
    a.add_argument("ref", help="the reference (bf16 or f32) .gguf of the same model")
    a.add_argument("--tensors", nargs="+", required=True, metavar="PATTERN", help="glob(s) of tensor names")
    a.add_argument("--experts", type=experts_arg, default=None, help="experts of stacked banks, e.g. 0,4-7 (all)")
    a.add_argument("--rows", type=rows_arg, default=None, help="output rows START:STOP (all)")
    a.add_argument("--cols", type=int, default=64, help="columns of the standard-normal X")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--json", default=None, metavar="OUT", help="write the rows as JSON to OUT")
    a.set_defaults(fn=_audit)
