"""Vision towers from llama.cpp multimodal projector files (``mmproj*.gguf``, ``general.architecture =
"clip"``), as ``convert_hf_to_gguf.py --mmproj`` writes them.

    open_mmproj(path) -> (GGUFSource, architecture id)     checked: a clip file with a vision encoder
                                                            whose ``clip.projector_type`` zoo knows
    vision_config_from_mmproj(src, arch, base=None)         the architecture's ``VisionConfig``
    mmproj_names(vision, arch, dst="") -> NameMap           mmproj names -> tower parameters (+ joins)
    load_vision_tower(path, base=None, dtype, store)        a filled bare ``VisionTower``
    find_mmproj(directories) -> Path | None                 the discovery rule (below)
    with_mmproj(source, cfg, names, path) -> (source, cfg, names)   a whole model: text GGUF + mmproj

Every architecture-specific piece is a part of the architecture's row (``zoo.models.architectures``
``VISION_PARTS``): the projector types it reads (``mmproj_projectors``; the file's
``clip.projector_type`` picks the architecture), the config fields the file carries
(``mmproj_fields``: ``clip.vision.*`` keys and tensor shapes), the tower's config and module
(``vision_config``, ``vision_tower``) and the name map (``mmproj_rules``, ``mmproj_joins``). The
config: the file's fields over ``base`` (the text model's HF ``vision_config``, a dict or a
``VisionConfig``, when one is known) over transformers' defaults.

Storage: the tower is filled through ``zoo.loader.fill.fill_from_source`` from a ``GGUFSource``; with
the default ``as_stored`` store (what ``zoo.load`` does with GGUF tensors) Q8_0 (any block type)
matrices stay ``QArray``s of their own type, F16/F32 tensors become dense arrays of the tower's
dtype; the two temporal slices of the patch kernel are joined in float32
(``zoo.sources.views.JoinedSource``).

Discovery (``find_mmproj``): in each directory in turn, the files whose name starts with ``mmproj``
(any case) and ends with ``.gguf``; the first directory with exactly one such file gives it; two or
more in a directory is an error (pass ``mmproj=`` or ``vision=False``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx

from zoo.loader.fill import fill_from_source
from zoo.models.architectures import ARCHITECTURES, architecture
from zoo.models.config import ConfigError
from zoo.quant.storage import as_stored
from zoo.sources.base import SourceError
from zoo.sources.gguf import GGUFSource
from zoo.sources.names import NameMap
from zoo.sources.views import MixedSource, Part, joined


def _part(arch: str, name: str):
    """One of ``arch``'s mmproj ``VISION_PARTS`` (``zoo.models.architectures``)."""
    return architecture(arch).part(name)


def projectors() -> dict[str, str]:
    """``{clip.projector_type: architecture id}`` for every architecture with a vision tower."""
    return {p: a.id for a in ARCHITECTURES.values() if a.has_vision for p in a.part("mmproj_projectors")}


def open_mmproj(path, arch: str | None = None) -> tuple[GGUFSource, str]:
    """``(source, architecture id)`` of an mmproj file; ``SourceError`` naming the file when it is not
    one (not a clip GGUF, no vision encoder, an unknown projector, or one of another architecture
    than ``arch``)."""
    src = path if isinstance(path, GGUFSource) else GGUFSource(path)
    where = src.files[0]
    md = src.metadata
    if src.architecture != "clip" or md.get("general.type", "mmproj") != "mmproj":
        raise SourceError(f"{where}: not an mmproj file (general.architecture {src.architecture!r}, "
                          f"general.type {md.get('general.type')!r}; expected 'clip' / 'mmproj')")
    if md.get("clip.has_vision_encoder") is not True:
        raise SourceError(f"{where}: mmproj without a vision encoder (clip.has_vision_encoder is not true)")
    projector = md.get("clip.projector_type", md.get("clip.vision.projector_type"))
    known = projectors()
    if projector not in known:
        raise SourceError(f"{where}: mmproj projector type {projector!r} is not supported; supported: "
                          f"{', '.join(f'{p} ({a})' for p, a in sorted(known.items()))}")
    if arch is not None and known[projector] != arch:
        raise SourceError(f"{where}: mmproj projector type {projector!r} is a {known[projector]} vision tower; "
                          f"the model is {arch}")
    return src, known[projector]


def _base_fields(base) -> dict[str, Any]:
    if base is None:
        return {}
    if dataclasses.is_dataclass(base):
        d = dataclasses.asdict(base)
        d["rope_parameters"] = {"rope_type": "axial", "rope_theta": d.pop("rope_theta")}
        return d
    d = dict(base)
    return dict(d["vision_config"]) if isinstance(d.get("vision_config"), dict) else d


