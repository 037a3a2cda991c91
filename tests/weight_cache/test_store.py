"""The repacked-weight cache (``zoo.load(..., cache=DIR)``): bit-identical round trips, fingerprints,
corruption, atomic saves, and the Kaggle dataset packaging / discovery."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import zoo
from tests.support.paths import DATA, ROOT
from zoo.engine.compile_cache import trust_compile_cache
from zoo.weight_cache import digests as shard_digests
from zoo.weight_cache import store as checkpoint

IDS = np.arange(40)[None] % 500


def leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model.module))]


def assert_same_model(a, b):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb))
    np.testing.assert_array_equal(a.logits(IDS), b.logits(IDS))


@pytest.mark.parametrize("gguf", ["qwen38-q256-udmix.gguf", "glm53-q256-udmix.gguf"])
def test_round_trip_is_bit_identical(tmp_path, gguf):
    """Quantized GGUF models (IQ2_S/IQ3_S expert banks, IQ3_XXS/IQ4_XS/Q6_K/Q8_0 linears as QArray
    planes): the restored parameters and logits equal the freshly loaded ones exactly."""
    src = tmp_path / gguf
    shutil.copy(DATA / gguf, src)
    fresh = zoo.load(src, dtype="float32", cache=tmp_path / "cache")
    assert fresh.load_info["source"] == "source" and "save" in fresh.load_info["seconds"]
    restored = zoo.load(src, dtype="float32", cache=tmp_path / "cache")
    assert restored.load_info["source"] == "cache"
    assert restored.load_info["cache_path"] == fresh.load_info["cache_path"]
    assert {"find", "restore"} <= set(restored.load_info["seconds"])
    assert_same_model(fresh, restored)
    assert restored.tokenizer is not None
    assert restored.tokenizer.encode("hello world") == fresh.tokenizer.encode("hello world")
    print(f"[{gguf}] cold {fresh.load_info['seconds']['fill']:.2f}s + save "
          f"{fresh.load_info['seconds']['save']:.2f}s, restore {restored.load_info['seconds']['restore']:.2f}s")


def _mapped_ranges(root: Path) -> list[tuple[int, int]]:
    """This process's memory maps of files under ``root`` (``/proc/self/maps``): ``(start, end)``."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith(str(root)):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi))
    return out


def _aliased_bytes(model, ranges) -> tuple[int, int]:
    """(bytes of the model's parameters whose device buffer lies in one of ``ranges``, all bytes)."""
    inside = total = 0
    for x in jax.tree.leaves(nnx.state(model.module)):
        total += x.nbytes
        at = x.unsafe_buffer_pointer()
        inside += x.nbytes if any(lo <= at and at + x.nbytes <= hi for lo, hi in ranges) else 0
    return inside, total


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="memory maps are listed by Linux")
def test_a_restore_maps_the_entry_and_the_weights_are_its_pages(tmp_path, monkeypatch):
    """On the CPU backend the restored weights are the entry's data files' own pages (``mmap``,
    ``zoo.weight_cache.ocdbt_reader.map_leaves``; no copy, no new anonymous memory): all but the
    small leaves that OCDBT keeps inline or that do not start on a 64-byte boundary. The same
    weights and logits as the copy path (``ZOO_CACHE_MMAP=0``), whose weights lie in no map."""
    saved = zoo.load("qwen38-tiny", cache=tmp_path)
    entry = Path(saved.load_info["cache_path"])
    mapped = zoo.load("qwen38-tiny", cache=tmp_path)
    assert mapped.load_info["source"] == "cache"
    inside, total = _aliased_bytes(mapped, _mapped_ranges(entry / "state"))
    assert inside >= 0.99 * total, (inside, total)
    monkeypatch.setenv("ZOO_CACHE_MMAP", "0")
    copied = zoo.load("qwen38-tiny", cache=tmp_path)
    assert copied.load_info["source"] == "cache"
    assert _aliased_bytes(copied, _mapped_ranges(entry / "state"))[0] == 0
    assert_same_model(mapped, copied)
    assert_same_model(saved, mapped)
    del mapped                  # the maps go with the model's last array of them
    gc.collect()
    assert _mapped_ranges(entry / "state") == []


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="page cache hints are a Linux call")
def test_a_copying_restore_large_for_the_host_leaves_no_page_cache_copy(tmp_path, monkeypatch):
    """Where leaves are copied rather than mapped (``ZOO_CACHE_MMAP=0`` here; a leaf that cannot be
    mapped anywhere), an entry of at least a quarter of the host's memory has the page cache's copy
    of a group's files dropped once the group is read (``zoo.formats.host_arrays``: reclaiming it
    while the restore allocated was most of a 14.8 GB restore's time); on a host where the entry is
    small it stays cached. The same weights either way. Residency by ``mincore``."""
    from tests.support.page_cache import make_resident, resident_fraction
    from zoo.formats import host_arrays

    monkeypatch.setenv("ZOO_CACHE_MMAP", "0")
    saved = zoo.load("qwen38-tiny", cache=tmp_path)
    entry = Path(saved.load_info["cache_path"])
    state = [p for p in (entry / "state").rglob("*") if p.is_file() and p.stat().st_size]
    size = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
    make_resident(state)
    kept = zoo.load("qwen38-tiny", cache=tmp_path)
    assert kept.load_info["source"] == "cache" and min(map(resident_fraction, state)) == 1.0
    monkeypatch.setattr(host_arrays, "host_memory", lambda: 2 * size)
    dropped = zoo.load("qwen38-tiny", cache=tmp_path)
    assert dropped.load_info["source"] == "cache" and max(map(resident_fraction, state)) == 0.0, \
        [(p.name, resident_fraction(p)) for p in state]
    assert_same_model(kept, dropped)


