"""``zoo serve``: the OpenAI- and Anthropic-compatible server, on one process or several.

    zoo serve [--model NAME|PATH] [--quant RECIPE] [--mesh tp|ep] [--spec K] [--port N] ...
    zoo serve ... --coordinator HOST:PORT --num-processes N --process-id I      one command per host

With several processes (``zoo.distributed``: the three flags, the ``ZOO_COORDINATOR`` /
``ZOO_NUM_PROCESSES`` / ``ZOO_PROCESS_ID`` variables, or nothing on a cluster JAX detects: a
multi-host TPU slice, SLURM, Open MPI) every process loads the same model over one mesh of all
their devices. Process 0 serves HTTP and runs the engine as a ``zoo.engine.replica.Leader``; the
others serve nothing and replay its steps (``Follower``). Process 0 publishes the engine's settings
(``zoo/serve/config`` in JAX's key-value store): the others check that they were given the same
model and take the rest from it. A follower that dies, hangs or fails (``zoo.engine.replica_watch``)
makes process 0 end the requests in flight with an error naming it and exit with status 3 within
``--follower-timeout`` seconds; when process 0 stops (SIGTERM: after the drain), the followers
stop too and exit 0.

Before it answers requests the engine compiles all its programs (``Generator.warmup``; ``/health``
says "warming up" meanwhile, the console prints each program's seconds); every process does. With
the compile cache (on by default: ``zoo.engine.compile_cache``) a second start of the same
configuration loads them instead, and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path

from zoo.engine.prefill_pace import INTERLEAVE_RATIO
from zoo.text.tool_calls import FORMATS as TOOL_CALL_FORMATS

CONFIG_KEY = "zoo/serve/config"
LOAD_ARGS = ("model", "quant", "dtype", "mesh", "mtp", "vision", "mmproj")
DEFAULT_CONTEXT = 32768  # zoo serve's tokens per request (capped by the model's positions)
FAIL_GRACE_S = 2.0        # after a follower failed: time for the error to reach the clients before exiting
EXIT_FOLLOWER_LOST = 3


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


def add_spec_policy(parser) -> None:
    """``--spec-policy`` (``zoo.engine.spec_policy``), for ``zoo serve`` and ``zoo generate``."""
    parser.add_argument("--spec-policy", default="auto", choices=["auto", "fixed"],
                        help="with --spec K (the most drafts per step): auto (default) chooses each step's draft "
                             "lengths (0..K) and sources (MTP or prompt lookup) from step costs and acceptance; "
                             "fixed drafts K MTP tokens every step. Either way a row's tokens are plain "
                             "decoding's (a seed reproduces a sampled output)")


def add_commands(sub) -> None:
    s = sub.add_parser("serve", help="serve a model over the OpenAI and Anthropic APIs (default: the tiny model)")
    s.add_argument("--model", default="qwen38-tiny", help="registry name or checkpoint path")
    s.add_argument("--quant", default=None, help="quantization recipe (see zoo.quant.recipe)")
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    s.add_argument("--mesh", default=None, help="device mesh layout for zoo.load (tp, ep)")
    s.add_argument("--spec", type=int, default=0, metavar="K",
                   help="MTP speculative decoding with at most K drafts per step (0: off)")
    add_spec_policy(s)
    s.add_argument("--mtp", default=None, metavar="DIR", help="an MTP overlay (zoo fit-mtp) applied to the model")
    s.add_argument("--mmproj", default=None, metavar="FILE",
                   help="a llama.cpp multimodal projector GGUF: the vision tower of a model loaded from a GGUF "
                        "(default: the only mmproj*.gguf beside it)")
    s.add_argument("--no-vision", dest="vision", action="store_false",
                   help="leave a multimodal checkpoint's vision tower out (text only; saves its memory)")
    s.add_argument("--cache", default=None, metavar="DIR",
                   help="repacked-weight cache directory: a matching entry there (or under /kaggle/input, "
                        "$ZOO_CACHE_SEARCH) is restored; otherwise the model loads from its sources and is saved there")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    s.add_argument("--api-key", default=None, help="required from clients (default: $ZOO_API_KEY, else generated)")
    s.add_argument("--max-batch", type=int, default=16,
                   help="requests decoded together (fewer if the accelerator's memory holds fewer)")
    s.add_argument("--narrow-rows", type=_narrow_rows, default=None, metavar="N|auto",
                   help="a second, narrower width of the decode programs: a step whose requests all sit in "
                        "the first N rows computes N rows, not --max-batch (requests in higher rows move "
                        "down when they fit; the decode step, with --spec under the auto policy its twin "
                        "without drafts, and the step split around grammar masks compiled once more at N "
                        "rows; pays where a step's cost follows its rows, a CPU); "
                        "default auto: a quarter of the rows on a CPU without --mesh, none elsewhere; 0: none")
    s.add_argument("--context", type=int, default=DEFAULT_CONTEXT, metavar="N",
                   help=f"tokens per request, prompt and output (default {DEFAULT_CONTEXT}, or the model's "
                        "positions if fewer); fixed at startup with the rows")
    s.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="the compiled-program cache (default: $ZOO_COMPILE_CACHE, else ~/.cache/zoo/compile); "
                        "only ever read from a directory you name or your own cache directory")
    s.add_argument("--trust-compile-cache", default=None, metavar="DIR",
                   help="also use the programs in DIR (e.g. published with your weights by zoo cache push "
                        "--compile-cache): they are copied into the compile cache. A compile cache is code: "
                        "name only one you made")
    s.add_argument("--no-compile-cache", dest="use_compile_cache", action="store_false",
                   help="compile every program at startup, keep none")
    s.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="serve at once and compile each program when a request first needs it (for debugging)")
    s.add_argument("--prefill-chunk", type=int, default=1024,
                   help="prompt tokens per prefill program, a power of two (zoo compile reports what fits)")
    s.add_argument("--interleave-ratio", type=_interleave_ratio, default=INTERLEAVE_RATIO, metavar="R",
                   help="while streams decode, a long prompt's prefill keeps each waiting at most about R "
                        f"decode steps between two tokens (default {INTERLEAVE_RATIO:g}; 0: one prefill chunk "
                        "per step, however long it takes)")
    s.add_argument("--prefix-cache-gb", type=float, default=None, metavar="N",
                   help="GiB of accelerator memory for cached prompt prefixes (default: a quarter of the "
                        "cache budget; 0: no prefix caching)")
    s.add_argument("--prefix-cache-host-gb", type=float, default=None, metavar="N",
                   help="GiB of host RAM for prefixes evicted from the accelerator (default: a tenth of RAM)")
    s.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot (more: 429)")
    s.add_argument("--queue-timeout", type=float, default=60.0, help="seconds a request may wait (then 503)")
    s.add_argument("--tool-format", default="auto", choices=["auto", *sorted(TOOL_CALL_FORMATS), "none"],
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
    s.add_argument("--max-images", type=int, default=8, metavar="N",
                   help="images one request may hold (default 8; more: 400)")
    s.add_argument("--max-image-mb", type=_positive, default=20.0, metavar="M",
                   help="largest encoded image in MiB (default 20; larger: 400)")
    s.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs of requests (default: only inline data: URLs / base64)")
    s.add_argument("--image-url-timeout", type=_positive, default=10.0, metavar="S",
                   help="seconds one image URL fetch may take, redirects and every read included (default 10)")
    s.add_argument("--allow-private-image-urls", action="store_true",
                   help="also fetch image URLs on loopback, private and link-local addresses (default: public "
                        "addresses only, checked on every connection and redirect)")
    s.add_argument("--max-request-image-mpx", type=_positive, default=64.0, metavar="M",
                   help="decoded megapixels of all of one request's images (default 64; more: 400)")
    s.add_argument("--max-image-tokens", type=int, default=1024, metavar="N",
                   help="image tokens (the tower's merged rows) per image at most (default 1024): every image "
                        "is resized to at most N * (patch * merge)^2 pixels, and the tower compiles one program "
                        "per bucket 256, 512, ... up to N (N itself the last) at warmup")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    s.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="several processes: process 0's address, the same on every host (default: "
                        "$ZOO_COORDINATOR; on a TPU slice, SLURM or Open MPI, detected)")
    s.add_argument("--num-processes", type=int, default=None, metavar="N", help="several processes: how many")
    s.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="several processes: this one's id, 0 .. N-1 (0 serves HTTP)")
    s.add_argument("--follower-timeout", type=_positive, default=10.0, metavar="S",
                   help="several processes: a process silent for S seconds ends the job (default 10)")
    s.set_defaults(fn=run)


def _job(args) -> dict | None:
    """``zoo.distributed.initialize``'s arguments, or None for one process."""
    import zoo.distributed as dist

    given = {"coordinator": args.coordinator, "num_processes": args.num_processes, "process_id": args.process_id}
    if any(v is not None for v in given.values()):
        return given
    env = dist.from_env()
    if env:
        return env
    return {} if dist.cluster_size() > 1 else None


