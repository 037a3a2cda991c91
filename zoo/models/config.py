"""Typed, frozen model configurations read from HF ``config.json`` (the text part).

A config is the only place a dimension comes from: modules never hard-code one. Each architecture
has one frozen dataclass in its package (``zoo.models.<arch>.config``); ``config_from_hf`` picks it
from ``model_type`` through the architecture table (``zoo.models.ARCHITECTURES``: data, not
branches). Multimodal checkpoints nest the text model under ``text_config``; both the flat and the
nested form are accepted. This module holds what every architecture's config shares.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zoo.models.architectures import BY_HF_MODEL_TYPE, for_hf_model_type


class ConfigError(ValueError):
    """A config.json that cannot describe a supported model (names the file and the field)."""


def text_part(hf: dict[str, Any]) -> dict[str, Any]:
    """The text-model fields of an HF config: ``text_config`` merged over the top level."""
    if isinstance(hf.get("text_config"), dict):
        merged = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
        merged.update(hf["text_config"])
        merged.setdefault("architectures", hf.get("architectures"))
        merged["outer_model_type"] = hf.get("model_type")
        return merged
    return dict(hf)


def rope_field(hf: dict[str, Any], name: str, default: Any) -> Any:
    """A rotary field from ``rope_parameters`` / ``rope_scaling`` or the top level."""
    for holder in ("rope_parameters", "rope_scaling"):
        params = hf.get(holder)
        if isinstance(params, dict) and name in params:
            return params[name]
    return hf.get(name, default)


def config_from_hf(hf: dict[str, Any], source: str = "config.json"):
    """The frozen config for an HF config dict; ``source`` names the file in errors."""
    model_type = text_part(hf).get("model_type") or hf.get("model_type")
    outer = hf.get("model_type")
    arch = for_hf_model_type(outer, model_type)
    if arch is None:
        raise ConfigError(f"{source}: unsupported model_type {outer or model_type!r}; "
                          f"supported: {sorted(BY_HF_MODEL_TYPE)}")
    try:
        return arch.config_class().from_hf(hf)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def load_config(path: str | Path):
    """Read a ``config.json`` (or a directory holding one) into its frozen config."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return config_from_hf(hf, source=str(path))