def test_registry_model_and_dtype_are_part_of_the_fingerprint(tmp_path, capsys):
    a = zoo.load("qwen38-tiny", cache=tmp_path)
    b = zoo.load("qwen38-tiny", cache=tmp_path)
    assert (a.load_info["source"], b.load_info["source"]) == ("source", "cache")
    assert_same_model(a, b)
    c = zoo.load("qwen38-tiny", dtype="float32", cache=tmp_path)
    assert c.load_info["source"] == "source"
    assert "dtype is 'bfloat16' in the cache, 'float32' requested" in capsys.readouterr().err
    assert len(list(tmp_path.glob(f"*/{checkpoint.MANIFEST}"))) == 2


def test_changed_source_or_recipe_rebuilds(tmp_path, capsys):
    src = tmp_path / "model.gguf"
    shutil.copy(DATA / "qwen38-q256-udmix.gguf", src)
    zoo.load(src, dtype="float32", cache=tmp_path / "c")
    q8 = zoo.load(src, dtype="float32", quant="Q8_0", cache=tmp_path / "c")
    assert q8.load_info["source"] == "source"
    assert "quant is None in the cache, 'Q8_0' requested" in capsys.readouterr().err
    shutil.copy(DATA / "qwen38-tiny-mtp-f32.gguf", src)          # a different file, same name
    other = zoo.load(src, dtype="float32", cache=tmp_path / "c")
    assert other.load_info["source"] == "source"
    assert "source file model.gguf differs" in capsys.readouterr().err
    assert other.config.hidden_size == 64


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove", "shape"])
def test_corrupted_cache_rebuilds_never_wrong_weights(tmp_path, damage, capsys):
    src = tmp_path / "m.gguf"
    shutil.copy(DATA / "glm53-q256-udmix.gguf", src)
    fresh = zoo.load(src, dtype="float32", cache=tmp_path / "c")
    entry = Path(fresh.load_info["cache_path"])
    files = sorted((f for f in (entry / "state").rglob("*") if f.is_file() and f.stat().st_size > 4096),
                   key=lambda f: -f.stat().st_size)
    victim = files[0]
    raw = bytearray(victim.read_bytes())
    if damage == "flip":
        for i in range(len(raw) // 3, len(raw) // 3 + 64):
            raw[i] ^= 0x5A
        victim.write_bytes(bytes(raw))
    elif damage == "truncate":
        victim.write_bytes(bytes(raw[: len(raw) // 2]))
    elif damage == "remove":
        shutil.rmtree(entry / "state" / "layers.1")
    else:                       # the manifest says another shape than the stored array's
        manifest = json.loads((entry / "manifest.json").read_text())
        leaf = next(r["leaves"][0] for r in manifest["params"].values()
                    if r["group"] == "layers.1" and len(r["leaves"][0]["shape"]) == 2)
        leaf["shape"] = [leaf["shape"][0] + 1, *leaf["shape"][1:]]
        (entry / "manifest.json").write_text(json.dumps(manifest))
    again = zoo.load(src, dtype="float32", cache=tmp_path / "c")
    assert again.load_info["source"] == "source"
    err = capsys.readouterr().err
    why = {"flip": "does not match its recorded digest", "truncate": f"{victim.name} has {len(raw) // 2} bytes",
           "remove": "missing", "shape": "the manifest says"}[damage]
    assert "rebuilding" in err and why in err, err
    assert_same_model(fresh, again)
    assert zoo.load(src, dtype="float32", cache=tmp_path / "c").load_info["source"] == "cache"


def test_killed_save_leaves_nothing_a_load_accepts(tmp_path):
    """SIGKILL a process in the middle of writing the cache: no entry is accepted afterwards."""
    cache = tmp_path / "c"
    code = ("import zoo, sys; zoo.load('glm53-tiny', dtype='float32', cache=sys.argv[1])")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code, str(cache)], env=env)
    deadline = time.time() + 300
    while time.time() < deadline and not any(cache.glob(".partial-*/state/*")):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert any(cache.glob(".partial-*")), "the save never started"
    assert not list(cache.glob(f"*/{checkpoint.MANIFEST}"))
    fp = checkpoint.fingerprint("glm53-tiny", None, "float32", None)
    assert checkpoint.find(fp, [cache]) == (None, [])
    model = zoo.load("glm53-tiny", dtype="float32", cache=cache)       # rebuilds and saves cleanly
    assert model.load_info["source"] == "source"
    assert zoo.load("glm53-tiny", dtype="float32", cache=cache).load_info["source"] == "cache"


def test_kaggle_push_pull_and_input_discovery(tmp_path, monkeypatch):
    """kagglehub's two functions are substituted (no network here); everything else is real."""
    import kagglehub

    built = zoo.load("glm53-tiny", cache=tmp_path / "c")
    entry = Path(built.load_info["cache_path"])
    uploads = []
    monkeypatch.setattr(kagglehub, "dataset_upload", lambda handle, local_dir, version_notes="", ignore_patterns=None:
                        uploads.append((handle, local_dir, version_notes)))
    checkpoint.push(entry, "someone/glm53-tiny-cache")
    assert uploads == [("someone/glm53-tiny-cache", str(entry), f"zoo cache {entry.name}")]
    with pytest.raises(ValueError, match="OWNER/NAME"):
        checkpoint.push(entry, "no-owner")
    with pytest.raises(checkpoint.CacheError):
        checkpoint.push(tmp_path, "someone/x")                    # not a cache entry
    # A notebook with the dataset attached: /kaggle/input/<dataset>/<entry>/...
    kaggle_input = tmp_path / "kaggle" / "input"
    shutil.copytree(entry, kaggle_input / "glm53-tiny-cache" / entry.name)
    monkeypatch.setattr(kagglehub, "dataset_download", lambda handle, path=None, force_download=False,
                        output_dir=None: str(kaggle_input / handle.split("/")[1]))
    assert checkpoint.pull("someone/glm53-tiny-cache") == kaggle_input / "glm53-tiny-cache" / entry.name
    monkeypatch.setenv("ZOO_CACHE_SEARCH", str(kaggle_input))
    found = zoo.load("glm53-tiny")                                    # no cache= flag at all
    assert found.load_info["source"] == "cache"
    assert found.load_info["cache_path"].startswith(str(kaggle_input))
    assert_same_model(built, found)
    # With the compiled programs: the entry in a folder of its name, the programs in compile-cache/
    programs = tmp_path / "programs"
    programs.mkdir()
    (programs / "jit_step-0123").write_bytes(b"program")
    monkeypatch.setattr(kagglehub, "dataset_upload", lambda handle, local_dir, version_notes="", ignore_patterns=None:
                        shutil.copytree(local_dir, kaggle_input / handle.split("/")[1]))
    checkpoint.push(entry, "someone/with-programs", compile_cache=programs)
    assert checkpoint.pull("someone/with-programs") == kaggle_input / "with-programs" / entry.name
    published = kaggle_input / "with-programs" / "compile-cache"
    assert (published / "jit_step-0123").read_bytes() == b"program"
    published.chmod(0o555)                                            # an attached dataset is read-only
    mine = tmp_path / "my-programs"
    line = trust_compile_cache(published, mine)
    assert (mine / "jit_step-0123").read_bytes() == b"program" and "1 programs copied" in line
    assert "0 programs copied" in trust_compile_cache(published, mine)  # what it has stays


def test_manifest_is_data_only(tmp_path):
    """A manifest naming a type outside the stored-weight whitelist is refused, not instantiated."""
    model = zoo.load("qwen38-tiny", cache=tmp_path)
    entry = Path(model.load_info["cache_path"])
    manifest = json.loads((entry / checkpoint.MANIFEST).read_text())
    first = next(iter(manifest["params"]))
    manifest["params"][first]["kind"] = "os:system"
    (entry / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CacheError, match="unknown stored type"):
        checkpoint.restore(entry)


def test_entries_digested_with_crc32_before_still_restore_and_catch_a_flipped_byte(tmp_path, monkeypatch, capsys):
    """Saves record their digest kind (XXH3); an entry without one was saved with CRC-32 and is checked
    with it: it restores, and a flipped byte is still caught. A kind this zoo does not know is refused
    with its name (and the model rebuilt), never skipped."""
    monkeypatch.setattr(shard_digests, "DIGEST", "crc32")
    saved = zoo.load("qwen38-tiny", cache=tmp_path)
    monkeypatch.undo()
    entry = Path(saved.load_info["cache_path"])
    manifest = json.loads((entry / checkpoint.MANIFEST).read_text())
    assert manifest.pop("digest") == "crc32"                  # as the entries of earlier zoos: no kind
    (entry / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    old = zoo.load("qwen38-tiny", cache=tmp_path)
    assert old.load_info["source"] == "cache"
    assert_same_model(saved, old)
    leaf = next(iter(manifest["digests"]["embed_tokens"]))
    record = manifest["digests"]["embed_tokens"][leaf][0]
    record[2] ^= 1                                             # a digest that no longer matches
    (entry / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CacheError, match="does not match its recorded digest"):
        checkpoint.restore(entry)
    manifest["digest"] = "md4"
    (entry / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CacheError, match="digests are 'md4'"):
        checkpoint.restore(entry)
    capsys.readouterr()
    rebuilt = zoo.load("qwen38-tiny", cache=tmp_path)
    assert rebuilt.load_info["source"] == "source" and "digests are 'md4'" in capsys.readouterr().err
    assert json.loads((entry / checkpoint.MANIFEST).read_text())["digest"] == "xxh3_64"


def test_both_digest_kinds_see_every_byte():
    """``host_digest``: any changed byte, a different length or other chunking changes it, for both kinds."""
    a = np.random.default_rng(0).integers(0, 255, 3 * shard_digests._DIGEST_CHUNK + 5, dtype=np.uint8)
    for kind in checkpoint.DIGESTS:
        base = checkpoint.host_digest(a, kind)
        assert checkpoint.host_digest(a.copy(), kind) == base
        for at in (0, shard_digests._DIGEST_CHUNK - 1, a.size - 1):
            b = a.copy()
            b[at] ^= 0x10
            assert checkpoint.host_digest(b, kind) != base, (kind, at)
        assert checkpoint.host_digest(a[:-1], kind) != base
    assert checkpoint.host_digest(a, "crc32") != checkpoint.host_digest(a, "xxh3_64")
    with pytest.raises(checkpoint.CacheError, match="unknown digest kind"):
        checkpoint.host_digest(a, "md4")


def test_cache_cli_build_and_ls(tmp_path, capsys):
    from zoo.cli import main as cli_main

    assert cli_main(["cache", "build", "qwen38-tiny", "--dir", str(tmp_path)]) == 0
    built = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert built["source"] == "source" and Path(built["cache_path"]).is_dir()
    assert cli_main(["cache", "build", "qwen38-tiny", "--dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["source"] == "cache"
    assert cli_main(["cache", "ls", str(tmp_path)]) == 0
    assert "model=qwen38-tiny quant=None dtype=bfloat16" in capsys.readouterr().out
    assert cli_main(["cache", "push", str(tmp_path), "--dataset", "a/b"]) == 2
    assert "unreadable cache manifest" in capsys.readouterr().err
