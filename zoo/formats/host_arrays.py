"""Host arrays the loader hands to JAX without a copy.

    aligned_empty(shape, dtype) -> np.ndarray      C-contiguous, its data 64-byte aligned
    to_device(array) -> jax.Array                  ``jax.device_put``: on the CPU backend an aligned,
                                                   contiguous array becomes the device buffer itself
    read_into(path, offset, nbytes, drop=None, out=None)
                                                   bytes of a file by ``os.preadv`` into an aligned
                                                   buffer or ``out`` (sequential reads at disk speed,
                                                   no page faults on a memory map); the page cache's
                                                   copy of them is dropped where the file is large
                                                   for this host
    large_for_host(nbytes) -> bool                 a file this large has its read pages dropped
    drop_cached(paths)                             drop the page cache's copy of these files

XLA's CPU client aliases a host buffer that is 64-byte aligned instead of copying it
(``jnp.asarray`` always copies; so does ``device_put`` of an array malloc placed 16 bytes off a
page). A 12.9 GB model then costs no host-to-device copy on a CPU host, and no second copy in RAM.
The array given must not be written afterwards: the device array may be that memory.

**The page cache.** A load keeps every byte it reads in its own memory, so the kernel's cached copy
of the file is a second one that nothing reads again. Where the model is about the size of the
host's memory, the kernel must reclaim that copy while the load allocates, and on this 2-core,
24 GiB VM that reclaim was most of a load's time: 14.8 GB of cache files read into fresh buffers
that are kept took 16-35 s (13.7-32.8 s of it in the kernel) against 8.6 s for a read into one
reused buffer; with each file's pages dropped once read (``POSIX_FADV_DONTNEED``), 6.5-7.1 s (3.8-4.1
s in the kernel). A file of at least ``1 / DROP_FRACTION`` of the host's memory is read that way
(``large_for_host``; a GGUF source decides from its whole file set); a smaller one stays cached, so
that loading it again is a warm read. The kernel drops only the page-cache folios (up to 16 pages
here) that lie wholly inside a read range, so up to two of them per read stay: a few MB over a
full-size model's ~1,000 tensors of several MB each.
"""

from __future__ import annotations

import os

import jax
import numpy as np

ALIGN = 64
READ_CHUNK = 64 << 20           # bytes per read call (a large request keeps the disk streaming)
DROP_FRACTION = 4               # a file of >= 1/4 of the host's memory: its pages are dropped once read


def host_memory() -> int:
    """Bytes of physical memory of this host (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def large_for_host(nbytes: int) -> bool:
    """Whether a file of ``nbytes`` is large enough for this host that the page cache's copy of what
    is read from it is dropped (the module docstring)."""
    memory = host_memory()
    return memory > 0 and nbytes * DROP_FRACTION >= memory


def _drop(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    if hasattr(os, "posix_fadvise"):            # not on macOS or Windows: a hint only, nothing to do
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def drop_cached(paths) -> None:
    """Drop the page cache's copy of ``paths`` (files already read into memory; see the module
    docstring). Only a hint to the kernel: the files are unchanged, a missing one is skipped."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            _drop(fd)
        finally:
            os.close(fd)


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary. (numpy asks for
    transparent huge pages on allocations of 4 MiB or more. Buffers without them, each its own
    private anonymous map, were tried on the 14.8 GB cache restore, every leaf kept: 39.6 and
    24.5 s against 21.1 and 24.8 s with numpy's, 3.6 M faults against 0.6 M: not kept.)"""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape) if isinstance(shape, (tuple, list)) else (int(shape),)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def is_aligned(array: np.ndarray) -> bool:
    return array.flags.c_contiguous and array.ctypes.data % ALIGN == 0


def to_device(array) -> jax.Array:
    """``array`` on the default device, uncommitted, like ``jnp.asarray``; an aligned contiguous
    host array is not copied on the CPU backend (see the module docstring)."""
    if isinstance(array, np.ndarray) and not is_aligned(array):
        copy = aligned_empty(array.shape, array.dtype)
        np.copyto(copy, array)
        array = copy
    return jax.device_put(array)


def read_into(path, offset: int, nbytes: int, drop: bool | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """``uint8 [nbytes]`` of ``path`` from ``offset``, read with ``os.preadv`` into an aligned buffer,
    or into ``out`` (a contiguous ``uint8 [nbytes]`` part of a larger buffer) where given (``OSError``
    on a short read: the file is shorter than its header says). ``drop``: the page cache's copy of
    these bytes is dropped once read; None: where the file is large for this host
    (``large_for_host``; a reader of several files passes what their sum says)."""
    if out is None:
        out = aligned_empty(nbytes, np.uint8)
    elif out.dtype != np.uint8 or out.shape != (nbytes,) or not out.flags.c_contiguous:
        raise ValueError(f"read_into: out must be a contiguous uint8[{nbytes}], got {out.dtype}{list(out.shape)}")
    view = memoryview(out)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:done + READ_CHUNK]], offset + done)
            if n <= 0:
                raise OSError(f"{path}: {nbytes - done} bytes missing at offset {offset + done} (file truncated?)")
            done += n
        if nbytes and (large_for_host(os.fstat(fd).st_size) if drop is None else drop):
            _drop(fd, offset, nbytes)
    finally:
        os.close(fd)
    return out
