"""The loader's host-side fast paths (``zoo.formats.host_arrays`` and what uses it): aligned buffers that
the CPU backend adopts without a copy, ``preadv`` reads, planes written a band of rows at a time,
dequantization a chunk at a time straight to the parameter dtype, the engine's cache budget on a
CPU host. Each is checked against the plain computation it replaces."""

from __future__ import annotations

import os

import jax
import ml_dtypes
import numpy as np
import pytest

from tests.support.kernel_cases import random_rows
from tests.support.paths import DATA
from zoo.formats import dequant as D
from zoo.formats import planes as P
from zoo.formats.ggml import BLOCK_LAYOUTS, QType
from zoo.formats.host_arrays import aligned_empty, is_aligned, read_into, to_device
from zoo.sources.gguf import GGUFSource


@pytest.mark.parametrize("shape,dtype", [((3, 5), np.float32), ((1 << 20,), np.uint8), ((7,), ml_dtypes.bfloat16)])
def test_aligned_buffers_become_the_device_buffer(shape, dtype):
    a = aligned_empty(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype) and is_aligned(a)
    a[...] = 1
    x = to_device(a)
    if jax.default_backend() == "cpu":                 # XLA's CPU client adopts the host buffer
        assert x.unsafe_buffer_pointer() == a.ctypes.data
    np.testing.assert_array_equal(np.asarray(x), a)
    odd = np.ones(11, np.float32)[1:]                  # not aligned: copied, same values
    assert not is_aligned(odd) and np.array_equal(np.asarray(to_device(odd)), odd)


def test_read_into_reads_the_byte_range_and_refuses_a_short_file(tmp_path):
    path = tmp_path / "bytes"
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    got = read_into(path, 12345, 2 << 20)
    assert is_aligned(got) and np.array_equal(got, data[12345:12345 + (2 << 20)])
    with pytest.raises(OSError, match="bytes missing"):
        read_into(path, len(data) - 10, 20)
    whole = aligned_empty(300, np.uint8)                # ``out``: into a part of a larger buffer
    assert read_into(path, 7, 100, out=whole[100:200]) is not None
    assert np.array_equal(whole[100:200], data[7:107])
    with pytest.raises(ValueError, match="contiguous uint8"):
        read_into(path, 7, 100, out=whole[:101])


def test_gguf_reads_equal_the_memory_map():
    """Whole tensors and leading-axis ranges come through ``preadv``; both equal the mapped bytes."""
    src = GGUFSource(DATA / "glm53-q256-udmix.gguf")
    for key in src.keys():
        info = src.info(key)
        mapped = np.memmap(info.file, np.uint8, "r", info.offset, (info.nbytes,)).view(info.dtype).reshape(
            info.stored_shape)
        assert np.array_equal(src.read(key), mapped), key
        if len(info.shape) >= 2 and info.shape[0] > 2:
            assert np.array_equal(src.read(key, (slice(1, 3),)), mapped[1:3]), key
            assert np.array_equal(src.read(key, (1,)), mapped[1]), key


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.Q6_K, QType.IQ3_XXS, QType.IQ2_S, QType.IQ3_S,
                                   QType.Q3_K], ids=lambda t: t.name)
