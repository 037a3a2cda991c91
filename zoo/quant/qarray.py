"""QArray: a quantized weight as a jax pytree of uint32 planes plus static metadata.

    QArray(planes, qtype, shape, in_order=None, version=LAYOUT_VERSION, in_splits=1)
      planes   {field: uint32 [*lead, n_words, out]}   the kernel layout of ``zoo.formats.planes``
      qtype    the ggml type of the blocks                                       (static)
      shape    logical shape ``[*lead, in, out]`` as the linear layer sees it    (static)
      in_order None, or ``(view_shape, axes)``: the stored input axis is the logical one reshaped
               to ``view_shape`` and transposed by ``axes`` (a head permutation the source applied
               across block boundaries, e.g. llama.cpp's tiled value heads in ``ssm_out``) (static)
      in_splits  the row's blocks packed as this many equal parts (``zoo.formats.planes``): a weight
               split by input blocks over that many devices holds whole word groups per device (static)

``lead`` is empty for a linear weight and ``(E,)`` for a bank of stacked experts. The planes are
the only array leaves, so a QArray passes through ``jit``, ``nnx.split`` / ``nnx.merge`` and
sharding like any parameter. ``matmul(x, qarray)`` and ``moe(..., banks)`` go to
``zoo.kernels.dispatch``: fused dequantizing kernels (Pallas) on TPU/GPU, their jnp twins on CPU,
and dequantize-then-dense for formats without a tile decoder; ``dequantize()`` is bit-exact with
``gguf.quants.dequantize``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from zoo.formats import planes as P
from zoo.formats.dequant import dequantize_jnp
from zoo.formats.ggml import BLOCK_LAYOUTS, QType, qtype_of
from zoo.formats.host_arrays import to_device
from zoo.kernels import dispatch
from zoo.ops.matmul import register_matmul
from zoo.ops.moe import register_moe
from zoo.sharding.mesh import ShardingRule, partition_spec, register_sharding, shard_shape

InOrder = tuple[tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class QArray:
    planes: dict[str, jax.Array]
    qtype: QType
    shape: tuple[int, ...]
    in_order: InOrder | None = None
    version: int = P.LAYOUT_VERSION
    in_splits: int = 1

    def __post_init__(self):
        *lead, d_in, d_out = self.shape
        layout = BLOCK_LAYOUTS[self.qtype]
        if layout.block_size == 1 or d_in % layout.block_size:
            raise ValueError(f"QArray {self.qtype.name} {self.shape}: the input dim must be whole "
                             f"blocks of a quantized type")
        expected = P.plane_shapes(self.qtype, tuple(lead), d_out, d_in // layout.block_size, self.in_splits)
        got = {name: tuple(p.shape) for name, p in self.planes.items()}
        if got != expected:
            raise ValueError(f"QArray {self.qtype.name} {self.shape}: planes {got}, expected {expected}")
        if self.in_order is not None and math.prod(self.in_order[0]) != d_in:
            raise ValueError(f"QArray in_order {self.in_order} does not cover the input dim {d_in}")

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def from_blocks(cls, data: np.ndarray, qtype, in_order: InOrder | None = None, in_splits: int = 1) -> "QArray":
        """From GGUF rows ``uint8 [*lead, out, row_bytes]`` (``GGUFSource.read`` of a matrix)."""
        qtype = qtype_of(qtype)
        layout = BLOCK_LAYOUTS[qtype]
        *lead, d_out, row_bytes = data.shape
        d_in = row_bytes // layout.type_size * layout.block_size
        planes = {k: to_device(v) for k, v in P.to_planes(np.asarray(data), qtype, in_splits).items()}
        return cls(planes, qtype, (*lead, d_in, d_out), in_order, in_splits=in_splits)

    # -- properties ---------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(p.size) * 4 for p in self.planes.values())

    @property
    def n_blocks(self) -> int:
        return self.shape[-2] // BLOCK_LAYOUTS[self.qtype].block_size

    def __repr__(self) -> str:
        return f"QArray({self.qtype.name}, shape={self.shape}, {self.nbytes} bytes)"

    # -- decoding -----------------------------------------------------------------------------------
    def blocks(self) -> jax.Array:
        """The GGUF rows again: ``uint8 [*lead, out, row_bytes]`` (exact inverse of ``from_blocks``)."""
        return P.from_planes(self.planes, self.qtype, self.n_blocks, self.in_splits)

    def dequantize(self) -> jax.Array:
        """The logical weight, float32 ``[*lead, in, out]`` (bit-exact with gguf's dequantizer)."""
        rows = dequantize_jnp(self.blocks(), self.qtype)            # [*lead, out, in (stored order)]
        if self.in_order is not None:
            view, axes = self.in_order
            lead = rows.shape[:-1]
            stored_view = tuple(view[a] for a in axes)
            rows = rows.reshape(*lead, *stored_view)
            inverse = tuple(np.argsort(axes))
            rows = jnp.transpose(rows, (*range(len(lead)), *(len(lead) + a for a in inverse)))
            rows = rows.reshape(*lead, -1)
        return jnp.swapaxes(rows, -1, -2)


jax.tree_util.register_dataclass(QArray, data_fields=["planes"],
                                 meta_fields=["qtype", "shape", "in_order", "version", "in_splits"])


# matmul / moe over QArrays: the kernels, or the jnp paths, as zoo.kernels.dispatch decides
register_matmul(QArray)(dispatch.quantized_matmul)
register_moe(QArray)(dispatch.quantized_moe)


# -- sharding (``zoo.sharding.mesh``): planes follow the logical [*lead, in, out] split ----------------------


def _in_split_aligned(q: QArray, ways: int) -> bool:
    """Splitting the input axis ``ways`` ways gives every device whole word groups of its own
    blocks in every plane: the packing already has a part per device, or the parts line up."""
    k_max = max(P.blocks_per_word_group(f) for f in BLOCK_LAYOUTS[q.qtype].fields)
    return q.in_splits % ways == 0 or (q.in_splits == 1 and q.n_blocks % (ways * k_max) == 0)


def _placement_spec(q: QArray, axes, shape, mesh) -> PartitionSpec:
    """The split the loader places a QArray of ``q``'s kind with: the input axis in whole blocks
    (the loader packs each device's blocks on their own), never under a head permutation."""
    units = (1,) * (len(shape) - 2) + (BLOCK_LAYOUTS[q.qtype].block_size, 1)
    spec = tuple(partition_spec(axes, tuple(shape), mesh, units))
    in_axis = None if q.in_order is not None else spec[-2]
    return PartitionSpec(*spec[:-2], in_axis, spec[-1])


def _logical_spec(q: QArray, axes, mesh) -> PartitionSpec:
    spec = tuple(_placement_spec(q, axes, q.shape, mesh))
    in_axis = spec[-2] if spec[-2] is not None and _in_split_aligned(q, mesh.shape[spec[-2]]) else None
    return PartitionSpec(*spec[:-2], in_axis, spec[-1])


def _plane_specs(q: QArray, spec: PartitionSpec) -> list[PartitionSpec]:
    """planes ``[*lead, n_words, out]``: lead as the lead, words as the input axis, minor as out."""
    return [spec] * len(q.planes)


def _cut(q: QArray, index: tuple) -> QArray:
    """Host sub-slice over the logical shape; an input-axis cut re-packs the kept blocks."""
    *lead, in_idx, out_idx = index
    block = BLOCK_LAYOUTS[q.qtype].block_size
    start, stop, _ = in_idx.indices(q.shape[-2])
    if (start, stop) == (0, q.shape[-2]):
        planes = {k: np.asarray(p)[(*lead, slice(None), out_idx)] for k, p in q.planes.items()}
        shape = tuple(len(range(*s.indices(d))) for s, d in zip((*lead, in_idx, out_idx), q.shape))
        return QArray(planes, q.qtype, shape, q.in_order, q.version, q.in_splits)
    if q.in_order is not None or start % block or stop % block:
        raise ValueError(f"{q}: cannot cut inputs {start}:{stop} (whole blocks, no head order)")
    rows = np.asarray(q.blocks())[(*lead, out_idx)]
    size = BLOCK_LAYOUTS[q.qtype].type_size
    return QArray.from_blocks(rows[..., start // block * size:stop // block * size], q.qtype)


def _assemble(local: QArray, shape, spec: PartitionSpec, mesh) -> QArray:
    """The global QArray whose device shards are packed like ``local`` (one part per input shard)."""
    in_axis = tuple(spec)[-2] if len(tuple(spec)) >= 2 else None
    in_splits = local.in_splits * (mesh.shape[in_axis] if in_axis is not None else 1)
    *lead, d_in, d_out = shape
    planes = {k: jax.ShapeDtypeStruct(s, jnp.uint32) for k, s in P.plane_shapes(
        local.qtype, tuple(lead), d_out, d_in // BLOCK_LAYOUTS[local.qtype].block_size, in_splits).items()}
    return QArray(planes, local.qtype, tuple(shape), local.in_order, local.version, in_splits)


def _local(q: QArray, leaves: list, spec: PartitionSpec, mesh) -> QArray:
    """One device's QArray inside ``shard_map`` from its plane shards."""
    in_axis = tuple(spec)[-2]
    ways = mesh.shape[in_axis] if in_axis is not None else 1
    planes = jax.tree.unflatten(jax.tree.structure(q.planes), leaves)
    return QArray(planes, q.qtype, shard_shape(q.shape, spec, mesh), q.in_order, q.version, q.in_splits // ways)


register_sharding(QArray, ShardingRule(
    logical_spec=_logical_spec, placement_spec=_placement_spec, leaf_specs=_plane_specs, cut=_cut,
    assemble=_assemble, local=_local))
