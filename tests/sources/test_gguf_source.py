"""GGUFSource: the source protocol over GGUF files and split sets, metadata, and clear errors for
corrupt input (including a bounded hypothesis fuzz of mutated headers)."""

from __future__ import annotations

import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.gguf_files import write_gguf
from tests.support.paths import DATA
from zoo.formats.ggml import QType
from zoo.sources.base import SourceError
from zoo.sources.gguf import GGUFSource

QWEN = DATA / "qwen38-q256-udmix.gguf"
GLM = DATA / "glm53-q256-udmix.gguf"


def small_tensors(rng) -> dict:
    return {
        "a.weight": (rng.standard_normal((4, 64)).astype(np.float32), QType.F32),
        "b.weight": (rng.standard_normal((3, 64)).astype(np.float32), QType.Q8_0),
        "c.weight": (rng.standard_normal((2, 5, 32)).astype(np.float32), QType.BF16),
        "d.bias": (rng.standard_normal(7).astype(np.float32), QType.F16),
    }


SMALL_META = [("general.name", "tiny", GGUFValueType.STRING, None),
              ("x.count", 3, GGUFValueType.UINT32, None),
              ("x.eps", 0.5, GGUFValueType.FLOAT32, None),
              ("x.flags", [True, False], GGUFValueType.ARRAY, GGUFValueType.BOOL),
              ("x.words", ["ab", "c"], GGUFValueType.ARRAY, GGUFValueType.STRING)]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, dict]:
    tensors = small_tensors(np.random.default_rng(0))
    path = write_gguf(tmp_path_factory.mktemp("small") / "small.gguf", "testarch", SMALL_META, tensors)
    return path, tensors


def test_reads_every_fixture_tensor_like_gguf_reader():
    for path in (QWEN, GLM):
        src, reader = GGUFSource(path), GGUFReader(path)
        assert src.keys() == [t.name for t in reader.tensors]
        for t in reader.tensors:
            info = src.info(t.name)
            assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist()))   # numpy order
            assert info.qtype == t.tensor_type and info.nbytes == t.n_bytes
            data = src.read(t.name)
            assert type(data) is np.ndarray and data.shape == t.data.shape
            assert np.array_equal(data.view(np.uint8), np.asarray(t.data).view(np.uint8)), t.name


def test_metadata_and_architecture():
    src = GGUFSource(QWEN)
    assert src.architecture == "qwen35"
    assert src.arch_value("block_count") == 4
    assert src.arch_value("attention.recurrent_layers") == [True, True, True, False]
    assert len(src.metadata["tokenizer.ggml.tokens"]) == 512
    assert src.arch_value("nextn_predict_layers", 0) == 0
    with pytest.raises(SourceError, match="qwen35.nope"):
        src.arch_value("nope")
    assert GGUFSource(GLM).architecture == "glm5-next"


def test_partial_reads_of_experts_and_rows():
    src = GGUFSource(GLM)
    key = "blk.1.ffn_gate_exps.weight"                       # IQ2_S [8 experts, 256 rows, 256 weights]
    info = src.info(key)
    assert info.quantized and info.shape == (8, 256, 256) and info.stored_shape == (8, 256, 82)
    full = src.read(key)
    assert np.array_equal(src.read(key, 5), full[5])
    assert np.array_equal(src.read(key, (slice(2, 4), slice(10, 20))), full[2:4, 10:20])
    with pytest.raises(SourceError, match="leading axes"):
        src.read(key, (0, 0, 0))
    assert np.array_equal(src.read("token_embd.weight", slice(7, 9)), src.read("token_embd.weight")[7:9])


def test_float_types_read_as_their_dtype(small):
    path, tensors = small
    src = GGUFSource(path)
    assert src.read("a.weight").dtype == np.float32 and np.array_equal(src.read("a.weight"), tensors["a.weight"][0])
    c = src.read("c.weight")
    assert c.dtype == ml_dtypes.bfloat16 and c.shape == (2, 5, 32)
    assert np.array_equal(c[1], src.read("c.weight", 1))
    np.testing.assert_allclose(c.astype(np.float32), tensors["c.weight"][0], rtol=1e-2)
    assert src.read("d.bias").dtype == np.float16
    assert src.info("b.weight").qtype == QType.Q8_0 and src.read("b.weight").shape == (3, 68)
    assert src.metadata["x.words"] == ["ab", "c"] and src.metadata["x.flags"] == [True, False]


def test_split_set_reads_like_the_single_file(small, tmp_path):
    path, tensors = small
    first = write_gguf(tmp_path / "split.gguf", "testarch", SMALL_META, tensors, split_max_tensors=1)
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert first.name == "split-00001-of-00004.gguf" and len(shards) == 4
    single, split = GGUFSource(path), GGUFSource(first)
    assert split.files == shards and split.keys() == single.keys()
    assert split.metadata == single.metadata and split.architecture == "testarch"
    for key in single.keys():
        assert np.array_equal(split.read(key).view(np.uint8), single.read(key).view(np.uint8))
    assert GGUFSource(shards[2]).keys() == single.keys()        # any shard opens the whole set
    shards[2].unlink()
    with pytest.raises(SourceError, match="missing shard.*split-00003-of-00004.gguf"):
        GGUFSource(first)


