"""Safetensors source: a checkpoint directory (one file, or shards with their index), read lazily.

Implements the weight-source contract (``zoo.sources.base.WeightSource``).

Files are memory-mapped; a read touches only the bytes of the requested slice, so the host never
holds more than one tensor (slice) at a time. The header (8-byte little-endian length + JSON) is
parsed here rather than through ``safetensors.safe_open`` because numpy cannot represent BF16 or
FP8 there; ``ml_dtypes`` supplies those dtypes. Every header is validated on open, and every
problem raises ``SourceError`` naming the file and the tensor.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from zoo.sources.base import SourceError, TensorInfo

INDEX_NAME = "model.safetensors.index.json"

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(bool),
}


@dataclass(frozen=True)
class _Entry:
    path: Path
    info: TensorInfo
    offset: int  # absolute byte offset of the tensor in its file


def read_header(path: Path) -> dict[str, _Entry]:
    """Parse and validate one safetensors file's header -> {name: entry}."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SourceError(f"{path}: too short to be a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100 * 2**20:
            raise SourceError(f"{path}: corrupt safetensors header (claims {n} header bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SourceError(f"{path}: corrupt safetensors header ({e})") from None
    data_start, data_len = 8 + n, size - 8 - n
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[meta["dtype"]]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except KeyError as e:
            raise SourceError(f"{path}: tensor {name!r} has unsupported dtype or missing field {e}") from None
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not (0 <= begin <= end <= data_len) or end - begin != expected:
            raise SourceError(f"{path}: tensor {name!r} has corrupt offsets {begin}..{end} "
                              f"(needs {expected} bytes of {data_len})")
        entries[name] = _Entry(path, TensorInfo(dtype, shape), data_start + begin)
    return entries


class SafetensorsSource:
    """All tensors of a checkpoint directory (or one ``.safetensors`` file)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_file():
            files = [path]
        elif (path / INDEX_NAME).is_file():
            files = self._shards_from_index(path)
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise SourceError(f"{path}: no *.safetensors files")
        self.files = files
        self._entries: dict[str, _Entry] = {}
        for f in files:
            for name, entry in read_header(f).items():
                if name in self._entries:
                    raise SourceError(f"tensor {name!r} appears in both {self._entries[name].path} and {f}")
                self._entries[name] = entry

    @staticmethod
    def _shards_from_index(path: Path) -> list[Path]:
        index_path = path / INDEX_NAME
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SourceError(f"{index_path}: not a valid safetensors index ({e})") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise SourceError(f"{path}: missing shard(s) named in {INDEX_NAME}: {', '.join(missing)}")
        return [path / s for s in shards]

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def info(self, key: str) -> TensorInfo:
        return self._entry(key).info

    def read(self, key: str, index=()) -> np.ndarray:
        """The tensor ``key`` (or ``tensor[index]``) as an in-memory numpy array."""
        e = self._entry(key)
        if 0 in e.info.shape:
            return np.zeros(e.info.shape, e.info.dtype)[index]
        mm = np.memmap(e.path, dtype=e.info.dtype, mode="r", offset=e.offset, shape=e.info.shape or (1,))
        return np.array(mm.reshape(e.info.shape)[index])

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise SourceError(f"no tensor {key!r} in {', '.join(str(f) for f in self.files)}") from None
