"""Whole leaves of a cache group read straight from their OCDBT data files into aligned buffers.

    direct_reads(state_dir, keys) -> {leaf key: DirectRead}       the leaves that can be read this way
    read_leaves(reads, pool) -> {leaf key: np.ndarray}            them, read (C order, aligned)
    read_leaf(read) -> np.ndarray                                  one of them
    map_leaves(reads, pool) -> ({leaf key: np.ndarray}, {path})   the leaves that can be, mapped from
                                                                   their files instead (read-only)

A cache entry's group is an Orbax checkpoint: zarr2 arrays in one OCDBT key-value store. A leaf that
one process saved is one zarr chunk (its chunk shape is its shape; a leaf of over ~1 GiB is split
into chunks of whole rows), raw (no compressor, no filters, C order), and OCDBT keeps each chunk's
bytes contiguous in one data file. TensorStore's own
description of the store (``tensorstore.ocdbt.dump``: the B+tree's entries, each key's value inline or
as ``value:<base>:<file>:<offset>:<length>``) names where. Reading those bytes with ``os.preadv``
into the buffer the restore keeps (``zoo.formats.host_arrays.read_into``) is one copy from the page
cache, where a TensorStore read is a read into a chunk buffer it allocates, a copy into the
destination and a free: on a 14.8 GB entry on 2 cores that was 2.3 s of copying and 2.1 s of
freeing (``munmap``) besides the page faults of the second buffer.

**Mapped leaves.** A leaf whose bytes start on a 64-byte boundary of a data file (or whose chunks
start on page boundaries) is better not copied at all: ``map_leaves`` maps its bytes (``mmap``,
private, read-only; a split leaf's chunks side by side in one range) and gives the leaf as a view of
them, faulted in over the pool (``MADV_POPULATE_READ``: the disk read and the page tables, no copy
and no new anonymous memory). XLA's CPU client aliases such an
aligned host buffer, so on a CPU host the model's weights are the page cache's pages of the entry;
elsewhere they are the source of the host-to-device copy and let go once placed. On the 14.8 GB
entry of the synthetic Qwen3.8-27B that removes the restore's largest cost on a VM: 14.8 GB of new
anonymous memory, which alone took as long as the whole restore (``bench/scale.py``). A cache
entry's files are never written in place (a rebuild writes a new entry and renames it over the
old), so a live model's mapped bytes cannot change; a file truncated by hand under a live model
would make its next read of them fail (SIGBUS), as any memory map does.

Only the layout described above is read directly; anything else (a tree of more than one node, a
compressed array, chunks that are not whole rows, a missing chunk) is left to TensorStore by the
caller, which checks shapes and dtypes against the manifest either way. Nothing here trusts the
bytes: the restore checks every leaf against the digests recorded at save
(``zoo.weight_cache.store``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import json
import mmap
import os
import sys
from pathlib import Path
from urllib.parse import unquote

import numpy as np

from zoo.formats.host_arrays import ALIGN, aligned_empty, read_into

PART = 32 << 20                 # bytes per read, or fault-in, of a part of a leaf (mapped: 2 and 8 MiB no faster)


@dataclasses.dataclass(frozen=True)
class DirectRead:
    """Where one leaf's bytes are. ``pieces``: ``(path, offset, nbytes)`` of each chunk's part of the
    leaf, in the leaf's C order (``path`` None: ``inline[i]`` holds the bytes, as OCDBT keeps values
    of up to 1 KiB in the tree node); ``shape`` and ``dtype`` are the zarr array's."""
    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: tuple[tuple[Path | None, int, int], ...]
    inline: tuple[bytes | None, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _zarr_dtype(name: str) -> np.dtype | None:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # bfloat16 and the float8s: zarr2 names them by their name
        kind = getattr(ml_dtypes, name, None)
        return np.dtype(kind) if kind is not None else None


def _entries(state_dir: Path) -> dict[str, object] | None:
    """``{key: inline bytes or indirect value location}`` of the store's newest version, or None
    where its tree has more than one node (left to TensorStore)."""
    import tensorstore as ts
    import tensorstore.ocdbt as ocdbt

    kv = ts.KvStore.open(f"file://{state_dir}/").result()
    manifest = ocdbt.dump(kv).result()
    versions = manifest.get("versions") or []
    if not versions or versions[-1].get("root_height") != 0:
        return None
    root = versions[-1].get("root", {}).get("location")
    if not root:
        return None
    out = {}
    for e in ocdbt.dump(kv, root).result().get("entries", []):
        key = e["key"].decode() if isinstance(e["key"], bytes) else str(e["key"])
        if "inline_value" in e:
            out[key] = bytes(e["inline_value"])
        elif "indirect_value" in e:
            out[key] = str(e["indirect_value"])
        else:
            return None
    return out


def _location(state_dir: Path, ref: str) -> tuple[Path, int, int] | None:
    """``value:<base>:<file>:<offset>:<length>`` (paths percent-encoded) as ``(path, offset, length)``."""
    head, _, rest = ref.partition(":")
    parts = rest.rsplit(":", 2)
    if head != "value" or len(parts) != 3:
        return None
    base, _, rel = parts[0].partition(":")
    try:
        offset, length = int(parts[1]), int(parts[2])
    except ValueError:
        return None
    path = state_dir / unquote(base) / unquote(rel)
    return path, offset, length


def _plan(state_dir: Path, entries: dict, k: str) -> DirectRead | None:
    """Leaf ``k``'s direct read: its zarr2 array raw, in C order, its chunks whole rows of it (the
    chunk shape is the array's but for the first dimension; Orbax splits a leaf of over ~1 GiB along
    it), every chunk present. None otherwise."""
    meta = entries.get(f"{k}/.zarray")
    if not isinstance(meta, bytes):
        return None
    try:
        z = json.loads(meta)
    except ValueError:
        return None
    shape, chunks, dtype = tuple(z.get("shape", ())), tuple(z.get("chunks", ())), _zarr_dtype(str(z.get("dtype")))
    if (z.get("zarr_format") != 2 or z.get("compressor") is not None or z.get("filters") is not None
            or z.get("order") != "C" or dtype is None or len(chunks) != len(shape) or chunks[1:] != shape[1:]):
        return None
    rows, chunk_rows = (shape[0], chunks[0]) if shape else (1, 1)      # a 0-d leaf: one row, chunk "0"
    if chunk_rows <= 0:
        return None
    sep = str(z.get("dimension_separator", "."))
    row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    stored = chunk_rows * row                                           # zarr2 stores edge chunks whole
    pieces, inline = [], []
    for i in range(-(-rows // chunk_rows)):
        value = entries.get(f"{k}/" + sep.join([str(i)] + ["0"] * (len(shape) - 1)))
        used = min(chunk_rows, rows - i * chunk_rows) * row
        if isinstance(value, bytes):
            if len(value) != stored:
                return None
            pieces.append((None, 0, used))
            inline.append(value[:used])
            continue
        loc = _location(state_dir, value) if isinstance(value, str) else None
        if loc is None or loc[2] != stored or not loc[0].is_file() or loc[0].stat().st_size < loc[1] + stored:
            return None
        pieces.append((loc[0], loc[1], used))
        inline.append(None)
    return DirectRead(shape, dtype, tuple(pieces), tuple(inline))


def direct_reads(state_dir: Path, keys) -> dict[str, DirectRead]:
    """The leaves among ``keys`` of the group at ``state_dir`` whose bytes can be read directly (the
    module docstring); the others are absent. Never raises for an unexpected layout: it reads less."""
    try:
        entries = _entries(state_dir)
    except Exception:                       # noqa: BLE001 - anything TensorStore says: leave it to TensorStore
        return {}
    if entries is None:
        return {}
    plans = {k: _plan(state_dir, entries, k) for k in keys}
    return {k: p for k, p in plans.items() if p is not None}


def _in_file_order(reads: dict[str, DirectRead]) -> list[str]:
    """The keys of ``reads`` by where their first bytes lie (file, then offset): reads in this order
    keep the disk streaming."""
    return sorted(reads, key=lambda k: (str(reads[k].pieces[0][0]), reads[k].pieces[0][1]))


def read_leaves(reads: dict[str, DirectRead], pool=None) -> dict[str, np.ndarray]:
    """The leaves' arrays, each in a fresh aligned buffer, read in file order in parts of at most
    ``PART`` bytes spread over ``pool``'s threads where given (``os.preadv`` releases the GIL, and
    on 2 cores the page faults of the fresh buffers are half of a read's work: one thread was
    slower than TensorStore's pool). The page cache's copy is left to the caller, which drops a
    group's files once they are read (``group_reads.read_group``)."""
    host, parts = {}, []
    for k in _in_file_order(reads):
        read = reads[k]
        flat = aligned_empty(read.nbytes, np.uint8)
        at = 0
        for (path, offset, nbytes), inline in zip(read.pieces, read.inline):
            if path is None:
                flat[at:at + nbytes] = np.frombuffer(inline, np.uint8)
            else:
                parts += [(path, offset + i, flat[at + i:at + min(nbytes, i + PART)]) for i in range(0, nbytes, PART)]
            at += nbytes
        host[k] = flat.view(read.dtype).reshape(read.shape)
    run = (lambda p: read_into(p[0], p[1], p[2].size, False, out=p[2]))      # noqa: E731
    for _ in (pool.map(run, parts) if pool is not None else map(run, parts)):
        pass
    return {k: host[k] for k in reads}


def read_leaf(read: DirectRead) -> np.ndarray:
    """One leaf's array, in a fresh aligned buffer (``read_leaves``)."""
    return read_leaves({"": read})[""]


# -- mapped leaves -------------------------------------------------------------------------------------
MADV_POPULATE_READ = 22         # Linux >= 5.14: fault a range in (read from disk, map), no copy
MADV_WILLNEED = 3               # older kernels: read ahead, faulted in by the first use
PAGE = mmap.PAGESIZE
PROT_NONE, MAP_FIXED = 0, 0x10                    # Linux's values (Python's mmap names neither)


def mapping_enabled() -> bool:
    """Whether leaves may be mapped (``map_leaves``): Linux, and ``ZOO_CACHE_MMAP`` not ``0`` (the copy
    path stays for comparison: ``bench/scale.py``)."""
    return sys.platform.startswith("linux") and os.environ.get("ZOO_CACHE_MMAP", "1") != "0"


def mappable(read: DirectRead) -> bool:
    """A leaf whose pieces can be mapped side by side into one range: some bytes, none inline; one
    piece from a 64-byte boundary of its file, or several each from a page boundary and each but the
    last a whole number of pages (Orbax writes a split leaf's chunks in any order, even within one
    file: the 2.5 GB embedding of Qwen3.8-27B was stored second chunk first)."""
    if not read.nbytes or any(path is None for path, _, _ in read.pieces):
        return False
    if len(read.pieces) == 1:
        return read.pieces[0][1] % ALIGN == 0
    return (all(offset % PAGE == 0 for _, offset, _ in read.pieces)
            and all(nbytes % PAGE == 0 for _, _, nbytes in read.pieces[:-1]))


@functools.lru_cache(maxsize=1)
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_FAILED = ctypes.c_void_p(-1).value


class _Region:
    """One range of addresses holding a leaf's pieces, each a private read-only map of its file's bytes,
    side by side; unmapped when the last array of it goes (``__del__``). ``address`` is the leaf's
    first byte (``shift`` bytes into the first page)."""

    def __init__(self, read: DirectRead):
        libc = _libc()
        self.shift = read.pieces[0][1] % PAGE
        self.size = -(-(self.shift + read.nbytes) // PAGE) * PAGE
        base = libc.mmap(None, self.size, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if base in (None, _FAILED):
            raise OSError(ctypes.get_errno(), "cannot reserve an address range for a cache leaf")
        self.base = base
        at = 0
        for path, offset, nbytes in read.pieces:
            start = offset - offset % PAGE
            fd = os.open(path, os.O_RDONLY)
            try:
                got = libc.mmap(base + at, offset % PAGE + nbytes, mmap.PROT_READ,
                                mmap.MAP_PRIVATE | MAP_FIXED, fd, start)
            finally:
                os.close(fd)
            if got != base + at:
                raise OSError(ctypes.get_errno(), f"cannot map {path} at offset {start}")
            at += offset % PAGE + nbytes
        self.address = base + self.shift

    def __del__(self):
        if getattr(self, "base", None) is not None:
            _libc().munmap(self.base, self.size)
            self.base = None


def _view(read: DirectRead) -> np.ndarray:
    """The leaf as a read-only array over a ``_Region`` of its pieces (which it keeps alive)."""
    region = _Region(read)
    buffer = (ctypes.c_ubyte * read.nbytes).from_address(region.address)
    buffer._region = region
    flat = np.frombuffer(buffer, np.uint8)
    flat.flags.writeable = False
    return flat.view(read.dtype).reshape(read.shape)


def _populate(address: int, nbytes: int) -> None:
    """Fault ``[address, address + nbytes)`` of a file map in: read from disk where not cached, and
    mapped (ctypes releases the GIL, so the pool's threads read in parallel). Where the kernel does
    not know ``MADV_POPULATE_READ`` (``EINVAL``: before Linux 5.14), a read-ahead is asked for instead
    and the first use faults the pages in; any other failure (the disk's ``EIO``, a file shorter than
    its map: ``EFAULT``) is an ``OSError`` here, not a ``SIGBUS`` at the first use."""
    start = address - address % PAGE
    libc = _libc()
    if libc.madvise(start, address + nbytes - start, MADV_POPULATE_READ) != 0:
        err = ctypes.get_errno()
        if err != errno.EINVAL:
            raise OSError(err, f"cannot read a mapped cache leaf ({os.strerror(err)})")
        libc.madvise(start, address + nbytes - start, MADV_WILLNEED)


def map_leaves(reads: dict[str, DirectRead], pool=None) -> tuple[dict[str, np.ndarray], set[Path]]:
    """The mappable leaves among ``reads`` (``mappable``) as read-only views of their files' bytes
    (each leaf its own range, its pieces side by side in it), and the files mapped. The views are
    faulted in before this returns, in parts of at most ``PART`` bytes over ``pool``'s threads where
    given. Empty where mapping is off (``mapping_enabled``); a leaf whose map fails is left out (the
    caller reads it instead)."""
    if not mapping_enabled():
        return {}, set()
    host, files, parts = {}, set(), []
    for k in _in_file_order(reads):
        read = reads[k]
        if not mappable(read):
            continue
        try:
            host[k] = _view(read)
        except OSError:
            continue
        files.update(path for path, _, _ in read.pieces)
        address = host[k].ctypes.data
        parts += [(address + i, min(PART, read.nbytes - i)) for i in range(0, read.nbytes, PART)]
    for _ in (pool.map(lambda p: _populate(*p), parts) if pool is not None else (_populate(*p) for p in parts)):
        pass
    return host, files