def test_tensor_missing_names_the_files(small):
    with pytest.raises(SourceError, match=r"no tensor 'nope' in .*small.gguf"):
        GGUFSource(small[0]).info("nope")


# --- corrupt input ------------------------------------------------------------------------------


def header_end(path: Path) -> int:
    """Offset of the first tensor's data (end of the header and padding)."""
    return GGUFReader(path).data_offset


def tensor_infos_end(path: Path) -> int:
    """Offset just past the last tensor info (where the alignment padding starts)."""
    field = GGUFReader(path).tensors[-1].field
    return field.offset + sum(int(p.nbytes) for p in field.parts)


def corrupt(tmp_path: Path, raw: bytes, name: str = "bad.gguf") -> Path:
    out = tmp_path / name
    out.write_bytes(raw)
    return out


def test_bad_magic_version_and_empty_file(small, tmp_path):
    raw = small[0].read_bytes()
    with pytest.raises(SourceError, match="bad.gguf: not a GGUF file"):
        GGUFSource(corrupt(tmp_path, b"GGUX" + raw[4:]))
    with pytest.raises(SourceError, match="unsupported GGUF version 7"):
        GGUFSource(corrupt(tmp_path, raw[:4] + struct.pack("<I", 7) + raw[8:]))
    with pytest.raises(SourceError, match="empty file"):
        GGUFSource(corrupt(tmp_path, b""))
    with pytest.raises(SourceError, match="no such GGUF file"):
        GGUFSource(tmp_path / "absent.gguf")


def test_truncated_files(small, tmp_path):
    raw = small[0].read_bytes()
    for cut in (6, 30, tensor_infos_end(small[0]) - 3):
        with pytest.raises(SourceError, match="bad.gguf: truncated GGUF header"):
            GGUFSource(corrupt(tmp_path, raw[:cut]))
    with pytest.raises(SourceError, match=r"bad.gguf: tensor 'd.bias' needs bytes up to \d+, the file has"):
        GGUFSource(corrupt(tmp_path, raw[:-20]))


def test_unknown_tensor_type_names_the_tensor(small, tmp_path):
    raw = bytearray(small[0].read_bytes())
    field = GGUFReader(small[0]).tensors[1].field    # b.weight: name len, name, n_dims, dims, type, offset
    type_offset = field.offset + sum(int(p.nbytes) for p in field.parts[:4])
    raw[type_offset:type_offset + 4] = struct.pack("<I", 99)
    with pytest.raises(SourceError, match="tensor 'b.weight' has unknown ggml type 99"):
        GGUFSource(corrupt(tmp_path, bytes(raw)))


def test_huge_array_length_is_an_error_not_a_hang(small, tmp_path):
    """gguf's own reader loops (practically) forever on this; the header check refuses it."""
    raw = bytearray(small[0].read_bytes())
    field = GGUFReader(small[0]).fields["x.flags"]
    length_offset = field.offset + sum(int(p.nbytes) for p in field.parts[:4])   # key len, key, type, item type
    raw[length_offset:length_offset + 8] = struct.pack("<Q", 1 << 60)
    with pytest.raises(SourceError, match="'x.flags' claims 1152921504606846976 elements"):
        GGUFSource(corrupt(tmp_path, bytes(raw)))


def test_an_empty_tensor_with_an_absurd_other_dim_is_an_error(small, tmp_path):
    """A header edit the fuzzer found (4 bytes at 262 set to 32): a.weight's dims become (0, 2^61),
    zero bytes, whose array numpy cannot even make. The header check names it."""
    raw = bytearray(small[0].read_bytes())
    raw[262:266] = (32).to_bytes(4, "little")
    with pytest.raises(SourceError, match="'a.weight' has dims .*more than any file holds"):
        GGUFSource(corrupt(tmp_path, bytes(raw)))


@settings(max_examples=50, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_headers_give_clear_errors_only(small, tmp_path, data):
    """Random byte edits in the header, random truncation: either the file opens and every tensor
    reads, or a SourceError is raised (never another exception, never a hang)."""
    raw = bytearray(small[0].read_bytes())
    end = header_end(small[0])
    for _ in range(data.draw(st.integers(1, 4), label="n_edits")):
        pos = data.draw(st.integers(0, end - 1), label="pos")
        width = data.draw(st.sampled_from([1, 4, 8]), label="width")
        value = data.draw(st.integers(0, 2 ** (8 * width) - 1), label="value")
        raw[pos:pos + width] = value.to_bytes(width, "little")[:len(raw) - pos]
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[:data.draw(st.integers(0, len(raw)), label="length")]
    path = corrupt(tmp_path, bytes(raw), "fuzz.gguf")
    try:
        src = GGUFSource(path)
        for key in src.keys():
            src.read(key)
    except SourceError as e:
        assert "fuzz.gguf" in str(e)
