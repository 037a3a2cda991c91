"""Registry: model names -> ``ModelSpec`` (where the weights live, which preset describes them).

``resolve_checkpoint(name)`` returns a local checkpoint directory: the embedded assets of a tiny
model, or a Hugging Face snapshot fetched with ``huggingface_hub`` (only the files a text model
needs; interrupted downloads resume).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from zoo.models.architectures import BY_MODEL_NAME

# What a text model needs from an HF repo (vision-only files are skipped).
HF_PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    preset: str | None = None          # configs/<preset>: the real shape, for planning without weights
    hf_repo: str | None = None         # Hugging Face repo of the original checkpoint
    embedded: str | None = None        # zoo/assets/<embedded>: weights shipped inside the package

    @property
    def arch(self) -> str:
        """The architecture id (``zoo.models.architectures``: the one table that maps names to it)."""
        return BY_MODEL_NAME[self.name].id


REGISTRY: dict[str, ModelSpec] = {s.name: s for s in [
    ModelSpec("qwen38-27b", "Qwen3.8-27B: 48 gated-DeltaNet + 16 gated-attention layers, MTP",
              preset="qwen38-27b.json", hf_repo="Qwen/Qwen3.8-27B"),
    ModelSpec("qwen38-tiny", "Tiny Qwen3.8-architecture demo model, trained on zoo's synthetic chat corpus",
              preset="qwen38-tiny.json", embedded="qwen38-tiny"),
    ModelSpec("glm53-flash", "GLM-5.3-Flash: 34 KDA + 11 MLA/indexer layers, 288-expert MoE, "
              "mHC streams, MTP (FP8 weights)", preset="glm53-flash.json", hf_repo="zai-org/GLM-5.3-Flash"),
    ModelSpec("glm53-tiny", "Tiny GLM-5.3-architecture demo model, trained on zoo's synthetic chat corpus",
              preset="glm53-tiny.json", embedded="glm53-tiny"),
]}


class UnknownModelError(KeyError):
    def __str__(self):
        return str(self.args[0])


def get_spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}: not a registered name ({', '.join(sorted(REGISTRY))}) "
            f"nor an existing path") from None


def list_models() -> list[str]:
    return sorted(REGISTRY)


def preset_path(preset: str) -> Path:
    """The file of a config preset in ``configs/`` (shipped as the ``zoo.configs`` package)."""
    return Path(str(resources.files("zoo.configs").joinpath(preset)))


def preset_config(spec: ModelSpec):
    """The frozen config of the spec's real shape, no download: an embedded model's own
    ``config.json`` (the demo models' shapes differ from the tiny presets of ``configs/``, which the
    parity tests use), else its preset (``configs/``)."""
    from zoo.models.config import config_from_hf

    if spec.embedded:
        path = embedded_path(spec.embedded) / "config.json"
        return config_from_hf(json.loads(path.read_text()), source=str(path))
    if spec.preset is None:
        raise ValueError(f"model {spec.name!r} has no config preset")
    path = preset_path(spec.preset)
    return config_from_hf(json.loads(path.read_text()), source=str(path))


def embedded_path(name: str) -> Path:
    return Path(str(resources.files("zoo").joinpath("assets", name)))


def local_checkpoint(spec: ModelSpec) -> Path | None:
    """The spec's checkpoint if it is on this machine already (embedded, or in the HF cache)."""
    if spec.embedded:
        return embedded_path(spec.embedded)
    if spec.hf_repo:
        from huggingface_hub import snapshot_download
        try:
            return Path(snapshot_download(spec.hf_repo, allow_patterns=list(HF_PATTERNS), local_files_only=True))
        except Exception:          # not downloaded (LocalEntryNotFoundError) or no cache at all
            return None
    return None


def resolve_checkpoint(spec: ModelSpec) -> Path:
    """A local directory holding the spec's checkpoint (downloading it if needed)."""
    if spec.embedded:
        return embedded_path(spec.embedded)
    if spec.hf_repo:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(spec.hf_repo, allow_patterns=list(HF_PATTERNS)))
    raise ValueError(f"model {spec.name!r} has no weight source")
