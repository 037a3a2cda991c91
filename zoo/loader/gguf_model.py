"""What a GGUF file says besides its tensors, for loading a model from it.

    config_from_gguf(source) -> frozen config   GGUF metadata -> HF config.json fields (the
                                                architecture's table, ``zoo.models.<arch>.gguf_config``)
                                                -> ``zoo.models.config.config_from_hf``
    open_gguf(path) -> (source, config, name map, tokenizer or None)

The architecture is read from ``general.architecture`` through the architecture table
(``zoo.models.architectures``); the tokenizer from the embedded vocabulary (``zoo.text.gguf_vocab``).
"""

from __future__ import annotations

from typing import Any

from zoo.models.architectures import BY_GGUF_ARCHITECTURE, Architecture, for_gguf
from zoo.models.config import ConfigError, config_from_hf
from zoo.sources.base import SourceError
from zoo.sources.gguf import GGUFSource
from zoo.sources.views import joined
from zoo.text.gguf_vocab import tokenizer_from_gguf


def _architecture(src: GGUFSource) -> Architecture:
    arch = for_gguf(src.architecture)
    if arch is None and src.architecture == "clip":
        raise SourceError(f"{src.files[0]}: a llama.cpp multimodal projector (mmproj, GGUF architecture 'clip'), "
                          f"not a model: load the model's GGUF with this file beside it or as mmproj= "
                          f"(zoo.loader.mmproj; a bare tower: load_vision_tower)")
    if arch is None:
        raise SourceError(f"{src.files[0]}: GGUF architecture {src.architecture!r} is not supported; "
                          f"supported: {sorted(BY_GGUF_ARCHITECTURE)}")
    return arch


def config_from_gguf(src: GGUFSource):
    """The frozen model config described by a GGUF file's metadata (and tensor shapes)."""
    fields = _architecture(src).part("gguf_fields")
    try:
        hf = fields(src)
    except (SourceError, ConfigError):
        raise
    except (TypeError, ValueError, ZeroDivisionError) as e:      # metadata of the wrong type or value
        raise SourceError(f"{src.files[0]}: GGUF metadata does not describe a {src.architecture} model ({e})") from None
    return config_from_hf(hf, source=str(src.files[0]))


def gguf_architecture(src: GGUFSource) -> str:
    """The architecture id of a GGUF file (from ``general.architecture`` alone)."""
    return _architecture(src).id


def open_gguf(path) -> tuple[GGUFSource, Any, Any, Any]:
    """``(source, config, name map, tokenizer or None)`` for a GGUF file or the first of a split set
    (a path, or a ``GGUFSource`` already open)."""
    src = path if isinstance(path, GGUFSource) else GGUFSource(path)
    cfg = config_from_gguf(src)
    source, names = gguf_names(src, cfg)
    return source, cfg, names, tokenizer_from_gguf(src)


def gguf_names(src: GGUFSource, cfg) -> tuple[Any, Any]:
    """``(source view, name map)`` of a GGUF file for a model config: the architecture's map, and
    the source with the map's joins applied (``zoo.sources.views.joined``)."""
    names = _architecture(src).gguf_name_map(cfg)
    return joined(src, names), names
