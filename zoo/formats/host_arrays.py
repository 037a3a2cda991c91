"""Host arrays the loader hands to JAX without a copy.

    aligned_empty(shape, dtype) -> np.ndarray      C-contiguous, its data 64-byte aligned
    to_device(array) -> jax.Array                  ``jax.device_put``: on the CPU backend an aligned,
                                                   contiguous array becomes the device buffer itself
    read_into(path, offset, nbytes) -> np.ndarray  bytes of a file by ``os.preadv`` into an aligned
                                                   buffer (sequential reads at disk speed, no page faults
                                                   on a memory map)

XLA's CPU client aliases a host buffer that is 64-byte aligned instead of copying it
(``jnp.asarray`` always copies; so does ``device_put`` of an array malloc placed 16 bytes off a
page). A 12.9 GB model then costs no host-to-device copy on a CPU host, and no second copy in RAM.
The array given must not be written afterwards: the device array may be that memory.
"""

from __future__ import annotations

import os

import jax
import numpy as np

ALIGN = 64
READ_CHUNK = 64 << 20           # bytes per read call (a large request keeps the disk streaming)


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary. (Transparent huge
    pages for the large ones were tried: no gain measured on a 12.9 GB load or restore, the kernel's
    compaction with a full page cache ate what the fewer faults saved.)"""
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


def read_into(path, offset: int, nbytes: int) -> np.ndarray:
    """``uint8 [nbytes]`` of ``path`` from ``offset``, read with ``os.preadv`` into an aligned buffer
    (``OSError`` on a short read: the file is shorter than its header says)."""
    out = aligned_empty(nbytes, np.uint8)
    view = memoryview(out)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:done + READ_CHUNK]], offset + done)
            if n <= 0:
                raise OSError(f"{path}: {nbytes - done} bytes missing at offset {offset + done} (file truncated?)")
            done += n
    finally:
        os.close(fd)
    return out
