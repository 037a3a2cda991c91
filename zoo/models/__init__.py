"""The models: one package per architecture (``qwen38/``, ``glm53/``), the layers they share
(``shared/``), the contract the engine relies on (``contract``), and the architecture table
(``architectures``) that maps every name an architecture is known by to its package."""

from zoo.models.architectures import ARCHITECTURES, Architecture, architecture

__all__ = ["ARCHITECTURES", "Architecture", "architecture"]
