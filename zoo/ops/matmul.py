"""The one entry point every linear layer calls: ``matmul(x, w)``.

A dense weight (a jax array ``[in, out]``) goes to ``jnp.dot``. Any other stored weight type
(``QArray`` planes, int8 with scales, ...) registers its implementation with ``register_matmul``;
the model files never look at the storage format.

Precision follows the data: float32 operands use ``Precision.HIGHEST`` (true f32 on TPU/GPU, where
the default would round to bf16 / TF32); lower-precision operands accumulate in float32.

Every implementation that decodes a weight in XLA before its product (the jnp kernels and
whole-weight dequantizing in ``zoo.kernels``, int8 off the TPU in ``zoo.quant.int8``) first passes
``(x, w)`` through ``decode_after``: the decode cannot be scheduled before the layer's input exists,
so a whole-model program holds about one layer's decoded weights at a time, not every layer's (XLA
would otherwise hoist every decode to the start: 1.006x the bf16 size of all matmul weights in
temporaries on a 27B model). A kernel that reads the stored weight itself (Pallas on TPU, Triton on
GPU) needs no barrier and gets none.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from zoo.sharding.mesh import current_mesh

# stored-weight type -> fn(x [..., in], w, out_dtype) -> [..., out]
_MATMUL_IMPLS: dict[type, Callable] = {}


def register_matmul(weight_type: type):
    """Decorator: ``fn(x, w, out_dtype)`` computes ``x @ w`` for weights of ``weight_type``."""
    def deco(fn):
        _MATMUL_IMPLS[weight_type] = fn
        return fn
    return deco


def precision_for(dtype) -> jax.lax.Precision:
    """HIGHEST for float32 operands, DEFAULT otherwise."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def decode_after(x: jax.Array, w):
    """``(x, w)`` through one ``jax.lax.optimization_barrier``: whatever is computed from the returned
    ``w`` (its decode) waits for ``x``. A no-op on values; ``w`` may be any pytree of arrays."""
    return jax.lax.optimization_barrier((x, w))


def dense_matmul(x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
    w = w.astype(x.dtype) if w.dtype != x.dtype else w
    out = jnp.dot(x, w, precision=precision_for(x.dtype), preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def matmul(x: jax.Array, w, out_dtype=None, axes=None) -> jax.Array:
    """``x [..., in] @ w [in, out] -> [..., out]``, f32 accumulation, result in ``out_dtype``
    (default ``x.dtype``). ``w`` is a dense array or any registered stored-weight type; on a device
    mesh a stored weight is computed per device on its shards, given its logical ``axes``
    (``zoo.sharding.shard_ops``; XLA partitions the dense product itself)."""
    impl = _MATMUL_IMPLS.get(type(w), dense_matmul)
    mesh = current_mesh() if impl is not dense_matmul else None
    if mesh is not None:
        from zoo.sharding.shard_ops import sharded_matmul
        return sharded_matmul(impl, mesh, x, w, out_dtype or x.dtype, axes)
    return impl(x, w, out_dtype or x.dtype)


def einsum(spec: str, *operands: jax.Array) -> jax.Array:
    """``jnp.einsum`` with the same precision rule, accumulating in f32, result in the first dtype."""
    dtype = operands[0].dtype
    out = jnp.einsum(spec, *operands, precision=precision_for(dtype), preferred_element_type=jnp.float32)
    return out.astype(dtype)
