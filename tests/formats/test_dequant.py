"""zoo.quant dequantizers are bit-identical to gguf.quants.dequantize, for every supported type.

Compile time dominates: every comparison of one type goes through the same flat block count
(``N_WEIGHTS`` weights, whatever the leading shape), so each type compiles once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGUFReader
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES

from tests.support.paths import DATA
from zoo.formats.dequant import DEQUANTIZERS
from zoo.formats.ggml import BLOCK_LAYOUTS, F16, F32, QType, qtype_of, row_bytes, tensor_nbytes
from zoo.quant import dequantize, dequantize_jnp

N_WEIGHTS = 384 * 256  # per type and case: 384 super-blocks, 3072 legacy blocks
SUPPORTED = sorted(DEQUANTIZERS)
LEADING_SHAPES = [(), (4,), (2, 3)]  # rows of N_WEIGHTS split over these leading shapes
# Types gguf can quantize itself (quantize() raises NotImplementedError for the others).
QUANTIZABLE = [
    QType.F32, QType.F16, QType.BF16, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1,
    QType.Q8_0, QType.TQ1_0, QType.TQ2_0, QType.MXFP4,
]
# Exponent bits of the float fields the finite variant must keep below all-ones.
FLOAT_EXPONENT_MASKS = {F16: 0x7C00, F32: 0x7F800000}
BF16_EXPONENT_MASK = 0x7F80
# IQ1_M's f16 scale has its exponent's top bit in bit 6 of the block's last byte.
IQ1_M_SCALE_EXPONENT_TOP = (BLOCK_LAYOUTS[QType.IQ1_M].type_size - 1, 0x40)


def assert_bit_exact(ours: np.ndarray, ref: np.ndarray, context: object = "") -> None:
    """Same shape, same values (NaN where gguf has NaN), same float32 bits wherever not NaN."""
    assert ours.dtype == np.float32 and ref.dtype == np.float32, context
    assert ours.shape == ref.shape, context
    assert np.array_equal(ours, ref, equal_nan=True), (context, f"{np.sum(ours != ref)} values differ")
    not_nan = ~np.isnan(ref)
    assert np.array_equal(ours[not_nan].view(np.uint32), ref[not_nan].view(np.uint32)), context


def gguf_dequantize(data: np.ndarray, qtype: QType) -> np.ndarray:
    """The reference; quiet about the NaN / Inf that random scales produce."""
    with np.errstate(all="ignore"):
        return gq.dequantize(data, qtype)


def random_blocks(qtype: QType, rng: np.random.Generator) -> np.ndarray:
    """uint8[n_blocks, type_size] of random bytes, N_WEIGHTS weights."""
    layout = BLOCK_LAYOUTS[qtype]
    return rng.integers(0, 256, size=(N_WEIGHTS // layout.block_size, layout.type_size), dtype=np.uint8)


def _clear_top_exponent_bit_where_special(words: np.ndarray, mask: int) -> np.ndarray:
    top_bit = mask & ~(mask >> 1)
    return np.where((words & mask) == mask, words ^ top_bit, words).astype(words.dtype)


def with_finite_scales(blocks: np.ndarray, qtype: QType) -> np.ndarray:
    """A copy of ``blocks`` whose float fields (scales, or the values of F16/F32/BF16) are all
    finite (random bit patterns otherwise, subnormals included)."""
    blocks = blocks.copy()
    layout = BLOCK_LAYOUTS[qtype]
    if qtype == QType.IQ1_M:
        byte, bit = IQ1_M_SCALE_EXPONENT_TOP
        blocks[:, byte] &= ~np.uint8(bit)
    for field in layout.fields:
        mask = BF16_EXPONENT_MASK if qtype == QType.BF16 else FLOAT_EXPONENT_MASKS.get(field.dtype)
        if mask is None:
            continue
        word_dtype = np.uint32 if field.dtype.itemsize == 4 else np.uint16
        words = np.ascontiguousarray(blocks[:, field.offset : field.end]).view(word_dtype)
        blocks[:, field.offset : field.end] = _clear_top_exponent_bit_where_special(words, mask).view(np.uint8)
    return blocks


def as_rows(blocks: np.ndarray, leading: tuple[int, ...]) -> np.ndarray:
    """The same bytes as rows: ``uint8[*leading, n_bytes]``."""
    return blocks.reshape(*leading, -1) if leading else blocks.reshape(-1)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_random_bytes_match_gguf(qtype: QType) -> None:
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, rng)
    cases = {"random": raw, "finite scales": with_finite_scales(raw, qtype)}
    assert not np.isnan(gguf_dequantize(cases["finite scales"], qtype)).any()
    for case, blocks in cases.items():
        for leading in LEADING_SHAPES:
            rows = as_rows(blocks, leading)
            ours = dequantize(rows, qtype)
            assert ours.shape == (*leading, N_WEIGHTS // math.prod(leading))
            assert_bit_exact(ours, gguf_dequantize(rows, qtype), (case, leading))


def quantizable_data(rng: np.random.Generator) -> np.ndarray:
    """float32[8, 2048] spanning magnitudes, with a zero row and rows at MXFP4's subnormal scales."""
    data = rng.standard_normal((8, 2048)).astype(np.float32)
    data *= np.float32([1, 1e-3, 1e3, 0, 2.0**-125, 2.0**-124, 1e-6, 50])[:, None]
    return data


