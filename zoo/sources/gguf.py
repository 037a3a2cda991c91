"""GGUF source: one ``.gguf`` file or a split set, memory-mapped, read lazily per tensor.

Implements the source protocol shared by every weight source (DESIGN.md, "Sources")::

    keys() -> list[str]                      tensor names, in file order (shard after shard)
    info(key) -> GGUFTensorInfo              ggml type, element shape, where the bytes are
    read(key, index=()) -> np.ndarray        the tensor, or ``tensor[index]`` along leading axes

Shapes are in **numpy order**, the reverse of ggml's ``ne`` (``output.weight`` with ``ne = [D, V]``
is ``(V, D)`` here): a matrix is ``[out, in]`` like a torch Linear weight, stacked experts are
``[E, out, in]``. ``read`` returns float types as arrays of their dtype (BF16 as
``ml_dtypes.bfloat16``) and quantized types as their raw blocks, ``uint8 [*shape[:-1], row_bytes]``
(each row whole: the layout ``gguf.quants.dequantize`` takes). ``index`` selects along the leading
axes only (one expert, a range of rows), and only those bytes are touched.

Split sets (``name-00001-of-00003.gguf``, as written by ``gguf-split`` and ``GGUFWriter``): any
shard opens the whole set; the metadata is the first shard's. A remote reference
(``hf://OWNER/REPO[@REV]/PATH.gguf`` or an ``https://`` URL, ``zoo.sources.remote``) is read with HTTP
range requests: the headers when it opens, then the bytes each ``read`` touches. Every header is validated by
``check_header`` before ``gguf.GGUFReader`` parses it, so corrupt or truncated files raise
``SourceError`` naming the file (and the tensor or key) instead of crashing or hanging the
reader (which loops forever on an array whose length runs past the end of the file).
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUFValueType

from zoo.formats.ggml import QType
from zoo.sources.base import SourceError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4
MAX_ARRAY_NESTING = 2
SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")

_SCALAR_SIZES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
                 GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4,
                 GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.UINT64: 8,
                 GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}
# Smallest encoding of one array element of each kind (a string is at least its u64 length, an
# array at least its u32 type and u64 length): bounds the element count by the bytes left.
_MIN_SIZES = {**_SCALAR_SIZES, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
# ggml float types -> numpy dtype of ``read``; every other type is read as its raw blocks.
FLOAT_DTYPES = {QType.F32: np.dtype(np.float32), QType.F16: np.dtype(np.float16),
                QType.BF16: np.dtype(ml_dtypes.bfloat16), QType.F64: np.dtype(np.float64),
                QType.I8: np.dtype(np.int8), QType.I16: np.dtype(np.int16),
                QType.I32: np.dtype(np.int32), QType.I64: np.dtype(np.int64)}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor: ggml type, element shape in numpy order, and its bytes in ``file``."""

    qtype: QType
    shape: tuple[int, ...]
    file: Path
    offset: int    # absolute byte offset in ``file``
    nbytes: int

    @property
    def quantized(self) -> bool:
        return self.qtype not in FLOAT_DTYPES

    @property
    def dtype(self) -> np.dtype:
        """The dtype ``read`` returns: the float type's own, ``uint8`` blocks for quantized types."""
        return FLOAT_DTYPES.get(self.qtype, np.dtype(np.uint8))

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape ``read`` returns: ``shape``, with the last axis in bytes for quantized types."""
        if not self.quantized:
            return self.shape
        block, size = GGML_QUANT_SIZES[self.qtype]
        return (*self.shape[:-1], self.shape[-1] // block * size)


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

    def skip_value(self, vtype: GGUFValueType, what: str, depth: int = 0) -> None:
        if vtype in _SCALAR_SIZES:
            self.take(_SCALAR_SIZES[vtype], what)
        elif vtype == GGUFValueType.STRING:
            self.take(self.u64(f"the length of {what}"), what)
        else:  # ARRAY
            if depth >= MAX_ARRAY_NESTING:
                raise SourceError(f"{self.path}: {what} nests arrays deeper than {MAX_ARRAY_NESTING}")
            itype = self.value_type(f"the elements of {what}")
            count = self.u64(f"the length of {what}")
            if count * _MIN_SIZES[itype] > self.remaining():
                raise SourceError(f"{self.path}: {what} claims {count} elements, more than the "
                                  f"{self.remaining()} bytes left in the file")
            if itype in _SCALAR_SIZES:
                self.take(count * _SCALAR_SIZES[itype], what)
            else:
                for _ in range(count):
                    self.skip_value(itype, what, depth + 1)


def check_header(path: Path, data: memoryview) -> int:
    """Validate a whole GGUF header and the byte range of every tensor; raise ``SourceError``.
    Returns where the tensor data starts (the header's end, aligned).

    Checks: magic, version (2 or 3, little-endian), every key/value (known value types, lengths
    inside the file, no duplicate keys, ``general.alignment`` a power of two), every tensor info
    (UTF-8 name, no duplicates, 1..4 dims, a known ggml type, rows a whole number of blocks, data
    aligned and inside the file). Runs in time linear in the header size.
    """
    cur = _Cursor(path, data)
    if bytes(cur.take(4, "the magic")) != MAGIC:
        raise SourceError(f"{path}: not a GGUF file (bad magic {bytes(data[:4])!r})")
    version = cur.u32("the version")
    if version not in VERSIONS:
        raise SourceError(f"{path}: unsupported GGUF version {version} (supported: {VERSIONS}; "
                          f"big-endian files are not supported)")
    n_tensors, n_kv = cur.u64("the tensor count"), cur.u64("the key/value count")
    alignment, keys = GGUF_DEFAULT_ALIGNMENT, set()
    for i in range(n_kv):
        key = cur.string(f"key #{i}")
        if key in keys:
            raise SourceError(f"{path}: duplicate metadata key {key!r}")
        keys.add(key)
        vtype = cur.value_type(f"key {key!r}")
        if key == "general.alignment":
            if vtype != GGUFValueType.UINT32:
                raise SourceError(f"{path}: general.alignment must be a UINT32, not {vtype.name}")
            alignment = cur.u32("general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise SourceError(f"{path}: general.alignment {alignment} is not a power of two")
        else:
            cur.skip_value(vtype, f"the value of key {key!r}")
    tensors, names = [], set()
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor #{i}")
        if name in names:
            raise SourceError(f"{path}: duplicate tensor {name!r}")
        names.add(name)
        n_dims = cur.u32(f"the rank of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise SourceError(f"{path}: tensor {name!r} has {n_dims} dims (1..{MAX_DIMS} allowed)")
        ne = [cur.u64(f"dim {d} of tensor {name!r}") for d in range(n_dims)]
        raw_type = cur.u32(f"the type of tensor {name!r}")
        offset = cur.u64(f"the offset of tensor {name!r}")
        tensors.append((name, ne, raw_type, offset))
    data_start = -(-cur.pos // alignment) * alignment
    for name, ne, raw_type, offset in tensors:
        nbytes = tensor_bytes(path, name, ne, raw_type)
        if offset % alignment:
            raise SourceError(f"{path}: tensor {name!r} is at offset {offset}, not a multiple of "
                              f"the alignment {alignment}")
        end = data_start + offset + nbytes
        if end > len(data):
            raise SourceError(f"{path}: tensor {name!r} needs bytes up to {end}, the file has "
                              f"{len(data)} (truncated?)")
    return data_start


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
    return math.prod(ne) // block * size


# --- the source -------------------------------------------------------------------------------


def shard_paths(path: Path) -> list[Path]:
    """All files of the set ``path`` belongs to (itself alone when it is not a split shard)."""
    m = SPLIT_NAME.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    if count < 1 or not 1 <= int(m["no"]) <= count:
        raise SourceError(f"{path}: shard number {int(m['no'])} of {count} in the file name is impossible")
    paths = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise SourceError(f"{path}: split GGUF set of {count} is missing shard(s): {', '.join(missing)}")
    return paths


def _read_metadata(path: Path, reader: GGUFReader) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as e:
            raise SourceError(f"{path}: metadata key {key!r} cannot be read ({e})") from None
    return meta


def _open_shard(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    """Validate and parse one file -> (metadata, {name: info})."""
    if not path.is_file():
        raise SourceError(f"{path}: no such GGUF file")
    if path.stat().st_size == 0:
        raise SourceError(f"{path}: empty file, not a GGUF file")
    mm = np.memmap(path, mode="r")
    try:
        check_header(path, memoryview(mm))
    finally:
        del mm
    try:
        reader = GGUFReader(path)
    except (ValueError, KeyError, IndexError, OverflowError) as e:  # not expected after check_header
        raise SourceError(f"{path}: GGUF header rejected by gguf's reader ({e})") from None
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = GGUFTensorInfo(t.tensor_type, shape, path, int(t.data_offset), int(t.n_bytes))
    return _read_metadata(path, reader), tensors


def _touched(array: np.ndarray, index: tuple) -> tuple[int, int]:
    """Byte range [lo, hi) of ``array`` (a view from its first byte) that ``array[index]`` reads:
    exact for ints and slices, the whole array for other (advanced) indices."""
    if not all(isinstance(i, (int, np.integer, slice)) or i is Ellipsis for i in index):
        return 0, array.nbytes
    view = array[index]
    if view.size == 0:
        return 0, 0
    lo, hi = np.lib.array_utils.byte_bounds(view)
    base = np.lib.array_utils.byte_bounds(array)[0]
    return lo - base, hi - base


class GGUFSource:
    """All tensors and the metadata of a GGUF file or split set (see the module docstring)."""

    def __init__(self, path: str | Path):
        from zoo.sources.remote import RemoteGGUF, is_remote

        self.remote = RemoteGGUF(path) if is_remote(path) else None
        path = self.remote.path if self.remote is not None else Path(path).expanduser()
        self.files = shard_paths(path)
        self._tensors: dict[str, GGUFTensorInfo] = {}
        first: dict[str, Any] = {}
        for i, shard in enumerate(self.files):
            meta, tensors = _open_shard(shard)
            if meta.get("split.count", 1) != len(self.files) or meta.get("split.no", 0) != i:
                raise SourceError(f"{shard}: split metadata (split.no {meta.get('split.no')}, split.count "
                                  f"{meta.get('split.count')}) does not match shard {i + 1} of "
                                  f"{len(self.files)} by file name")
            first = first or meta
            for name, info in tensors.items():
                if name in self._tensors:
                    raise SourceError(f"tensor {name!r} appears in both {self._tensors[name].file} and {shard}")
                self._tensors[name] = info
        expected = first.get("split.tensors.count", len(self._tensors))
        if expected != len(self._tensors):
            raise SourceError(f"{self.files[0]}: split.tensors.count says {expected} tensors, the "
                              f"{len(self.files)} shard(s) hold {len(self._tensors)}")
        self.metadata: dict[str, Any] = {k: v for k, v in first.items() if k not in SPLIT_KEYS}
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise SourceError(f"{self.files[0]}: no general.architecture in the GGUF metadata")
        self.architecture: str = arch

    def __repr__(self) -> str:
        return f"GGUFSource({', '.join(str(f) for f in self.files)})"

    # -- the source protocol --------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, key: str) -> bool:
        return key in self._tensors

    def info(self, key: str) -> GGUFTensorInfo:
        try:
            return self._tensors[key]
        except KeyError:
            raise SourceError(f"no tensor {key!r} in {', '.join(str(f) for f in self.files)}") from None

    def read(self, key: str, index=()) -> np.ndarray:
        """``tensor[index]`` in numpy order, copied out of the memory map (see the module docstring)."""
        info = self.info(key)
        index = index if isinstance(index, tuple) else (index,)
        if len(index) >= len(info.shape) and info.quantized:
            raise SourceError(f"{info.file}: tensor {key!r} is {info.qtype.name}; an index may select "
                              f"along its leading axes {info.shape[:-1]} only, not inside a row")
        if info.nbytes == 0:
            return np.zeros(info.stored_shape, info.dtype)[index]
        mm = np.memmap(info.file, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
        array = mm.view(info.dtype).reshape(info.stored_shape)
        try:
            if self.remote is not None:
                lo, hi = _touched(array, index)
                self.remote.ensure(info.file, info.offset + lo, info.offset + hi)
            return np.array(array[index])
        except IndexError as e:
            raise SourceError(f"{info.file}: tensor {key!r} of shape {info.shape}: bad index {index} ({e})") from None

    # -- metadata -------------------------------------------------------------------------------
    def arch_value(self, name: str, default: Any = ...) -> Any:
        """Metadata ``{architecture}.{name}``; ``SourceError`` if absent and no default is given."""
        key = f"{self.architecture}.{name}"
        if key in self.metadata:
            return self.metadata[key]
        if default is ...:
            raise SourceError(f"{self.files[0]}: GGUF metadata has no {key!r}")
        return default
