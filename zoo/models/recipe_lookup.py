"""Finding a recipe by name for an architecture: its recipes are ``zoo.quant.recipe.GENERIC_RECIPES``
plus its own (``zoo.models.<arch>.recipes.RECIPES``, found through the architecture table; they win
on a name clash)."""

from __future__ import annotations

from zoo.models.architectures import architecture
from zoo.quant.recipe import GENERIC_RECIPES, Recipe


def recipes_for(arch_id: str) -> dict[str, Recipe]:
    """Every recipe of architecture ``arch_id`` by name: the generic ones and its own (own win)."""
    return {**GENERIC_RECIPES, **architecture(arch_id).part("recipes")}


def get_recipe(name, arch_id: str) -> Recipe:
    """The recipe ``name`` of architecture ``arch_id``; ``ValueError`` listing that architecture's
    recipes otherwise."""
    known = recipes_for(arch_id)
    if isinstance(name, str) and name in known:
        return known[name]
    raise ValueError(f"unknown quantization recipe {name!r}; known: {', '.join(sorted(known))} "
                     f"(the recipes of {arch_id})")
