"""Meshes, layouts, and the rules that map logical axis names to mesh axes.

Every parameter (and cache leaf, ``zoo.sharding.cache_axes``) carries logical axis names
(``"embed"``, ``"heads"``, ``"mlp"``, ``"experts"``, ...). A *layout* is a set of mesh axis names
plus a rules table ``logical name -> mesh axis | None``; ``partition_spec`` turns a value's logical
axes into a ``PartitionSpec`` for a concrete mesh, with two safety rules: a mesh axis is used at
most once per value, and a dimension that the mesh axis does not divide (in whole ``units``, e.g.
quantization blocks) stays replicated (correct, just not split). A logical name missing from the
table is an error, so a new axis cannot be silently replicated.

Layouts (docs/reference.md section 4 has the two ways of splitting the routed experts):
    "tp"  one mesh axis ``tp`` over all devices: attention / KDA / DeltaNet heads, MLP width, the
          width of every routed expert (gate/up by output rows, down by input blocks) and the
          vocabulary are split; the residual stream, latent and LoRA dims are replicated.
    "ep"  ``ep x tp``: the routed experts are split over ``ep`` (each device holds E/ep whole-width
          experts, split again by width over ``tp``); everything "tp" splits is split over ``tp``.

Stored-weight types other than plain arrays (``QArray`` planes, int8 + scales) register how their
leaves follow the logical spec (``register_sharding``), as they register their matmul.

Inside a jitted program, ``zoo.sharding.cache_axes.shard_cache`` pins cache arrays to their layout
(typed cache containers carry their logical axes). The weights' layout
propagates through the activations on its own (XLA partitions dense products); stored weights
(QArray planes, int8) and routed experts run per device under ``shard_map`` (``zoo.sharding.shard_ops``).
Both read the mesh set by ``jax.set_mesh`` (``on_mesh``) and do nothing without a multi-device mesh.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Axes = tuple[str | None, ...]

TP_RULES: dict[str, str | None] = {
    # split: heads of every mixer, MLP / expert width, vocabulary, and cache heads
    "heads": "tp", "kv_heads": "tp", "mlp": "tp", "vocab": "tp",
    "linear_qkv": "tp", "linear_v": "tp", "linear_heads": "tp", "cache_heads": "tp",
    # replicated: the residual stream, small, latent or LoRA dims, and cache bookkeeping
    "embed": None, "head_dim": None, "q_lora": None, "kv_lora": None, "conv": None, "kpool": None,
    "experts": None, "hc": None, "hc_scale": None,
    # split along the contracted input of small replicated matrices (hyper-connection mixing, router):
    # each chip holds 1/tp of the weight, the [B, T, few] product is summed across chips
    # (and the low-rank down projections of the residual stream: MLA q_a / kv_a, KDA f_a / g_a, the
    # indexer's keys and gate, MTP's fc, whose outputs are not split)
    "hc_embed": "tp", "router_embed": "tp", "embed_in": "tp",
    "batch": None, "cache_len": None,
    # split over the sequence: GLM's latent cache and the indexer's pooled keys are shared by all heads,
    # so a split by heads cannot shard them; each chip holds 1/tp of the slots (attention and the
    # indexer scores then reduce across chips)
    "latent_len": "tp", "pools": "tp",
    # Qwen's KV cache slots: split where its KV heads (listed first, so they take "tp" where they
    # divide over it) do not, e.g. Qwen3.8-27B's 4 KV heads on 8 chips
    "kv_len": "tp",
    # the vision towers: heads and MLP widths split like the text model's, the tower's residual
    # stream, patch / position tables and the merger's input replicated
    "vision_heads": "tp", "vision_mlp": "tp", "vision_merger_mlp": "tp",
    "vision_embed": None, "vision_patch": None, "vision_pos": None, "vision_merged": None, "vision_out": None,
}
EP_RULES: dict[str, str | None] = {**TP_RULES, "experts": "ep"}


@dataclass(frozen=True)
class Layout:
    name: str
    axis_names: tuple[str, ...]
    rules: dict[str, str | None]

    def mesh_shape(self, n_devices: int) -> tuple[int, ...]:
        """Default mesh shape on ``n_devices``: all on ``tp``, or ``ep x tp`` with ``ep`` the
        largest divisor of ``n_devices`` not above its square root (8 -> 2 x 4)."""
        if len(self.axis_names) == 1:
            return (n_devices,)
        ep = max(d for d in range(1, int(np.sqrt(n_devices)) + 1) if n_devices % d == 0)
        return (ep, n_devices // ep)


MESH_LAYOUTS: dict[str, Layout] = {
    "tp": Layout("tp", ("tp",), TP_RULES),
    "ep": Layout("ep", ("ep", "tp"), EP_RULES),
}


def get_layout(name: str) -> Layout:
    try:
        return MESH_LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown mesh layout {name!r}; known: {sorted(MESH_LAYOUTS)}") from None


def make_mesh(layout: str = "tp", devices=None, shape: tuple[int, ...] | None = None) -> Mesh:
    """A mesh over ``devices`` (default: every device of the job, all processes' with
    ``zoo.distributed``; a single process: its own) in the named layout; ``shape`` overrides the
    default split (e.g. ``(8, 1)`` for pure expert parallelism in "ep")."""
    lay = get_layout(layout)
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(shape) if shape is not None else lay.mesh_shape(len(devices))
    if len(shape) != len(lay.axis_names) or int(np.prod(shape)) != len(devices):
        raise ValueError(f"mesh shape {shape} does not fit layout {layout!r} {lay.axis_names} on "
                         f"{len(devices)} device(s)")
    return Mesh(np.asarray(devices).reshape(shape), lay.axis_names)


def mesh_layout(mesh) -> Layout:
    """The layout whose axis names this mesh (a ``Mesh`` or an abstract mesh) has."""
    for lay in MESH_LAYOUTS.values():
        if tuple(mesh.axis_names) == lay.axis_names:
            return lay
    raise ValueError(f"mesh axes {tuple(mesh.axis_names)} match no layout; known: "
                     f"{ {n: lay.axis_names for n, lay in MESH_LAYOUTS.items()} }")


def resolve_mesh(mesh) -> Mesh | None:
    """``zoo.load(mesh=...)``: None, a ``Mesh``, or a layout name meaning all of the job's devices."""
    if isinstance(mesh, Mesh):
        mesh_layout(mesh)                       # its axis names must name a layout
        return mesh
    if mesh is None:
        return None
    if isinstance(mesh, str):
        return make_mesh(mesh)
    raise TypeError(f"mesh must be a jax.sharding.Mesh or a layout name, got {type(mesh).__name__}")


