"""Content digests of a cache entry's leaves, per saved shard, checked where each process reads.

Orbax restores flipped bytes silently, so the save records a CRC-32 of every shard it wrote and the
restore checks them. A leaf's record is a list of its saved shards::

    [[start, ...], [size, ...], crc]      one per distinct shard (replicas are written once)

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

import numpy as np

from zoo.sharding.mesh import host_value


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
    start, size, crc = rec
    sl = tuple(slice(a - o, a - o + n) for a, n, o in zip(start, size, offset))
    return digest(np.ascontiguousarray(block[sl])) == crc


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
