"""``zoo fit-mtp``: fit an MTP head to a model as loaded and write it as an overlay (``zoo.train.fit_mtp``).

    zoo fit-mtp MODEL [--quant RECIPE] [--dtype D] --out DIR [--steps N] [--prompts FILE] [--spec K]
                [--trainable GLOB ...]
    zoo generate --mtp DIR ... / zoo serve --mtp DIR ...     apply it (``zoo.load(..., mtp=DIR)``)

Prints the progress and the acceptance before / after (per draft position) on stderr, the overlay's
path on stdout (``--json``: the whole report).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_prompts(path, model) -> list[list[int]]:
    """One prompt per non-empty line: a user turn in the model's chat template (plain text without
    one), or token ids separated by spaces for a model without a tokenizer."""
    from zoo.train.fit_mtp import encode_prompts

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such prompt file")
    lines = [line.strip() for line in p.read_text().splitlines() if line.strip()]
    if model.tokenizer is not None:
        return encode_prompts(model, lines)
    try:
        return [[int(x) for x in line.split()] for line in lines]
    except ValueError:
        raise ValueError(f"{p}: this model has no tokenizer; give each prompt as token ids") from None


def _fit(args: argparse.Namespace) -> int:
    import zoo
    from zoo.train.fit_mtp import fit_mtp, save_overlay

    model = zoo.load(args.model, quant=args.quant, mesh=args.mesh, dtype=args.dtype)
    prompts = eval_prompts = None
    if args.prompts:
        lines = read_prompts(args.prompts, model)
        if len(lines) <= args.n_eval:
            raise ValueError(f"{args.prompts}: {len(lines)} prompts; the last --n-eval {args.n_eval} are held out "
                             f"to measure, so it needs more")
        prompts, eval_prompts = lines[:-args.n_eval], lines[-args.n_eval:]
    log = (lambda line: print(f"[zoo] {line}", file=sys.stderr, flush=True))
    result = fit_mtp(model, prompts, eval_prompts, steps=args.steps, new_tokens=args.new_tokens, lr=args.lr,
                     trainable=tuple(args.trainable), batch=args.batch, seed=args.seed, spec_tokens=args.spec,
                     temperature=args.temperature, n_prompts=args.n_prompts, n_eval=args.n_eval, log=log)
    manifest = save_overlay(result, args.out, base_name=args.model)
    report = result.report
    for when in ("before", "after"):
        acc = report[when]
        text = ("no MTP layer" if acc is None else
                f"{acc['rate']:.3f} ({acc['accepted']}/{acc['drafted']}), by draft position "
                f"{[round(x, 3) for x in acc['by_position']]}, {acc['tokens_per_step']:.2f} tokens/step")
        log(f"acceptance (k={args.spec}) {when}: {text}")
    log(f"wrote {len(manifest['tensors'])} MTP tensors to {args.out} in {report['seconds']['total']:.1f}s; "
        f"apply with: zoo serve --mtp {args.out}")
    print(json.dumps(report, indent=2, default=str) if args.json else str(args.out))
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("fit-mtp", help="fit an MTP head to a model as loaded (e.g. quantized) by self-distillation; "
                                       "write it as an MTP overlay for zoo serve/generate --mtp")
    p.add_argument("model", help="registry name, checkpoint directory or GGUF")
    p.add_argument("--out", required=True, help="the overlay directory to write")
    p.add_argument("--quant", default=None, help="quantization recipe to load with (the model as it will be served)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="activation dtype to load with (the MTP parameters train in float32 either way)")
    p.add_argument("--mesh", default=None, help="device mesh layout for zoo.load (tp, ep)")
    p.add_argument("--steps", type=int, default=200, help="Adam updates (default 200)")
    p.add_argument("--batch", type=int, default=8, help="sequences per update (default 8)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens the model writes per prompt (default 32)")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="one prompt per line (the last --n-eval are held out to measure); default: the "
                        "synthetic corpus's questions in the model's chat template")
    p.add_argument("--n-prompts", type=int, default=64, help="default prompts to fit on (default 64)")
    p.add_argument("--n-eval", type=int, default=8, help="held-out prompts to measure acceptance on (default 8)")
    p.add_argument("--spec", type=int, default=2, metavar="K", help="draft length to measure with (default 2)")
    p.add_argument("--trainable", nargs="+", default=["mtp.*"], metavar="GLOB",
                   help="MTP parameters to train (globs over paths, e.g. 'mtp.fc.*' 'mtp.block.self_attn.*' to "
                        "keep a MoE MTP layer's experts frozen as loaded); default: mtp.*")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: fit for greedy decoding (the model's argmax); T > 0: sample the data and match "
                        "the model's distribution at T")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")
    p.set_defaults(fn=_fit)
