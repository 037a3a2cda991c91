"""MTP overlays: an MTP layer's tensors fitted apart from its checkpoint, applied after a load.

An overlay is a directory (written by ``zoo fit-mtp``, ``zoo.train.fit_mtp``)::

    mtp.safetensors     the MTP tensors only, under the architecture's HF names (the loader's name
                        map, ``zoo.models.<arch>.weights.hf_names``), float32
    mtp_overlay.json    {"format": 1, "arch", "config": {MATCH_FIELDS..., "mtp_num_hidden_layers"},
                         "tensors": {name: {"param", "shape", "dtype", "crc32"}},
                         "complete": the whole MTP layer (else: the fitted subset only),
                         "base": the model it was fitted to (name, path, quant, dtype, files),
                         "fit": how it was fitted (steps, prompts, acceptance before / after)}

    read_overlay(path) -> Overlay                 the files checked (manifest, header, every tensor's
                                                  CRC-32); nothing is loaded into a model
    apply_overlay(module, cfg, overlay, mesh) -> (module, cfg, info)
    write_overlay(out_dir, tensors, params, cfg, complete, base, fit) -> manifest

``apply_overlay`` maps the tensors by the same name map and storage as a load (``fill_from_source``:
dense in the model's dtype, placed with the parameters' shardings on ``mesh``), replacing the MTP
parameters they hold; a model loaded without an MTP layer gets one (a complete overlay only). Every
check runs before the new module is assembled and raises ``OverlayError`` (a ``ValueError``): a
missing directory or file, a corrupt manifest or safetensors file, another architecture or a
config field that differs (both values named), a tensor that is not an MTP tensor, a missing MTP
tensor, a shape that differs (the tensor and both shapes named). The model passed in is never
modified. A base checkpoint whose files differ (name, size) from those the overlay was fitted on
is only warned about: the shapes fit, the acceptance may be lower.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import zlib
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from zoo.loader.fill import fill_from_source
from zoo.models.architectures import architecture
from zoo.quant.storage import dense_store
from zoo.sharding.mesh import named_sharding
from zoo.sources.base import SourceError
from zoo.sources.safetensors import SafetensorsSource

TENSORS_FILE, MANIFEST_FILE, FORMAT = "mtp.safetensors", "mtp_overlay.json", 1
MATCH_FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers")
WEIGHT_PATTERNS = ("*.safetensors", "*.gguf")


class OverlayError(ValueError):
    """An MTP overlay that cannot be applied (the message names the file, field or tensor)."""


@dataclasses.dataclass(frozen=True)
class Overlay:
    path: Path
    manifest: dict
    source: SafetensorsSource


def dotted(path) -> str:
    return ".".join(map(str, path))


def checkpoint_files(path) -> list[dict]:
    """``[{"name", "size"}]`` of a checkpoint's weight files (a directory or a GGUF file): the cheap
    fingerprint an overlay records of its base."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for pat in WEIGHT_PATTERNS for f in p.glob(pat) if f.is_file())
    return [{"name": f.name, "size": f.stat().st_size} for f in files]


def _crc(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).tobytes())


