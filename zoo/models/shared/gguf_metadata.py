"""Helpers for reading an architecture's GGUF metadata into HF config fields
(``zoo.models.<arch>.gguf_config``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from zoo.sources.base import SourceError


def f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (9.99999997e-07 -> 1e-06)."""
    return float(str(np.float32(value)))


def one(value: Any, what: str) -> Any:
    """A per-layer array whose non-zero entries agree -> that value; a scalar -> itself."""
    if not isinstance(value, list):
        return value
    distinct = {v for v in value if v}
    if len(distinct) != 1:
        raise SourceError(f"{what} differs between layers ({value}); the config needs one value")
    return distinct.pop()


def as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]
