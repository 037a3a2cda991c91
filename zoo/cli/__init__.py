"""The ``zoo`` command (also ``python -m zoo``).

    zoo serve [--model NAME|PATH] [--port N] [--api-key KEY] ...   OpenAI/Anthropic-compatible server
    zoo generate --model NAME|PATH --prompt TEXT [--max-tokens N] [--temperature T] ...
    zoo models                       registered model names
    zoo inspect NAME|PATH            config and tensor inventory of a checkpoint, no weights loaded
    zoo plan | audit ...             memory plan, quantization audit (``zoo.tools.cli``)
    zoo cache build | ls | push | pull   repacked-weight caches and Kaggle datasets (``zoo.cli.cache``)
    zoo compile NAME --target v5e-8      the engine's programs compiled for a target chip (``zoo.cli.compile``)
    zoo fit-mtp NAME --out DIR           fit an MTP head to the model as loaded, as an overlay (``zoo.cli.fit_mtp``);
                                         ``serve`` / ``generate --mtp DIR`` apply it
"""

from __future__ import annotations

import argparse
import json
import os
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
    gen = model.generator(args.spec)
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
    print(f"[zoo] {n} tokens in {end - t1:.2f}s (first token {first - t1:.2f}s, decode {decode_rate:.1f} tok/s, "
          f"{req.stats['steps']} decode steps, finish: {req.finish_reason})", file=sys.stderr)
    if args.spec:
        drafted, accepted = req.stats["drafted"], req.stats["accepted"]
        by_pos = ", ".join(f"{a / max(req.stats['steps'], 1):.2f}" for a in req.stats["accepted_by_position"])
        print(f"[zoo] MTP k={args.spec}: acceptance {accepted / max(drafted, 1):.2f} ({accepted}/{drafted}), "
              f"by draft position [{by_pos}], {(n - 1) / max(req.stats['steps'], 1):.2f} tokens/step",
              file=sys.stderr)
    return 0


def _serve(args) -> int:
    import secrets
    from pathlib import Path

    from zoo.serving.transport import bind

    host = f"[{args.host}]" if ":" in args.host else args.host
    try:                                 # the port first: a port in use fails now, not after the model loads
        sock = bind(args.host, args.port)
    except OSError as e:
        print(f"zoo serve: cannot listen on {host}:{args.port}: {(e.strerror or str(e)).lower()}", file=sys.stderr)
        return 2
    try:
        import zoo
        from zoo.serving.server import create_app, serve

        key = args.api_key or os.environ.get("ZOO_API_KEY") or secrets.token_urlsafe(24)
        t0 = time.perf_counter()
        model = zoo.load(args.model, quant=args.quant, mesh=args.mesh, dtype=args.dtype, mtp=args.mtp)
        name = Path(args.model).name if Path(args.model).expanduser().exists() else args.model
        app = create_app(model, api_key=key, spec_tokens=args.spec, max_batch=args.max_batch,
                         prefill_chunk=args.prefill_chunk, max_queue=args.max_queue,
                         queue_timeout_s=args.queue_timeout, model_name=name,
                         tool_format=None if args.tool_format == "none" else args.tool_format,
                         thinking_budget=args.thinking_budget, prefix_cache_gb=args.prefix_cache_gb,
                         prefix_cache_host_gb=args.prefix_cache_host_gb,
                         max_body_bytes=int(args.max_body_mb * (1 << 20)), body_timeout_s=args.body_timeout)
        base = f"http://{host}:{sock.getsockname()[1]}"
        print(f"[zoo] loaded {args.model} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        print(f"zoo serve: {name}\n  OpenAI base URL:    {base}/v1\n  Anthropic base URL: {base}\n  API key: {key}",
              flush=True)
        try:                             # until SIGTERM / SIGINT, after the drain (see zoo.serving.transport)
            serve(app, sock, log_level=args.log_level, header_timeout_s=args.header_timeout,
                  keepalive_timeout_s=args.keepalive_timeout, drain_seconds=args.drain_seconds)
        except KeyboardInterrupt:        # a Ctrl-C that came before the server ran
            pass
    finally:
        sock.close()
    return 0


def _models(args) -> int:
    from zoo.registry import REGISTRY
    for spec in REGISTRY.values():
        print(f"{spec.name:16s} {spec.arch:10s} {spec.description}")
    return 0


