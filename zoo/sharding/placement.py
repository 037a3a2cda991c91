"""Placement: each parameter created directly with its ``NamedSharding``, read from its source in
slices, never gathered whole on one device (``zoo.load(..., mesh=...)``).

For one parameter (logical ``axes``, abstract value ``want``) on a mesh::

    spec      the layout's PartitionSpec (``zoo.sharding.mesh``); after the first read, the stored kind's
              own placement rule (a QArray splits its input axis only in whole blocks, ...)
    groups    devices grouped by their *read index*: the device's slice of the parameter, widened
              to the whole axis where a slice cannot be read exactly on its own (below)
    per group the source slice is read through a ``SliceView`` and handed to the storage function
              (on the host: the CPU device), cut into each member device's shard, put on that
              device, and dropped
    assemble  the shards become global arrays (``jax.make_array_from_single_device_arrays``)

Which axes are read whole (and cut after storing):

* every axis, when the name map's transform is not a pure re-indexing of the stored tensor (head
  permutations, conv reshapes): that tensor is read once per host and cut per device;
* the input axis (``-2``) of a **float** tensor: storage may quantize along it (int8 scales per
  output column, Q8_0 blocks along a row), so it is stored whole and cut afterwards;
* for a **quantized** tensor, its block axis unless the device's slice is whole blocks; a row is
  whole bytes on disk, so devices holding different blocks of the same rows share one read of
  those rows (``SliceView.rows``) and each stores only its own blocks.

With several processes (``zoo.distributed``) each process does this for its own devices only: it
reads the slices they hold and nothing else, and the shards of all processes form one global array.

So host memory during a load is bounded by one read: one device's slice for column-parallel and
expert-split weights, the rows they share for row-parallel quantized ones (``down`` split by input
blocks), one tensor for float row-parallel weights and re-ordered ones; never by the model; and
each byte is read from the file once per host (FP8 block-scaled tensors in whole 128 x 128 blocks).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding

from zoo.formats.ggml import BLOCK_LAYOUTS
from zoo.sharding.mesh import partition_spec, sharding_rule
from zoo.sources.names import Transform, layout_transform

Index = tuple[slice, ...]



def full_index(index, ndim: int) -> Index:
    """``index`` (an int-free tuple of slices, possibly short) as ``ndim`` explicit slices."""
    index = index if isinstance(index, tuple) else (index,)
    return tuple(index) + (slice(None),) * (ndim - len(index))


def source_index(transform, index: tuple) -> tuple | None:
    """The stored tensor's index for parameter ``index`` under ``transform`` (or any tuple with one
    entry per parameter axis); None if the transform is not a pure re-indexing."""
    if isinstance(transform, Transform) and transform.heads is not None:
        return None
    if not isinstance(transform, (str, Transform, type(None))):
        return None
    reindex = layout_transform(transform).reindex
    if reindex == "same":
        return index
    if reindex == "swap" and len(index) >= 2:
        return (*index[:-2], index[-1], index[-2])
    return None


def _slice_shape(index: Index, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(d))) for s, d in zip(index, shape))


class SliceView:
    """One source tensor seen through an index (over its element shape): ``info(key).shape`` is the
    slice's, ``read(key)`` returns only the slice. A quantized tensor is read as whole rows of its
    leading axes, kept in ``rows`` (shared by the views of one parameter: devices that differ only
    in their blocks of the same rows read the file once), then cut to whole blocks."""

    def __init__(self, source, key: str, index: Index, rows: dict | None = None):
        self.source, self.key = source, key
        self.full = source.info(key)
        self.index = full_index(index, len(self.full.shape))
        self.rows = {} if rows is None else rows

    def keys(self) -> list[str]:
        return [self.key]

    def info(self, key: str):
        return dataclasses.replace(self.full, shape=_slice_shape(self.index, self.full.shape))

    def read(self, key: str, index=()) -> np.ndarray:
        if not getattr(self.full, "quantized", False):
            return self.source.read(key, self.index)[index]
        lead = tuple(s.indices(d)[:2] for s, d in zip(self.index[:-1], self.full.shape))
        if self.rows.get("lead") != lead:
            self.rows.clear()
            self.rows.update(lead=lead, data=self.source.read(key, self.index[:-1]))
        layout = BLOCK_LAYOUTS[self.full.qtype]
        start, stop, _ = self.index[-1].indices(self.full.shape[-1])
        cut = slice(start // layout.block_size * layout.type_size, stop // layout.block_size * layout.type_size)
        return self.rows["data"][..., cut][index]


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """How one parameter's slices map onto its stored tensor.

    axes_of_source  for each stored axis, the parameter axis it holds (None: the transform is not
                    a re-indexing, or the stored shape is not the parameter's: read whole, and let
                    storage report the mismatch)
    sliced          per parameter axis: may a device's slice be read on its own
    block_axis      the parameter axis holding a quantized tensor's blocks (None for floats)
    block           elements per block along it
    """

    axes_of_source: tuple[int, ...] | None
    sliced: tuple[bool, ...]
    block_axis: int | None = None
    block: int = 1

    @classmethod
    def of(cls, source, key: str, transform, shape: tuple[int, ...]) -> "ReadPlan":
        info = source.info(key)
        quantized = bool(getattr(info, "quantized", False))
        ndim = len(shape)
        axes = source_index(transform, tuple(range(ndim)))
        if axes is None or tuple(shape[a] for a in axes) != tuple(info.shape):
            return cls(None, (False,) * ndim)
        sliced = tuple(not (not quantized and ndim >= 2 and a == ndim - 2) for a in range(ndim))
        if not quantized:
            return cls(tuple(axes), sliced)
        return cls(tuple(axes), sliced, axes[-1], BLOCK_LAYOUTS[info.qtype].block_size)

    def read_index(self, index: Index, shape: tuple[int, ...]) -> Index:
        """A device's slice widened to whole axes where it cannot be read on its own."""
        out = []
        for a, (s, dim) in enumerate(zip(index, shape)):
            start, stop, _ = s.indices(dim)
            whole = not self.sliced[a] or (a == self.block_axis and (start % self.block or stop % self.block))
            out.append(slice(0, dim) if whole else slice(start, stop))
        return tuple(out)

    def source_slice(self, read_index: Index) -> Index:
        return tuple(read_index[a] for a in self.axes_of_source)


