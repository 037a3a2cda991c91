"""Full size on one host: a synthetic GGUF of a real model's config (``zoo.tools.synthetic_gguf``),
then what a user does with it, each step in its own process, cold (the page cache dropped first
where this user may; else every figure says "warm"), each with its baseline measured in the same run:

    write           the synthetic file (skipped when it exists: --reuse)
    raw read        a sequential read of the GGUF into one reused buffer (the baseline of the load)
    raw kept        the same read into fresh buffers that are kept, as any loader's bytes are (the page
                    cache's copy dropped where the files are large for the host, as a load does): on a host
                    whose disk outruns its page faults, this is the floor of a load
    fresh memory    the file's size of fresh anonymous memory touched once (a byte per 4 KiB page), in
                    a fresh process: the other floor of a load, whose bytes all land in new memory
                    (on this 2-core VM 0.9-2.3 GiB/s from one run to the next, under the disk's rate)
    inspect, plan   ``zoo inspect`` / ``zoo plan`` on the file (time, peak RSS)
    load            ``zoo.load(FILE)``: time / raw read, peak RSS / the file's bytes
    generate        ``--tokens`` greedy tokens after the load: time to the first token, time per token
    cache build     ``zoo cache build FILE --dir D``: time, peak RSS, the entry's bytes
    cache raw read  a sequential read of the entry (the baseline of the restore), and kept as above
    restore         ``zoo.load(FILE, cache=D)``: time / the cache's raw read (its leaves mapped from the
                    entry's files, ``zoo.weight_cache.ocdbt_reader.map_leaves``)
    restore copied  the same with ``ZOO_CACHE_MMAP=0`` (every leaf copied into a fresh buffer): the
                    baseline of the mapping, and its ratio

    python bench/scale.py --model qwen38-27b                   # the whole 12.9 GB model
    python bench/scale.py --model glm53-flash --layers 4       # four full-width layers of GLM-5.3-Flash
    python bench/scale.py --model qwen38-27b --layers 4 --vocab 4096 --tokens 2    # a quick run

Prints one line per step and a JSON summary at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

CHUNK = 64 << 20


def drop_caches() -> bool:
    """Drop the page cache (root only); False when this user may not (the next step runs warm)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def raw_read(paths: list[Path]) -> dict:
    """Read ``paths`` sequentially, 64 MiB at a time: seconds and bytes."""
    cold = drop_caches()
    buf = bytearray(CHUNK)
    view, total, t0 = memoryview(buf), 0, time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return {"seconds": time.perf_counter() - t0, "bytes": total, "cold": cold}


