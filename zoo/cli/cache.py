"""``zoo cache``: build, list, push and pull repacked-weight caches (``zoo.weight_cache.store``).

    zoo cache build NAME|PATH --dir DIR [--quant RECIPE --dtype bfloat16] [--mesh tp]
    zoo cache ls DIR
    zoo cache push ENTRY --dataset OWNER/NAME [--notes TEXT] [--compile-cache DIR]   (kagglehub upload)
    zoo cache pull OWNER/NAME [--dest DIR]                         (kagglehub dataset download)

``build`` writes the entry ``zoo.load(NAME, quant=, dtype=, cache=DIR)`` would, and prints one JSON
line ``{"cache_path", "source", "seconds"}``. A matching entry already under DIR (or the search
roots, as ``zoo.load`` looks) is checked group by group (files, shapes, digests:
``store.verify``) and reported (``"source": "cache"``, seconds ``find``/``verify``/``total``); a
missing or damaged one is built, streamed (``zoo.weight_cache.build``: one parameter group in host
memory at a time, one process; ``"source": "source"``, seconds ``find``/``build``/``total``), so a
CPU machine with less memory than the model writes its cache ("prepare on CPU, serve on TPU").

``--mesh LAYOUT`` builds the old way instead: ``zoo.load`` loads the whole model sharded on that
mesh (every process of a multi-host job holding its shards) and saves it (``store.save``); the JSON
line carries that load's ``load_info``. Use it where no single host can fill a layer group, or to
build from a multi-process job (the streamed build is one process); it needs memory (host or
device) for the whole model over the job.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _build(args) -> int:
    import zoo
    if args.mesh is not None:                  # the whole model, loaded (and saved) on the mesh
        model = zoo.load(args.model, quant=args.quant, dtype=args.dtype, mesh=args.mesh, cache=args.dir,
                         vision=args.vision, mmproj=args.mmproj)
        info = model.load_info
        print(json.dumps({"cache_path": info.get("cache_path"), "source": info["source"], "seconds": info["seconds"]}))
        return 0
    import jax.numpy as jnp

    from zoo.loader.open import check_recipe, dtype_of
    from zoo.weight_cache import build, store
    t0 = time.perf_counter()
    dtype = jnp.dtype(dtype_of(args.dtype)).name
    check_recipe(args.model, args.quant)
    fp = store.request_fingerprint(args.model, args.quant, dtype, args.vision, args.mmproj)
    entry, reasons = store.find(fp, store.search_roots(args.dir))
    for why in reasons:
        print(f"[zoo] not using cache {why}; rebuilding", file=sys.stderr)
    t_find = time.perf_counter()
    if entry is not None:
        try:
            store.verify(entry)
            done = time.perf_counter()
            print(json.dumps({"cache_path": str(entry), "source": "cache",
                              "seconds": {"find": t_find - t0, "verify": done - t_find, "total": done - t0}}))
            return 0
        except store.CacheError as e:
            print(f"[zoo] not using cache: {e}; rebuilding", file=sys.stderr)
    t_build = time.perf_counter()
    path = build(args.model, quant=args.quant, dtype=args.dtype, root=args.dir, vision=args.vision,
                 mmproj=args.mmproj)
    done = time.perf_counter()
    print(json.dumps({"cache_path": str(path), "source": "source",
                      "seconds": {"find": t_build - t0, "build": done - t_build, "total": done - t0}}))
    return 0


def _ls(args) -> int:
    from zoo.weight_cache import store as checkpoint
    for manifest in sorted(Path(args.dir).glob(f"*/{checkpoint.MANIFEST}")):
        entry = manifest.parent
        try:
            req = checkpoint.read_manifest(entry)["fingerprint"]["request"]
        except checkpoint.CacheError as e:
            print(f"{entry.name}: unreadable ({e})")
            continue
        size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
        print(f"{entry.name}  model={req['model']} quant={req['quant']} dtype={req['dtype']}  {size / 1e9:.3f} GB")
    return 0


def _push(args) -> int:
    from zoo.weight_cache import store as checkpoint
    checkpoint.push(args.entry, args.dataset, args.notes, compile_cache=args.compile_cache)
    print(f"pushed {args.entry}" + (f" and the programs in {args.compile_cache}" if args.compile_cache else "")
          + f" to kaggle dataset {args.dataset}")
    return 0


def _pull(args) -> int:
    from zoo.weight_cache import store as checkpoint
    print(checkpoint.pull(args.dataset, args.dest))
    return 0


def add_commands(sub) -> None:
    c = sub.add_parser("cache", help="build, list, push and pull repacked-weight caches").add_subparsers(
        dest="cache_command", required=True)
    b = c.add_parser("build", help="write a model's cache entry under --dir (one parameter group in memory "
                                   "at a time)")
    b.add_argument("model")
    b.add_argument("--dir", required=True)
    b.add_argument("--quant")
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    b.add_argument("--mmproj", default=None, metavar="FILE", help="a llama.cpp mmproj GGUF: the vision tower")
    b.add_argument("--no-vision", dest="vision", action="store_false",
                   help="leave a multimodal checkpoint's vision tower out")
    b.add_argument("--mesh", help="mesh layout name (tp, ep): load the whole model on that mesh and save it "
                                  "(the multi-host way) instead of the streamed one-process build")
    b.set_defaults(fn=_build)
    ls = c.add_parser("ls", help="list the cache entries in a directory")
    ls.add_argument("dir")
    ls.set_defaults(fn=_ls)
    p = c.add_parser("push", help="upload a cache entry as a Kaggle dataset (kagglehub)")
    p.add_argument("entry")
    p.add_argument("--dataset", required=True, help="OWNER/NAME")
    p.add_argument("--notes", default="")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="also publish these compiled programs (zoo serve's compile cache) in compile-cache/; "
                        "restore them with zoo serve --trust-compile-cache")
    p.set_defaults(fn=_push)
    q = c.add_parser("pull", help="download a Kaggle dataset holding a cache entry (kagglehub)")
    q.add_argument("dataset", help="OWNER/NAME[/versions/N]")
    q.add_argument("--dest")
    q.set_defaults(fn=_pull)
