"""Leaves read straight from a group's OCDBT data files (``zoo.weight_cache.ocdbt_reader``): bit-exact
against what Orbax saved, for every layout it claims (one chunk, inline values, 0-d, chunks of whole
rows), and anything else left to TensorStore."""

from __future__ import annotations

from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

import zoo
from zoo.formats.host_arrays import is_aligned
from zoo.weight_cache import ocdbt_reader, store


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
    host = store._read_leaves_here(tmp_path, "group", state, target)          # direct, and TensorStore for 4
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
