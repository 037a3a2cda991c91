"""The weight-source contract: what every source of tensors (a file format or a view over others)
provides, and the one error type they raise.

A source is read one tensor (or one slice) at a time, so the host never holds a whole checkpoint::

    keys() -> list[str]                 tensor names, in storage order
    key in source -> bool
    info(key) -> TensorInfo-like        .dtype (numpy / ml_dtypes) and .shape (numpy order); a block-
                                        quantized tensor also has .quantized = True and .qtype (a ggml
                                        ``QType``), and may name its .file
    read(key, index=()) -> np.ndarray   ``tensor[index]``: floats in their dtype; a quantized tensor as
                                        ``uint8 [*lead, rows, row_bytes]`` blocks (an index may select
                                        along the leading axes only)

Implementations: ``SafetensorsSource`` (``zoo.sources.safetensors``), ``GGUFSource``
(``zoo.sources.gguf``, also remote through ``zoo.sources.remote``), and the views
``Fp8Dequantized`` (``zoo.sources.fp8``), ``JoinedSource`` / ``MixedSource``
(``zoo.sources.views``). Every problem with a source (missing file or tensor, corrupt header,
wrong shape) raises ``SourceError`` naming the file and the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


class SourceError(ValueError):
    """A weight source that is missing, corrupt, or does not hold what the model needs."""


@dataclass(frozen=True)
class TensorInfo:
    """A float tensor: its dtype and numpy-order shape."""

    dtype: np.dtype
    shape: tuple[int, ...]


class TensorInfoLike(Protocol):
    @property
    def dtype(self) -> np.dtype: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


@runtime_checkable
class WeightSource(Protocol):
    """See the module docstring."""

    def keys(self) -> list[str]: ...

    def __contains__(self, key: str) -> bool: ...

    def info(self, key: str) -> TensorInfoLike: ...

    def read(self, key: str, index=()) -> np.ndarray: ...