def read_overlay(path) -> Overlay:
    """Open and check an overlay directory: both files, the manifest's fields, the safetensors
    header, the tensors the manifest lists (no more, no fewer), each one's shape and CRC-32."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise OverlayError(f"MTP overlay {p}: no such directory")
    for name in (MANIFEST_FILE, TENSORS_FILE):
        if not (p / name).is_file():
            raise OverlayError(f"MTP overlay {p}: no {name} (an overlay directory holds {TENSORS_FILE} and "
                               f"{MANIFEST_FILE}, written by zoo fit-mtp)")
    try:
        manifest = json.loads((p / MANIFEST_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OverlayError(f"{p / MANIFEST_FILE}: corrupt overlay manifest ({e})") from None
    fields = {"format": int, "arch": str, "config": dict, "tensors": dict, "complete": bool}
    bad = [k for k, t in fields.items() if not isinstance(manifest, dict) or not isinstance(manifest.get(k), t)]
    if bad:
        raise OverlayError(f"{p / MANIFEST_FILE}: not an MTP overlay manifest (no valid {', '.join(bad)})")
    if manifest["format"] != FORMAT:
        raise OverlayError(f"{p / MANIFEST_FILE}: overlay format {manifest['format']!r}, this zoo reads {FORMAT}")
    try:
        source = SafetensorsSource(p / TENSORS_FILE)
    except SourceError as e:
        raise OverlayError(f"corrupt MTP overlay: {e}") from None
    listed, held = manifest["tensors"], set(source.keys())
    if absent := sorted(set(listed) - held):
        raise OverlayError(f"{p / TENSORS_FILE}: missing MTP tensor(s) {absent[:4]} that {MANIFEST_FILE} lists")
    if extra := sorted(held - set(listed)):
        raise OverlayError(f"{p / TENSORS_FILE}: tensor(s) {extra[:4]} that {MANIFEST_FILE} does not list")
    for name, meta in listed.items():
        shape = tuple(source.info(name).shape)
        if not isinstance(meta, dict) or not {"shape", "crc32", "param"} <= set(meta):
            raise OverlayError(f"{p / MANIFEST_FILE}: tensor {name!r} lacks its shape, crc32 or param")
        if shape != tuple(meta["shape"]):
            raise OverlayError(f"{p / TENSORS_FILE}: tensor {name!r} has shape {shape}, the manifest says "
                               f"{tuple(meta['shape'])}")
        if _crc(source.read(name)) != meta["crc32"]:
            raise OverlayError(f"{p / TENSORS_FILE}: tensor {name!r} is corrupt (CRC-32 differs from the manifest)")
    return Overlay(p, manifest, source)


def _config_for(overlay: Overlay, cfg):
    """``cfg`` with the overlay's MTP layer count, after checking the architecture and MATCH_FIELDS."""
    m, where = overlay.manifest, overlay.path / MANIFEST_FILE
    if m["arch"] != cfg.arch:
        raise OverlayError(f"MTP overlay {overlay.path} was fitted for architecture {m['arch']!r}; this model is "
                           f"{cfg.arch!r}")
    for field in MATCH_FIELDS:
        if field in m["config"] and m["config"][field] != getattr(cfg, field):
            raise OverlayError(f"MTP overlay {overlay.path} was fitted for {field}={m['config'][field]}; this "
                               f"model has {field}={getattr(cfg, field)} ({where})")
    n = int(m["config"].get("mtp_num_hidden_layers", 1))
    if cfg.mtp_num_hidden_layers and cfg.mtp_num_hidden_layers != n:
        raise OverlayError(f"MTP overlay {overlay.path} holds {n} MTP layer(s); this model has "
                           f"mtp_num_hidden_layers={cfg.mtp_num_hidden_layers}")
    if not cfg.mtp_num_hidden_layers and not m["complete"]:
        raise OverlayError(f"this model has no MTP layer and MTP overlay {overlay.path} holds only part of one "
                           f"(fitted with trainable={m.get('fit', {}).get('trainable')})")
    return dataclasses.replace(cfg, mtp_num_hidden_layers=n)


def abstract_model(cfg, dtype) -> nnx.Module:
    """The architecture's model for ``cfg``, abstract (shapes and axes only)."""
    cls = architecture(cfg.arch).model_class()
    return nnx.eval_shape(lambda: cls(cfg, dtype=dtype))


