"""Shared inputs and oracles for the kernel tests (``tests/test_kernels_*.py``).

Random GGUF blocks whose f16 scales are chosen so the weights have an RMS of about 0.05 (outputs of
order one, as in a real model, so float32 rounding is measured rather than amplified by SwiGLU's
clamp); routing cases for a decode step (rows sharing experts, all distinct, padding slots); and
the oracle: ``gguf.quants.dequantize`` then the layer in float64 numpy.
"""

from __future__ import annotations

import jax
import numpy as np
from gguf import quants as gq
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from tests.support.ggml_oracle import blocks, moe_oracle  # noqa: F401  (re-exported for the kernel tests)
from tests.support.helpers import rel_err  # noqa: F401  (re-exported for the kernel tests)
from zoo.formats.ggml import BLOCK_LAYOUTS, F16, QType
from zoo.kernels.tile_decoders import FORMATS
from zoo.quant.qarray import QArray

KERNEL_TYPES = sorted(FORMATS, key=lambda t: t.name)
LIMIT = 0.5            # SwiGLU clamp, low enough that some gate/up values are clamped


def raw_blocks(qtype: QType, lead: tuple[int, ...], rows: int, n_blocks: int, seed: int) -> np.ndarray:
    """uint8 blocks with random bytes and random f16 fields over many binades, subnormals included
    (for bit-exactness checks)."""
    rng = np.random.default_rng(seed)
    layout = BLOCK_LAYOUTS[qtype]
    data = rng.integers(0, 256, size=(*lead, rows, n_blocks, layout.type_size), dtype=np.uint8)
    for f in layout.fields:
        if f.dtype == F16:
            values = rng.standard_normal((*lead, rows, n_blocks, f.count)) * np.exp2(rng.integers(-26, 0, size=1))
            data[..., f.offset:f.end] = values.astype(np.float16).view(np.uint8)
    return data.reshape(*lead, rows, n_blocks * layout.type_size)


def activations(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """float32 activations ``k / 4``, ``k`` in [-4, 4] (see :func:`blocks`)."""
    return (np.random.default_rng(seed).integers(-4, 5, size=shape) / 4).astype(np.float32)


def bank(qtype: QType, n_experts: int, d_in: int, d_out: int, seed: int,
         in_splits: int = 1) -> tuple[QArray, np.ndarray]:
    """A QArray bank ``[E, d_in, d_out]`` (or a matrix when ``n_experts`` is 0) and its float64 weights."""
    lead = (n_experts,) if n_experts else ()
    raw = blocks(qtype, lead, d_out, d_in // BLOCK_LAYOUTS[qtype].block_size, seed)
    dense = np.swapaxes(gq.dequantize(raw, qtype), -1, -2).astype(np.float64)
    return QArray.from_blocks(raw, qtype, in_splits=in_splits), dense


def routings(rows: int, top_k: int, n_experts: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Routing cases for ``rows`` rows: every row on the same experts; rows as distinct as the
    experts allow; a random mix; the mix as one device of the expert-parallel layout sees it (slots
    of other devices' experts as expert 0 with weight 0, which no kernel may read).
    (ids int32 [rows, k], weights float32 [rows, k])."""
    rng = np.random.default_rng(seed)
    same = np.tile(rng.permutation(n_experts)[:top_k], (rows, 1))
    distinct = (np.arange(rows * top_k) % n_experts).reshape(rows, top_k)
    mixed = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(rows)])
    cases = [(ids.astype(np.int32), rng.random((rows, top_k)).astype(np.float32)) for ids in (same, distinct, mixed)]
    ids, weights = cases[2][0].copy(), cases[2][1].copy()
    elsewhere = ids >= n_experts // 2
    ids[elsewhere], weights[elsewhere] = 0, 0.0
    return cases + [(ids, weights)]


def jit_static(fn, *static: int):
    """``jax.jit`` with the given static positional arguments, compiled at LLVM -O0: an interpreted
    Pallas kernel is a large program run once, so compile time is what counts."""
    return jax.jit(fn, static_argnums=static, compiler_options={"xla_backend_optimization_level": 0})


def _abstract(kind: str, platform: str) -> AbstractMesh:
    return AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                        abstract_device=AbstractDevice(device_kind=kind, num_cores=1 if platform == "tpu" else None,
                                                       platform=platform))


V5E = _abstract("TPU v5 lite", "tpu")
H100 = _abstract("NVIDIA H100", "gpu")


def tpu_custom_calls(jitted, *args) -> int:
    """How many Mosaic kernels ``jitted(*args)`` lowers to for a TPU v5e (no TPU needed)."""
    with jax.sharding.use_abstract_mesh(V5E):
        return jitted.trace(*args).lower(lowering_platforms=("tpu",)).as_text().count("tpu_custom_call")


def triton_calls(jitted, *args) -> int:
    """How many Triton kernels ``jitted(*args)`` lowers to for an H100 (no GPU needed)."""
    with jax.sharding.use_abstract_mesh(H100):
        return jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton")


def random_rows(qtype: QType, lead: tuple[int, ...], rows: int, n_blocks: int, seed: int = 0) -> np.ndarray:
    """uint8 [*lead, rows, n_blocks * type_size]: random blocks whose f16 fields are small finite scales."""
    rng = np.random.default_rng(seed)
    layout = BLOCK_LAYOUTS[qtype]
    blocks = rng.integers(0, 256, size=(*lead, rows, n_blocks, layout.type_size), dtype=np.uint8)
    for f in layout.fields:
        if f.dtype == F16:
            scales = (rng.standard_normal((*lead, rows, n_blocks, f.count)) * 1e-2).astype(np.float16)
            blocks[..., f.offset:f.end] = scales.view(np.uint8)
    return blocks.reshape(*lead, rows, n_blocks * layout.type_size)


TOP_K, EXPERTS = 2, 8      # the MoE kernel cases: top-k of 8 experts


def moe_shapes(qtype: QType) -> tuple[int, int]:
    """(D, I): D is two parts of whole blocks (the gate/up input packed as ``in_splits=2``, so the
    kernels loop over chunks), I whole blocks; Q8_0's I is not a multiple of the 128 lanes."""
    bs = BLOCK_LAYOUTS[qtype].block_size
    return (512, 256) if bs == 256 else (8 * bs, 2 * bs)


def moe_banks(qtype: QType, seed: int = 0):
    d, i = moe_shapes(qtype)
    made = [bank(qtype, EXPERTS, d, i, seed + 1, in_splits=2), bank(qtype, EXPERTS, d, i, seed + 2, in_splits=2),
            bank(qtype, EXPERTS, i, d, seed + 3)]
    return [q for q, _ in made], [w for _, w in made]
