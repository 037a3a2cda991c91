"""Tests of zoo.images; ``encode`` and ``png_bytes`` make real image files in memory."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image


def encode(image: Image.Image, fmt: str, **save_kw) -> bytes:
    """A Pillow image saved as ``fmt`` ("PNG", "JPEG", ...) -> the file's bytes."""
    buf = io.BytesIO()
    image.save(buf, fmt, **save_kw)
    return buf.getvalue()


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    """One PNG chunk: length, type, payload, CRC32 of type + payload."""
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_bytes(width: int, height: int, idat: bytes, *, bit_depth: int = 8, colour_type: int = 0) -> bytes:
    """A PNG file from its parts: signature, IHDR (with a valid CRC), one IDAT, IEND."""
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")