def _normal(index: Index, shape: tuple[int, ...]) -> Index:
    return tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, shape))


def _relative(inner: Index, outer: Index) -> Index:
    return tuple(slice(i.start - o.start, i.stop - o.start) for i, o in zip(inner, outer))


def _groups(mesh, shape, spec, plan: ReadPlan) -> dict[Index, list[tuple[object, Index]]]:
    """read index -> [(device, device index)] for ``shape`` split by ``spec``, over this process's
    devices only (with several processes, ``zoo.distributed``, each reads and places its own)."""
    groups: dict[Index, list] = {}
    me = jax.process_index()
    for device, index in NamedSharding(mesh, spec).devices_indices_map(tuple(shape)).items():
        if device.process_index != me:
            continue
        index = _normal(index, shape)
        groups.setdefault(plan.read_index(index, shape), []).append((device, index))
    return groups


def _on_host():
    """Storage functions compute on the CPU device, so a whole tensor never lands on an accelerator
    (when the CPU backend is disabled, e.g. ``JAX_PLATFORMS=tpu``: on the default device)."""
    try:
        return jax.default_device(jax.local_devices(backend="cpu")[0])
    except RuntimeError:
        return contextlib.nullcontext()


def place(store, source, key: str, transform, want, axes, path: str, mesh):
    """``store`` (a ``fill_from_source`` storage function) applied to source tensor ``key``, the
    result placed shard by shard on ``mesh`` for the parameter at ``path`` (see module doc)."""
    shape = tuple(want.shape)
    plan = ReadPlan.of(source, key, transform, shape)
    whole = tuple(slice(0, d) for d in shape)
    rows: dict = {}                                   # the rows last read, shared by this tensor's views

    def stored(read_index: Index):
        view = source if read_index == whole else SliceView(source, key, plan.source_slice(read_index), rows)
        part = jax.ShapeDtypeStruct(_slice_shape(read_index, shape), want.dtype)
        with _on_host():
            return store(view, key, transform, part, path)

    spec = partition_spec(tuple(axes), shape, mesh)
    groups = _groups(mesh, shape, spec, plan)
    first_index = next(iter(groups))
    first = stored(first_index)
    rule = sharding_rule(first)
    final = rule.placement_spec(first, tuple(axes), shape, mesh)
    if final != spec:                                 # the stored kind splits differently: regroup
        spec, groups = final, _groups(mesh, shape, final, plan)
        first_index = None
    shards: dict[object, list] = {}
    local = None
    for read_index, members in groups.items():
        value = first if read_index == first_index else stored(read_index)
        if sharding_rule(value) is not rule:
            raise ValueError(f"parameter {path}: slices of tensor {key!r} were stored as different kinds")
        for device, index in members:
            local = value if index == read_index else rule.cut(value, _relative(index, read_index))
            shards[device] = [jax.device_put(np.asarray(leaf), device) for leaf in jax.tree.leaves(local)]
        first = value = None
    target = rule.assemble(local, shape, spec, mesh)
    leaves = jax.tree.leaves(target)
    arrays = [jax.make_array_from_single_device_arrays(leaf.shape, NamedSharding(mesh, leaf_spec),
                                                       [shards[d][i] for d in shards])
              for i, (leaf, leaf_spec) in enumerate(zip(leaves, rule.leaf_specs(target, spec)))]
    return jax.tree.unflatten(jax.tree.structure(target), arrays)