def partition_spec(axes: Axes, shape: tuple[int, ...], mesh,
                   units: tuple[int, ...] | None = None) -> PartitionSpec:
    """The ``PartitionSpec`` for a value with logical ``axes`` and ``shape`` on ``mesh``.

    ``units[i]``: dimension i may only be split in whole multiples of this many elements."""
    if len(axes) != len(shape):
        raise ValueError(f"axes {axes} and shape {shape} differ in rank")
    rules = mesh_layout(mesh).rules
    units = units or (1,) * len(shape)
    used: set[str] = set()
    spec = []
    for name, dim, unit in zip(axes, shape, units):
        if name is not None and name not in rules:
            raise ValueError(f"logical axis {name!r} has no rule in layout {mesh_layout(mesh).name!r}")
        mesh_axis = rules.get(name) if name is not None else None
        if mesh_axis is None or mesh_axis in used or dim % (mesh.shape[mesh_axis] * unit):
            spec.append(None)
            continue
        used.add(mesh_axis)
        spec.append(mesh_axis)
    return PartitionSpec(*spec)


def named_sharding(axes: Axes, shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(tuple(axes), tuple(shape), mesh))


# -- stored-weight types ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardingRule:
    """How a stored-weight type (a pytree) follows a spec over its logical shape ``[*lead, in, out]``.

    logical_spec(value, axes, mesh) -> spec          the split an existing (global) value allows
    placement_spec(local, axes, shape, mesh) -> spec  the split the loader places a global value of
                                                      ``local``'s kind and ``shape`` with
    leaf_specs(value, spec) -> [spec]                 one per ``jax.tree.leaves(value)``
    cut(value, index) -> value                        host sub-slice (index over the logical shape,
                                                      relative to ``value``)
    assemble(local, shape, spec, mesh) -> value       the global value (ShapeDtypeStruct leaves)
                                                      whose device shards are values like ``local``
    local(value, leaves, spec, mesh) -> value         one device's value (inside ``shard_map``) from
                                                      its shards of ``value``'s leaves
    """

    logical_spec: Callable[..., PartitionSpec]
    placement_spec: Callable[..., PartitionSpec]
    leaf_specs: Callable[..., list[PartitionSpec]]
    cut: Callable[..., Any]
    assemble: Callable[..., Any]
    local: Callable[..., Any]