def vision_config_from_mmproj(src: GGUFSource, arch: str, base=None):
    """The ``VisionConfig`` of ``arch`` an mmproj describes: the file's fields over ``base`` (an HF
    ``vision_config`` dict, a whole config.json dict, or a ``VisionConfig``) over the defaults."""
    try:
        fields = _part(arch, "mmproj_fields")(src)
    except SourceError:
        raise
    except KeyError as e:
        raise SourceError(f"{src.files[0]}: mmproj has no {e.args[0]!r} (metadata key or tensor)") from None
    except (TypeError, ValueError, IndexError) as e:
        raise SourceError(f"{src.files[0]}: mmproj metadata does not describe a {arch} vision tower ({e})") from None
    try:
        return _part(arch, "vision_config").from_hf({**_base_fields(base), **fields})
    except ConfigError as e:
        raise SourceError(f"{src.files[0]}: {e}") from None


def mmproj_names(vision, arch: str, dst: str = "") -> NameMap:
    """The mmproj's tensor names -> the tower's parameters under ``dst`` ("" for a bare tower), with the
    joins of the patch kernel's temporal slices."""
    return NameMap(rules=tuple(_part(arch, "mmproj_rules")(vision, dst)),
                   joins=tuple(_part(arch, "mmproj_joins")(vision)))


def load_vision_tower(path, base=None, dtype=jnp.float32, store=as_stored, arch: str | None = None):
    """``(tower, config, unused keys)``: a bare ``VisionTower`` filled from an mmproj file (see the
    module docstring for ``base`` and ``store``)."""
    src, arch = open_mmproj(path, arch)
    cfg = vision_config_from_mmproj(src, arch, base)
    names = mmproj_names(cfg, arch)
    tower_class = _part(arch, "vision_tower")
    abstract = nnx.eval_shape(lambda: tower_class(cfg, dtype=dtype))
    tower, unused = fill_from_source(abstract, joined(src, names), names, store)
    return tower, cfg, unused


def _candidates(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*") if p.is_file() and p.name.lower().startswith("mmproj")
                  and p.name.lower().endswith(".gguf"))


def find_mmproj(*directories: Path) -> Path | None:
    """The discovery rule (module docstring): the only ``mmproj*.gguf`` of the first directory that has
    any, else None; ``ValueError`` when that directory has several."""
    seen = set()
    for directory in directories:
        directory = Path(directory).resolve()
        if directory in seen or not directory.is_dir():
            continue
        seen.add(directory)
        found = _candidates(directory)
        if len(found) > 1:
            raise ValueError(f"{directory}: several mmproj files ({', '.join(p.name for p in found)}); pass "
                             f"mmproj=PATH to choose one, or vision=False for the text model only")
        if found:
            return found[0]
    return None


def with_mmproj(source, cfg, names, path, base=None):
    """A text model loaded from a GGUF (``source``, ``cfg``, ``names``) + an mmproj file ->
    ``(source, cfg, names)``: ``cfg.vision`` from the mmproj (``base``: the HF ``vision_config`` when
    the checkpoint directory has one, else the config's own); the source a ``MixedSource`` of both
    files (the tower's parameters ``visual.*`` from the mmproj, everything else from the model GGUF),
    its name map covering both."""
    if getattr(cfg, "vision", ...) is ...:
        raise SourceError(f"{path}: the {cfg.arch} model has no vision tower to load an mmproj into")
    mm_src, arch = open_mmproj(path, cfg.arch)
    vision = vision_config_from_mmproj(mm_src, arch, base if base is not None else cfg.vision)
    if vision.out_hidden_size != cfg.hidden_size:
        raise SourceError(f"{path}: the mmproj's tower outputs rows of {vision.out_hidden_size} "
                          f"(out_hidden_size); the model's hidden_size is {cfg.hidden_size}: not this model's mmproj")
    try:
        cfg = dataclasses.replace(cfg, vision=vision)
    except ConfigError as e:
        raise SourceError(f"{path}: the mmproj does not fit the model: {e}") from None
    mm_names = mmproj_names(vision, arch, "visual")
    mm_view = joined(mm_src, mm_names)
    unknown = [k for k in mm_view.keys() if mm_names.resolve(k) is None]
    if unknown:
        raise SourceError(f"{path}: tensor(s) {', '.join(map(repr, unknown[:4]))} are not part of the {arch} "
                          f"vision tower")
    mixed = MixedSource([
        Part(f"mmproj {path}", mm_view, mm_names, lambda p: p.startswith("visual.")),
        Part("model GGUF", source, names, lambda p: True),    # a text-only config: no visual.* rules
    ])
    return mixed, cfg, mixed.names

