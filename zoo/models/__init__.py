"""Architectures: config class, NNX module and checkpoint name maps, looked up by ``arch`` name.

The table is data; modules are imported only when an architecture is asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    name: str
    module: str        # "package.module:Class" of the NNX model
    hf_names: str      # "package.module:NAME" of the HF safetensors name map (or of a fn(config) -> map)

    def model_class(self):
        return _resolve(self.module)

    def hf_name_map(self, cfg=None):
        """The HF name map; maps that depend on the config are functions of it."""
        names = _resolve(self.hf_names)
        return names(cfg) if callable(names) else names


def _resolve(ref: str):
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


ARCHS: dict[str, Arch] = {
    "qwen35": Arch("qwen35", "zoo.models.qwen38:Qwen38", "zoo.quant.names:QWEN35_HF"),
    "glm5next": Arch("glm5next", "zoo.models.glm53:Glm53", "zoo.quant.names:glm5next_hf"),
}


def arch(name: str) -> Arch:
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(f"unknown architecture {name!r}; known: {sorted(ARCHS)}") from None
