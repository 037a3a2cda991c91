"""The streamed cache build (``zoo.weight_cache.build``): the entry equals the one ``zoo.load(...,
cache=)`` writes and restores to the same model, no two groups' arrays are alive at once, a failure
half-way leaves nothing, and ``zoo cache build`` uses it."""

from __future__ import annotations

import gc
import importlib
import json
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest

import zoo
from tests.support.paths import DATA
from zoo.engine.compile_cache import CompileCounter
from zoo.weight_cache import build, store

build_module = importlib.import_module("zoo.weight_cache.build")   # ``zoo.weight_cache.build`` is the function
IDS = np.arange(40)[None] % 500
SAME = ("params", "config", "fingerprint", "digests")


def _groups_of_files(manifest: dict) -> set[str]:
    return {f.split("/")[1] for f in manifest["files"]}


@pytest.mark.parametrize("name,quant", [("qwen38-tiny", None), ("qwen38-tiny", "int8"), ("glm53-tiny", None),
                                        ("glm53-tiny", "Q8_0"), (DATA / "glm53-q256-udmix.gguf", None)],
                         ids=["qwen38", "qwen38-int8", "glm53", "glm53-Q8_0", "glm53-gguf-udmix"])
def test_streamed_entry_equals_the_loaded_one_and_restores(tmp_path, name, quant):
    entry = build(name, quant=quant, root=tmp_path / "streamed", progress=False)
    loaded = zoo.load(name, quant=quant, cache=tmp_path / "loaded")
    assert loaded.load_info["source"] == "source"
    reference = Path(loaded.load_info["cache_path"])
    assert entry.name == reference.name and entry.parent == tmp_path / "streamed"
    ours, theirs = store.read_manifest(entry), store.read_manifest(reference)
    for key in SAME:
        assert ours[key] == theirs[key], key
    assert _groups_of_files(ours) == _groups_of_files(theirs) == {r["group"] for r in ours["params"].values()}
    if quant is not None:           # the recipe really quantized something
        assert any(r["kind"] != "dense" for r in ours["params"].values())
    if name == "glm53-tiny":        # config.json is silent about MTP, the weights have it (``_open``)
        assert "mtp" in {r["group"] for r in ours["params"].values()}
    for tok in ("tokenizer.json", "tokenizer_config.json"):
        assert (entry / tok).read_bytes() == (reference / tok).read_bytes()
    assert not list((tmp_path / "streamed").glob(".partial-*"))

    restored = zoo.load(name, quant=quant, cache=tmp_path / "streamed")
    assert restored.load_info["source"] == "cache" and restored.load_info["cache_path"] == str(entry)
    want = loaded.logits(IDS)
    with CompileCounter() as counter:         # the same model restored: the loaded one's programs, none new
        got = restored.logits(IDS)            # (its leaves placed alike, its graph hashing alike)
    assert counter.programs == 0, counter.programs
    np.testing.assert_array_equal(got, want)
    assert restored.tokenizer.encode("hello world") == loaded.tokenizer.encode("hello world")


def test_one_group_alive_at_a_time(tmp_path, monkeypatch):
    """Weak references to every leaf the writer saves: when the next group is filled, and after the
    build, every leaf of the groups written before is gone (the build holds one group at a time)."""
    saved: list[tuple[str, list[weakref.ref]]] = []
    filled: list[str] = []
    real_checkpointer, real_fill = store._checkpointer, build_module.fill_from_source

    class Recording:
        def __init__(self):
            self.inner = real_checkpointer()

        def save(self, directory, arrays):
            leaves = jax.tree.leaves(arrays)
            assert leaves
            saved.append((Path(directory).name, [weakref.ref(x) for x in leaves]))
            return self.inner.save(directory, arrays)

    def fill(*args, **kwargs):
        gc.collect()
        alive = [group for group, refs in saved if any(r() is not None for r in refs)]
        assert not alive, f"filling group {len(filled)}: the arrays of {alive} are still alive"
        filled.append(len(filled))
        return real_fill(*args, **kwargs)

    monkeypatch.setattr(store, "_checkpointer", Recording)
    monkeypatch.setattr(build_module, "fill_from_source", fill)
    entry = build("glm53-tiny", quant="int8", root=tmp_path, progress=False)
    gc.collect()
    groups = [group for group, _ in saved]
    assert groups == list(dict.fromkeys(r["group"] for r in store.read_manifest(entry)["params"].values()))
    assert len(filled) == len(groups) >= 10
    assert all(r() is None for _, refs in saved for r in refs), "leaves alive after the build"


def test_failure_half_way_leaves_nothing(tmp_path, monkeypatch):
    real_fill, calls = build_module.fill_from_source, []

    def fill(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:         # two groups are written in the temporary directory by now
            assert sorted(d.name for d in tmp_path.glob(".partial-*/state/*")) == ["embed_tokens", "layers.0"]
            raise OSError("disk went away while reading the third group")
        return real_fill(*args, **kwargs)

    monkeypatch.setattr(build_module, "fill_from_source", fill)
    with pytest.raises(OSError, match="third group"):
        build("qwen38-tiny", root=tmp_path, progress=False)
    assert len(calls) == 3
    assert list(tmp_path.iterdir()) == []                     # no entry, no .partial-* directory
    assert store.find(store.request_fingerprint("qwen38-tiny", None, "bfloat16"), [tmp_path]) == (None, [])


def test_one_process_only(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(RuntimeError, match="one process"):
        build("qwen38-tiny", root=tmp_path, progress=False)
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


def test_cli_build_streams_checks_and_rebuilds_a_damaged_entry(tmp_path, capsys, monkeypatch):
    from zoo.cli import main as cli_main

    streamed = []
    monkeypatch.setattr(build_module, "filled_groups", _counting(build_module.filled_groups, streamed))
    args = ["cache", "build", "glm53-tiny", "--quant", "int8", "--dir", str(tmp_path)]
    assert cli_main(args) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["source"] == "source" and set(first["seconds"]) == {"find", "build", "total"}
    assert len(streamed) == 1                                  # the streamed build, not zoo.load
    entry = Path(first["cache_path"])
    assert cli_main(args) == 0
    second = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (second["source"], second["cache_path"]) == ("cache", str(entry))
    victim = max((f for f in (entry / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    raw = bytearray(victim.read_bytes())
    for i in range(len(raw) // 3, len(raw) // 3 + 64):
        raw[i] ^= 0x5A
    victim.write_bytes(bytes(raw))
    assert cli_main(args) == 0
    out = capsys.readouterr()
    third = json.loads(out.out.strip().splitlines()[-1])
    assert third["source"] == "source" and "does not match its recorded digest" in out.err and "rebuilding" in out.err
    assert len(streamed) == 2
    assert zoo.load("glm53-tiny", quant="int8", cache=tmp_path).load_info["source"] == "cache"


def _counting(fn, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return wrapped
