"""The architecture table: one identifier per architecture, and every name it is known by.

    id          the identifier everything else uses (``config.arch``, the weight cache, the planner)
    package     the model's package: its config, NNX modules, weight maps, GGUF metadata table,
                tensor inventory and recipes, found under fixed module and attribute names
                (``PARTS``), imported only when asked for
    hf_model_types      HF ``config.json`` ``model_type`` values (the outer one of a multimodal
                        checkpoint and the ``text_config`` one)
    gguf_architectures  GGUF ``general.architecture`` strings (llama.cpp spells some two ways)
    models      the registry names (``zoo.registry``) of this architecture
    tool_format the native tool-call syntax the model writes: a key of ``zoo.text.tool_calls.FORMATS``
                (the server's parser and tool-call grammar, the training corpus's calls)
    image_family        the ``zoo.images`` preprocessing family of the model's vision tower
                        (``ImageSpec``: resize rule, defaults, placeholder tokens); None: text only.
                        An architecture with one provides every ``VISION_PARTS`` part too

This module imports nothing from zoo, so every layer may read the table; what the loader, the engine
and the server need to know about an architecture is a field of its row or one of its parts, so no
module outside the model's package and this table names an architecture.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

# part -> "module:attribute" inside an architecture's package
PARTS = {
    "config": "config:CONFIG",              # the frozen config dataclass (``from_hf``)
    "model": "model:MODEL",                 # the NNX module class (a ``zoo.models.shared.causal_lm.CausalLM``)
    "hf_names": "weights:hf_names",         # fn(config) -> NameMap of the HF safetensors checkpoint
    "gguf_names": "weights:gguf_names",     # fn(config) -> NameMap of llama.cpp's GGUF
    "gguf_fields": "gguf_config:hf_fields",  # fn(GGUFSource) -> HF config.json fields
    "gguf_metadata": "gguf_config:gguf_metadata",  # fn(config) -> GGUF metadata keys (gguf_fields' inverse)
    "inventory": "inventory:tensors",       # fn(config) -> [Tensor] in GGUF names (the planner's)
    "recipes": "recipes:RECIPES",           # {name: Recipe}: this architecture's own recipes
}
# part -> "module:attribute" (or "module": the module itself), of an architecture with a vision tower
VISION_PARTS = {
    "vision_config": "vision:VisionConfig",      # the tower's frozen config (``from_hf(vision_config dict)``)
    "vision_tower": "vision:VisionTower",        # the tower's NNX module, ``VisionTower(vision_config, dtype=)``
    "multimodal": "multimodal",                  # the host side: ``prepare(ids, images, cfg) -> MMBatch``
    "mmproj_projectors": "gguf_config:MMPROJ_PROJECTORS",   # llama.cpp ``clip.projector_type`` values it reads
    "mmproj_fields": "gguf_config:mmproj_vision_fields",     # fn(GGUFSource) -> HF vision_config fields
    "mmproj_rules": "vision:gguf_rules",         # fn(vision_config, dst) -> [Rule]: mmproj names -> tower
    "mmproj_joins": "vision:gguf_joins",         # fn(vision_config) -> (Join, ...): the split patch kernel
}


@dataclass(frozen=True)
class Architecture:
    id: str
    package: str
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    models: tuple[str, ...]
    tool_format: str
    image_family: str | None = None

    @property
    def has_vision(self) -> bool:
        """The architecture has a vision tower (its ``VISION_PARTS`` exist)."""
        return self.image_family is not None

    def part(self, name: str) -> Any:
        """One of ``PARTS`` or ``VISION_PARTS`` of this architecture's package (imports it on first
        use); ``ValueError`` for a vision part of a text-only architecture."""
        if name in VISION_PARTS and not self.has_vision:
            raise ValueError(f"the {self.id} architecture has no vision tower (no {name!r} part)")
        module, _, attr = (PARTS.get(name) or VISION_PARTS[name]).partition(":")
        loaded = importlib.import_module(f"{self.package}.{module}")
        return getattr(loaded, attr) if attr else loaded

    def config_class(self) -> type:
        return self.part("config")

    def model_class(self) -> type:
        return self.part("model")

    def hf_name_map(self, cfg):
        return self.part("hf_names")(cfg)

    def gguf_name_map(self, cfg):
        return self.part("gguf_names")(cfg)


ARCHITECTURES: dict[str, Architecture] = {a.id: a for a in [
    Architecture("qwen38", "zoo.models.qwen38", hf_model_types=("qwen3_5", "qwen3_5_text"),
                 gguf_architectures=("qwen35",), models=("qwen38-27b", "qwen38-tiny"), tool_format="qwen",
                 image_family="qwen3_5"),
    Architecture("glm53", "zoo.models.glm53", hf_model_types=("glm5_next", "glm5_next_text"),
                 gguf_architectures=("glm5next", "glm5-next"), models=("glm53-flash", "glm53-tiny"),
                 tool_format="glm", image_family="glm5_next"),
]}


def architecture(arch_id: str) -> Architecture:
    """The architecture called ``arch_id``; ``ValueError`` listing the known ones otherwise."""
    try:
        return ARCHITECTURES[arch_id]
    except KeyError:
        raise ValueError(f"unknown architecture {arch_id!r}; known: {sorted(ARCHITECTURES)}") from None


def _index(field: str) -> dict[str, Architecture]:
    return {name: a for a in ARCHITECTURES.values() for name in getattr(a, field)}


BY_HF_MODEL_TYPE = _index("hf_model_types")
BY_GGUF_ARCHITECTURE = _index("gguf_architectures")
BY_MODEL_NAME = _index("models")


def for_hf_model_type(*model_types: str | None) -> Architecture | None:
    """The architecture of the first of ``model_types`` that one is known by, or None."""
    return next((BY_HF_MODEL_TYPE[t] for t in model_types if t in BY_HF_MODEL_TYPE), None)


def for_gguf(gguf_architecture: str) -> Architecture | None:
    return BY_GGUF_ARCHITECTURE.get(gguf_architecture)
