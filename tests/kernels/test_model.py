"""The kernels on real quantized blocks (the fixture GGUFs written by llama.cpp's quantizer), in the
models, and the dispatch rule.

* the GLM fixture's IQ2_S / IQ3_S expert banks through the decode and the grouped kernels;
* the Qwen fixture's IQ3_XXS / IQ4_XS / Q6_K / Q8_0 matrices through both linear kernels;
* the tiny quantized models loaded from those GGUFs give the same logits on the kernel path
  (Pallas, interpret mode) as on the jnp path: Qwen through the decode kernels, GLM through the
  decode kernels (8 tokens) and through the grouped GEMM (128-token prefill).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants as gq

import zoo
from tests.support.kernel_cases import activations, jit_static, moe_oracle, rel_err, tpu_custom_calls
from tests.support.paths import DATA
from zoo.formats import planes as P
from zoo.formats.ggml import BLOCK_LAYOUTS, QType
from zoo.kernels import dequant_matvec as mv
from zoo.kernels import dequant_matvec_gpu as mv_gpu
from zoo.kernels import dispatch
from zoo.kernels import grouped_matmul as gm
from zoo.kernels.dispatch import Policy, use_policy
from zoo.quant.qarray import QArray
from zoo.sources.gguf import GGUFSource

GLM, QWEN = DATA / "glm53-q256-udmix.gguf", DATA / "qwen38-q256-udmix.gguf"
TOL = 1e-6
KERNELS = Policy(backend="tpu", interpret=True)


def fixture_matrix(path, key: str) -> tuple[QArray, np.ndarray]:
    """A quantized tensor of a fixture as a QArray ``[*lead, in, out]`` and its float64 weights."""
    src = GGUFSource(path)
    raw, qtype = src.read(key), src.info(key).qtype
    return QArray.from_blocks(raw, qtype), np.swapaxes(gq.dequantize(raw, qtype), -1, -2).astype(np.float64)


def test_glm_expert_banks_through_both_kernels():
    """Layer 1's routed experts (gate/up IQ2_S, down IQ3_S, 8 experts): decode kernel on 3 rows
    sharing experts, grouped kernel on 24 rows, both == jnp reference == float64 oracle."""
    banks, dense = zip(*(fixture_matrix(GLM, f"blk.1.ffn_{p}_exps.weight") for p in ("gate", "up", "down")))
    assert [b.qtype for b in banks] == [QType.IQ2_S, QType.IQ2_S, QType.IQ3_S]
    rng = np.random.default_rng(0)
    for rows, kernel in [(3, functools.partial(mv.moe_matvec, interpret=True)),
                         (24, functools.partial(gm.moe_grouped, block_rows=8, interpret=True))]:
        x = activations((rows, 256), seed=rows)
        ids = np.stack([rng.permutation(8)[:2] for _ in range(rows)]).astype(np.int32)
        ids[0] = ids[-1]
        weights = rng.random((rows, 2)).astype(np.float32)
        ours = jit_static(kernel, 6)(x, weights, ids, *banks, 3.0)
        theirs = jit_static(mv.reference_moe, 6)(x, weights, ids, *banks, 3.0)
        oracle = moe_oracle(x, weights, ids, *dense, 3.0)
        assert max(rel_err(ours, oracle), rel_err(theirs, oracle), rel_err(ours, theirs)) <= TOL, rows


@pytest.mark.parametrize("key", ["blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "output.weight",
                                 "blk.0.attn_qkv.weight"])
def test_qwen_matrices_through_both_linear_kernels(key):
    """IQ3_XXS, IQ4_XS, Q6_K, Q8_0 matrices: matvec on 4 rows, grouped GEMM on 20 rows."""
    w, dense = fixture_matrix(QWEN, key)
    for rows, kernel in [(4, functools.partial(mv.linear_matvec, interpret=True)),
                         (20, functools.partial(gm.linear_grouped, block_rows=8, interpret=True))]:
        x = activations((rows, w.shape[0]), seed=rows)
        ours = jit_static(kernel, 2)(x, w, jnp.float32)
        theirs = jit_static(mv.reference_linear, 2)(x, w, jnp.float32)
        oracle = x.astype(np.float64) @ dense
        assert max(rel_err(ours, oracle), rel_err(theirs, oracle), rel_err(ours, theirs)) <= TOL, (key, rows)


def test_qwen_decode_logits_on_the_kernels_equal_the_jnp_path():
    """8 tokens (decode kernels for every quantized matrix) against the jnp path's full-sequence
    logits (causal: the same first 8 positions)."""
    ids = np.load(DATA / "qwen38-q256.input_ids.npy")
    jnp_path = zoo.load(QWEN, dtype="float32").logits(ids)
    with use_policy(KERNELS):
        ours = zoo.load(QWEN, dtype="float32").logits(ids[:1, :8])
    err = rel_err(ours, jnp_path[:1, :8])
    print(f"qwen38-q256-udmix, decode kernels vs jnp path: {err:.3e}")
    assert err <= 1e-5


def test_glm_decode_logits_on_the_kernels_equal_the_jnp_path():
    """8 tokens (<= 16 rows: routed experts through the de-duplicating decode kernel) against the
    jnp path; with the prefill test below, decode and prefill kernels agree on the same model."""
    ids = np.load(DATA / "glm53-q256.input_ids.npy")
    jnp_path = zoo.load(GLM, dtype="float32").logits(ids[:1, :8])
    with use_policy(KERNELS):
        ours = zoo.load(GLM, dtype="float32").logits(ids[:1, :8])
    err = rel_err(ours, jnp_path)
    print(f"glm53-q256-udmix, decode kernels vs jnp path: {err:.3e}")
    assert err <= 1e-5


def test_glm_prefill_logits_on_the_kernels_equal_the_jnp_path():
    """128 tokens: routed experts through the grouped GEMM (Q8_0 / Q6_K matrices through the
    grouped linear kernel), against the jnp path."""
    ids = np.load(DATA / "glm53-q256.input_ids.npy")
    jnp_path = zoo.load(GLM, dtype="float32").logits(ids)
    with use_policy(KERNELS):
        ours = zoo.load(GLM, dtype="float32").logits(ids)
    err = rel_err(ours, jnp_path)
    print(f"glm53-q256-udmix, grouped kernels vs jnp path: {err:.3e}")
    assert np.std(jnp_path) > 0.1 and err <= 1e-5


def test_dispatch_rule():
    """One place decides: formats without a tile decoder dequantize whole; up to 16 rows take the
    decode kernels, more the grouped GEMM; the backend picks Pallas TPU, Triton GPU or the jnp twins."""
    q8, _ = fixture_matrix(QWEN, "blk.0.attn_qkv.weight")
    banks = [fixture_matrix(GLM, f"blk.1.ffn_{p}_exps.weight")[0] for p in ("gate", "up", "down")]
    tpu, gpu, ref = Policy(backend="tpu"), Policy(backend="gpu"), Policy(backend="reference")
    assert dispatch.matmul_impl(16, q8, tpu).func is mv.linear_matvec
    assert dispatch.matmul_impl(17, q8, tpu).func is gm.linear_grouped
    assert dispatch.moe_impl(16, 2, banks, tpu).func is mv.moe_matvec
    grouped = dispatch.moe_impl(64, 8, banks, tpu)
    assert grouped.func is gm.moe_grouped and grouped.keywords["block_rows"] == 64
    assert dispatch.moe_impl(8, 2, banks, gpu).func is mv_gpu.moe_matvec_gpu
    assert dispatch.moe_impl(64, 2, banks, gpu) is gm.reference_moe                # no GPU grouped GEMM
    assert dispatch.matmul_impl(8, q8, ref) is mv.reference_linear
    assert dispatch.moe_impl(8, 2, banks, ref) is mv.reference_moe
    assert dispatch.moe_impl(64, 2, banks, ref) is gm.reference_moe
    assert dispatch.moe_impl(8, 2, banks, Policy(backend="dequantize")) is dispatch.dequantized_moe
    assert dispatch.matmul_impl(8, q8, gpu).func is mv_gpu.linear_matvec_gpu
    zeros = lambda qtype, *lead: QArray.from_blocks(                                 # noqa: E731
        np.zeros((*lead, 64, 2 * BLOCK_LAYOUTS[qtype].type_size), np.uint8), qtype)
    # measured on an H200 (bench/gpu_kernels.py): codebook matrices dequantize whole; IQ4_XS's
    # decoder overflows shared memory, so its banks take the jnp twin
    assert dispatch.matmul_impl(8, zeros(QType.IQ2_S), gpu) is dispatch.dequantized_matmul
    iq4 = [zeros(QType.IQ4_XS, 4)] * 3
    assert not mv_gpu.supported(*iq4) and dispatch.moe_impl(8, 2, iq4, gpu) is mv.reference_moe
    mxfp4 = QArray.from_blocks(np.zeros((4, 17), np.uint8), QType.MXFP4)          # no tile decoder
    assert dispatch.matmul_impl(8, mxfp4, tpu) is dispatch.dequantized_matmul
    with use_policy(tpu):
        assert dispatch.current_policy() is tpu
    assert dispatch.current_policy() == Policy()


def test_kernels_lower_at_glm_per_chip_sizes():
    """GLM-5.3-Flash on 8 chips (docs/reference.md section 4): per chip, gate/up [288, 4096, 256] IQ2_S,
    down [288, 256, 4096] IQ3_S; a 3-stream decode step and a 2048-token prefill; a Q8_0 [12288, 4096]
    dense projection. Abstract planes: the shapes, block specs and VMEM limits, nothing allocated."""
    def abstract(qtype, shape):
        *lead, d_in, d_out = shape
        planes = P.plane_shapes(qtype, tuple(lead), d_out, d_in // BLOCK_LAYOUTS[qtype].block_size)
        return QArray({k: jax.ShapeDtypeStruct(s, jnp.uint32) for k, s in planes.items()}, qtype, shape)

    banks = (abstract(QType.IQ2_S, (288, 4096, 256)), abstract(QType.IQ2_S, (288, 4096, 256)),
             abstract(QType.IQ3_S, (288, 256, 4096)))
    for rows, kernel in [(3, mv.moe_matvec), (2048, functools.partial(gm.moe_grouped, block_rows=64))]:
        x = jax.ShapeDtypeStruct((rows, 4096), jnp.bfloat16)
        ids, weights = jax.ShapeDtypeStruct((rows, 8), jnp.int32), jax.ShapeDtypeStruct((rows, 8), jnp.float32)
        assert tpu_custom_calls(jit_static(kernel, 6), x, weights, ids, *banks, 3.0) == 2
    dense = abstract(QType.Q8_0, (12288, 4096))
    x = jax.ShapeDtypeStruct((256, 12288), jnp.bfloat16)
    assert tpu_custom_calls(jit_static(gm.linear_grouped, 2), x, dense, jnp.bfloat16) == 1