def _inspect(args) -> int:
    import dataclasses

    from zoo.api import resolve
    from zoo.models.config import load_config
    from zoo.sources.safetensors import SafetensorsSource

    path = resolve(args.model)
    cfg = load_config(path)
    source = SafetensorsSource(path)
    print(json.dumps({"path": str(path), "arch": cfg.arch, "config": dataclasses.asdict(cfg)}, indent=2))
    total = 0
    for key in source.keys():
        info = source.info(key)
        n = 1
        for d in info.shape:
            n *= d
        total += n * info.dtype.itemsize
        if args.tensors:
            print(f"{key:70s} {str(info.dtype):10s} {list(info.shape)}")
    print(f"{len(source.keys())} tensors, {total / 1e9:.3f} GB")
    return 0


def _positive(text: str) -> float:
    """An argparse type: a number > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    """An argparse type: a number >= 0."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zoo", description="Flax NNX model zoo: serve, generate, inspect.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve a model over the OpenAI and Anthropic APIs (default: the tiny model)")
    s.add_argument("--model", default="qwen38-tiny", help="registry name or checkpoint path")
    s.add_argument("--quant", default=None, help="quantization recipe (see zoo.quant.recipes)")
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    s.add_argument("--mesh", default=None, help="device mesh layout for zoo.load (tp, ep)")
    s.add_argument("--spec", type=int, default=0, metavar="K", help="MTP speculative draft length (0: off)")
    s.add_argument("--mtp", default=None, metavar="DIR", help="an MTP overlay (zoo fit-mtp) applied to the model")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    s.add_argument("--api-key", default=None, help="required from clients (default: $ZOO_API_KEY, else generated)")
    s.add_argument("--max-batch", type=int, default=16, help="requests decoded together")
    s.add_argument("--prefill-chunk", type=int, default=1024,
                   help="prompt tokens per prefill program, a power of two (zoo compile reports what fits)")
    s.add_argument("--prefix-cache-gb", type=float, default=None, metavar="N",
                   help="GiB of accelerator memory for cached prompt prefixes (default: a quarter of the "
                        "cache budget; 0: no prefix caching)")
    s.add_argument("--prefix-cache-host-gb", type=float, default=None, metavar="N",
                   help="GiB of host RAM for prefixes evicted from the accelerator (default: a tenth of RAM)")
    s.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot (more: 429)")
    s.add_argument("--queue-timeout", type=float, default=60.0, help="seconds a request may wait (then 503)")
    s.add_argument("--tool-format", default="auto", choices=["auto", "qwen", "glm", "none"],
                   help="tool-call format to parse (auto: from the chat template / architecture)")
    s.add_argument("--thinking-budget", type=int, default=None, metavar="N",
                   help="force </think> after N reasoning tokens (default: unlimited; a request's own budget wins)")
    s.add_argument("--max-body-mb", type=_positive, default=32.0, metavar="N",
                   help="largest request body in MiB (default 32; larger: 413, before the body is read)")
    s.add_argument("--body-timeout", type=_positive, default=30.0, metavar="S",
                   help="seconds a request body may send nothing before the request gets 408 (default 30)")
    s.add_argument("--header-timeout", type=_positive, default=30.0, metavar="S",
                   help="seconds a connection has to send a complete request head; slow or half-open "
                        "clients are disconnected (default 30)")
    s.add_argument("--keepalive-timeout", type=_positive, default=5.0, metavar="S",
                   help="seconds an idle keep-alive connection stays open (default 5)")
    s.add_argument("--drain-seconds", type=_non_negative, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT: new requests get 503, running ones may finish for S seconds "
                        "(default 30), the rest end with an error event, then the server exits 0 "
                        "(a second signal: at once)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(fn=_serve)

    g = sub.add_parser("generate", help="generate text from a prompt (greedy by default)")
    g.add_argument("--model", default="qwen38-tiny", help="registry name or checkpoint path")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    g.add_argument("--quant", default=None, help="quantization recipe (see zoo.quant.recipes)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--spec", type=int, default=0, metavar="K", help="MTP speculative draft length (0: off)")
    g.add_argument("--mtp", default=None, metavar="DIR", help="an MTP overlay (zoo fit-mtp) applied to the model")
    g.set_defaults(fn=_generate)

    m = sub.add_parser("models", help="list registered models")
    m.set_defaults(fn=_models)

    i = sub.add_parser("inspect", help="show a checkpoint's config and tensors without loading it")
    i.add_argument("model")
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
