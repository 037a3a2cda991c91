"""The repacked-weight cache: the loaded, placed state written once with Orbax, restored directly.

    zoo.load(name, quant=..., cache=DIR)    first time: load from the sources, then save to
                                            DIR/<model>-<fingerprint hash>/; afterwards: restore
                                            from there (no parsing, re-quantizing or re-packing)
    zoo.weight_cache.build(name, ..., root=DIR)   the same entry, written one parameter group in
                                            memory at a time (``zoo.weight_cache.build``; ``zoo cache build``)

Writing: ``write_entry(groups, root, fp, name, config, tokenizer)`` consumes an iterator of
``(group, {leaf index: array}, {param path: manifest entry})`` (``pack_group``), saving and digesting
each group before asking for the next and keeping nothing of it but its manifest entries and
digests; ``save(model, ...)`` hands it the groups of a loaded model (on one device or sharded over a
multi-process job), ``build`` groups it fills from the sources one by one.

Layout of one cache entry (written to ``DIR/.partial-*`` and renamed when complete, so a save
killed or failing half-way leaves nothing a later load accepts)::

    manifest.json   fingerprint, config, and for every parameter (``params``: path -> entry) its
                    stored kind (dense array, or a known stored-weight type with its static
                    metadata), its leaves' shapes and dtypes, its group and the index of its first
                    leaf in the group; ``digests`` (group -> leaf index -> shard records) and
                    ``files`` (every state file's size)
    state/<group>/  one Orbax checkpoint per parameter group (embedding, each layer, head, MTP,
                    final norm: ``_group``), a dict leaf index ("0", "1", ...) -> array, the
                    leaves of the group's parameters in flat-state order: a streamed build and
                    each read of a restore hold one group in host memory, and progress is shown
                    (the manifest also holds a digest of every saved shard of every leaf, XXH3 or in
                    older entries CRC-32 (its "digest"),
                    checked on restore: ``zoo.weight_cache.digests``)
    tokenizer.json, tokenizer_config.json   when the model has a tokenizer

The **fingerprint** names what was loaded: the request (model, recipe, dtype, the zoo storage
layout versions) and the identity of each source file (name, size, a hash of its first 16 MiB,
which covers the header/index). A cache is used only when the request matches and, where the
sources are on this machine, the sources match too; otherwise the load rebuilds and says why.

Restoring builds the abstract model first and targets each leaf's ``NamedSharding`` on the
requested mesh (never the layout it was saved with), so a cache written on one mesh restores on
another. One process (one host holds all its chips) reads a group to host memory, checks its
digests and places each leaf; several processes have Orbax read each group straight onto its
shardings, each process only the chunks of its own devices' shards, and check the digests on host
copies of those shards. ``verify(entry)`` checks an entry the same way without building the model,
one group in host memory at a time (``zoo cache build`` on an existing entry). Caches are
also found (read-only) under the search roots, by default every dataset folder in ``/kaggle/input``
(``ZOO_CACHE_SEARCH`` = colon-separated roots overrides it).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import jax
import numpy as np

from zoo import registry
from zoo.formats import planes
from zoo.models.architectures import ARCHITECTURES
from zoo.sharding.mesh import value_specs
from zoo.text.tokenizer import Tokenizer
from zoo.weight_cache import digests as shard_digests
from zoo.weight_cache.digests import DIGESTS, host_digest, manifest_digest  # noqa: F401  (the cache's API)
from zoo.weight_cache.errors import CacheError
from zoo.weight_cache.group_reads import GroupReads, check_files, read_group

MANIFEST = "manifest.json"
# 6: digests per saved shard (a process checks what it read); 5: GLM MLA kv_b stored [H*(dn+dv), C] as
# the checkpoint keeps it; 4: the package layout of the redesign (config classes, architecture ids);
# 3: + the size of every state file; 2: zarr2 + OCDBT without zstd; 1: zarr3 + zstd
CACHE_FORMAT = 6
HASHED_BYTES = 16 * 2**20
DEFAULT_SEARCH_ROOTS = ("/kaggle/input",)
# Stored-weight types a manifest may name (a cache is data: nothing else is ever instantiated).
STORED_TYPES = {"QArray": "zoo.quant.qarray:QArray", "Int8Weight": "zoo.quant.int8:Int8Weight"}
ENUMS = {"GGMLQuantizationType": "gguf.constants:GGMLQuantizationType"}
# Nested config dataclasses a manifest may hold (a model's vision tower config): zoo's model packages only.
CONFIG_MODULES = ("zoo.models.",)


def _import(ref: str):
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


def _progress(iterable, desc: str, total: int | None = None, disable: bool | None = None):
    """A tqdm bar over parameter groups on stderr (``disable`` None: shown on a terminal only)."""
    from tqdm.auto import tqdm
    return tqdm(iterable, desc=desc, total=total, unit="group", disable=disable, file=sys.stderr)


# -- fingerprints ----------------------------------------------------------------------------------
def layout_versions() -> dict:
    return {"cache_format": CACHE_FORMAT, "planes": planes.LAYOUT_VERSION}


def file_identity(path: Path) -> dict:
    """name, size and a sha256 of the first 16 MiB (the header and index of GGUF/safetensors)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(HASHED_BYTES))
    return {"name": path.name, "size": path.stat().st_size, "head_sha256": digest.hexdigest()}


