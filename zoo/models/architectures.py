"""The architecture table: one identifier per architecture, and every name it is known by.

    id          the identifier everything else uses (``config.arch``, the weight cache, the planner)
    package     the model's package: its config, NNX modules, weight maps, GGUF metadata table,
                tensor inventory and recipes, found under fixed module and attribute names
                (``PARTS``), imported only when asked for
    hf_model_types      HF ``config.json`` ``model_type`` values (the outer one of a multimodal
                        checkpoint and the ``text_config`` one)
    gguf_architectures  GGUF ``general.architecture`` strings (llama.cpp spells some two ways)
    models      the registry names (``zoo.registry``) of this architecture
    tool_format the native tool-call syntax the server parses (``zoo.text.tool_calls``)

This module imports nothing from zoo, so every layer may read the table.
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
    "inventory": "inventory:tensors",       # fn(config) -> [Tensor] in GGUF names (the planner's)
    "recipes": "recipes:RECIPES",           # {name: Recipe}: this architecture's own recipes
}


@dataclass(frozen=True)
class Architecture:
    id: str
    package: str
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    models: tuple[str, ...]
    tool_format: str

    def part(self, name: str) -> Any:
        """One of ``PARTS`` of this architecture's package (imports it on first use)."""
        module, attr = PARTS[name].split(":")
        return getattr(importlib.import_module(f"{self.package}.{module}"), attr)

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
                 gguf_architectures=("qwen35",), models=("qwen38-27b", "qwen38-tiny"), tool_format="qwen"),
    Architecture("glm53", "zoo.models.glm53", hf_model_types=("glm5_next", "glm5_next_text"),
                 gguf_architectures=("glm5next", "glm5-next"), models=("glm53-flash", "glm53-tiny"),
                 tool_format="glm"),
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
