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
range requests: the headers when it opens, then the bytes each ``read`` touches. Every header is parsed and
validated by ``parse_header`` (``zoo.sources.gguf_header``), so corrupt or truncated files raise
``SourceError`` naming the file (and the tensor or key), and opening a file reads its header's bytes only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from gguf.constants import GGML_QUANT_SIZES

from zoo.formats.ggml import QType
from zoo.formats.host_arrays import large_for_host, read_into
from zoo.sources.base import SourceError
from zoo.sources.gguf_header import SPLIT_KEYS, SPLIT_NAME, parse_header
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


def _open_shard(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    """Validate and parse one file's header (``parse_header``) -> (metadata, {name: info})."""
    if not path.is_file():
        raise SourceError(f"{path}: no such GGUF file")
    if path.stat().st_size == 0:
        raise SourceError(f"{path}: empty file, not a GGUF file")
    mm = np.memmap(path, mode="r")
    try:
        header = parse_header(path, memoryview(mm))
    finally:
        del mm
    tensors = {t.name: GGUFTensorInfo(t.qtype, tuple(int(d) for d in reversed(t.ne)), path, t.offset, t.nbytes)
               for t in header.tensors}
    return header.metadata, tensors


def _basic(index: tuple) -> bool:
    """``index`` is ints, slices and ``...`` only (a view, no gather)."""
    return all(isinstance(i, (int, np.integer, slice)) or i is Ellipsis for i in index)


def _touched(array: np.ndarray, index: tuple) -> tuple[int, int]:
    """Byte range [lo, hi) of ``array`` (a view from its first byte) that ``array[index]`` reads:
    exact for ints and slices, the whole array for other (advanced) indices."""
    if not _basic(index):
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
        # a model large for this host: the page cache's copy of what is read is dropped (host_arrays)
        self._drop_reads = self.remote is None and large_for_host(sum(f.stat().st_size for f in self.files))

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
        """``tensor[index]`` in numpy order (see the module docstring): a selection that is one byte range
        is read with ``os.preadv`` into an aligned buffer (``zoo.formats.host_arrays``), any other is
        copied out of the memory map."""
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
            view = array[index]
            lo, hi = _touched(array, index)
        except IndexError as e:
            raise SourceError(f"{info.file}: tensor {key!r} of shape {info.shape}: bad index {index} ({e})") from None
        if self.remote is not None:
            self.remote.ensure(info.file, info.offset + lo, info.offset + hi)
        elif _basic(index) and view.flags.c_contiguous and view.nbytes == hi - lo and view.nbytes:   # one range
            try:
                return read_into(info.file, info.offset + lo, hi - lo, self._drop_reads).view(info.dtype).reshape(
                    view.shape)
            except OSError as e:
                raise SourceError(f"{info.file}: tensor {key!r}: {e}") from None
        return np.array(view)

    # -- metadata -------------------------------------------------------------------------------
    def arch_value(self, name: str, default: Any = ...) -> Any:
        """Metadata ``{architecture}.{name}``; ``SourceError`` if absent and no default is given."""
        key = f"{self.architecture}.{name}"
        if key in self.metadata:
            return self.metadata[key]
        if default is ...:
            raise SourceError(f"{self.files[0]}: GGUF metadata has no {key!r}")
        return default
