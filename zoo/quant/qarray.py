"""QArray: a quantized weight as a jax pytree of uint32 planes plus static metadata.

    QArray(planes, qtype, shape, in_order=None, version=LAYOUT_VERSION)
      planes   {field: uint32 [*lead, n_words, out]}   the kernel layout of ``zoo.quant.planes``
      qtype    the ggml type of the blocks                                       (static)
      shape    logical shape ``[*lead, in, out]`` as the linear layer sees it    (static)
      in_order None, or ``(view_shape, axes)``: the stored input axis is the logical one reshaped
               to ``view_shape`` and transposed by ``axes`` (a head permutation the source applied
               across block boundaries, e.g. llama.cpp's tiled value heads in ``ssm_out``) (static)

``lead`` is empty for a linear weight and ``(E,)`` for a bank of stacked experts. The planes are
the only array leaves, so a QArray passes through ``jit``, ``nnx.split`` / ``nnx.merge`` and
sharding like any parameter. ``matmul(x, qarray)`` and ``moe(..., banks)`` dequantize on the fly
in jnp (bit-exact with ``gguf.quants.dequantize``) and then compute as the dense path does; the
Pallas kernels replace these implementations later without changing the layer API.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from zoo.quant import planes as P
from zoo.quant.dequant import dequantize_jnp
from zoo.quant.ggml import LAYOUTS, QType, qtype_of
from zoo.quant.matmul import dense_matmul, register_matmul
from zoo.quant.moe import dense_moe, register_moe

InOrder = tuple[tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class QArray:
    planes: dict[str, jax.Array]
    qtype: QType
    shape: tuple[int, ...]
    in_order: InOrder | None = None
    version: int = P.LAYOUT_VERSION

    def __post_init__(self):
        *lead, d_in, d_out = self.shape
        layout = LAYOUTS[self.qtype]
        if layout.block_size == 1 or d_in % layout.block_size:
            raise ValueError(f"QArray {self.qtype.name} {self.shape}: the input dim must be whole "
                             f"blocks of a quantized type")
        expected = P.plane_shapes(self.qtype, tuple(lead), d_out, d_in // layout.block_size)
        got = {name: tuple(p.shape) for name, p in self.planes.items()}
        if got != expected:
            raise ValueError(f"QArray {self.qtype.name} {self.shape}: planes {got}, expected {expected}")
        if self.in_order is not None and math.prod(self.in_order[0]) != d_in:
            raise ValueError(f"QArray in_order {self.in_order} does not cover the input dim {d_in}")

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def from_blocks(cls, data: np.ndarray, qtype, in_order: InOrder | None = None) -> "QArray":
        """From GGUF rows ``uint8 [*lead, out, row_bytes]`` (``GGUFSource.read`` of a matrix)."""
        qtype = qtype_of(qtype)
        layout = LAYOUTS[qtype]
        *lead, d_out, row_bytes = data.shape
        d_in = row_bytes // layout.type_size * layout.block_size
        planes = {k: jnp.asarray(v) for k, v in P.to_planes(np.asarray(data), qtype).items()}
        return cls(planes, qtype, (*lead, d_in, d_out), in_order)

    # -- properties ---------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(p.size) * 4 for p in self.planes.values())

    @property
    def n_blocks(self) -> int:
        return self.shape[-2] // LAYOUTS[self.qtype].block_size

    def __repr__(self) -> str:
        return f"QArray({self.qtype.name}, shape={self.shape}, {self.nbytes} bytes)"

    # -- decoding -----------------------------------------------------------------------------------
    def blocks(self) -> jax.Array:
        """The GGUF rows again: ``uint8 [*lead, out, row_bytes]`` (exact inverse of ``from_blocks``)."""
        return P.from_planes(self.planes, self.qtype, self.n_blocks)

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
                                 meta_fields=["qtype", "shape", "in_order", "version"])


@register_matmul(QArray)
def qarray_matmul(x: jax.Array, w: QArray, out_dtype) -> jax.Array:
    """``x [..., in] @ w`` for a 2-D QArray: dequantize (jnp reference), then the dense matmul."""
    if w.ndim != 2:
        raise ValueError(f"matmul needs a 2-D weight, got {w}; expert banks go through zoo.quant.moe")
    return dense_matmul(x, w.dequantize().astype(x.dtype), out_dtype)


@register_moe(QArray)
def qarray_moe(x, weights, ids, gate_bank: QArray, up_bank: QArray, down_bank: QArray, limit):
    """Routed experts over QArray banks ``[E, in, out]``: dequantize every bank, then ``dense_moe``."""
    return dense_moe(x, weights, ids, *(b.dequantize().astype(x.dtype) for b in (gate_bank, up_bank, down_bank)),
                     limit)
