"""Reading a cache entry's parameter groups for a restore (``zoo.weight_cache.store.restore``, ``verify``).

    check_files(entry, files)                           every state file there, with its saved size
    read_leaves_here(entry, group, state_dir, target, direct=None, mapped=None) -> {leaf: np.ndarray}
                                                        one process: a group's leaves as host arrays
    read_group(ckptr, entry, group, target, files, direct=None) -> {leaf: array}
                                                        a group's leaves, checked against ``target``
    GroupReads(ckptr, entry, targets, files)            every group in order, read ahead on threads

One process reads whole leaves to the host: mapped from the group's OCDBT data files where they can
be (``ocdbt_reader.map_leaves``: no copy), else read into aligned buffers (``ocdbt_reader.read_leaves``),
else through TensorStore. Several processes read their own shards through Orbax. ``GroupReads``
reads ``READ_AHEAD`` groups ahead of the caller, which checks digests and places each group, and
plans every group's direct reads (``ocdbt_reader.direct_reads``: each store's small description)
first, on a thread of its own.

Where the time went on the 14.8 GB entry of the synthetic Qwen3.8-27B (2 cores, this VM, cold), and
why this layout: each group's checks of its files' sizes and its store's description, made between
the other groups' large reads, waited behind them in the disk's queue (9-12 s and 4-9 s of the
reading threads' time), against 0.1 s and 0.7 s when made first; with one group read ahead the
reading thread never idled and was the whole restore.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zoo.formats.host_arrays import aligned_empty, drop_cached, large_for_host
from zoo.weight_cache import ocdbt_reader
from zoo.weight_cache.errors import CacheError

READ_AHEAD = 2      # groups read while the caller checks one (1 / 2 / 3 on the 14.8 GB entry: 32.0 / 28.9 / 25.0 s)


@functools.lru_cache(maxsize=1)
def _read_pool() -> ThreadPoolExecutor:
    """The threads that read a group's leaves from their files (``ocdbt_reader.read_leaves``)."""
    return ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="zoo-read")


@functools.lru_cache(maxsize=1)
def _map_pool() -> ThreadPoolExecutor:
    """The threads that fault a group's mapped leaves in (``ocdbt_reader.map_leaves``): waiting on the
    disk, not the CPU, so more of them than cores keep more reads in flight (the 14.8 GB entry's files
    faulted in on 2 cores: 14.8 s with 2 threads, 11.6-12.1 s with 4 or 8)."""
    return ThreadPoolExecutor(8, thread_name_prefix="zoo-map")


@functools.lru_cache(maxsize=1)
def _ts_context():
    import tensorstore as ts
    return ts.Context()


def check_files(entry: Path, files: dict[str, int]) -> None:
    """Every state file the save wrote (``files``: the manifest's ``{relative path: bytes}``) is there
    with its size: a truncated or missing file is reported by name before anything is read."""
    for rel, size in files.items():
        if not rel.startswith("state/"):
            continue
        path = entry / rel
        group = rel.split("/")[1]
        if not path.is_file():
            raise CacheError(f"{entry}: missing file {rel} of parameter group {group!r}")
        if path.stat().st_size != size:
            raise CacheError(f"{entry}: {rel} has {path.stat().st_size} bytes, the save wrote {size} (truncated?)")


def _check_leaf(entry: Path, group: str, k: str, dtype, shape, t: jax.ShapeDtypeStruct) -> None:
    """The stored leaf ``k`` of ``group`` has the manifest's shape and dtype (``t``); else a
    ``CacheError`` naming both."""
    if tuple(shape) != tuple(t.shape) or np.dtype(dtype) != np.dtype(t.dtype):
        raise CacheError(f"{entry}: leaf {k} of group {group!r} is {np.dtype(dtype)}{list(shape)}, "
                         f"the manifest says {np.dtype(t.dtype)}{list(t.shape)}")


def _state_dir(entry: Path, group: str) -> Path:
    return (entry / "state" / group).absolute()


def read_leaves_here(entry: Path, group: str, state_dir: Path, target: dict[str, jax.ShapeDtypeStruct],
                     direct: dict | None = None, mapped: set | None = None) -> dict[str, np.ndarray]:
    """A group's leaves as whole host arrays: the arrays the restore checks and places (on the CPU
    backend the device buffer is that memory). The leaves are the group's Orbax checkpoint's arrays
    (zarr2 in its OCDBT store). A leaf saved as raw chunks of whole rows (every leaf one process
    saved) is mapped from its data file where its chunks lie on 64-byte / page boundaries
    (``ocdbt_reader.map_leaves``: no copy, read-only views), else read from it straight into an
    aligned buffer (``ocdbt_reader.read_leaves``: one copy, in file order); any other is read by
    TensorStore into an aligned buffer (``aligned_empty``), with the spec Orbax reads it by. (Orbax's
    own restore returned arrays TensorStore allocated, which then needed an aligned copy;
    TensorStore's read into a given buffer still reads each chunk into one of its own first.)
    ``direct``: the group's ``ocdbt_reader.direct_reads`` where already planned. ``mapped``: where
    given, gains the absolute paths of the files mapped."""
    import tensorstore as ts

    direct = ocdbt_reader.direct_reads(state_dir, target) if direct is None else direct
    for k, d in direct.items():         # checked before any buffer is made
        _check_leaf(entry, group, k, d.dtype, d.shape, target[k])
    host, files = ocdbt_reader.map_leaves(direct, _map_pool())
    if mapped is not None:
        mapped.update(os.path.abspath(f) for f in files)
    host.update(ocdbt_reader.read_leaves({k: d for k, d in direct.items() if k not in host}, _read_pool()))
    writes = []
    try:
        for k, t in target.items():
            if k in host:
                continue
            spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{state_dir}/", "path": k},
                    "recheck_cached_data": False, "recheck_cached_metadata": False}
            src = ts.open(spec, open=True, read=True, context=_ts_context()).result()
            _check_leaf(entry, group, k, src.dtype.numpy_dtype, src.shape, t)      # before the buffer is made
            host[k] = aligned_empty(t.shape, t.dtype)
            writes.append(ts.array(host[k], copy=False, write=True).write(src))
    finally:                        # every write started ends before anything is raised or returned
        failed = None
        for w in writes:
            try:
                w.result()
            except Exception as e:  # noqa: PERF203
                failed = failed or e
    if failed is not None:
        raise failed
    return {k: host[k] for k in target}


