"""The one entry point every linear layer calls: ``matmul(x, w)``.

A dense weight goes to ``jnp.dot``; quantized weights (QArray) are dispatched to the kernels in
``zoo.kernels`` when they land. Weights are stored ``[in, out]``.

Precision follows the data: float32 operands use ``Precision.HIGHEST`` (true f32 on TPU/GPU, where
the default would round to bf16 / TF32); lower-precision operands accumulate in float32 and return
in the activation dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def precision_for(dtype) -> jax.lax.Precision:
    """HIGHEST for float32 operands, DEFAULT otherwise."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def matmul(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """``x [..., in] @ w [in, out] -> [..., out]``, f32 accumulation, result in ``out_dtype``
    (default ``x.dtype``)."""
    w = w.astype(x.dtype) if w.dtype != x.dtype else w
    out = jnp.dot(x, w, precision=precision_for(x.dtype), preferred_element_type=jnp.float32)
    return out.astype(out_dtype or x.dtype)


def einsum(spec: str, *operands: jax.Array) -> jax.Array:
    """``jnp.einsum`` with the same precision rule, accumulating in f32, result in the first dtype."""
    dtype = operands[0].dtype
    out = jnp.einsum(spec, *operands, precision=precision_for(dtype), preferred_element_type=jnp.float32)
    return out.astype(dtype)