def test_planes_over_several_bands_equal_the_plain_transpose(qtype):
    """Rows beyond one band of ``TRANSPOSE_ROWS`` (and experts): every plane equals the plane made the
    plain way (gather the field's bytes, view them as words, transpose)."""
    rows = 2 * P.TRANSPOSE_ROWS + 37
    data = random_rows(qtype, (2,), rows=rows, n_blocks=4)
    planes = P.to_planes(data, qtype)
    layout = BLOCK_LAYOUTS[qtype]
    blocks = data.reshape(2, rows, 4, layout.type_size)
    for f in layout.fields:
        raw = blocks[..., f.offset:f.end]
        k = P.blocks_per_word_group(f)
        if -4 % k:                                              # a word group's padding blocks
            raw = np.concatenate([raw, np.zeros((2, rows, -4 % k, f.nbytes), np.uint8)], axis=-2)
        words = np.ascontiguousarray(raw).reshape(2, rows, -1).view("<u4")
        assert np.array_equal(planes[f.name], np.swapaxes(words, -1, -2)), f.name
        assert is_aligned(planes[f.name])
    assert np.array_equal(np.asarray(P.from_planes(planes, qtype, 4)), data)


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K, QType.IQ3_XXS], ids=lambda t: t.name)
def test_dequantize_as_equals_dequantize_then_cast(qtype, monkeypatch):
    """A chunk of blocks at a time, the last one padded: the same bits as dequantizing whole to float32
    and casting."""
    monkeypatch.setattr(D, "CHUNK_BLOCKS", 7)
    data = random_rows(qtype, (), rows=9, n_blocks=3)            # 27 blocks: 3 chunks of 7 and one of 6
    for dtype in (ml_dtypes.bfloat16, np.float32):
        got = D.dequantize_as(data, qtype, dtype)
        want = D.dequantize(data, qtype).astype(dtype)
        assert got.dtype == np.dtype(dtype) and is_aligned(got)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_the_cpu_cache_budget_leaves_the_programs_room(monkeypatch):
    """On a host without device memory stats the caches get at most 40% of the RAM still available
    (the loaded weights are in that RAM), and the prefix cache's host tier at most a fifth of it."""
    from zoo.engine import rows

    monkeypatch.setattr(rows, "host_available", lambda: 1 << 30)
    if "bytes_limit" not in (jax.local_devices()[0].memory_stats() or {}):
        assert rows.default_memory_budget() == int(0.4 * (1 << 30))
    assert rows.default_host_tier() == int(0.2 * (1 << 30))


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="page cache hints are a Linux call")
def test_reads_of_a_file_large_for_the_host_leave_no_page_cache_copy(tmp_path, monkeypatch):
    """A file of at least a quarter of the host's memory: the page cache's copy of what ``read_into``
    read is dropped (the loader keeps the bytes; reclaiming that copy was most of a large load's
    time), the bytes outside the read stay. A smaller file stays cached. Residency by ``mincore``."""
    from tests.support.page_cache import make_resident, resident_fraction
    from zoo.formats import host_arrays

    path = tmp_path / "weights"
    data = np.random.default_rng(1).integers(0, 256, 4 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    make_resident([path])
    assert resident_fraction(path) == 1.0
    got = read_into(path, 0, 2 << 20)                                      # 4 MiB on this host: small
    assert np.array_equal(got, data[:2 << 20]) and resident_fraction(path) == 1.0
    monkeypatch.setattr(host_arrays, "host_memory", lambda: 16 << 20)     # a host of 16 MiB: large
    assert host_arrays.large_for_host(4 << 20) and not host_arrays.large_for_host((4 << 20) - 1)
    got = read_into(path, 0, 2 << 20)
    assert np.array_equal(got, data[:2 << 20])
    assert resident_fraction(path) == 0.5                                   # the half not read stays
    host_arrays.drop_cached([path, tmp_path / "missing"])                  # a missing file is skipped
    assert resident_fraction(path) == 0.0


def test_a_gguf_source_drops_what_it_reads_where_the_model_is_large_for_the_host(monkeypatch):
    """A GGUF source decides once, from its whole file set (a split model of small files is large
    too), and every read passes that to ``read_into`` (whose dropping is checked above)."""
    from zoo.formats import host_arrays
    from zoo.sources import gguf

    path = DATA / "glm53-q256-udmix.gguf"
    passed = []
    read = gguf.read_into
    monkeypatch.setattr(gguf, "read_into", lambda *a: passed.append(a[3]) or read(*a))
    for memory, drop in [(4 * path.stat().st_size, True), (4 * path.stat().st_size + 1, False)]:
        monkeypatch.setattr(host_arrays, "host_memory", lambda m=memory: m)
        passed.clear()
        src = GGUFSource(path)
        for key in src.keys():
            src.read(key)
        assert len(passed) == len(src.keys()) and set(passed) == {drop}, (memory, set(passed))
