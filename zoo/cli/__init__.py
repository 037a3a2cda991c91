"""The ``zoo`` command (also ``python -m zoo``).

    zoo serve [--model NAME|PATH] [--port N] [--api-key KEY] ...   OpenAI/Anthropic-compatible server
                                     (``zoo.cli.serve``; one command per host for several processes)
    zoo generate --model NAME|PATH --prompt TEXT [--max-tokens N] [--temperature T] ...
    zoo models                       registered model names
    zoo inspect NAME|PATH            config and tensor inventory of a checkpoint, no weights loaded
    zoo plan | audit ...             memory plan, quantization audit (``zoo.tools.cli``)
    zoo cache build | ls | push | pull   repacked-weight caches and Kaggle datasets (``zoo.cli.cache``)
    zoo compile NAME --target v5e-8      the engine's programs compiled for a target chip (``zoo.cli.compile``)
    zoo eval base | kld ...              KL divergence, top-1 agreement, perplexity against a reference
                                         (``zoo.cli.eval``, ``zoo.eval``)
    zoo fit-mtp NAME --out DIR           fit an MTP head to the model as loaded, as an overlay (``zoo.cli.fit_mtp``);
                                         ``serve`` / ``generate --mtp DIR`` apply it
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _generate(args) -> int:
    import zoo

    t0 = time.perf_counter()
    model = zoo.load(args.model, quant=args.quant, dtype=args.dtype, mtp=args.mtp)
    load_s = time.perf_counter() - t0
    tok = model.tokenizer
    if tok is None:
        ids = [int(x) for x in args.prompt.split()]
    elif args.raw or tok.chat_template is None:
        ids = tok.encode(args.prompt)
    else:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": args.prompt}]))
    print(f"[zoo] loaded {args.model} in {load_s:.2f}s; prompt {len(ids)} tokens", file=sys.stderr)
    gen = model.generator(args.spec, args.spec_policy)
    shown = {"text": "", "first": None}

    def show(req, new_tokens):
        shown["first"] = shown["first"] or time.perf_counter()
        if tok is None:
            print(" ".join(map(str, new_tokens)), end=" ", flush=True)
            return
        text = tok.decode(req.tokens)
        print(text[len(shown["text"]):], end="", flush=True)
        shown["text"] = text

    t1 = time.perf_counter()
    req = gen.submit(gen.make_request(ids, max_new_tokens=args.max_tokens, temperature=args.temperature,
                                      top_p=args.top_p, top_k=args.top_k, seed=args.seed, on_tokens=show))
    while not req.done.is_set():
        gen.step()
    end = time.perf_counter()
    print()
    n, first = len(req.tokens), shown["first"] or end
    decode_rate = (n - 1) / (end - first) if n > 1 else 0.0
    if req.finish_reason == "error":              # the engine ended the request: the command failed
        print(f"zoo generate: error: {req.stats.get('error', 'the request failed')}", file=sys.stderr)
        return 1
    print(f"[zoo] {n} tokens in {end - t1:.2f}s (first token {first - t1:.2f}s, decode {decode_rate:.1f} tok/s, "
          f"{req.stats['steps']} decode steps, finish: {req.finish_reason})", file=sys.stderr)
    if args.spec:
        drafted, accepted = req.stats["drafted"], req.stats["accepted"]
        by_pos = ", ".join(f"{a / max(req.stats['steps'], 1):.2f}" for a in req.stats["accepted_by_position"])
        print(f"[zoo] MTP k={args.spec}: acceptance {accepted / max(drafted, 1):.2f} ({accepted}/{drafted}), "
              f"by draft position [{by_pos}], {(n - 1) / max(req.stats['steps'], 1):.2f} tokens/step "
              f"({args.spec_policy} policy)", file=sys.stderr)
        for source, by in sorted(req.stats.get("spec", {}).items()):
            if source != "lengths":
                rates = ", ".join(f"{a / t:.2f}" if t else "-" for a, t in zip(by["accepted"], by["tried"]))
                print(f"[zoo]   {source} drafts: acceptance by position [{rates}] over {by['tried'][0]} steps",
                      file=sys.stderr)
    return 0


def _models(args) -> int:
    from zoo.registry import REGISTRY
    for spec in REGISTRY.values():
        print(f"{spec.name:16s} {spec.arch:10s} {spec.description}")
    return 0


def _inspect(args) -> int:
    """A checkpoint directory's config.json and safetensors headers, or a GGUF's header (a local file,
    the first of a split set, or a remote reference): the config and every tensor, no weight read."""
    import collections
    import dataclasses

    from zoo.models.config import load_config
    from zoo.sources.remote import is_remote

    rows = []                                                   # (name, type, shape, bytes)
    if str(args.model).endswith(".gguf") or is_remote(args.model):
        from zoo.loader.gguf_model import config_from_gguf
        from zoo.sources.gguf import GGUFSource

        source = GGUFSource(args.model)
        path, cfg = ", ".join(str(f) for f in source.files), config_from_gguf(source)
        for key in source.keys():
            info = source.info(key)
            rows.append((key, info.qtype.name, list(info.shape), info.nbytes))
    else:
        from zoo.loader.open import resolve
        from zoo.sources.safetensors import SafetensorsSource

        path = resolve(args.model)
        cfg, source = load_config(path), SafetensorsSource(path)
        for key in source.keys():
            info = source.info(key)
            n = 1
            for d in info.shape:
                n *= d
            rows.append((key, str(info.dtype), list(info.shape), n * info.dtype.itemsize))
    print(json.dumps({"path": str(path), "arch": cfg.arch, "config": dataclasses.asdict(cfg)}, indent=2))
    if args.tensors:
        for name, kind, shape, _ in rows:
            print(f"{name:70s} {kind:10s} {shape}")
    by_type = collections.Counter()
    for _, kind, _, nbytes in rows:
        by_type[kind] += nbytes
    print("by type: " + ", ".join(f"{kind} {n / 1e9:.3f} GB" for kind, n in by_type.most_common()))
    print(f"{len(rows)} tensors, {sum(by_type.values()) / 1e9:.3f} GB")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zoo", description="Flax NNX model zoo: serve, generate, inspect.")
    sub = p.add_subparsers(dest="command", required=True)
    from zoo.cli import serve
    serve.add_commands(sub)

    g = sub.add_parser("generate", help="generate text from a prompt (greedy by default)")
    g.add_argument("--model", default="qwen38-tiny", help="registry name or checkpoint path")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    g.add_argument("--quant", default=None, help="quantization recipe (see zoo.quant.recipe)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--spec", type=int, default=0, metavar="K", help="MTP speculative draft length (0: off)")
    serve.add_spec_policy(g)
    g.add_argument("--mtp", default=None, metavar="DIR", help="an MTP overlay (zoo fit-mtp) applied to the model")
    g.set_defaults(fn=_generate)

    m = sub.add_parser("models", help="list registered models")
    m.set_defaults(fn=_models)

    i = sub.add_parser("inspect", help="show a checkpoint's config and tensors without loading it")
    i.add_argument("model", help="registry name, checkpoint directory, or .gguf file (local or remote: "
                                 "hf://OWNER/REPO[@REV]/PATH.gguf, https://...)")
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.set_defaults(fn=_inspect)

    from zoo.tools.cli import add_commands
    add_commands(sub)
    from zoo.cli import cache
    cache.add_commands(sub)
    from zoo.cli import compile as compile_cli
    compile_cli.add_commands(sub)
    from zoo.cli import fit_mtp
    fit_mtp.add_commands(sub)
    from zoo.cli import eval as eval_cli
    eval_cli.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, KeyError, NotImplementedError) as e:
        print(f"zoo: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
