"""Stored weights on a device mesh: each device computes with its own shards (``shard_map``), then
one all-reduce where the split was along a contracted axis (docs/reference.md section 4).

Dense weights need none of this: XLA partitions ``jnp.dot`` by the weights' shardings. A stored
weight type (QArray planes, int8 + scales) is computed by its registered implementation, which may
be a Pallas kernel, an opaque call XLA cannot partition: here it runs per device on local weights
rebuilt from the local leaves (``ShardingRule.local``). ``check_vma`` is off: Pallas kernels do not
declare how their outputs vary over the mesh; every output here is made uniform by construction
(a ``psum``, or the out spec names the split).

``sharded_matmul``  ``x [..., in] @ w [in, out]``: split over ``out`` (column-parallel) gives the
                    output split the same way; split over ``in`` (row-parallel) takes ``x`` split
                    along its last axis and sums the partial products (float32 ``psum``).
``sharded_moe``     routed experts: experts over ``ep``, the expert width ``I`` over ``tp`` (gate/up
                    by output rows, down by input blocks). A device sees its ``E_l`` experts at width
                    ``I_l``; a (token, expert) slot routed to another device's expert becomes local
                    expert 0 with weight 0, which the kernels treat as no slot (no expert is read for
                    it; a device without slots runs no kernel); the down projection of a width
                    slice is a partial sum; one ``psum``
                    over the splitting axes. Tokens are not dispatched: every device sees all N.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from zoo.sharding.mesh import sharding_rule

# moe() contract: gate/up [E, D, I], down [E, I, D]
BANK_AXES = (("experts", "embed", "mlp"), ("experts", "embed", "mlp"), ("experts", "mlp", "embed"))


def _local_values(values, specs, mesh, flat) -> list:
    """Each value rebuilt from its run of local leaves in ``flat``."""
    out, at = [], 0
    for value, spec in zip(values, specs):
        n = len(jax.tree.leaves(value))
        out.append(sharding_rule(value).local(value, list(flat[at:at + n]), spec, mesh))
        at += n
    return out


def _sum(y: jax.Array, axes: tuple, dtype) -> jax.Array:
    return jax.lax.psum(y.astype(jnp.float32), axes).astype(dtype) if axes else y.astype(dtype)


def sharded_matmul(impl: Callable, mesh, x: jax.Array, w, out_dtype, axes) -> jax.Array:
    """``impl(x, w, out_dtype)`` per device for ``w`` with logical ``axes`` (see the module doc);
    ``axes`` None: ``w`` is gathered whole onto every device (a Mosaic kernel must still run inside
    ``shard_map``)."""
    rule = sharding_rule(w)
    spec = rule.logical_spec(w, tuple(axes), mesh) if axes is not None else PartitionSpec(None, None)
    in_axis, out_axis = tuple(spec)
    lead = (None,) * (x.ndim - 1)
    reduce = (in_axis,) if in_axis is not None else ()

    def local(x, *flat):
        (lw,) = _local_values((w,), (spec,), mesh, flat)
        return _sum(impl(x, lw, jnp.float32 if reduce else out_dtype), reduce, out_dtype)

    return jax.shard_map(local, in_specs=(PartitionSpec(*lead, in_axis), *rule.leaf_specs(w, spec)),
                         out_specs=PartitionSpec(*lead, out_axis), check_vma=False)(x, *jax.tree.leaves(w))


def _bank_axes(banks, mesh) -> tuple[str | None, str | None]:
    """(mesh axis of the experts, of the expert width) that every bank allows, or None."""
    specs = [tuple(sharding_rule(b).logical_spec(b, axes, mesh)) for b, axes in zip(banks, BANK_AXES)]
    experts = specs[0][0] if specs[0][0] == specs[1][0] == specs[2][0] else None
    width = specs[0][2] if specs[0][2] == specs[1][2] == specs[2][1] else None
    return experts, width


def sharded_moe(impl: Callable, mesh, x, weights, ids, gate, up, down, limit):
    """``impl(x, weights, ids, gate, up, down, limit)`` per device (see the module docstring)."""
    banks = (gate, up, down)
    experts, width = _bank_axes(banks, mesh)
    specs = (PartitionSpec(experts, None, width), PartitionSpec(experts, None, width),
             PartitionSpec(experts, width, None))
    n_local = gate.shape[0] // (mesh.shape[experts] if experts else 1)
    reduce = tuple(a for a in (experts, width) if a is not None)

    def local(x, weights, ids, *flat):
        gate, up, down = _local_values(banks, specs, mesh, flat)
        if experts is not None:
            lid = ids - jax.lax.axis_index(experts) * n_local
            own = (lid >= 0) & (lid < n_local)
            weights, ids = jnp.where(own, weights, 0.0), jnp.where(own, lid, 0)
        return _sum(impl(x, weights, ids, gate, up, down, limit), reduce, x.dtype)

    leaf_specs = [s for b, spec in zip(banks, specs) for s in sharding_rule(b).leaf_specs(b, spec)]
    replicated = PartitionSpec()
    return jax.shard_map(local, in_specs=(replicated, replicated, replicated, *leaf_specs), out_specs=replicated,
                         check_vma=False)(x, weights, ids, *(leaf for b in banks for leaf in jax.tree.leaves(b)))