def run(args) -> int:
    import zoo.distributed as dist

    try:
        job = _job(args)
        if job is not None:
            dist.check_args(job.get("coordinator"), job.get("num_processes"), job.get("process_id"))
            if job.get("process_id", 0) == 0:
                sock = _bind(args)                        # a port in use fails now, before joining the job
                if sock is None:
                    return 2
                sock.close()
            dist.initialize(**job, heartbeat_s=max(60, int(3 * args.follower_timeout)))
    except dist.DistributedError as e:
        print(f"zoo serve: {e}", file=sys.stderr)
        return 2
    import jax

    if jax.process_count() == 1:
        return _serve(args)
    if jax.process_index() == 0:
        return _lead(args)
    return _follow(args)


def _bind(args):
    from zoo.server.transport import bind

    try:
        return bind(args.host, args.port)
    except OSError as e:
        print(f"zoo serve: cannot listen on {_host(args)}:{args.port}: {(e.strerror or str(e)).lower()}",
              file=sys.stderr)
        return None


def _host(args) -> str:
    return f"[{args.host}]" if ":" in args.host else args.host


def _load_args(args) -> dict:
    return {key: getattr(args, key) for key in LOAD_ARGS}


def _engine_args(args) -> dict:
    """The settings that must be equal in every process's engine (``Generator``'s), resolved here."""
    host_gb = args.prefix_cache_host_gb
    if host_gb is None:                                  # the default depends on this host's RAM
        from zoo.engine.rows import default_host_tier
        host_gb = default_host_tier() / 2**30
    return {"spec_tokens": args.spec, "spec_policy": args.spec_policy, "max_batch": args.max_batch,
            "context": args.context, "narrow_rows": args.narrow_rows,
            "prefill_chunk": args.prefill_chunk, "interleave_ratio": args.interleave_ratio,
            "prefix_cache": args.prefix_cache_gb,
            "prefix_cache_host_gb": host_gb, "max_image_tokens": args.max_image_tokens}