DENSE = ShardingRule(
    logical_spec=lambda value, axes, mesh: partition_spec(axes, tuple(value.shape), mesh),
    placement_spec=lambda local, axes, shape, mesh: partition_spec(axes, tuple(shape), mesh),
    leaf_specs=lambda value, spec: [spec],
    cut=lambda value, index: np.asarray(value)[index],
    assemble=lambda local, shape, spec, mesh: jax.ShapeDtypeStruct(tuple(shape), local.dtype),
    local=lambda value, leaves, spec, mesh: leaves[0])

_RULES: dict[type, ShardingRule] = {}


def register_sharding(value_type: type, rule: ShardingRule) -> None:
    """Declare how values of ``value_type`` (a pytree) are sharded (see ``ShardingRule``)."""
    _RULES[value_type] = rule


def sharding_rule(value) -> ShardingRule:
    return _RULES.get(type(value), DENSE)


def value_specs(value, axes: Axes, mesh) -> tuple[PartitionSpec, list[PartitionSpec]]:
    """(logical spec, one spec per leaf of ``value``) for a stored value with logical ``axes``."""
    rule = sharding_rule(value)
    spec = rule.logical_spec(value, tuple(axes), mesh)
    return spec, rule.leaf_specs(value, spec)


def shard_shape(shape: tuple[int, ...], spec: PartitionSpec, mesh) -> tuple[int, ...]:
    """The per-device shape of a ``shape`` value split by ``spec``."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    return tuple(d // (mesh.shape[a] if a is not None else 1) for d, a in zip(shape, spec))


def state_shardings(module, mesh: Mesh):
    """``{parameter path: [NamedSharding per leaf]}`` for every parameter of an NNX module, from its
    logical axes (what ``zoo.load(mesh=...)`` places, and what a restore should target)."""
    from flax import nnx

    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module)):
        value = var.get_value()
        _, leaf = value_specs(value, var.get_metadata()["axes"], mesh)
        out[".".join(map(str, path))] = [NamedSharding(mesh, s) for s in leaf]
    return out


# -- inside jitted programs ------------------------------------------------------------------------


def current_mesh():
    """The mesh set by ``jax.set_mesh`` while tracing, or None (no mesh, or a single device)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh


def current_spec(axes: Axes, shape: tuple[int, ...]) -> PartitionSpec | None:
    """The ``PartitionSpec`` of a value with logical ``axes`` and ``shape`` on the current mesh (None:
    no mesh), for code that works per shard where the mesh splits a dimension."""
    mesh = current_mesh()
    return partition_spec(axes, tuple(shape), mesh) if mesh is not None else None


def on_mesh(fn: Callable, mesh: Mesh | None) -> Callable:
    """``fn`` called (and so traced) with ``mesh`` set as the current mesh; ``fn`` itself if None."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with jax.set_mesh(mesh):
            return fn(*args, **kwargs)
    return run


def host_value(x) -> np.ndarray:
    """``x`` as a numpy array on this host. An array whose shards all live in this process (one
    process, or replicated) is read directly; one split over several processes' devices is gathered
    from all of them (``process_allgather``: every process must make the same call, in the same order,
    as with every program of a multi-process job)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
