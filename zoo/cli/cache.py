"""``zoo cache``: build, list, push and pull repacked-weight caches (``zoo.weight_cache.store``).

    zoo cache build NAME|PATH --dir DIR [--quant RECIPE --dtype bfloat16 --mesh tp]
    zoo cache ls DIR
    zoo cache push ENTRY --dataset OWNER/NAME [--notes TEXT]       (kagglehub dataset upload)
    zoo cache pull OWNER/NAME [--dest DIR]                         (kagglehub dataset download)
"""

from __future__ import annotations

import json
from pathlib import Path


def _build(args) -> int:
    import zoo
    model = zoo.load(args.model, quant=args.quant, dtype=args.dtype, mesh=args.mesh, cache=args.dir)
    info = model.load_info
    print(json.dumps({"cache_path": info.get("cache_path"), "source": info["source"], "seconds": info["seconds"]}))
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
    checkpoint.push(args.entry, args.dataset, args.notes)
    print(f"pushed {args.entry} to kaggle dataset {args.dataset}")
    return 0


def _pull(args) -> int:
    from zoo.weight_cache import store as checkpoint
    print(checkpoint.pull(args.dataset, args.dest))
    return 0


def add_commands(sub) -> None:
    c = sub.add_parser("cache", help="build, list, push and pull repacked-weight caches").add_subparsers(
        dest="cache_command", required=True)
    b = c.add_parser("build", help="load a model and write its cache entry under --dir")
    b.add_argument("model")
    b.add_argument("--dir", required=True)
    b.add_argument("--quant")
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    b.add_argument("--mesh", help="mesh layout name (tp, ep) to load on")
    b.set_defaults(fn=_build)
    ls = c.add_parser("ls", help="list the cache entries in a directory")
    ls.add_argument("dir")
    ls.set_defaults(fn=_ls)
    p = c.add_parser("push", help="upload a cache entry as a Kaggle dataset (kagglehub)")
    p.add_argument("entry")
    p.add_argument("--dataset", required=True, help="OWNER/NAME")
    p.add_argument("--notes", default="")
    p.set_defaults(fn=_push)
    q = c.add_parser("pull", help="download a Kaggle dataset holding a cache entry (kagglehub)")
    q.add_argument("dataset", help="OWNER/NAME[/versions/N]")
    q.add_argument("--dest")
    q.set_defaults(fn=_pull)