def _drop_group_files(entry: Path, group: str, files: dict[str, int], mapped=frozenset()) -> None:
    """Drop the page cache's copy of ``group``'s files where the entry is large for this host, but for
    the ``mapped`` ones (absolute paths: their pages are the mapped leaves', which the kernel does not
    drop)."""
    if large_for_host(sum(files.values())):
        drop_cached(entry / rel for rel in files
                    if rel.startswith(f"state/{group}/") and os.path.abspath(entry / rel) not in mapped)


def read_group(ckptr, entry: Path, group: str, target: dict[str, jax.ShapeDtypeStruct],
               files: dict[str, int], direct: dict | Future | None = None) -> dict[str, Any]:
    """One parameter group's leaves, checked against the target's shapes and dtypes: with one process
    as whole host arrays (checked, then placed, by the caller: no device-to-host copy); with several,
    on their target shardings (each process reads the chunks of its own devices' shards only).
    In an entry that is large for this host (``zoo.formats.host_arrays.large_for_host``), the page
    cache's copy of the group's files that were read, not mapped, is dropped once they are read:
    nothing reads them again, and the kernel reclaiming it while the restore allocates was most of
    a restore's time. ``direct``: the group's planned direct reads (or a future of them)."""
    import orbax.checkpoint as ocp

    state_dir = _state_dir(entry, group)
    if not state_dir.is_dir():
        raise CacheError(f"{entry}: missing state for parameter group {group!r}")
    try:
        if jax.process_count() == 1:        # checked leaf by leaf as it is opened
            mapped: set[str] = set()
            plan = direct.result() if isinstance(direct, Future) else direct
            host = read_leaves_here(entry, group, state_dir, target, plan, mapped)
            _drop_group_files(entry, group, files, mapped)
            return host
        args = ocp.args.PyTreeRestore(
            item=dict(target),
            restore_args={k: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape, dtype=t.dtype)
                          for k, t in target.items()})
        host = ckptr.restore(state_dir, args=args)
        _drop_group_files(entry, group, files)
    except CacheError:
        raise
    except Exception as e:      # orbax/tensorstore raise many kinds on truncated or missing files
        raise CacheError(f"{entry}: cannot restore parameter group {group!r} ({type(e).__name__}: "
                         f"{str(e)[:200]})") from None
    if set(host) != set(target):            # what Orbax restored: the leaves it found
        raise CacheError(f"{entry}: parameter group {group!r} holds leaves {sorted(host)[:5]}..., "
                         f"the manifest lists {sorted(target)[:5]}...")
    for k, t in target.items():
        _check_leaf(entry, group, k, host[k].dtype, host[k].shape, t)
    return host


class GroupReads:
    """``(group, target, arrays)`` for each group of ``targets`` in order, by iteration. With one
    process, reading starts at construction: every group's direct reads are planned in order on a
    thread of their own, and ``READ_AHEAD`` groups are read on worker threads ahead of the caller,
    which checks and places each (the reads and the digests release the GIL). At most ``READ_AHEAD
    + 1`` groups are in host memory at once. With several processes each read is a collective: the
    groups are read in turn, when asked for. ``close()`` (or leaving a ``with`` block) cancels what
    has not started and waits for the rest."""

    def __init__(self, ckptr, entry: Path, targets: dict[str, dict], files: dict[str, int],
                 ahead: int | None = None):
        self.ckptr, self.entry, self.files = ckptr, entry, files
        self.groups = list(targets.items())
        self.ahead = max(1, READ_AHEAD if ahead is None else ahead)
        self._pending: list[Future] = []
        self._plans: list[Future] = []
        self._planner = self._pool = None
        if jax.process_count() == 1 and self.groups:
            self._planner = ThreadPoolExecutor(1, thread_name_prefix="zoo-plan")
            self._plans = [self._planner.submit(ocdbt_reader.direct_reads, _state_dir(entry, g), t)
                           for g, t in self.groups]
            self._pool = ThreadPoolExecutor(self.ahead, thread_name_prefix="zoo-restore")
            self._pending = [self._read(i) for i in range(min(self.ahead, len(self.groups)))]

    def _read(self, i: int) -> Future:
        group, target = self.groups[i]
        return self._pool.submit(read_group, self.ckptr, self.entry, group, target, self.files, self._plans[i])

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self):
        if self._pool is None:
            for group, target in self.groups:
                yield group, target, read_group(self.ckptr, self.entry, group, target, self.files)
            return
        for i, (group, target) in enumerate(self.groups):
            arrays = self._pending.pop(0).result()
            if i + len(self._pending) + 1 < len(self.groups):
                self._pending.append(self._read(i + len(self._pending) + 1))
            yield group, target, arrays
            del arrays

    def close(self) -> None:
        for pool in (self._pool, self._planner):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._pending = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
