"""Qwen3.8's own quantization recipes (besides ``zoo.quant.recipe.GENERIC_RECIPES``)."""

from __future__ import annotations

from zoo.quant.recipe import Recipe

RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe("UD-IQ3_XXS", "the whole Unsloth UD-IQ3_XXS GGUF of Qwen3.8, every tensor as stored (put it in "
                         "the checkpoint directory); its per-tensor types are the file's: plan it from "
                         "the file's header (zoo plan FILE.gguf)",
           load="as_stored", plan=None, whole_gguf="*UD-IQ3_XXS*.gguf"),
]}
