"""A GGUF header, parsed and validated in one pass (``parse_header``), and the split-set file names.
Used by the local source (``zoo.sources.gguf``) and the remote one (``zoo.sources.remote``).

gguf-py's ``GGUFReader`` is not used to read headers: it builds numpy views per array element (48 s
for the 248k-token vocabulary of a Qwen3.8 file, and gigabytes of memory) and loops forever on an
array whose length runs past the end of the file."""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUFValueType

from zoo.formats.ggml import QType
from zoo.sources.base import SourceError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4
MAX_ARRAY_NESTING = 2
SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")

_SCALAR_DTYPES = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.BOOL: "<u1",
                  GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4",
                  GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.UINT64: "<u8",
                  GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8"}
_SCALAR_SIZES = {t: np.dtype(d).itemsize for t, d in _SCALAR_DTYPES.items()}
# Smallest encoding of one array element of each kind (a string is at least its u64 length, an
# array at least its u32 type and u64 length): bounds the element count by the bytes left.
_MIN_SIZES = {**_SCALAR_SIZES, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
_U64 = struct.Struct("<Q")


# --- header validation ------------------------------------------------------------------------


class _Cursor:
    """Bounds-checked little-endian reads over a file's bytes; errors name the file and the field."""

    def __init__(self, path: Path, data: memoryview):
        self.path, self.data, self.pos = path, data, 0

    def remaining(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, what: str) -> memoryview:
        if n > self.remaining():
            raise SourceError(f"{self.path}: truncated GGUF header: {what} needs {n} bytes at offset "
                              f"{self.pos}, the file has {len(self.data)}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        raw = bytes(self.take(n, what))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SourceError(f"{self.path}: {what} is not valid UTF-8") from None

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.u32(f"the type of {what}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise SourceError(f"{self.path}: {what} has unknown GGUF value type {raw}") from None

    def scalars(self, vtype: GGUFValueType, count: int, what: str) -> list:
        """``count`` scalars of ``vtype`` as Python values (one numpy read, not one per element)."""
        raw = self.take(count * _SCALAR_SIZES[vtype], what)
        values = np.frombuffer(raw, _SCALAR_DTYPES[vtype], count)
        return (values != 0).tolist() if vtype == GGUFValueType.BOOL else values.tolist()

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings (a u64 length, then UTF-8 bytes, each): one pass over the bytes."""
        data, pos, end, out = self.data, self.pos, len(self.data), []
        unpack, append = _U64.unpack_from, out.append
        try:
            for _ in range(count):
                n = unpack(data, pos)[0]
                pos += 8
                if n > end - pos:
                    raise IndexError
                append(str(data[pos:pos + n], "utf-8"))
                pos += n
        except (IndexError, struct.error):
            raise SourceError(f"{self.path}: truncated GGUF header: {what} runs past the end of the file "
                              f"({len(self.data)} bytes)") from None
        except UnicodeDecodeError:
            raise SourceError(f"{self.path}: an element of {what} is not valid UTF-8") from None
        finally:
            self.pos = pos
        return out

    def value(self, vtype: GGUFValueType, what: str, depth: int = 0):
        """One metadata value as Python data (what ``gguf.ReaderField.contents()`` gives)."""
        if vtype in _SCALAR_SIZES:
            return self.scalars(vtype, 1, what)[0]
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if depth >= MAX_ARRAY_NESTING:
            raise SourceError(f"{self.path}: {what} nests arrays deeper than {MAX_ARRAY_NESTING}")
        itype = self.value_type(f"the elements of {what}")
        count = self.u64(f"the length of {what}")
        if count * _MIN_SIZES[itype] > self.remaining():
            raise SourceError(f"{self.path}: {what} claims {count} elements, more than the "
                              f"{self.remaining()} bytes left in the file")
        if itype in _SCALAR_SIZES:
            return self.scalars(itype, count, what)
        if itype == GGUFValueType.STRING:
            return self.strings(count, what)
        return [self.value(itype, what, depth + 1) for _ in range(count)]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's header entry: name, ggml dims ``ne`` (ggml order), type and absolute byte range."""

    name: str
    ne: tuple[int, ...]
    qtype: QType
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Header:
    """A parsed GGUF header: its metadata (Python values), its tensors, where the data starts."""

    metadata: dict[str, Any]
    tensors: list[TensorEntry]
    data_start: int


def parse_header(path: Path, data: memoryview) -> Header:
    """Parse and validate a whole GGUF header in one pass; raise ``SourceError`` naming the file.

    Checks: magic, version (2 or 3, little-endian), every key/value (known value types, lengths
    inside the file, UTF-8 strings, no duplicate keys, ``general.alignment`` a power of two), every
    tensor info (UTF-8 name, no duplicates, 1..4 dims, a known ggml type, rows a whole number of
    blocks, data aligned and inside the file). Only the header's bytes are read; arrays of numbers are
    read with numpy and arrays of strings in one loop, so a 250k-token vocabulary takes well under a
    second.
    """
    cur = _Cursor(path, data)
    if bytes(cur.take(4, "the magic")) != MAGIC:
        raise SourceError(f"{path}: not a GGUF file (bad magic {bytes(data[:4])!r})")
    version = cur.u32("the version")
    if version not in VERSIONS:
        raise SourceError(f"{path}: unsupported GGUF version {version} (supported: {VERSIONS}; "
                          f"big-endian files are not supported)")
    n_tensors, n_kv = cur.u64("the tensor count"), cur.u64("the key/value count")
    alignment, metadata = GGUF_DEFAULT_ALIGNMENT, {}
    for i in range(n_kv):
        key = cur.string(f"key #{i}")
        if key in metadata:
            raise SourceError(f"{path}: duplicate metadata key {key!r}")
        vtype = cur.value_type(f"key {key!r}")
        if key == "general.alignment":
            if vtype != GGUFValueType.UINT32:
                raise SourceError(f"{path}: general.alignment must be a UINT32, not {vtype.name}")
            alignment = cur.u32("general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise SourceError(f"{path}: general.alignment {alignment} is not a power of two")
            metadata[key] = alignment
        else:
            metadata[key] = cur.value(vtype, f"the value of key {key!r}")
    raw, names = [], set()
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor #{i}")
        if name in names:
            raise SourceError(f"{path}: duplicate tensor {name!r}")
        names.add(name)
        n_dims = cur.u32(f"the rank of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise SourceError(f"{path}: tensor {name!r} has {n_dims} dims (1..{MAX_DIMS} allowed)")
        ne = tuple(cur.u64(f"dim {d} of tensor {name!r}") for d in range(n_dims))
        raw_type = cur.u32(f"the type of tensor {name!r}")
        offset = cur.u64(f"the offset of tensor {name!r}")
        raw.append((name, ne, raw_type, offset))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, ne, raw_type, offset in raw:
        nbytes = tensor_bytes(path, name, list(ne), raw_type)
        if offset % alignment:
            raise SourceError(f"{path}: tensor {name!r} is at offset {offset}, not a multiple of "
                              f"the alignment {alignment}")
        end = data_start + offset + nbytes
        if end > len(data):
            raise SourceError(f"{path}: tensor {name!r} needs bytes up to {end}, the file has "
                              f"{len(data)} (truncated?)")
        tensors.append(TensorEntry(name, ne, QType(raw_type), data_start + offset, nbytes))
    return Header(metadata, tensors, data_start)


def check_header(path: Path, data: memoryview) -> int:
    """Validate a whole GGUF header (``parse_header``); returns where the tensor data starts."""
    return parse_header(path, data).data_start


MAX_WEIGHTS = 1 << 52          # per tensor, its zero dims left out: 4 PiB of int8; numpy's arrays end at 2^63 bytes


def tensor_bytes(path: Path, name: str, ne: list[int], raw_type: int) -> int:
    """Bytes of a tensor with ggml dims ``ne`` and type id ``raw_type``; ``SourceError`` if invalid."""
    try:
        qtype = QType(raw_type)
        block, size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise SourceError(f"{path}: tensor {name!r} has unknown ggml type {raw_type}") from None
    if ne[0] % block:
        raise SourceError(f"{path}: tensor {name!r} ({qtype.name}) has rows of {ne[0]} weights, not a "
                          f"multiple of the block size {block}")
    span = math.prod(max(d, 1) for d in ne)     # an empty tensor's other dims still shape its arrays
    if span > MAX_WEIGHTS:
        raise SourceError(f"{path}: tensor {name!r} has dims {ne}: {span} weights, more than any file holds")
    return math.prod(ne) // block * size


# --- the source -------------------------------------------------------------------------------