def gguf_quantize(data: np.ndarray, qtype: QType) -> np.ndarray:
    with np.errstate(all="ignore"):  # gguf's quantizers divide by the (tiny or zero) scales
        return gq.quantize(data, qtype)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_gguf_quantized_data_round_trips(qtype: QType) -> None:
    data = quantizable_data(np.random.default_rng(7))
    quantized = gguf_quantize(data, qtype)
    ours = dequantize(quantized, qtype)
    assert_bit_exact(ours, gguf_dequantize(quantized, qtype))
    assert ours.shape == data.shape
    row_max = np.abs(data).max(axis=-1)
    big = row_max > 1e-3  # sanity: the quantized values approximate the data (ternary: within half the max)
    assert (np.abs(ours - data).max(axis=-1)[big] <= 0.51 * row_max[big]).all()


def test_mxfp4_subnormal_scales_are_not_flushed() -> None:
    data = quantizable_data(np.random.default_rng(8))[4:6]
    quantized = gguf_quantize(data, QType.MXFP4)
    assert {0, 1} <= set(quantized.reshape(-1, 17)[:, 0].tolist())  # E8M0 scales 2**-128, 2**-127
    ours = dequantize(quantized, QType.MXFP4)
    assert np.count_nonzero(ours) > 0.9 * ours.size
    assert_bit_exact(ours, gguf_dequantize(quantized, QType.MXFP4))


FIXTURES = {
    "glm53-q256-udmix.gguf": {"F32", "Q8_0", "IQ2_S", "IQ3_S", "Q6_K"},
    "qwen38-q256-udmix.gguf": {"F32", "Q8_0", "IQ3_XXS", "IQ4_XS", "Q6_K"},
}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_llama_cpp_quantized_tensors_match_gguf(name: str) -> None:
    path = DATA / name
    assert path.is_file(), f"committed fixture {path} is missing"
    tensors = GGUFReader(path).tensors
    assert {t.tensor_type.name for t in tensors} == FIXTURES[name]
    for tensor in tensors:
        ours = dequantize(tensor.data, tensor.tensor_type)
        ref = gguf_dequantize(tensor.data, tensor.tensor_type)
        assert ours.shape == ref.shape, tensor.name
        assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), tensor.name


@pytest.mark.parametrize("qtype", [QType.IQ2_S, QType.Q6_K, QType.MXFP4, QType.F16], ids=lambda t: t.name)
def test_jit_blocks_in_blocks_out(qtype: QType) -> None:
    layout = BLOCK_LAYOUTS[qtype]
    blocks = with_finite_scales(random_blocks(qtype, np.random.default_rng(3)), qtype)
    stacked = blocks.reshape(2, -1, layout.type_size)
    # no float arithmetic after dequantizing: XLA:CPU would flush MXFP4's subnormals to zero
    step = jax.jit(lambda b: jnp.flip(dequantize_jnp(b, qtype.name.lower()), axis=0))
    ours = np.asarray(step(stacked))
    assert ours.shape == (2, stacked.shape[1], layout.block_size)
    assert_bit_exact(ours, np.flip(gguf_dequantize(stacked, qtype).reshape(ours.shape), axis=0))


def test_qtype_of_accepts_enum_int_and_name() -> None:
    assert qtype_of(QType.IQ2_S) is QType.IQ2_S
    assert qtype_of(22) is QType.IQ2_S
    assert qtype_of("iq2_s") is QType.IQ2_S
    assert qtype_of("IQ2_S") is QType.IQ2_S


@pytest.mark.parametrize("bad", ["IQ9_Z", 12345, 2.5])
def test_unknown_type_raises_value_error_naming_it(bad) -> None:
    with pytest.raises(ValueError, match=str(bad)):
        qtype_of(bad)
    with pytest.raises(ValueError, match=str(bad)):
        dequantize(np.zeros(34, np.uint8), bad)


def test_partial_block_raises_value_error() -> None:
    with pytest.raises(ValueError, match="not a whole number of Q8_0 blocks"):
        dequantize(np.zeros((2, 35), np.uint8), "Q8_0")
    with pytest.raises(ValueError, match="not a whole number of IQ2_S blocks"):
        dequantize_jnp(np.zeros(83, np.uint8), QType.IQ2_S)
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size"):
        row_bytes("Q4_K", 100)
    with pytest.raises(ValueError, match="not a multiple of the Q4_0 block size"):
        tensor_nbytes(QType.Q4_0, (4, 48))


def test_unsupported_known_type_raises_not_implemented() -> None:
    with pytest.raises(NotImplementedError, match="Q8_K"):
        dequantize(np.zeros(292, np.uint8), QType.Q8_K)


def test_layouts_agree_with_gguf_sizes() -> None:
    for qtype, (block_size, type_size) in GGML_QUANT_SIZES.items():
        layout = BLOCK_LAYOUTS[qtype]
        assert (layout.block_size, layout.type_size) == (block_size, type_size), qtype.name
        assert sum(f.nbytes for f in layout.fields) == type_size, qtype.name
        assert tensor_nbytes(qtype, (3, 4 * block_size)) == 3 * 4 * type_size
        assert row_bytes(qtype, 4 * block_size) == gq.quant_shape_to_byte_shape((4 * block_size,), qtype)[0]


def test_empty_input() -> None:
    ours = dequantize(np.zeros((0, 68), np.uint8), QType.Q8_0)
    assert ours.shape == (0, 64) and ours.dtype == np.float32