def _narrow_rows(text: str) -> int | None:
    """``--narrow-rows``: a count >= 0, or auto (None: ``zoo.engine.rows.narrow_width``'s default)."""
    if text == "auto":
        return None
    try:
        rows = int(text)
    except ValueError:
        rows = -1
    if rows < 0:
        raise argparse.ArgumentTypeError(f"expected a number of rows >= 0 or auto, got {text!r}")
    return rows


def _interleave_ratio(text: str) -> float | None:
    """``--interleave-ratio``: a number >= 1, or 0 for none (the token budget alone)."""
    try:
        ratio = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1 or 0, got {text!r}") from None
    if ratio == 0:
        return None
    if not ratio >= 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1 (decode steps) or 0 (off), got {text!r}")
    return ratio


def _context(args, model) -> int:
    """``--context``, capped by the model's positions when it is the default."""
    positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20)
    return min(args.context, positions) if args.context == DEFAULT_CONTEXT else args.context


def _start_compile_cache(args):
    """Turn the compile cache on (before anything compiles) and print where it is; None when off."""
    from zoo.engine.compile_cache import CompileCounter, compile_cache_dir, trust_compile_cache, use_compile_cache

    directory = compile_cache_dir(args.compile_cache, not args.use_compile_cache)
    if args.trust_compile_cache is not None:
        if directory is None:
            raise SystemExit("zoo serve: --trust-compile-cache needs the compile cache (not --no-compile-cache)")
        print(f"[zoo] {trust_compile_cache(args.trust_compile_cache, directory)}", file=sys.stderr, flush=True)
    if directory is not None:
        print(f"[zoo] {use_compile_cache(directory).note}", file=sys.stderr, flush=True)
    return CompileCounter()


