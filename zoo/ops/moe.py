"""The one entry point every mixture-of-experts layer calls: ``moe(x, weights, ids, banks...)``.

Routed experts are stored as stacked banks, ``gate``/``up`` ``[E, D, I]`` and ``down`` ``[E, I, D]``.
A dense bank (a jax array) goes to ``dense_moe``: the (token, expert) slots are sorted by expert and
run as grouped matmuls (``jax.lax.ragged_dot``); any other stored-bank type (``QArray`` planes, int8
with scales, ...) registers its implementation with ``register_moe`` and the model files never look
at the storage format (as ``zoo.ops.matmul`` does for plain linear layers). Under a device mesh
(``jax.set_mesh``) the chosen implementation runs per device on its bank shards.

Every expert is a clamped SwiGLU: ``down(silu(min(gate, L)) * clip(up, -L, L))`` (no clamp when
``limit`` is None; ``zoo.ops.activation.swiglu``).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from zoo.ops.activation import swiglu
from zoo.ops.matmul import precision_for
from zoo.sharding.mesh import current_mesh

# stored-bank type -> fn(x [N, D], weights [N, k], ids [N, k], gate, up, down, limit) -> [N, D]
_MOE_IMPLS: dict[type, Callable] = {}


def register_moe(bank_type: type):
    """Decorator: ``fn(x, weights, ids, gate_bank, up_bank, down_bank, limit)`` for banks of ``bank_type``."""
    def deco(fn):
        _MOE_IMPLS[bank_type] = fn
        return fn
    return deco


def dense_moe(x, weights, ids, gate_bank, up_bank, down_bank, limit):
    """Reference: sort the N*k slots by expert, grouped matmuls, unsort, weighted sum over k.

    x [N, D]; weights [N, k] (f32); ids [N, k] int; banks [E, D, I], [E, D, I], [E, I, D].
    Returns [N, D] in x's dtype (matmuls accumulate in f32).
    """
    n, k = ids.shape
    n_experts = gate_bank.shape[0]
    dtype = x.dtype
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids)
    rows = x[order // k]                                             # [N*k, D], expert-sorted
    sizes = jnp.bincount(flat_ids, length=n_experts).astype(jnp.int32)

    def grouped(lhs, bank):
        out = jax.lax.ragged_dot(lhs, bank.astype(dtype), sizes, precision=precision_for(dtype),
                                 preferred_element_type=jnp.float32)
        return out.astype(dtype)

    h = swiglu(grouped(rows, gate_bank), grouped(rows, up_bank), limit)
    out_sorted = grouped(h, down_bank)                               # [N*k, D]
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(n, k, -1)
    combined = jnp.einsum("nk,nkd->nd", weights.astype(jnp.float32), out.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
    return combined.astype(dtype)


def moe(x, weights, ids, gate_bank, up_bank, down_bank, limit: float | None):
    """``sum_k weights[:, k] * expert_{ids[:, k]}(x)`` for x [N, D] (see module docstring); on a
    device mesh, each device runs its shards of the banks (``zoo.sharding.shard_ops``)."""
    impl = _MOE_IMPLS.get(type(gate_bank), dense_moe)
    mesh = current_mesh()
    if mesh is not None:
        from zoo.sharding.shard_ops import sharded_moe
        return sharded_moe(impl, mesh, x, weights, ids, gate_bank, up_bank, down_bank, limit)
    return impl(x, weights, ids, gate_bank, up_bank, down_bank, limit)