def source_files(path: Path) -> list[Path]:
    """The files a load reads weights and config from (a checkpoint dir or a GGUF file/split set)."""
    if path.is_file():                     # a GGUF (split set) and the mmproj files beside it (zoo.loader.mmproj)
        files = sorted(path.parent.glob(_split_glob(path.name))) if "-of-" in path.name else [path]
        return files + sorted(f for f in path.parent.iterdir()
                              if f.is_file() and f.name.lower().startswith("mmproj") and f.suffix.lower() == ".gguf")
    patterns = ("config.json", "*.safetensors", "*.gguf", "model.safetensors.index.json")
    return sorted({f for p in patterns for f in path.glob(p) if f.is_file()})


def _split_glob(name: str) -> str:
    stem, _, rest = name.rpartition("-of-")
    return stem.rsplit("-", 1)[0] + "-*-of-" + rest


def fingerprint(model: str, quant: str | None, dtype: str, sources: list[dict] | None, vision: bool = True) -> dict:
    """``sources`` None: the sources are not on this machine (match on the request alone); ``vision``:
    whether the load keeps a multimodal checkpoint's vision tower."""
    return {"request": {"model": model, "quant": quant, "dtype": dtype, "vision": bool(vision), **layout_versions()},
            "sources": sources}


def request_fingerprint(name_or_path, quant, dtype: str, vision: bool = True, mmproj=None) -> dict:
    """The cache fingerprint of a load request; source identities where the sources are local (and
    of an mmproj file given apart from them)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        files = source_files(path)
        if mmproj is not None and Path(mmproj).resolve() not in {f.resolve() for f in files}:
            files.append(Path(mmproj))
        return fingerprint(f"path:{path.resolve().name}", quant, dtype, [file_identity(f) for f in files], vision)
    spec = registry.get_spec(str(name_or_path))
    local = registry.local_checkpoint(spec)
    sources = None if local is None else [file_identity(f) for f in source_files(local)]
    return fingerprint(spec.name, quant, dtype, sources, vision)


def entry_name(name_or_path, ckpt: Path) -> str:
    """The name part of a cache entry's directory: the registry name, else the checkpoint's stem."""
    return registry.REGISTRY[name_or_path].name if name_or_path in registry.REGISTRY else Path(ckpt).stem


def fingerprint_hash(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def mismatch(saved: dict, wanted: dict) -> str | None:
    """Why a saved fingerprint does not serve a request (None if it does)."""
    for key, value in wanted["request"].items():
        if saved["request"].get(key) != value:
            return f"{key} is {saved['request'].get(key)!r} in the cache, {value!r} requested"
    if wanted["sources"] is not None and saved["sources"] != wanted["sources"]:
        names = {s["name"]: s for s in saved["sources"] or []}
        for s in wanted["sources"]:
            if names.get(s["name"]) != s:
                return f"source file {s['name']} differs from the one the cache was built from"
        return "the cache was built from a different set of source files"
    return None


# -- stored values <-> manifest entries --------------------------------------------------------------
def _encode_meta(value):
    if isinstance(value, enum.Enum):
        kind = next(k for k, ref in ENUMS.items() if isinstance(value, _import(ref)))
        return {"__enum__": kind, "name": value.name}
    if isinstance(value, (tuple, list)):
        return {"__tuple__": [_encode_meta(v) for v in value]}
    if value is None or isinstance(value, (int, float, str, bool)):
        return value
    if dataclasses.is_dataclass(value) and type(value).__module__.startswith(CONFIG_MODULES):
        return {"__dataclass__": f"{type(value).__module__}:{type(value).__qualname__}",   # a nested config
                "fields": {f.name: _encode_meta(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    raise TypeError(f"cannot record metadata value {value!r} in a cache manifest")


def _decode_meta(value):
    if isinstance(value, dict) and "__enum__" in value:
        if value["__enum__"] not in ENUMS:
            raise CacheError(f"manifest names an unknown enum {value['__enum__']!r}")
        return _import(ENUMS[value["__enum__"]])[value["name"]]
    if isinstance(value, dict) and "__tuple__" in value:
        return tuple(_decode_meta(v) for v in value["__tuple__"])
    if isinstance(value, dict) and "__dataclass__" in value:       # only zoo's own model configs
        ref = value["__dataclass__"]
        cls = _import(ref) if isinstance(ref, str) and ref.startswith(CONFIG_MODULES) else None
        if cls is None or not dataclasses.is_dataclass(cls):
            raise CacheError(f"manifest names an unknown config class {ref!r}")
        return cls(**{k: _decode_meta(v) for k, v in value["fields"].items()})
    return value


def _leaf_record(x) -> dict:
    return {"shape": list(x.shape), "dtype": np.dtype(x.dtype).name}


def describe(value) -> dict:
    """Manifest entry of a stored parameter value: its kind, static metadata and leaves (in
    ``jax.tree.leaves`` order)."""
    if isinstance(value, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return {"kind": "dense", "leaves": [_leaf_record(value)]}
    name = type(value).__name__
    if name not in STORED_TYPES or not dataclasses.is_dataclass(value):
        raise TypeError(f"cannot cache a parameter stored as {type(value).__name__}")
    fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    leaves_of = {k: v for k, v in fields.items() if jax.tree.leaves(v) and not isinstance(v, (enum.Enum, tuple, int))}
    meta = {k: _encode_meta(v) for k, v in fields.items() if k not in leaves_of}
    data = {k: sorted(v) if isinstance(v, dict) else None for k, v in leaves_of.items()}
    return {"kind": name, "meta": meta, "data": data, "leaves": [_leaf_record(x) for x in jax.tree.leaves(value)]}


def abstract_value(entry: dict, shardings: list | None = None):
    """The value a manifest entry describes, with ``ShapeDtypeStruct`` leaves (with ``shardings``)."""
    leaves = [jax.ShapeDtypeStruct(tuple(rec["shape"]), np.dtype(rec["dtype"]),
                                   sharding=None if shardings is None else shardings[i])
              for i, rec in enumerate(entry["leaves"])]
    if entry["kind"] == "dense":
        return leaves[0]
    if entry["kind"] not in STORED_TYPES:
        raise CacheError(f"manifest names an unknown stored type {entry['kind']!r}")
    cls = _import(STORED_TYPES[entry["kind"]])
    meta = {k: _decode_meta(v) for k, v in entry["meta"].items()}
    placeholders = {k: ({n: 0 for n in names} if names is not None else 0) for k, names in entry["data"].items()}
    treedef = jax.tree.structure(_skeleton(cls, meta, placeholders))
    if treedef.num_leaves != len(leaves):
        raise CacheError(f"manifest entry of kind {entry['kind']} lists {len(leaves)} leaves, "
                         f"its structure has {treedef.num_leaves}")
    return jax.tree.unflatten(treedef, leaves)


def _skeleton(cls, meta: dict, data: dict):
    """An instance of a stored-weight dataclass with placeholder leaves, only to read its pytree
    structure (bypasses the constructor's shape checks, which run again on ``unflatten``)."""
    obj = object.__new__(cls)
    for k, v in {**meta, **data}.items():
        object.__setattr__(obj, k, v)
    return obj


def group_records(arrays: dict[str, Any]) -> dict[str, list]:
    """The digest records of this process's shards of a group's leaves (``zoo.weight_cache.digests``)."""
    return {k: shard_digests.shard_records(v, host_digest) for k, v in arrays.items()}


def _checkpointer():
    """The Orbax checkpointer of cache entries: zarr2 arrays in one OCDBT store per group, without
    zstd (quantized planes do not compress; measured on 1 GB of IQ2_S/IQ3_S planes, zarr3 + zstd
    restored in 4.4 s, this in 1.1-1.8 s, about one memcpy of the data on a 2-core machine)."""
    import orbax.checkpoint as ocp
    return ocp.PyTreeCheckpointer(use_ocdbt=True, use_zarr3=False, use_compression=False)


# -- saving ----------------------------------------------------------------------------------------
def _group(path: str) -> str:
    """Parameter group = one Orbax checkpoint: ``layers.N`` per layer, else the first component."""
    parts = path.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def _flat_params(module):
    from flax import nnx
    return [(".".join(map(str, p)), v) for p, v in nnx.to_flat_state(nnx.state(module))]


def _config_record(cfg) -> dict:
    return {"arch": cfg.arch, "class": f"{type(cfg).__module__}:{type(cfg).__qualname__}",
            "fields": {f.name: _encode_meta(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}}


def _config_from_record(rec: dict):
    arch = ARCHITECTURES.get(rec.get("arch"))
    cls = arch.config_class() if arch is not None else None
    if cls is None or rec["class"] != f"{cls.__module__}:{cls.__qualname__}":
        raise CacheError(f"manifest names an unknown architecture or config class {rec.get('arch')!r} "
                         f"{rec.get('class')!r}")
    return cls(**{k: _decode_meta(v) for k, v in rec["fields"].items()})


def pack_group(group: str, values: list[tuple[str, Any]]) -> tuple[dict[str, Any], dict[str, dict]]:
    """One parameter group as the writer takes it: ``(arrays, entries)`` from its ``(path, value)``
    pairs in flat-state order. ``arrays``: ``{leaf index: array}`` (the leaves of every value, in
    order, numbered from 0); ``entries``: ``{path: manifest entry}`` (``describe`` plus the group and
    the index of the value's first leaf)."""
    arrays: dict[str, Any] = {}
    entries: dict[str, dict] = {}
    for path, value in values:
        first = len(arrays)
        arrays.update({str(first + i): leaf for i, leaf in enumerate(jax.tree.leaves(value))})
        entries[path] = {**describe(value), "group": group, "first": first}
    return arrays, entries


def save(model, root: str | Path, fp: dict, name: str) -> Path:
    """Write ``model`` (a ``zoo.Model``, loaded: on one device, or on a mesh over one or several
    processes) as a cache entry under ``root``; returns its directory (``write_entry``)."""
    by_group: dict[str, list] = {}
    for path, var in _flat_params(model.module):
        by_group.setdefault(_group(path), []).append((path, var.get_value()))
    groups = ((group, *pack_group(group, values)) for group, values in by_group.items())
    return write_entry(groups, root, fp, name, model.config, model.tokenizer, total=len(by_group))


def write_entry(groups: Iterable[tuple[str, dict[str, Any], dict[str, dict]]], root: str | Path, fp: dict,
                name: str, config, tokenizer, *, total: int | None = None, desc: str = "zoo cache save",
                progress: bool = True) -> Path:
    """Write a cache entry under ``root`` from ``groups``, an iterator of ``(group name, {leaf index:
    array}, {param path: manifest entry})`` (``pack_group``), consumed one group at a time: each is
    saved (Orbax) and digested, then let go before the next is asked for, so a caller that produces
    groups lazily (``zoo.weight_cache.build``) holds one at a time. Returns the entry's directory.

    Written to ``root/.partial-*`` and renamed when complete (removed if anything fails); an
    existing complete entry with the same fingerprint is replaced. With several processes, every
    process calls this with its own shards of the same groups, in the same order."""
    root = Path(root)
    leader = jax.process_index() == 0
    if leader:
        root.mkdir(parents=True, exist_ok=True)
    final = root / f"{name}-{fingerprint_hash(fp)}"
    tmp = root / f".partial-{final.name}-{_shared_token()}"
    entries: dict[str, dict] = {}
    records = {}
    bar = _progress(None, desc, total, disable=None if progress else True)
    try:
        ckptr = _checkpointer()
        for group, arrays, group_entries in groups:
            if group in records:
                raise ValueError(f"parameter group {group!r} written twice")
            bar.set_postfix_str(group, refresh=False)
            ckptr.save((tmp / "state" / group).absolute(), arrays)      # every process writes its shards
            records[group] = group_records(arrays)                      # and digests them
            entries.update(group_entries)
            del arrays, group_entries               # nothing of this group outlives its write
            bar.update(1)
        bar.close()
        parts = _gather(f"zoo/cache/{tmp.name}", records)
        _barrier(f"zoo-cache-saved-{tmp.name}")
        if leader:                                  # one process writes the manifest and renames
            digests = shard_digests.merge(parts)
            if tokenizer is not None:
                tokenizer.save(tmp)
            files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted((tmp / "state").rglob("*"))
                     if f.is_file()}
            manifest = {"format": CACHE_FORMAT, "fingerprint": fp, "config": _config_record(config),
                        "params": entries, "digests": digests, "digest": shard_digests.DIGEST, "files": files,
                        "created": time.time()}
            (tmp / MANIFEST).write_text(json.dumps(manifest))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
    finally:
        bar.close()
        if leader and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _barrier(f"zoo-cache-done-{tmp.name}")          # nobody reads the entry before it is complete
    return final


def _shared_token() -> str:
    """A random name part, the same in every process of the job (process 0's)."""
    token = np.frombuffer(uuid.uuid4().bytes[:4], np.uint32)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        token = multihost_utils.broadcast_one_to_all(token)
    return f"{int(np.asarray(token)[0]):08x}"


def _gather(key: str, value) -> list:
    """Every process's JSON-able ``value`` (in process order) on process 0 (the others get []),
    through the job's key-value store."""
    if jax.process_count() == 1:
        return [value]
    from jax._src.distributed import global_state

    client, me = global_state.client, jax.process_index()
    client.key_value_set_bytes(f"{key}/{me}", json.dumps(value).encode())
    if me:
        return []
    return [json.loads(client.blocking_key_value_get_bytes(f"{key}/{i}", 600_000)) for i in range(jax.process_count())]


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


# -- finding and restoring ---------------------------------------------------------------------------
def search_roots(cache: str | Path | None) -> list[Path]:
    """Where complete cache entries are looked for: ``cache`` itself, then the search roots
    (``ZOO_CACHE_SEARCH``, default every dataset under /kaggle/input)."""
    roots = [Path(cache)] if cache is not None else []
    env = os.environ.get("ZOO_CACHE_SEARCH")
    for base in (env.split(":") if env else DEFAULT_SEARCH_ROOTS):
        base = Path(base)
        if base.is_dir():
            roots += [base] + [d for d in sorted(base.iterdir()) if d.is_dir()]
    return roots


def read_manifest(entry: Path) -> dict:
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CacheError(f"{entry}: unreadable cache manifest ({e})") from None
    if manifest.get("format") != CACHE_FORMAT:
        raise CacheError(f"{entry}: cache format {manifest.get('format')!r}, this zoo reads {CACHE_FORMAT}")
    return manifest


def find(fp: dict, roots: list[Path]) -> tuple[Path | None, list[str]]:
    """The first complete entry serving ``fp`` under ``roots``, and why the other entries of the
    same model did not."""
    reasons = []
    for root in roots:
        for entry in sorted(p.parent for p in root.glob(f"*/{MANIFEST}")):
            if entry.name.startswith(".partial-"):
                continue
            try:
                saved = read_manifest(entry)["fingerprint"]
            except CacheError as e:
                reasons.append(str(e))
                continue
            if saved["request"].get("model") != fp["request"]["model"]:
                continue                                  # another model's cache: not a candidate
            why = mismatch(saved, fp)
            if why is None:
                return entry, reasons
            reasons.append(f"{entry}: {why}")
    return None, reasons


def verify(entry: Path, progress: bool = True) -> dict:
    """Check a complete entry without building the model, one group in host memory at a time: its
    config names a known architecture, and every group's files, leaf shapes and dtypes and digests
    are what the save recorded (what a restore checks). Returns the manifest; raises ``CacheError``.
    One process only (it reads whole leaves to the host)."""
    manifest = read_manifest(entry)
    _config_from_record(manifest["config"])
    digest = manifest_digest(manifest)
    check_files(entry, manifest["files"])
    targets = _targets(manifest, lambda path, rec: None)
    ckptr = _checkpointer()
    for group, target in _progress(targets.items(), "zoo cache verify", len(targets),
                                   disable=None if progress else True):
        arrays = read_group(ckptr, entry, group, target, manifest["files"])
        bad = shard_digests.verify(arrays, manifest["digests"].get(group, {}), digest)
        del arrays
        if bad is not None:
            raise CacheError(f"{entry}: parameter group {group!r} does not match its recorded digest "
                             f"at leaf {bad} (corrupted cache)")
    return manifest


def _targets(manifest: dict, shardings_of) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
    """``{group: {leaf index: ShapeDtypeStruct}}`` of the manifest's parameters, each parameter's leaves
    on ``shardings_of(path, rec)`` (a list, one per leaf, or None: no sharding); each record gains
    its abstract value as ``rec["_abstract"]``."""
    targets: dict[str, dict[str, jax.ShapeDtypeStruct]] = {}
    for path, rec in manifest["params"].items():
        rec["_abstract"] = abstract_value(rec, shardings_of(path, rec))
        group = targets.setdefault(rec["group"], {})
        for i, leaf in enumerate(jax.tree.leaves(rec["_abstract"])):
            group[str(rec["first"] + i)] = leaf
    return targets


def restore(entry: Path, mesh=None, dtype=None):
    """Rebuild the model from a cache entry, each leaf placed on its sharding on ``mesh`` (or the
    default device). Returns (module, config, tokenizer).

    Without a mesh the reads start first (``group_reads.GroupReads``), and the abstract model is built
    and the tokenizer loaded while they run; on a mesh the leaves' shardings come from the model, so
    it is built first."""
    from flax import nnx

    manifest = read_manifest(entry)
    cfg = _config_from_record(manifest["config"])
    digest = manifest_digest(manifest)
    check_files(entry, manifest["files"])
    ckptr = _checkpointer()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    reads = None
    if mesh is None:
        reads = GroupReads(ckptr, entry, _targets(manifest, lambda path, rec: [device] * len(rec["leaves"])),
                           manifest["files"])
    try:
        side = ThreadPoolExecutor(1, thread_name_prefix="zoo-tokenizer")     # its vocabulary beside the reads
        tokenizer = side.submit(Tokenizer.from_dir, entry)
        side.shutdown(wait=False)
        dt = np.dtype(manifest["fingerprint"]["request"]["dtype"]) if dtype is None else dtype
        abstract = nnx.eval_shape(lambda: ARCHITECTURES[cfg.arch].model_class()(cfg, dtype=dt))
        graphdef, state = nnx.split(abstract)
        flat = nnx.to_flat_state(state)
        variables = {".".join(map(str, p)): v for p, v in flat}
        if set(variables) != set(manifest["params"]):
            missing = sorted(set(variables) ^ set(manifest["params"]))[:5]
            raise CacheError(f"{entry}: the cached parameters do not match the model ({missing} ...)")
        if reads is None:
            def on_mesh(path, rec):
                _, specs = value_specs(abstract_value(rec), variables[path].get_metadata()["axes"], mesh)
                return [jax.sharding.NamedSharding(mesh, s) for s in specs]
            reads = GroupReads(ckptr, entry, _targets(manifest, on_mesh), manifest["files"])
        restored = {}
        for group, target, arrays in _progress(reads, "zoo cache restore", len(reads)):
            bad = shard_digests.verify(arrays, manifest["digests"].get(group, {}), digest)
            if bad is not None:
                raise CacheError(f"{entry}: parameter group {group!r} does not match its recorded digest "
                                 f"at leaf {bad} (corrupted cache)")
            # without a mesh the leaves go to the default device uncommitted, as a load from the sources
            # places them: a committed copy would make every program of the model another program (its
            # arguments' shardings are part of what is compiled) than the loaded model's
            restored[group] = {k: jax.device_put(a, None if mesh is None else target[k].sharding)
                               if isinstance(a, np.ndarray) else a for k, a in arrays.items()}
            del arrays
    finally:
        if reads is not None:
            reads.close()
    for path, rec in manifest["params"].items():
        leaves = [restored[rec["group"]][str(rec["first"] + i)] for i in range(len(rec["leaves"]))]
        variables[path].set_value(jax.tree.unflatten(jax.tree.structure(rec["_abstract"]), leaves))
    module = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return module, cfg, tokenizer.result()


# -- Kaggle datasets ---------------------------------------------------------------------------------
def push(entry: str | Path, dataset: str, notes: str = "", compile_cache: str | Path | None = None) -> None:
    """Upload a cache entry as (a new version of) the Kaggle dataset ``OWNER/NAME``; with
    ``compile_cache`` (a directory of compiled programs, ``zoo.engine.compile_cache``) the dataset
    holds the entry in a folder of its name and the programs in ``compile-cache/`` (a session that
    attaches it restores both: ``zoo serve --cache ... --trust-compile-cache DATASET/compile-cache``)."""
    import kagglehub

    entry = Path(entry)
    read_manifest(entry)                      # only complete entries are published
    if dataset.count("/") != 1:
        raise ValueError(f"dataset must be OWNER/NAME, got {dataset!r}")
    notes = notes or f"zoo cache {entry.name}"
    if compile_cache is None:
        kagglehub.dataset_upload(dataset, str(entry), version_notes=notes)
        return
    programs = Path(compile_cache)
    if not programs.is_dir():
        raise ValueError(f"compile cache {programs} is not a directory")
    with tempfile.TemporaryDirectory(prefix="zoo-push-") as staged:    # links, not copies
        _link_tree(entry, Path(staged) / entry.name)
        _link_tree(programs, Path(staged) / "compile-cache")
        kagglehub.dataset_upload(dataset, staged, version_notes=notes + " (with its compiled programs)")


def _link_tree(src: Path, dst: Path) -> None:
    for f in src.rglob("*"):
        if f.is_file():
            target = dst / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, target)
            except OSError:                   # another file system
                shutil.copyfile(f, target)


def pull(dataset: str, dest: str | Path | None = None) -> Path:
    """Download the Kaggle dataset ``OWNER/NAME[/versions/N]``; returns the cache entry inside it."""
    import kagglehub

    path = Path(kagglehub.dataset_download(dataset, output_dir=None if dest is None else str(dest)))
    if (path / MANIFEST).is_file():
        return path
    entries = sorted(p.parent for p in path.glob(f"*/{MANIFEST}"))
    if not entries:
        raise CacheError(f"dataset {dataset} ({path}) holds no zoo cache entry")
    return entries[0]
