"""Storage: what each parameter holds, decided per tensor from its own type and the recipe.

A storage function has the signature ``fill_from_source`` calls (``zoo.loader.fill``)::

    store(source, key, transform, want, path) -> jax.Array | QArray     with .shape == want.shape

``transform`` comes from the name map (a ``TRANSFORMS`` name or a ``Transform``); ``want`` is the
abstract parameter (shape, dtype). The rules:

* a **quantized** source tensor whose parameter is a matrix in the matmul layout (its transform's
  ``LayoutTransform.matmul``: stored ``[*lead, out, in]``, parameter ``[*lead, in, out]``) becomes a
  ``QArray`` of its own ggml type; a head permutation of its rows is applied to the blocks, one of
  its columns becomes the QArray's ``in_order``;
* any other quantized tensor (an embedding table, read by row) is dequantized bit-exactly;
* a **float** tensor is stored dense in the parameter dtype, unless the recipe quantizes it
  (``quantizing_store``: gguf's own quantizer, e.g. Q8_0, for matmul-layout matrices whose rows
  are whole blocks).

Storage never looks at a tensor's name: only at its type, its layout transform and its shape.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from gguf import quants as gq

from zoo.formats.dequant import dequantize, dequantize_as
from zoo.formats.ggml import BLOCK_LAYOUTS, QType
from zoo.formats.host_arrays import aligned_empty, to_device
from zoo.quant.qarray import QArray
from zoo.sources.base import SourceError
from zoo.sources.names import Transform, apply_transform, layout_transform

Store = Callable[..., "jax.Array | QArray"]


def cast(array: np.ndarray, dtype) -> np.ndarray:
    """``array.astype(dtype)`` into an aligned array (``to_device`` then takes it without a copy)."""
    out = aligned_empty(array.shape, dtype)
    np.copyto(out, array, casting="unsafe")
    return out


def _is_quantized(info) -> bool:
    return bool(getattr(info, "quantized", False))


def _where(source, key: str) -> str:
    """``"{file}: tensor 'name'"`` (the file when the source's info knows it)."""
    file = getattr(source.info(key), "file", None)
    return f"{file}: tensor {key!r}" if file else f"tensor {key!r}"


def _check(value, source, key: str, want, path: str, transform):
    if tuple(value.shape) != tuple(want.shape):
        raise SourceError(f"{_where(source, key)} has shape {tuple(source.info(key).shape)}; parameter "
                          f"{path} needs {tuple(want.shape)} (after layout transform {transform!r})")
    return value


def dense_value(source, key: str, transform, want, path: str) -> jax.Array:
    """The tensor as a dense array in the parameter dtype (quantized types dequantized bit-exactly)."""
    info = source.info(key)
    array = source.read(key)
    if _is_quantized(info) and transform is None:         # straight to the dtype, a chunk at a time
        return to_device(_check(dequantize_as(array, info.qtype, want.dtype), source, key, want, path, transform))
    if _is_quantized(info):
        array = dequantize(array, info.qtype)
    array = _check(apply_transform(transform, array), source, key, want, path, transform)
    return to_device(cast(array, want.dtype))


def qarray_value(source, key: str, transform, want, path: str, data=None, qtype=None) -> QArray:
    """A matmul-layout matrix as a QArray (``data``/``qtype`` override the source's own blocks)."""
    info = source.info(key)
    data = source.read(key) if data is None else data
    qtype = info.qtype if qtype is None else qtype
    heads = transform.heads if isinstance(transform, Transform) else None
    in_order = None
    if heads is not None:
        rows_axis, cols_axis = len(info.shape) - 2, len(info.shape) - 1
        if heads.axis == rows_axis:
            data = np.take(data, heads.index(data.shape[rows_axis]), axis=rows_axis)
        elif heads.axis == cols_axis:
            in_order = heads.as_view(info.shape[cols_axis])
            if in_order is None:
                raise SourceError(f"{_where(source, key)}: its head order {heads} does not span the "
                                  f"whole input axis, which a quantized weight cannot keep")
        else:
            raise SourceError(f"{_where(source, key)}: a head order on axis {heads.axis} of a stacked "
                              f"quantized tensor is not supported")
    return _check(QArray.from_blocks(data, qtype, in_order), source, key, want, path, transform)


def _matmul_matrix(info, transform) -> bool:
    return layout_transform(transform).matmul and len(info.shape) >= 2


def as_stored(source, key: str, transform, want, path: str):
    """Quantized matrices as QArrays of their own type, everything else dense (see module doc)."""
    info = source.info(key)
    if _is_quantized(info) and _matmul_matrix(info, transform):
        return qarray_value(source, key, transform, want, path)
    return dense_value(source, key, transform, want, path)


def quantizing_store(qtype: QType) -> Store:
    """Float matmul matrices quantized to ``qtype`` by gguf's quantizer at load; quantized source
    tensors as stored; everything else dense."""
    block = BLOCK_LAYOUTS[qtype].block_size

    def store(source, key: str, transform, want, path: str):
        info = source.info(key)
        if _is_quantized(info) or not _matmul_matrix(info, transform) or info.shape[-1] % block:
            return as_stored(source, key, transform, want, path)
        blocks = gq.quantize(source.read(key).astype(np.float32), qtype)   # in stored order, as llama.cpp would
        return qarray_value(source, key, transform, want, path, data=blocks, qtype=qtype)

    return store


def dequantized_store(source, key: str, transform, want, path: str) -> jax.Array:
    """Every tensor dense in the parameter dtype (quantized ones dequantized at load)."""
    return dense_value(source, key, transform, want, path)


def dense_store(source, key: str, transform: str | None, want: jax.ShapeDtypeStruct, path: str):
    """Default storage: read the tensor, bring it to the parameter layout, cast to its dtype.

    A storage function decides what a parameter holds (a dense array here; ``QArray`` planes or
    int8 + scales in the quantized recipes). Its result must have ``.shape == want.shape``.
    """
    array = apply_transform(transform, source.read(key))
    if array.shape != want.shape:
        raise SourceError(f"tensor {key!r} has shape {tuple(source.info(key).shape)}; parameter "
                          f"{path} needs {want.shape} (after layout transform {transform!r})")
    return to_device(cast(array, want.dtype))
