"""``zoo eval``: the output-quality cost of a quantization against a reference model (``zoo.eval``).

    zoo eval base MODEL (--text FILE | --tokens FILE.npy) --out BASE.npz [--ctx 512] [--chunks N]
                        [--quant R] [--dtype D] [--mesh tp|ep] [--batch B]
    zoo eval kld MODEL --base BASE.npz [--text FILE | --tokens FILE.npy] [--quant R] [--dtype D]
                       [--mesh tp|ep] [--batch B] [--json] [--per-token OUT.npz]

``base`` runs the reference (e.g. ``--quant bf16`` or ``--dtype float32``) and writes BASE.npz;
``kld`` runs the candidate on the same windows and prints KL divergence, top-1 agreement and the
perplexities (``--json``: the same as JSON on stdout). Progress and tokens/s go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def _load(args):
    import zoo
    return zoo.load(args.model, quant=args.quant, dtype=args.dtype, mesh=args.mesh, cache=args.cache)


def _inputs(args) -> dict:
    if args.text is not None:
        return {"text": Path(args.text).read_text(encoding="utf-8")}
    if args.tokens is not None:
        return {"tokens": np.load(args.tokens, allow_pickle=False)}
    return {}


def _base(args) -> int:
    import zoo.eval

    inputs = _inputs(args)
    if not inputs:
        raise ValueError("zoo eval base: give the evaluation text (--text FILE) or its ids (--tokens FILE.npy)")
    out = zoo.eval.base(_load(args), args.out, ctx=args.ctx, chunks=args.chunks, batch=args.batch,
                        progress=not args.quiet, **inputs)
    meta = zoo.eval.BaseFile(out).meta
    print(f"zoo eval: wrote {out}: {meta['windows']} windows of {meta['ctx']} tokens, "
          f"{meta['windows'] * meta['scored']} scored", file=sys.stderr)
    return 0


def _kld(args) -> int:
    import zoo.eval

    base = zoo.eval.BaseFile(args.base)                  # a wrong file fails before the model loads
    report = zoo.eval.kld(_load(args), base, batch=args.batch, progress=not args.quiet, **_inputs(args))
    if args.per_token:
        np.savez(args.per_token, **report.per_token)
    print(report.to_json() if args.json else report.text())
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="registry name, checkpoint directory or GGUF")
    p.add_argument("--quant", default=None, help="quantization recipe (see zoo plan)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--mesh", default=None, help="device mesh layout for zoo.load (tp, ep)")
    p.add_argument("--cache", default=None, metavar="DIR", help="repacked-weight cache directory (as zoo serve)")
    p.add_argument("--batch", type=int, default=1, help="windows per forward pass (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--text", default=None, metavar="FILE", help="the evaluation text (UTF-8)")
    text.add_argument("--tokens", default=None, metavar="FILE.npy", help="the evaluation text as 1-D token ids")


def add_commands(sub) -> None:
    e = sub.add_parser("eval", help="KL divergence, top-1 agreement and perplexity of a model against a reference")
    passes = e.add_subparsers(dest="eval_pass", required=True)
    b = passes.add_parser("base", help="pass 1: score the text with the reference model and store it")
    _common(b)
    b.add_argument("--out", required=True, metavar="BASE.npz")
    b.add_argument("--ctx", type=int, default=512, help="tokens per window (default 512; the second half is scored)")
    b.add_argument("--chunks", type=int, default=None, metavar="N", help="only the first N windows")
    b.set_defaults(fn=_base)
    k = passes.add_parser("kld", help="pass 2: score a candidate against the stored reference")
    _common(k)
    k.add_argument("--base", required=True, metavar="BASE.npz", help="written by zoo eval base")
    k.add_argument("--json", action="store_true", help="the figures as JSON")
    k.add_argument("--per-token", default=None, metavar="OUT.npz", help="also save the per-token values")
    k.set_defaults(fn=_kld)
