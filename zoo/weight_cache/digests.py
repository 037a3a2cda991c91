"""Content digests of a cache entry's leaves, per saved shard, checked where each process reads.

Orbax restores flipped bytes silently, so the save records a digest of every shard it wrote and the
restore checks them (XXH3; CRC-32 in the entries saved before it: ``host_digest``). A
leaf's record is a list of its saved shards::

    [[start, ...], [size, ...], digest]   one per distinct shard (replicas are written once)

``host_digest(array, kind)`` is the digest; ``manifest_digest(manifest)`` the one an entry records.

Each process computes the records of the shards it holds (``shard_records``) and the save gathers
them (``merge``). One process restores whole leaves to the host and checks every record there,
before anything is placed on a device. Several processes restore only the chunks of their own
devices' shards (Orbax's sharded restore), so ``verify`` checks each saved shard that lies inside a
shard this process holds, on a host copy of it. The processes then agree (a small all-gather): a
saved shard that no process holds whole (the entry was saved on a coarser mesh than it is restored
on, e.g. by one device and restored over eight) is checked on the gathered leaf, every process
making the same calls; a bad shard anywhere fails the restore everywhere, so no process goes on
alone.
"""

from __future__ import annotations

import functools
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from zoo.sharding.mesh import host_value
from zoo.weight_cache.errors import CacheError

_DIGEST_CHUNK = 1 << 24      # bytes per digest chunk; chunks are hashed in parallel threads
# The digest kind a save records (the manifest's "digest"). XXH3 (64-bit) runs at 11.6 GB/s a core here
# against zlib's CRC-32 at 2.5-2.7: on the 14.8 GB entry of the synthetic Qwen3.8-27B the CRC-32s were
# 12.8 s of the restore's CPU once its leaves were mapped. Entries saved before record no kind: CRC-32.
DIGEST = "xxh3_64"
DIGESTS = ("xxh3_64", "crc32")


@functools.lru_cache(maxsize=1)
def _digest_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(2, min(16, os.cpu_count() or 2)), thread_name_prefix="zoo-digest")


def host_digest(a: np.ndarray, kind: str | None = None) -> int:
    """Content digest of a host array's bytes: the ``kind`` digest (``DIGESTS``; None: ``DIGEST``, what a
    save records) of each 16 MiB chunk (both release the GIL, so chunks run in parallel threads),
    then of the chunk digests, seeded with the length. Orbax restores flipped bytes silently, so
    every restored leaf is checked against the digest recorded at save, on the host, before it is
    placed on a device (no device program to compile, no device-to-host copy)."""
    kind = DIGEST if kind is None else kind
    data = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    starts = range(0, len(data), _DIGEST_CHUNK)
    if kind == "xxh3_64":
        import xxhash
        parts = list(_digest_pool().map(lambda i: xxhash.xxh3_64_intdigest(data[i:i + _DIGEST_CHUNK]), starts))
        return xxhash.xxh3_64_intdigest(np.asarray(parts, np.uint64).tobytes(), len(data))
    if kind == "crc32":
        crcs = list(_digest_pool().map(lambda i: zlib.crc32(data[i:i + _DIGEST_CHUNK]), starts))
        return zlib.crc32(np.asarray(crcs, np.uint32).tobytes(), len(data) & 0xFFFFFFFF)
    raise CacheError(f"unknown digest kind {kind!r} (this zoo checks {', '.join(DIGESTS)})")


def manifest_digest(manifest: dict):
    """``host_digest`` of the kind ``manifest`` records (CRC-32 where it records none)."""
    kind = manifest.get("digest", "crc32")
    if kind not in DIGESTS:
        raise CacheError(f"the cache entry's digests are {kind!r}; this zoo checks {', '.join(DIGESTS)}")
    return functools.partial(host_digest, kind=kind)


def _bounds(shard, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    start = tuple(s.start or 0 for s in shard.index) if shard.index else ()
    stop = tuple(dim if s.stop is None else s.stop for s, dim in zip(shard.index, shape)) if shard.index else ()
    return start, stop


def shard_records(x, digest) -> list:
    """The records of this process's distinct shards of ``x`` (a jax array, or a host array: one
    shard); ``digest(np.ndarray) -> int``."""
    if not hasattr(x, "addressable_shards"):
        a = np.asarray(x)
        return [[[0] * a.ndim, list(a.shape), digest(a)]]
    out = []
    for s in x.addressable_shards:
        if s.replica_id == 0:
            start, stop = _bounds(s, x.shape)
            out.append([list(start), [b - a for a, b in zip(start, stop)], digest(np.asarray(s.data))])
    return out


def merge(parts: list[dict]) -> dict:
    """Every process's ``{group: {leaf: records}}`` as one, each leaf's records sorted by start."""
    out: dict = {}
    for part in parts:
        for group, leaves in part.items():
            for leaf, recs in leaves.items():
                out.setdefault(group, {}).setdefault(leaf, []).extend(recs)
    for leaves in out.values():
        for recs in leaves.values():
            recs.sort(key=lambda r: r[0])
    return out


def _check(block: np.ndarray, rec, offset, digest) -> bool:
    start, size, want = rec
    sl = tuple(slice(a - o, a - o + n) for a, n, o in zip(start, size, offset))
    return digest(np.ascontiguousarray(block[sl])) == want


def verify(arrays: dict, records: dict, digest) -> str | None:
    """Check the restored ``arrays`` of one group against its ``records``; the first leaf found bad,
    or None. ``arrays``: ``{leaf: host array}`` (one process read whole leaves: every record is
    checked on them) or ``{leaf: jax array}`` (a sharded restore: every process of the job must
    call this for the same group)."""
    import jax

    if all(isinstance(x, np.ndarray) for x in arrays.values()):
        for leaf, x in arrays.items():
            if leaf not in records or not all(_check(x, rec, [0] * x.ndim, digest) for rec in records[leaf]):
                return leaf
        return None
    bad: str | None = None
    seen: dict[str, np.ndarray] = {}
    for leaf, x in arrays.items():
        recs = records.get(leaf)
        if recs is None:
            return leaf
        done = np.zeros(len(recs), np.uint8)
        shards = [(_bounds(s, x.shape), s) for s in x.addressable_shards]
        host: dict[int, np.ndarray] = {}                 # each shard copied to the host once
        for i, rec in enumerate(recs):
            start, size = rec[0], rec[1]
            for j, ((lo, hi), s) in enumerate(shards):
                if all(a <= r and r + n <= b for a, b, r, n in zip(lo, hi, start, size)):
                    done[i] = 1
                    if bad is None:
                        block = host[j] if j in host else host.setdefault(j, np.asarray(s.data))
                        if not _check(block, rec, lo, digest):
                            bad = leaf
                    break
        seen[leaf] = done
    flags = np.concatenate([np.array([bad is not None], np.uint8)] + list(seen.values()))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        flags = np.asarray(multihost_utils.process_allgather(flags)).max(axis=0)
    if flags[0] and bad is None:
        bad = "(a leaf checked by another process)"
    at = 1
    for leaf, done in seen.items():
        missing = np.flatnonzero(flags[at:at + len(done)] == 0)
        at += len(done)
        if len(missing):                             # saved on a coarser mesh: check on the whole leaf
            whole = host_value(arrays[leaf])
            if bad is None and not all(_check(whole, records[leaf][i], [0] * whole.ndim, digest) for i in missing):
                bad = leaf
    return bad
