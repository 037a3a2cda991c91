"""Leaves read straight from a group's OCDBT data files (``zoo.weight_cache.ocdbt_reader``): bit-exact
against what Orbax saved, for every layout it claims (one chunk, inline values, 0-d, chunks of whole
rows), and anything else left to TensorStore."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

import zoo
from zoo.formats.host_arrays import is_aligned
from zoo.weight_cache import group_reads, ocdbt_reader, store


def _arrays():
    rng = np.random.default_rng(0)
    return {
        "0": rng.standard_normal((300, 70)).astype(ml_dtypes.bfloat16),     # one chunk, in a data file
        "1": rng.standard_normal(3).astype(np.float32),                     # inline in the tree node
        "2": np.array(7, np.int32),                                         # 0-d
        "3": rng.integers(0, 255, (64, 10), dtype=np.uint8),                # split into chunks of 8 rows
        "4": rng.standard_normal((4, 40)).astype(np.float32),               # split along its columns
    }


def _save(path: Path, arrays: dict) -> None:
    """As the cache writes a group (``store._checkpointer``), with leaves 3 and 4 split into chunks."""
    save_args = {k: ocp.SaveArgs(chunk_byte_size=128 if k in ("3", "4") else None) for k in arrays}
    store._checkpointer().save(path, args=ocp.args.PyTreeSave(arrays, save_args=save_args))


def test_direct_reads_are_bit_exact_and_others_are_left_to_tensorstore(tmp_path):
    arrays = _arrays()
    state = (tmp_path / "group").absolute()
    _save(state, arrays)
    direct = ocdbt_reader.direct_reads(state, arrays)
    assert set(direct) == {"0", "1", "2", "3"}            # 4's chunks are not whole rows
    assert len(direct["3"].pieces) == 8 and direct["1"].pieces[0][0] is None and direct["0"].pieces[0][0] is not None
    for k, d in direct.items():
        got = ocdbt_reader.read_leaf(d)
        assert got.dtype == arrays[k].dtype and got.shape == arrays[k].shape
        assert got.tobytes() == arrays[k].tobytes(), k
    target = {k: jax.ShapeDtypeStruct(a.shape, a.dtype) for k, a in arrays.items()}
    host = group_reads.read_leaves_here(tmp_path, "group", state, target)          # direct, and TensorStore for 4
    assert list(host) == list(arrays)
    for k, a in arrays.items():
        assert host[k].tobytes() == a.tobytes() and is_aligned(host[k]), k


def test_a_layout_it_does_not_know_reads_nothing_directly(tmp_path):
    """A store whose description cannot be had (no OCDBT manifest) or a leaf that is not there: no
    direct read is claimed, and nothing is raised (TensorStore then reports what is wrong)."""
    arrays = _arrays()
    state = (tmp_path / "group").absolute()
    _save(state, arrays)
    assert set(ocdbt_reader.direct_reads(state, ["0", "9"])) == {"0"}
    (state / "manifest.ocdbt").unlink()
    assert ocdbt_reader.direct_reads(state, arrays) == {}


def test_every_leaf_of_a_model_entry_is_read_directly(tmp_path):
    """The cache entry of a real (tiny) model: every leaf of every group has a direct read, so the
    restore's path is this one and not TensorStore's."""
    model = zoo.load("qwen38-tiny", cache=tmp_path)
    entry = Path(model.load_info["cache_path"])
    manifest = store.read_manifest(entry)
    keys: dict[str, set] = {}
    for rec in manifest["params"].values():
        keys.setdefault(rec["group"], set()).update(str(rec["first"] + i) for i in range(len(rec["leaves"])))
    for group, wanted in keys.items():
        assert set(ocdbt_reader.direct_reads((entry / "state" / group).absolute(), wanted)) == wanted, group


def test_mapped_leaves_are_read_only_views_of_the_data_files_and_bit_exact(tmp_path):
    """``map_leaves``: a mappable leaf is a read-only, aligned view of a map of its file's bytes,
    bit-exact; inline values are never mapped (the restore reads them)."""
    arrays = _arrays()
    state = (tmp_path / "group").absolute()
    _save(state, arrays)
    direct = ocdbt_reader.direct_reads(state, arrays)
    host, files = ocdbt_reader.map_leaves(direct)
    assert "1" not in host and "0" in host               # inline in the tree node / one chunk in a data file
    assert set(host) == {k for k, d in direct.items() if ocdbt_reader.mappable(d)}
    assert files == {path for k in host for path, _, _ in direct[k].pieces}
    maps = Path("/proc/self/maps").read_text()
    for k, a in host.items():
        assert a.dtype == arrays[k].dtype and a.shape == arrays[k].shape and a.tobytes() == arrays[k].tobytes(), k
        assert not a.flags.writeable and is_aligned(a), k
        assert all(str(path) in maps for path, _, _ in direct[k].pieces), k


def test_a_split_leaf_stored_in_any_order_maps_into_one_range(tmp_path):
    """A leaf of several chunks at page boundaries of their files, in any order and any files (the
    embedding of the full-size Qwen3.8-27B entry: its second chunk first in the file), is mapped
    side by side into one range and reads back whole."""
    rng = np.random.default_rng(1)
    leaf = rng.integers(0, 255, (5, 8192), dtype=np.uint8)           # 5 rows of 2 pages
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(bytes(4096) + leaf[2:4].tobytes() + leaf[0:2].tobytes())
    b.write_bytes(leaf[4:].tobytes())
    read = ocdbt_reader.DirectRead(leaf.shape, np.dtype(np.uint8),
                                   ((a, 4096 + 2 * 8192, 2 * 8192), (a, 4096, 2 * 8192), (b, 0, 8192)), (None,) * 3)
    assert ocdbt_reader.mappable(read)
    host, files = ocdbt_reader.map_leaves({"0": read})
    assert files == {a, b} and np.array_equal(host["0"], leaf) and not host["0"].flags.writeable


def test_what_is_mappable(tmp_path):
    """``mappable``: some bytes, none inline; one piece from a 64-byte boundary, or several each from a
    page boundary and each but the last whole pages."""
    a, b = tmp_path / "a", tmp_path / "b"

    def read(*pieces):
        shape = (sum(n for _, _, n in pieces),)
        return ocdbt_reader.DirectRead(shape, np.dtype(np.uint8), tuple(pieces), (None,) * len(pieces))

    assert ocdbt_reader.mappable(read((a, 128, 100)))
    assert not ocdbt_reader.mappable(read((a, 136, 100)))                         # not on a 64-byte boundary
    assert ocdbt_reader.mappable(read((a, 8192, 4096), (b, 0, 100)))              # two files, any order
    assert not ocdbt_reader.mappable(read((a, 8192 + 64, 4096), (a, 0, 100)))     # not on a page boundary
    assert not ocdbt_reader.mappable(read((a, 8192, 4000), (a, 0, 100)))          # a piece of part of a page
    inline = ocdbt_reader.DirectRead((128,), np.dtype(np.uint8), ((None, 0, 128),), (b"x" * 128,))
    assert not ocdbt_reader.mappable(inline)
    assert not ocdbt_reader.mappable(ocdbt_reader.DirectRead((0, 32), np.dtype(np.uint8), ((a, 0, 0),), (None,)))


def test_mapping_off_maps_nothing(tmp_path, monkeypatch):
    arrays = _arrays()
    state = (tmp_path / "group").absolute()
    _save(state, arrays)
    monkeypatch.setenv("ZOO_CACHE_MMAP", "0")
    assert ocdbt_reader.map_leaves(ocdbt_reader.direct_reads(state, arrays)) == ({}, set())


def test_a_file_cut_short_under_a_map_is_an_error_not_a_crash(tmp_path):
    """A data file shortened after its reads were planned: faulting the map in fails with an
    ``OSError`` (the restore then rebuilds), never a ``SIGBUS`` at the first read of the weights."""
    a = tmp_path / "a"
    a.write_bytes(np.arange(3 * 4096, dtype=np.uint8).tobytes())
    read = ocdbt_reader.DirectRead((3, 4096), np.dtype(np.uint8), ((a, 0, 3 * 4096),), (None,))
    os.truncate(a, 4096)
    with pytest.raises(OSError, match="cannot read a mapped cache leaf"):
        ocdbt_reader.map_leaves({"0": read})
