"""Checks run by every process of a multi-process job (``tests/sharding/test_multihost.py``)::

    python -m tests.support.multihost_checks CHECK '{"out": DIR, ...}'     env: ZOO_COORDINATOR,
        ZOO_NUM_PROCESSES, ZOO_PROCESS_ID (absent: one process), XLA_FLAGS with the device count

Each process joins the job (``zoo.distributed.initialize``), runs CHECK, and writes what it measured
to ``DIR/process-<id>.json`` and, for arrays the test compares, ``DIR/process-<id>.npz``. The same
check run as one process over all the devices is the oracle.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from tests.support.helpers import rss


def count_reads() -> list[int]:
    """From now on, the bytes of every safetensors read of this process, appended to the list returned."""
    from zoo.sources import safetensors as st

    reads: list[int] = []
    read = st.SafetensorsSource.read

    def counted(self, key, index=()):
        value = read(self, key, index)
        reads.append(value.nbytes)
        return value
    st.SafetensorsSource.read = counted
    return reads


def forward(paths: dict, layouts: dict[str, list[str]], new_tokens: int = 4,
            decoding: dict[str, str] | None = None) -> tuple[dict, dict]:
    """Each model (``paths``: name -> checkpoint) in its layouts: float32 logits and MTP logits of fixed
    prompts, the bytes this process read from the checkpoint, its host memory around the load, and
    the bytes of the parameters' shards on its devices; greedy and speculative tokens (``decoding``:
    name -> "greedy" or "spec" for one of them only)."""
    import jax

    import zoo

    reads = count_reads()
    rng = np.random.default_rng(7)
    out, arrays = {}, {}
    for name, path in paths.items():
        for layout in layouts[name]:
            key = f"{name}/{layout}"
            reads.clear()
            before, _ = rss()
            t0 = time.perf_counter()
            model = zoo.load(path, dtype="float32", mesh=layout)
            load_s = time.perf_counter() - t0
            after, peak = rss()
            vocab = model.config.vocab_size
            ids = rng.integers(1, vocab, (2, 12))
            arrays[f"{key}/logits"] = model.logits(ids)
            arrays[f"{key}/mtp"] = model.mtp_logits(ids)
            prompts = ids.tolist()
            which = (decoding or {}).get(name)
            if which in (None, "greedy"):
                arrays[f"{key}/greedy"] = np.asarray([g.tokens for g in model.generate(prompts,
                                                                                       max_new_tokens=new_tokens)])
            if which in (None, "spec"):
                arrays[f"{key}/spec"] = np.asarray([g.tokens for g in model.generate(prompts, max_new_tokens=new_tokens,
                                                                                       spec_tokens=2)])
            local = sum(s.data.nbytes for leaf in jax.tree.leaves(model.module) if hasattr(leaf, "addressable_shards")
                        for s in leaf.addressable_shards)
            out[key] = {"read_bytes": sum(reads), "load_s": load_s,
                        "rss_before": before, "rss_after": after, "rss_peak": peak, "local_param_bytes": local,
                        "devices": jax.local_device_count()}
    return out, arrays


def cache(path: str, cache_dir: str, layout: str) -> tuple[dict, dict]:
    """``zoo.load(path, cache=cache_dir)`` on ``layout``: saved there when no entry matches, restored
    otherwise; its logits of fixed prompts and where it came from."""
    import orbax.checkpoint  # noqa: F401  (imported now: its module files are not the cache's reads)

    import zoo
    from zoo.weight_cache import group_reads

    reads = []
    read_group = group_reads.read_group

    def counted(*args, **kwargs):                # what reading the groups' state reads (not the tokenizer)
        before = read_chars()
        out = read_group(*args, **kwargs)
        reads.append(read_chars() - before)
        return out
    group_reads.read_group = counted
    model = zoo.load(path, dtype="float32", mesh=layout, cache=cache_dir)
    ids = np.random.default_rng(7).integers(1, model.config.vocab_size, (2, 12))
    return {"source": model.load_info["source"], "cache_path": model.load_info.get("cache_path"),
            "read_chars": sum(reads), "local_bytes": local_bytes(model)}, {"logits": model.logits(ids)}


def local_bytes(model) -> int:
    """The bytes of the distinct parameter shards on this process's devices (a shard held by two of
    its devices counts once)."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(model.module):
        if hasattr(leaf, "addressable_shards"):
            seen = {}
            for s in leaf.addressable_shards:
                seen.setdefault(str(s.index), s.data.nbytes)
            total += sum(seen.values())
    return total


def read_chars() -> int:
    """Bytes this process has read through system calls so far (``rchar``: files, whether or not
    they were in the page cache)."""
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])


