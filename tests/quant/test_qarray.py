"""QArray and the plane layout: exact round trips, bit-exact dequantization, pytree / jit behaviour."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants as gq

from tests.support.helpers import rel_err
from tests.support.kernel_cases import random_rows
from tests.support.paths import DATA
from zoo.formats import planes as P
from zoo.formats.ggml import BLOCK_LAYOUTS, QType
from zoo.ops.matmul import dense_matmul, matmul
from zoo.quant.qarray import QArray
from zoo.sources.gguf import GGUFSource

QUANTIZED = sorted(t for t, layout in BLOCK_LAYOUTS.items() if layout.block_size > 1)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_planes_round_trip_exactly(qtype):
    """blocks -> planes -> blocks is the identity, for an odd block count (packing padding) and experts."""
    data = random_rows(qtype, (3,), rows=5, n_blocks=3)
    planes = P.to_planes(data, qtype)
    assert {k: v.shape for k, v in planes.items()} == P.plane_shapes(qtype, (3,), 5, 3)
    assert all(v.dtype == np.uint32 for v in planes.values())
    back = np.asarray(P.from_planes(planes, qtype, 3))
    assert back.dtype == np.uint8 and np.array_equal(back, data)
    payload = data[0].nbytes
    assert payload <= P.plane_nbytes(qtype, 5, 3) <= payload + 5 * 4 * len(BLOCK_LAYOUTS[qtype].fields)


def test_plane_layout_puts_rows_on_the_minor_axis():
    """Q8_0: ``d`` of blocks 2j, 2j+1 packed in one word; code words on the second-minor axis."""
    data = random_rows(QType.Q8_0, (), rows=4, n_blocks=2)
    planes = P.to_planes(data, QType.Q8_0)
    blocks = data.reshape(4, 2, 34)
    d = blocks[..., :2].copy().view(np.uint16)[..., 0].astype(np.uint32)       # [rows, blocks]
    assert np.array_equal(planes["d"][0], d[:, 0] | (d[:, 1] << 16))
    qs_words = blocks[..., 2:].copy().view("<u4")                               # [rows, blocks, 8]
    assert np.array_equal(planes["qs"], qs_words.reshape(4, 16).T)


def test_exact_payload_for_the_ud_expert_types():
    """Storage equals the GGUF payload when a row holds an even number of blocks."""
    for qtype in (QType.IQ2_S, QType.IQ3_S, QType.IQ4_XS):
        assert P.plane_nbytes(qtype, 256, 16) == 256 * 16 * BLOCK_LAYOUTS[qtype].type_size


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q6_K, QType.IQ3_XXS, QType.IQ4_XS, QType.IQ2_S,
                                   QType.IQ3_S, QType.Q2_K, QType.MXFP4], ids=lambda t: t.name)
def test_dequantize_from_planes_is_bit_exact_with_gguf(qtype):
    """Stacked experts [E, out, in]: QArray.dequantize() equals gguf's dequantizer, transposed."""
    data = random_rows(qtype, (2,), rows=6, n_blocks=2, seed=int(qtype))
    q = QArray.from_blocks(data, qtype)
    block = BLOCK_LAYOUTS[qtype].block_size
    assert q.shape == (2, 2 * block, 6) and q.ndim == 3
    ours = np.asarray(q.dequantize())
    ref = gq.dequantize(data, qtype).swapaxes(-1, -2)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_real_blocks_from_the_fixture():
    """The fixture's IQ3_XXS / IQ4_XS / Q6_K matrices dequantize bit-exactly through planes."""
    src = GGUFSource(DATA / "qwen38-q256-udmix.gguf")
    for key in ("blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "output.weight"):
        info = src.info(key)
        q = QArray.from_blocks(src.read(key), info.qtype)
        assert q.shape == info.shape[::-1]
        assert np.array_equal(np.asarray(q.blocks()), src.read(key))
        ref = gq.dequantize(src.read(key), info.qtype).T
        assert np.array_equal(np.asarray(q.dequantize()), ref), key


def test_qarray_is_a_pytree_usable_in_jit():
    data = random_rows(QType.Q8_0, (), rows=8, n_blocks=2)
    q = QArray.from_blocks(data, QType.Q8_0)
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 2 and all(leaf.dtype == jnp.uint32 for leaf in leaves)
    assert jax.tree_util.tree_unflatten(treedef, leaves).shape == (64, 8)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 64)), jnp.float32)
    ours = jax.jit(lambda x, w: matmul(x, w))(x, q)
    ref = jax.jit(dense_matmul, static_argnums=2)(x, jnp.asarray(gq.dequantize(data, QType.Q8_0).T), jnp.float32)
    assert rel_err(ours, ref) <= 1e-6
    doubled = jax.tree_util.tree_map(lambda p: p, q)        # structure and static metadata survive
    assert doubled.qtype == QType.Q8_0 and doubled.shape == q.shape


def test_in_order_undoes_a_column_permutation_across_blocks():
    """A weight whose input columns are stored in tiled head order (heads of 8 < block of 32)."""
    rng = np.random.default_rng(2)
    w_logical = rng.standard_normal((5, 96)).astype(np.float32)            # [out, in], 12 heads of 8
    view, axes = (4, 3, 8), (1, 0, 2)                                      # 4 groups x 3 per group
    stored = w_logical.reshape(5, *view).transpose(0, *(1 + a for a in axes)).reshape(5, 96)
    blocks = gq.quantize(stored, QType.Q8_0)
    q = QArray.from_blocks(blocks, QType.Q8_0, in_order=(view, axes))
    expected = gq.dequantize(blocks, QType.Q8_0).reshape(5, 3, 4, 8).transpose(0, 2, 1, 3).reshape(5, 96).T
    assert np.array_equal(np.asarray(q.dequantize()), expected)


def test_inconsistent_planes_are_rejected():
    data = random_rows(QType.Q8_0, (), rows=4, n_blocks=2)
    planes = {k: jnp.asarray(v) for k, v in P.to_planes(data, QType.Q8_0).items()}
    with pytest.raises(ValueError, match="planes"):
        QArray(planes, QType.Q8_0, (64, 5))
    with pytest.raises(ValueError, match="whole blocks"):
        QArray(planes, QType.F32, (64, 4))


def test_moe_over_qarray_banks_equals_dense_banks():
    from zoo.ops.moe import dense_moe, moe

    rng = np.random.default_rng(3)
    e, d, i = 4, 64, 32
    banks = [random_rows(QType.Q8_0, (e,), rows=i, n_blocks=d // 32, seed=10),
             random_rows(QType.Q8_0, (e,), rows=i, n_blocks=d // 32, seed=11),
             random_rows(QType.Q8_0, (e,), rows=d, n_blocks=i // 32, seed=12)]
    qbanks = [QArray.from_blocks(b, QType.Q8_0) for b in banks]
    dense = [jnp.asarray(gq.dequantize(b, QType.Q8_0).swapaxes(-1, -2)) for b in banks]
    x = jnp.asarray(rng.standard_normal((5, d)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, e, (5, 2)))
    weights = jnp.asarray(rng.random((5, 2)), jnp.float32)
    ours = moe(x, weights, ids, *qbanks, limit=None)
    # the QArray path decodes in plane order (zoo.kernels): the same weights, another summation order
    assert rel_err(ours, dense_moe(x, weights, ids, *dense, None)) <= 1e-6