def rebuild(module: nnx.Module, cfg, values: dict, mesh=None) -> nnx.Module:
    """A new module for ``cfg`` (possibly with an MTP layer ``module`` lacks): each parameter is
    ``values[path]`` where given (dense arrays placed on ``mesh`` by their axes; taken as they are,
    dtype included), else ``module``'s own at the same path. ``module`` is not modified."""
    graphdef, state = nnx.split(abstract_model(cfg, module.dtype))
    have = {dotted(p): v for p, v in nnx.to_flat_state(nnx.state(module))}
    flat, missing = [], []
    for path, var in nnx.to_flat_state(state):
        name, want = dotted(path), var.get_value()
        if name not in values:
            if name not in have:
                missing.append(name)
                continue
            var.set_value(have[name].get_value())
            flat.append((path, var))
            continue
        value = values[name]
        if tuple(value.shape) != tuple(want.shape):
            raise OverlayError(f"parameter {name}: a value of shape {tuple(value.shape)}, the model needs "
                               f"{tuple(want.shape)}")
        if isinstance(value, (jax.Array, np.ndarray)) and mesh is not None:
            value = jax.device_put(value, named_sharding(var.get_metadata()["axes"], value.shape, mesh))
        var.set_value(value)
        flat.append((path, var))
    if missing:
        raise OverlayError(f"no value for parameter(s) {missing[:5]}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def apply_overlay(module: nnx.Module, cfg, overlay: Overlay, mesh=None, base_path=None):
    """``(new module, config, info)``: ``module`` with the overlay's MTP parameters (see the module
    docstring); ``base_path``: the checkpoint ``module`` was loaded from (for the fingerprint warning)."""
    new_cfg = _config_for(overlay, cfg)
    name_map = architecture(new_cfg.arch).hf_name_map(new_cfg)
    covered = set()
    for key in overlay.source.keys():
        hit = name_map.resolve(key)
        if hit is None or not hit.path.startswith("mtp."):
            why = f"it maps to {hit.path}" if hit else f"no rule of the {cfg.arch} name map takes it"
            raise OverlayError(f"{overlay.path / TENSORS_FILE}: tensor {key!r} is not an MTP tensor ({why})")
        covered.add(hit.path)
    abstract = abstract_model(new_cfg, module.dtype)
    mtp_params = {dotted(p) for p, _ in nnx.to_flat_state(nnx.state(abstract, nnx.Param)) if p[0] == "mtp"}
    if overlay.manifest["complete"] or not cfg.mtp_num_hidden_layers:
        if lacking := sorted(mtp_params - covered):
            raise OverlayError(f"MTP overlay {overlay.path}: missing MTP tensor(s) for parameter(s) {lacking[:5]}")
    try:
        filled, _ = fill_from_source(abstract, overlay.source, name_map, dense_store, mesh,
                                     select=covered.__contains__)
    except SourceError as e:
        raise OverlayError(f"MTP overlay {overlay.path}: {e}") from None
    values = {dotted(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(filled)) if dotted(p) in covered}
    new = rebuild(module, new_cfg, values)
    _warn_if_other_base(overlay, base_path)
    info = {"path": str(overlay.path), "tensors": len(overlay.manifest["tensors"]), "parameters": len(covered),
            "added_mtp_layer": not cfg.mtp_num_hidden_layers, "fit": overlay.manifest.get("fit", {}).get("summary")}
    return new, new_cfg, info


def _warn_if_other_base(overlay: Overlay, base_path) -> None:
    fitted = (overlay.manifest.get("base") or {}).get("files")
    if base_path is None or not fitted or not Path(base_path).exists():
        return
    now = checkpoint_files(base_path)
    if now != fitted:
        print(f"[zoo] MTP overlay {overlay.path} was fitted on {[f['name'] for f in fitted]}, this model was "
              f"loaded from other files {[f['name'] for f in now]}; its drafts may be accepted less", file=sys.stderr)


def write_overlay(out_dir, tensors: dict[str, np.ndarray], params: dict[str, str], cfg, *, complete: bool,
                  base: dict, fit: dict) -> dict:
    """Write ``tensors`` (``{HF name: array}``; ``params``: ``{HF name: parameter path}``) and the
    manifest into ``out_dir`` (created); returns the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v) for k, v in sorted(tensors.items())}
    config = {f: getattr(cfg, f) for f in MATCH_FIELDS}
    config["mtp_num_hidden_layers"] = int(cfg.mtp_num_hidden_layers or 1)
    manifest = {"format": FORMAT, "arch": cfg.arch, "config": config, "complete": bool(complete),
                "tensors": {k: {"param": params[k], "shape": list(v.shape), "dtype": str(v.dtype), "crc32": _crc(v)}
                            for k, v in tensors.items()},
                "base": base, "fit": fit}
    save_file(tensors, str(out / TENSORS_FILE), metadata={"format": "pt", "zoo": "mtp-overlay"})
    (out / TENSORS_FILE).chmod(0o644)                       # safetensors writes it 0600, unlike its neighbours
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    return manifest