def load_memory(path: str, layout: str = "tp") -> tuple[dict, dict]:
    """Host memory of this process around loading ``path`` (float32) on ``layout``, after the runtime
    is up: resident bytes before, after and at the peak (VmHWM reset first), the bytes read from the
    checkpoint and the bytes of the parameters' shards on this process's devices."""
    import jax

    import zoo

    zoo.load("qwen38-tiny", dtype="float32", mesh=layout)          # imports, runtime, collectives up first
    reads = count_reads()
    Path("/proc/self/clear_refs").write_text("5")
    before, _ = rss()
    model = zoo.load(path, dtype="float32", mesh=layout)
    after, peak = rss()
    local = sum(s.data.nbytes for leaf in jax.tree.leaves(model.module) if hasattr(leaf, "addressable_shards")
                for s in leaf.addressable_shards)
    return {"rss_before": before, "rss_after": after, "rss_peak": peak, "read_bytes": sum(reads),
            "local_param_bytes": local}, {}


def replica(path: str, layout: str = "tp", spec_tokens: int = 2, spec_policy: str = "auto") -> tuple[dict, dict]:
    """An engine session driven by process 0 (``zoo.engine.replica``): requests arrive between
    steps, one samples, one is cancelled mid-way; the other processes replay. One process: the same
    session on a plain generator. Returns each request's tokens and finish reason (a follower: the
    tokens of the requests it replayed)."""
    import jax

    import zoo
    from zoo.engine.generator import Generator
    from zoo.engine.replica import Channel, Follower, Leader

    model = zoo.load(path, dtype="float32", mesh=layout)
    gen = Generator(model, spec_tokens=spec_tokens, prefix_cache=None, spec_policy=spec_policy)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, vocab, n).tolist() for n in (12, 20, 7)]
    if jax.process_count() > 1 and jax.process_index() > 0:
        replayed, submit = [], gen.submit
        gen.submit = lambda req: replayed.append(req) or submit(req)
        steps = Follower(gen, Channel()).run(timeout_s=120)
        return {"steps": steps, "options": gen.spec_policy.chosen}, \
            {f"tokens{i}": np.asarray(r.tokens, np.int64) for i, r in enumerate(replayed)}
    engine = Leader(gen, Channel()) if jax.process_count() > 1 else gen
    reqs = [engine.submit(engine.make_request(prompts[0], max_new_tokens=12)),
            engine.submit(engine.make_request(prompts[1], max_new_tokens=30, stop=[5]))]
    steps = 0
    while engine.has_work():
        if steps == 3:
            reqs.append(engine.submit(engine.make_request(prompts[2], max_new_tokens=10, temperature=0.8,
                                                          top_p=0.9, seed=11)))
        if steps == 5:
            engine.cancel(reqs[1])
        engine.step()
        steps += 1
    if isinstance(engine, Leader):
        engine.close()
    return {"steps": steps, "finish": [r.finish_reason for r in reqs], "options": gen.spec_policy.chosen}, \
        {f"tokens{i}": np.asarray(r.tokens, np.int64) for i, r in enumerate(reqs)}


def gguf(path: str, layout: str) -> tuple[dict, dict]:
    """A llama.cpp GGUF (quantized, kept in its ggml types) loaded on ``layout``: its float32 logits of
    the fixture's prompt and the bytes this process read from the file, of routed experts and of the
    rest."""
    import zoo
    from zoo.sources.gguf import GGUFSource

    reads = {"experts": 0, "other": 0}
    read = GGUFSource.read

    def counted(self, key, index=()):
        value = read(self, key, index)
        reads["experts" if "_exps" in key else "other"] += value.nbytes
        return value
    GGUFSource.read = counted
    model = zoo.load(path, dtype="float32", mesh=layout)
    ids = np.load(Path(path).with_name(Path(path).name.split("-udmix")[0] + ".input_ids.npy"))
    return {"read_bytes": reads}, {"logits": model.logits(ids)}


def join() -> tuple[dict, dict]:
    """Only join the job: the global and local device counts."""
    import jax
    return {"devices": jax.device_count(), "local_devices": jax.local_device_count()}, {}


CHECKS = {"forward": forward, "cache": cache, "load_memory": load_memory, "replica": replica, "join": join,
          "gguf": gguf}


def main() -> None:
    import zoo.distributed

    check, args = sys.argv[1], json.loads(sys.argv[2])
    job = zoo.distributed.from_env()
    if job:
        zoo.distributed.initialize(**job, timeout_s=args.get("timeout_s", 60))
    import jax

    result, arrays = CHECKS[check](**{k: v for k, v in args.items() if k not in ("out", "timeout_s")})
    me = jax.process_index()
    out = Path(args["out"])
    np.savez(out / f"process-{me}.npz", **arrays)
    (out / f"process-{me}.json").write_text(json.dumps({"process": me, "processes": jax.process_count(), **result}))


if __name__ == "__main__":
    main()