def _progress(counter):
    """Print each compiled program's seconds as a progress bar, then how many were compiled or loaded."""
    t0 = time.perf_counter()

    def show(name: str, seconds: float, done: int, total: int) -> None:
        bar = "#" * done + "-" * (total - done)
        print(f"[zoo] programs [{bar}] {done}/{total} {name}: {seconds:.1f}s", file=sys.stderr, flush=True)
        if done == total:
            print(f"[zoo] ready: {total} programs in {time.perf_counter() - t0:.1f}s ({counter.compiled} compiled, "
                  f"{counter.loaded} loaded from the compile cache)", file=sys.stderr, flush=True)
    return show


def _image_policy(args):
    from zoo.server.image_inputs import ImagePolicy

    if args.max_images < 1:
        raise SystemExit(f"zoo serve: --max-images must be >= 1, got {args.max_images}")
    if args.max_image_tokens < 1:
        raise SystemExit(f"zoo serve: --max-image-tokens must be >= 1, got {args.max_image_tokens}")
    return ImagePolicy(max_images=args.max_images, max_bytes=int(args.max_image_mb * (1 << 20)),
                       allow_urls=args.allow_image_urls, url_timeout_s=args.image_url_timeout,
                       allow_private_urls=args.allow_private_image_urls,
                       max_request_pixels=int(args.max_request_image_mpx * 1e6))


def _serve(args, engine: dict | None = None, replica=None, on_ready=None) -> int:
    """Load, build the app and serve until SIGTERM / SIGINT (one process, or process 0 of several)."""
    sock = _bind(args)
    if sock is None:
        return 2
    try:
        import zoo
        from zoo.server.app import create_app, serve

        engine = engine or _engine_args(args)
        key = args.api_key or os.environ.get("ZOO_API_KEY") or secrets.token_urlsafe(24)
        counter = _start_compile_cache(args)
        t0 = time.perf_counter()
        model = zoo.load(args.model, quant=args.quant, mesh=args.mesh, dtype=args.dtype, mtp=args.mtp,
                         cache=args.cache, vision=args.vision,
                         mmproj=args.mmproj)
        name = Path(args.model).name if Path(args.model).expanduser().exists() else args.model
        app = create_app(model, api_key=key, spec_tokens=engine["spec_tokens"], spec_policy=engine["spec_policy"],
                         max_batch=engine["max_batch"],
                         context=_context(args, model), prefill_chunk=engine["prefill_chunk"],
                         interleave_ratio=engine["interleave_ratio"], narrow_rows=engine["narrow_rows"],
                         warmup=args.warmup, on_warmup=_progress(counter), max_queue=args.max_queue,
                         queue_timeout_s=args.queue_timeout, model_name=name,
                         tool_format=None if args.tool_format == "none" else args.tool_format,
                         thinking_budget=args.thinking_budget, prefix_cache_gb=engine["prefix_cache"],
                         prefix_cache_host_gb=engine["prefix_cache_host_gb"],
                         max_body_bytes=int(args.max_body_mb * (1 << 20)), body_timeout_s=args.body_timeout,
                         replica=replica, image_policy=_image_policy(args),
                         max_image_tokens=engine["max_image_tokens"])
        if on_ready is not None:
            on_ready(app)
        base = f"http://{_host(args)}:{sock.getsockname()[1]}"
        where = model.load_info.get("cache_path") if model.load_info.get("source") == "cache" else "its sources"
        print(f"[zoo] loaded {args.model} from {where} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        print(f"zoo serve: {name}\n  OpenAI base URL:    {base}/v1\n  Anthropic base URL: {base}\n  API key: {key}",
              flush=True)
        try:                             # until SIGTERM / SIGINT, after the drain (see zoo.server.transport)
            serve(app, sock, log_level=args.log_level, header_timeout_s=args.header_timeout,
                  keepalive_timeout_s=args.keepalive_timeout, drain_seconds=args.drain_seconds)
        except KeyboardInterrupt:        # a Ctrl-C that came before the server ran
            pass
    finally:
        sock.close()
    return 0


