"""FP8 block-scaled checkpoints (GLM-5 / DeepSeek-V3 style): e4m3 weights with 128x128 block scales.

A weight ``W`` stored as ``float8_e4m3fn [rows, cols]`` comes with ``W_scale_inv`` (float32 or bf16,
``[ceil(rows/128), ceil(cols/128)]``; the last block of a dimension that is not a multiple of 128 is
partial); the real weight is ``W * scale_inv`` block by block. ``Fp8Dequantized`` wraps any source
(the protocol of ``zoo.sources.safetensors``): such weights read as float32 and the ``*_scale_inv``
tensors are hidden, so name maps and storage functions never see them. Leading axes (stacked
experts) share the block layout of the last two.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from zoo.sources.base import SourceError, TensorInfo

BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn),)


def dequantize_blocks(w: np.ndarray, scale_inv: np.ndarray, block: int = BLOCK, name: str = "?") -> np.ndarray:
    """float32 ``w * scale_inv`` with one scale per ``block x block`` tile of the last two axes."""
    rows, cols = w.shape[-2:]
    want = w.shape[:-2] + (-(-rows // block), -(-cols // block))
    if tuple(scale_inv.shape) != want:
        raise SourceError(f"tensor {name + SCALE_SUFFIX!r} has shape {tuple(scale_inv.shape)}; the "
                          f"{block}x{block} block scales of {name!r} {tuple(w.shape)} need {want}")
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), block, axis=-2), block, axis=-1)
    return w.astype(np.float32) * scale[..., :rows, :cols]


class Fp8Dequantized:
    """A source view in which block-scaled FP8 weights read as float32 and their scales are hidden."""

    def __init__(self, inner, block: int = BLOCK):
        self.inner = inner
        self.block = block
        keys = inner.keys()
        present = set(keys)
        self._scaled = {k for k in keys if k + SCALE_SUFFIX in present}
        hidden = {k + SCALE_SUFFIX for k in self._scaled}
        self._keys = [k for k in keys if k not in hidden]
        for k in self._keys:
            if inner.info(k).dtype in FP8_DTYPES and k not in self._scaled:
                raise SourceError(f"FP8 tensor {k!r} has no {k + SCALE_SUFFIX!r} block scales")

    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def info(self, key: str) -> TensorInfo:
        info = self.inner.info(key)
        return TensorInfo(np.dtype(np.float32), info.shape) if key in self._scaled else info

    def read(self, key: str, index=()) -> np.ndarray:
        """The tensor (float32 if block-scaled FP8), or ``tensor[index]``; an index of slices reads
        only the whole scale blocks it touches."""
        if key not in self._scaled:
            return self.inner.read(key, index)
        shape = self.inner.info(key).shape
        index = index if isinstance(index, tuple) else (index,)
        if not index or not all(isinstance(i, slice) and i.step in (None, 1) for i in index):
            w = dequantize_blocks(self.inner.read(key), self.inner.read(key + SCALE_SUFFIX), self.block, key)
            return w[index]
        index = index + (slice(None),) * (len(shape) - len(index))
        bounds = [i.indices(d)[:2] for i, d in zip(index, shape)]
        lead = tuple(slice(a, b) for a, b in bounds[:-2])
        blocks = [(a // self.block, -(-b // self.block)) for a, b in bounds[-2:]]
        w = self.inner.read(key, lead + tuple(slice(a * self.block, b * self.block) for a, b in blocks))
        scale = self.inner.read(key + SCALE_SUFFIX, lead + tuple(slice(a, b) for a, b in blocks))
        w = dequantize_blocks(w, scale, self.block, key)
        return w[(...,) + tuple(slice(a - k * self.block, b - k * self.block)
                                for (a, b), (k, _) in zip(bounds[-2:], blocks))]
