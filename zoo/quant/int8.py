"""int8 weight-only storage: one float32 scale per output channel (``zoo.load(..., quant="int8")``).

``Int8Weight`` holds ``q int8 [..., in, out]`` and ``scale f32 [..., out]`` with ``w ~= q * scale``
(symmetric, ``scale = max|w| / 127`` over the input axis). It is a pytree, so a parameter can hold it,
and it registers with ``zoo.ops.matmul`` (linear layers) and ``zoo.ops.moe`` (expert banks
``[E, in, out]``, one scale per expert and output channel). ``int8_store`` is the storage function
for ``fill_from_source``: matmul weights (by their layout transform, ``LayoutTransform.matmul``) become
``Int8Weight``; norms, embeddings, routers, decays and the like stay dense.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from zoo.ops.matmul import decode_after, dense_matmul, register_matmul
from zoo.ops.moe import dense_moe, register_moe
from zoo.quant.storage import as_stored, dense_store
from zoo.sharding.mesh import ShardingRule, partition_spec, register_sharding
from zoo.sources.names import layout_transform


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    q: jax.Array        # int8 [..., in, out]
    scale: jax.Array    # float32 [..., out]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    def dequantize(self, dtype) -> jax.Array:
        return (self.q.astype(jnp.float32) * self.scale[..., None, :]).astype(dtype)


def quantize_int8(w: jax.Array) -> Int8Weight:
    """Symmetric per-output-channel int8 of ``w [..., in, out]`` (computed in f32)."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=-2)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w / scale[..., None, :]), -127, 127).astype(jnp.int8)
    return Int8Weight(q=q, scale=scale)


def _after_input(x: jax.Array, w):
    """``decode_after(x, w)`` where the int8 codes are converted by a separate op (CPU, GPU: without the
    barrier XLA converts every layer's codes up front); on the TPU, XLA fuses the conversion into the
    matmul's operand and the barrier only costs (2% of GLM-5.3-Flash's v5e decode step, XLA's estimate)."""
    from zoo.kernels.dispatch import backend_of, current_policy
    return (x, w) if backend_of(current_policy()) == "tpu" else decode_after(x, w)


@register_matmul(Int8Weight)
def int8_matmul(x: jax.Array, w: Int8Weight, out_dtype) -> jax.Array:
    x, w = _after_input(x, w)
    return (dense_matmul(x, w.q, jnp.float32) * w.scale).astype(out_dtype)


@register_moe(Int8Weight)
def int8_moe(x, weights, ids, gate_bank, up_bank, down_bank, limit):
    """Reference: dequantize the banks (after ``x`` exists: ``_after_input``), then the dense grouped path."""
    x, banks = _after_input(x, (gate_bank, up_bank, down_bank))
    banks = (bank.dequantize(x.dtype) for bank in banks)
    return dense_moe(x, weights, ids, *banks, limit)


def int8_store(source, key: str, transform, want: jax.ShapeDtypeStruct, path: str):
    """``fill_from_source`` storage: matmul weights (the transform's ``LayoutTransform.matmul``) as
    ``Int8Weight``, the rest dense."""
    if not layout_transform(transform).matmul:
        return dense_store(source, key, transform, want, path)
    full = dense_store(source, key, transform, jax.ShapeDtypeStruct(want.shape, jnp.float32), path)
    return quantize_int8(full)


def int8_unless_quantized(source, key: str, transform, want: jax.ShapeDtypeStruct, path: str):
    """Storage: a tensor quantized in its source as stored (``storage.as_stored``: a QArray of its own
    type), a float matmul weight as ``Int8Weight``, the rest dense."""
    if getattr(source.info(key), "quantized", False):
        return as_stored(source, key, transform, want, path)
    return int8_store(source, key, transform, want, path)


# -- sharding (``zoo.sharding.mesh``): q follows the logical spec, the scales its lead and output axes ------


def _scale_spec(spec: PartitionSpec) -> PartitionSpec:
    spec = tuple(spec)
    return PartitionSpec(*spec[:-2], spec[-1])


def _cut(w: Int8Weight, index: tuple) -> Int8Weight:
    return Int8Weight(q=np.asarray(w.q)[index], scale=np.asarray(w.scale)[(*index[:-2], index[-1])])


register_sharding(Int8Weight, ShardingRule(
    logical_spec=lambda w, axes, mesh: partition_spec(axes, w.shape, mesh),
    placement_spec=lambda w, axes, shape, mesh: partition_spec(axes, tuple(shape), mesh),
    leaf_specs=lambda w, spec: [spec, _scale_spec(spec)],
    cut=_cut,
    assemble=lambda w, shape, spec, mesh: Int8Weight(
        q=jax.ShapeDtypeStruct(tuple(shape), jnp.int8),
        scale=jax.ShapeDtypeStruct(tuple(shape[:-2]) + tuple(shape[-1:]), jnp.float32)),
    local=lambda w, leaves, spec, mesh: Int8Weight(*leaves)))
