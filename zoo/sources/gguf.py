"""GGUF source: one ``.gguf`` file or a split set, memory-mapped, read lazily per tensor.

Implements the weight-source contract (``zoo.sources.base.WeightSource``)::

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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES

from zoo.formats.ggml import QType
from zoo.sources.base import SourceError
from zoo.sources.gguf_header import SPLIT_KEYS, SPLIT_NAME, check_header
from zoo.sources.remote import RemoteGGUF, is_remote

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