def files_under(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def child(step: str, args: dict, env: dict | None = None) -> dict:
    """Run ``step`` in a fresh process (``--child``), cold, with ``env`` added to its environment; its
    JSON line, with its peak RSS."""
    cold = drop_caches()
    out = subprocess.run([sys.executable, __file__, "--child", step, json.dumps(args)], capture_output=True,
                         text=True, env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
                                         **(env or {})})
    if out.returncode != 0:
        raise SystemExit(f"{step} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {**result, "cold": cold}


def peak_rss() -> int:
    """This process's peak resident bytes: ``VmHWM``, which starts afresh at ``exec``. (``ru_maxrss``
    keeps the high-water mark of the process that forked it: after the bench writes the synthetic
    file, that is the parent's 1.2 GiB, not the child's.)"""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_child(step: str, args: dict) -> dict:
    t0 = time.perf_counter()
    out: dict = {}
    if step in ("inspect", "plan"):
        import contextlib
        import io

        from zoo.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            code = main([step, args["path"]])
        if code:
            raise SystemExit(code)
    elif step in ("load", "restore"):
        import numpy as np

        import zoo
        model = zoo.load(args["path"], cache=args.get("cache"))
        out["load_s"] = time.perf_counter() - t0
        out["load_peak_rss"] = peak_rss()     # before any program
        out["load_info"] = {k: v for k, v in model.load_info.items() if k in ("source", "seconds")}
        if args.get("tokens"):
            gen = model.generator()
            times = []
            req = gen.submit(gen.make_request([1, 2, 3, 4, 5, 6, 7, 8], max_new_tokens=args["tokens"],
                                              on_tokens=lambda r, new: times.append(time.perf_counter())))
            t1 = time.perf_counter()
            while not req.done.is_set():
                gen.step()
            if req.finish_reason == "error":
                raise SystemExit(f"generation failed: {req.stats.get('error')}")
            out["tokens"] = list(req.tokens)
            out["first_token_s"] = times[0] - t1
            out["per_token_s"] = float(np.mean(np.diff(times))) if len(times) > 1 else None
    elif step == "fresh memory":
        import mmap

        import numpy as np
        t0 = time.perf_counter()                    # after the import: the touching alone
        pages = np.frombuffer(mmap.mmap(-1, args["bytes"], flags=mmap.MAP_PRIVATE), np.uint8)
        pages[::mmap.PAGESIZE] = 1
        out["bytes"] = args["bytes"]
    elif step == "raw kept":
        from zoo.formats.host_arrays import large_for_host, read_into
        sizes = {f: Path(f).stat().st_size for f in args["files"]}
        drop = large_for_host(sum(sizes.values()))         # as the loader and the restore decide, from the whole set
        held = [read_into(Path(f), 0, n, drop) for f, n in sizes.items() if n]
        out["bytes"] = sum(h.nbytes for h in held)
    elif step == "build":
        import contextlib
        import io

        from zoo.cli import main
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            code = main(["cache", "build", args["path"], "--dir", args["cache"]])
        if code:
            raise SystemExit(code)
        out["entry"] = json.loads(text.getvalue().strip().splitlines()[-1])["cache_path"]
    else:
        raise SystemExit(f"unknown step {step}")
    out["seconds"] = time.perf_counter() - t0
    out["peak_rss"] = peak_rss()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen38-27b")
    p.add_argument("--layers", type=int, default=None, help="keep this many full-width layers (every kind)")
    p.add_argument("--vocab", type=int, default=None, help="a smaller vocabulary")
    p.add_argument("--tokens", type=int, default=4, help="greedy tokens to generate after the load (0: none)")
    p.add_argument("--dir", default="/tmp/zoo-scale", help="where the file and the cache go")
    p.add_argument("--reuse", action="store_true", help="keep an existing synthetic file")
    p.add_argument("--skip", nargs="*", default=[], choices=["source", "build", "cache"],
                   help="steps to leave out: source (the GGUF's reads, tools and load), build (restore the entry "
                        "already there), cache (the cache's steps)")
    a = p.parse_args()

    from zoo.tools.synthetic_gguf import write_synthetic_gguf

    root = Path(a.dir)
    suffix = "" if a.layers is None else f"-{a.layers}L"
    suffix += "" if a.vocab is None else f"-v{a.vocab}"
    path = root / f"{a.model}{suffix}-synthetic.gguf"
    report: dict = {"model": a.model, "layers": a.layers, "vocab": a.vocab, "path": str(path)}

    def say(name: str, text: str, **fields) -> None:
        report[name] = fields
        print(f"{name:15s} {text}", flush=True)

    if not (a.reuse and path.exists()):
        t0 = time.perf_counter()
        write_synthetic_gguf(path, a.model, layers=a.layers, vocab=a.vocab)
        say("write", f"{time.perf_counter() - t0:.1f} s", seconds=time.perf_counter() - t0)
    size = path.stat().st_size
    if "source" not in a.skip:
        raw = raw_read([path])
        mbs = size / raw["seconds"] / 1e6
        state = "cold" if raw["cold"] else "warm"
        say("raw read", f"{raw['seconds']:.1f} s for {size / 1e9:.2f} GB ({mbs:.0f} MB/s, {state})", **raw)
        kept = child("raw kept", {"files": [str(path)]})
        say("raw kept", f"{kept['seconds']:.1f} s: the same read into fresh memory that is kept, as a loader's "
                        f"is ({kept['seconds'] / raw['seconds']:.2f}x the raw read)", **kept)
        fresh = child("fresh memory", {"bytes": size})
        say("fresh memory", f"{fresh['seconds']:.1f} s to touch {size / 2**30:.1f} GiB of new memory "
                            f"({size / 2**30 / fresh['seconds']:.2f} GiB/s)", **fresh)
        for tool in ("inspect", "plan"):
            r = child(tool, {"path": str(path)})
            say(tool, f"{r['seconds']:.2f} s, peak RSS {r['peak_rss'] / 2**30:.2f} GiB", **r)
        r = child("load", {"path": str(path), "tokens": a.tokens})
        gen = "" if not a.tokens else (f"; first token {r['first_token_s']:.1f} s, "
                                       f"{r['per_token_s'] or 0:.1f} s/token, tokens {r['tokens']}")
        say("load", f"{r['load_s']:.1f} s = {r['load_s'] / raw['seconds']:.2f}x the raw read "
                    f"({r['load_s'] / kept['seconds']:.2f}x the kept read, {r['load_s'] / fresh['seconds']:.2f}x "
                    f"touching the file's size of new memory); peak RSS "
                    f"{r['load_peak_rss'] / 2**30:.2f} GiB = {r['load_peak_rss'] / size:.2f}x the file (with "
                    f"generation {r['peak_rss'] / 2**30:.2f} GiB){gen}",
            ratio=r["load_s"] / raw["seconds"], kept_ratio=r["load_s"] / kept["seconds"],
            rss_ratio=r["load_peak_rss"] / size, **r)
    if "cache" not in a.skip:
        cache = root / f"cache{suffix}"
        entries = sorted(cache.glob(f"{path.stem}-*")) if "build" in a.skip else []
        if entries:
            entry = entries[0]
            cache_bytes = sum(f.stat().st_size for f in files_under(entry))
        else:
            subprocess.run(["rm", "-rf", str(cache)], check=True)
            r = child("build", {"path": str(path), "cache": str(cache)})
            entry = Path(r["entry"])
            cache_bytes = sum(f.stat().st_size for f in files_under(entry))
            say("cache build", f"{r['seconds']:.1f} s, peak RSS {r['peak_rss'] / 2**30:.2f} GiB, "
                               f"{cache_bytes / 1e9:.2f} GB", bytes=cache_bytes, **r)
        craw = raw_read(files_under(entry))
        say("cache raw", f"{craw['seconds']:.1f} s ({cache_bytes / craw['seconds'] / 1e6:.0f} MB/s"
                         f"{', cold' if craw['cold'] else ', warm'})", **craw)
        cfresh = child("fresh memory", {"bytes": cache_bytes})
        say("cache fresh", f"{cfresh['seconds']:.1f} s to touch the entry's size of new memory", **cfresh)
        ckept = child("raw kept", {"files": [str(f) for f in files_under(entry)]})
        say("cache kept", f"{ckept['seconds']:.1f} s ({ckept['seconds'] / craw['seconds']:.2f}x the cache's raw read)",
            **ckept)
        # the restore, its leaves mapped from the entry's files (the default), then copied into fresh
        # buffers as before (ZOO_CACHE_MMAP=0): the copy is this run's baseline of the mapping
        for name, env in (("restore", None), ("restore copied", {"ZOO_CACHE_MMAP": "0"})):
            r = child("restore", {"path": str(path), "cache": str(cache)}, env)
            say(name, f"{r['load_s']:.1f} s = {r['load_s'] / craw['seconds']:.2f}x the cache's raw read "
                      f"({r['load_s'] / ckept['seconds']:.2f}x its kept read, {r['load_s'] / cfresh['seconds']:.2f}x "
                      f"touching its size of new memory); peak RSS "
                      f"{r['load_peak_rss'] / 2**30:.2f} GiB", ratio=r["load_s"] / craw["seconds"],
                kept_ratio=r["load_s"] / ckept["seconds"], **r)
        mapped, copied = report["restore"]["load_s"], report["restore copied"]["load_s"]
        print(f"{'mapped/copied':15s} {mapped / copied:.2f}x (the restore's time, mapped over copied)", flush=True)
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(run_child(sys.argv[2], json.loads(sys.argv[3])), default=str))
        sys.exit(0)
    sys.exit(main())
