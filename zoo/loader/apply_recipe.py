"""What a recipe means at load time: the storage function and the sources to fill from.

    recipe_of(quant, arch_id) -> the Recipe a ``quant=`` name means for the architecture, or None
    storage_at_load(quant, arch_id, dtype, gguf) -> storage function (``zoo.quant.storage``)
    sources_for(recipe, checkpoint, cfg, source, names) -> (source, name map)
    whole_gguf(recipe, checkpoint) -> the GGUF a whole-GGUF recipe loads, or None
"""

from __future__ import annotations

import re
from pathlib import Path

from zoo.loader.gguf_model import gguf_names
from zoo.models.recipe_lookup import get_recipe
from zoo.quant.recipe import Recipe, storage_of
from zoo.quant.storage import dense_store
from zoo.sources.gguf import GGUFSource
from zoo.sources.gguf_header import SPLIT_NAME
from zoo.sources.views import MixedSource, Part


def recipe_of(quant: str | None, arch_id: str) -> Recipe | None:
    """The recipe ``quant`` names for the architecture (None: the source as stored)."""
    return None if quant is None else get_recipe(quant, arch_id)


def storage_at_load(quant: str | None, arch_id: str, dtype: str, gguf: bool = False):
    """The storage function of ``zoo.load(quant=..., dtype=...)`` for an architecture: the named
    recipe's (``zoo.quant.recipe.storage_of``); for ``quant=None``, ``dense_store`` of a float
    checkpoint, a GGUF's tensors as stored."""
    if quant is None and not gguf:
        return dense_store
    return storage_of(recipe_of(quant, arch_id), dtype, gguf)


def find_gguf(checkpoint: Path, pattern: str) -> Path:
    """The one GGUF (single file or first shard) matching ``pattern`` under ``checkpoint``."""
    found = sorted(p for p in checkpoint.rglob(pattern)
                   if p.is_file() and ((m := SPLIT_NAME.match(p.name)) is None or int(m["no"]) == 1))
    if not found:
        raise FileNotFoundError(f"{checkpoint}: no GGUF matching {pattern!r} in this checkpoint directory "
                                f"(the recipe takes some weights from it)")
    if len(found) > 1:
        raise ValueError(f"{checkpoint}: several GGUFs match {pattern!r}: {', '.join(map(str, found))}")
    return found[0]


def whole_gguf(recipe: Recipe | None, checkpoint: Path) -> Path | None:
    """The GGUF that ``recipe`` loads whole from ``checkpoint`` (a directory), or None."""
    if recipe is None or recipe.whole_gguf is None:
        return None
    return find_gguf(checkpoint, recipe.whole_gguf)


def sources_for(recipe: Recipe | None, checkpoint: Path, cfg, source, names):
    """``(source, name map)`` to fill a model from: ``source`` / ``names`` (the checkpoint's) as they
    are, unless the recipe has a ``gguf_part``: then a ``MixedSource`` whose selected parameters come
    from that GGUF (through its architecture's name map) and everything else from the checkpoint."""
    if recipe is None or recipe.gguf_part is None:
        return source, names
    path = find_gguf(checkpoint, recipe.gguf_part.files)
    gguf_source, gguf_map = gguf_names(GGUFSource(path), cfg)
    take = re.compile(recipe.gguf_part.params)
    mixed = MixedSource([Part(f"GGUF {path}", gguf_source, gguf_map, lambda p: take.match(p) is not None),
                         Part(f"checkpoint {checkpoint}", source, names, lambda p: True)])
    return mixed, mixed.names
