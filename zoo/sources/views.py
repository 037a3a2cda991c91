"""Source views: sources made of other sources, with the same protocol (``keys``, ``info``, ``read``).

    JoinedSource(source, joins)     stored parts presented as one joined tensor (``names.Join``: GLM's
                                    ``attn_kv_b`` from llama.cpp's ``attn_k_b`` + ``attn_v_b``)
    MixedSource(parts)              each parameter from the first part whose ``select`` takes it
                                    (routed experts from a GGUF as stored, the rest from the original
                                    checkpoint); each part keeps its own name map (``.names``)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from zoo.formats.dequant import dequantize
from zoo.sources.base import SourceError
from zoo.sources.names import Join, NameMap, Target


@dataclass(frozen=True)
class JoinedTensorInfo:
    """A joined tensor: float32 of ``shape``, made from ``parts`` (stored in ``file``)."""

    shape: tuple[int, ...]
    parts: tuple[str, ...]
    file: Path | None
    dtype: np.dtype = np.dtype(np.float32)
    quantized: bool = False


class JoinedSource:
    """``inner`` with the ``joins`` applied: each join's parts are hidden and its joined tensor shows
    up in their place (dequantized bit-exactly and combined in float32 when read)."""

    def __init__(self, inner, joins: tuple[Join, ...]):
        self.inner = inner
        present = set(inner.keys())
        self._joined: dict[str, tuple[Join, tuple[str, ...]]] = {}
        hidden: dict[str, str | None] = {}                # first part -> joined name; other parts -> None
        for key in inner.keys():
            for join in joins:
                hit = join.match(key)
                if hit is None or hit[0] in present:
                    continue
                name, parts = hit
                missing = [p for p in parts if p not in present]
                if missing:
                    raise SourceError(f"{self._file(key)}: tensor {key!r} needs {missing[0]!r} to make "
                                      f"{name!r}, and the file has no such tensor")
                self._joined[name] = (join, parts)
                hidden.update(dict.fromkeys(parts[1:]))
                hidden[parts[0]] = name
        self._keys = [hidden.get(k, k) for k in inner.keys() if hidden.get(k, k) is not None]
        self._key_set = set(self._keys)
        self._info = {name: self._joined_info(name) for name in self._joined}

    def _file(self, key: str) -> str:
        return str(getattr(self.inner.info(key), "file", "") or self.inner)

    def _joined_info(self, name: str) -> JoinedTensorInfo:
        join, parts = self._joined[name]
        try:
            shape = join.combine.shape(*(tuple(self.inner.info(p).shape) for p in parts))
        except ValueError as e:
            raise SourceError(f"{self._file(parts[0])}: tensors {', '.join(map(repr, parts))} cannot make "
                              f"{name!r}: {e}") from None
        return JoinedTensorInfo(tuple(shape), parts, getattr(self.inner.info(parts[0]), "file", None))

    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._key_set

    def info(self, key: str):
        return self._info[key] if key in self._info else self.inner.info(key)

    def _float(self, key: str) -> np.ndarray:
        info, data = self.inner.info(key), self.inner.read(key)
        return dequantize(data, info.qtype) if getattr(info, "quantized", False) else data.astype(np.float32)

    def read(self, key: str, index=()) -> np.ndarray:
        if key not in self._joined:
            return self.inner.read(key, index)
        join, parts = self._joined[key]
        return join.combine.fn(*(self._float(p) for p in parts))[index]


def joined(source, name_map: NameMap):
    """``source`` with the joins of ``name_map`` applied (itself when the map has none)."""
    return JoinedSource(source, name_map.joins) if name_map.joins else source


# --- mixing sources ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """One source of a mixed load: ``select(parameter path)`` says which parameters it provides."""

    name: str
    source: object
    names: NameMap
    select: Callable[[str], bool]


class MixedNames:
    """The name map of a ``MixedSource``: each key resolved by the map of the part it came from."""

    def __init__(self, owner: dict[str, Part]):
        self._owner = owner

    def resolve(self, key: str) -> Target | None:
        return self._owner[key].names.resolve(key)

    def ignored(self, key: str) -> bool:
        return self._owner[key].names.ignored(key)


class MixedSource:
    """The keys of several parts (the last one the base checkpoint): a key belongs to its part when
    that part's map resolves it to a parameter the part selects and no earlier part selects; the
    base part also keeps the keys its map does not resolve (so they are reported as unused)."""

    def __init__(self, parts: list[Part]):
        self.parts = parts
        self._owner: dict[str, Part] = {}
        for i, part in enumerate(parts):
            for key in part.source.keys():
                hit = part.names.resolve(key)
                if hit is None and i < len(parts) - 1:
                    continue
                if hit is not None and (not part.select(hit.path) or any(p.select(hit.path) for p in parts[:i])):
                    continue
                if key in self._owner:
                    raise SourceError(f"tensor {key!r} is in both the {self._owner[key].name} and the "
                                      f"{part.name}")
                self._owner[key] = part
        for part in parts[:-1]:
            if part not in self._owner.values():
                raise SourceError(f"the {part.name} provides none of the parameters it is meant to")

    @property
    def names(self) -> MixedNames:
        """The name map to fill from this source with."""
        return MixedNames(self._owner)

    def keys(self) -> list[str]:
        return list(self._owner)

    def __contains__(self, key: str) -> bool:
        return key in self._owner

    def info(self, key: str):
        return self._part(key).source.info(key)

    def read(self, key: str, index=()) -> np.ndarray:
        return self._part(key).source.read(key, index)

    def _part(self, key: str) -> Part:
        try:
            return self._owner[key]
        except KeyError:
            raise SourceError(f"no tensor {key!r} in the mixed source") from None
