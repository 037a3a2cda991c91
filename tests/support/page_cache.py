"""How much of a file the kernel's page cache holds (Linux ``mincore`` on a read-only map of it)."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

PAGE = mmap.PAGESIZE


def resident_fraction(path: str | Path) -> float:
    """The fraction of ``path``'s pages in the page cache now (0.0 for an empty file)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = -(-size // PAGE)
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(b & 1 for b in vec) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def make_resident(paths) -> None:
    """Write back and read every file of ``paths``: afterwards the page cache holds them, clean."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        Path(p).read_bytes()