def _lead(args) -> int:
    """Process 0 of several: publish the settings, watch the followers, serve."""
    import jax
    from jax._src.distributed import global_state

    from zoo.engine.replica import Channel, Leader
    from zoo.engine.replica_watch import Watchdog

    client, count = global_state.client, jax.process_count()
    engine = _engine_args(args)
    client.key_value_set_bytes(CONFIG_KEY, json.dumps({"load": _load_args(args), "engine": engine,
                                                       "warmup": args.warmup}).encode())
    channel = Channel(client)
    app_engine = []

    def on_failure(message: str) -> None:              # the watchdog's thread
        print(f"zoo serve: {message}; ending the requests in flight and exiting", file=sys.stderr, flush=True)
        if app_engine:
            app_engine[0].fail_all(f"the server lost a process: {message}", status=503)
        time.sleep(FAIL_GRACE_S)
        os._exit(EXIT_FOLLOWER_LOST)

    watchdog = Watchdog(client, list(range(1, count)), args.follower_timeout, on_failure, channel=channel).start()
    print(f"zoo serve: process 0 of {count} ({jax.local_device_count()} of {jax.device_count()} devices); "
          f"serving HTTP for all", file=sys.stderr, flush=True)
    try:
        def leader(gen):
            gen.on_step_failure = lambda e: watchdog.settle()
            return Leader(gen, channel)

        return _serve(args, engine, replica=leader,
                      on_ready=lambda app: app_engine.append(app.state.service.engine))
    finally:
        watchdog.stop()                                  # the followers stop after the stop plan: not a failure


def _follow(args) -> int:
    """Process I > 0 of several: take process 0's settings, load the same model, replay its steps."""
    import jax
    from jax._src.distributed import global_state

    import zoo
    from zoo.engine.generator import Generator
    from zoo.engine.replica import Channel, Follower
    from zoo.engine.replica_watch import Heartbeat

    client, me, count = global_state.client, jax.process_index(), jax.process_count()
    _start_compile_cache(args)
    follower = None
    heartbeat = Heartbeat(client, me, progress=lambda: follower.n if follower is not None else 0).start()
    try:
        config = json.loads(client.blocking_key_value_get_bytes(CONFIG_KEY, 120_000))
        mine = _load_args(args)
        differ = [f"--{k} {mine[k]!r} (process 0: {config['load'][k]!r})" for k in LOAD_ARGS
                  if mine[k] != config["load"][k]]
        if differ:
            raise ValueError(f"this process was given another model than process 0: {', '.join(differ)}; "
                             f"give every process the same command but --process-id")
        print(f"zoo serve: process {me} of {count} ({jax.local_device_count()} of {jax.device_count()} devices); "
              f"replaying process 0's engine, no HTTP here", file=sys.stderr, flush=True)
        model = zoo.load(args.model, quant=args.quant, mesh=args.mesh, dtype=args.dtype, mtp=args.mtp,
                         cache=args.cache, vision=args.vision,
                         mmproj=args.mmproj)
        follower = Follower(Generator(model, **{**config["engine"], "context": _context(args, model)}),
                            Channel(client))
        steps = follower.run(warmup=config["warmup"])
    except Exception as e:
        message = f"{type(e).__name__}: {e}"
        heartbeat.fail(message)
        print(f"zoo serve: process {me} failed: {message}", file=sys.stderr, flush=True)
        os._exit(EXIT_FOLLOWER_LOST)     # not through the runtime's shutdown barrier: process 0 is leaving too
    heartbeat.stop()
    print(f"zoo serve: process {me}: process 0 stopped after {steps} steps", file=sys.stderr, flush=True)
    return 0
