"""Named quantization recipes, as data: how ``zoo.load(..., quant=NAME)`` stores each weight, and
what ``zoo.plan`` assumes about every tensor's storage without reading a file.

A recipe has

* ``load``: the storage policy at load (a key of ``STORES``, see ``zoo.quant.storage``);
* ``plan``: ordered rules ``(pattern, kind)`` matched (``re.match``) against ``"{class}:{name}"``
  of every tensor of the inventory (``zoo.tools.plan``; llama.cpp tensor names, classes such as
  ``routed_experts``); the first match gives the tensor's storage kind: a ggml type name (block
  types apply to matmul matrices whose rows are whole blocks), ``"FP8"`` (e4m3 with 128x128 f32
  block scales, the layout of the original GLM checkpoint) or a float type. A block kind that does
  not apply, and a tensor no rule matches, fall back to ``fallback``;
* ``dtype``: the parameter dtype the recipe implies, if any;
* ``gguf_part``: parameters taken from a GGUF stored beside the original checkpoint, the rest
  from the checkpoint itself (``zoo.loader.apply_recipe.sources_for``: a ``zoo.sources.views.MixedSource``);
* ``whole_gguf``: the model is the GGUF matching this glob in the checkpoint directory, every
  tensor as stored (its per-tensor types are the file's: such a recipe has no ``plan`` rules and
  is planned from the file's header).

``GENERIC_RECIPES`` apply to every architecture; an architecture adds its own in
``zoo.models.<arch>.recipes`` (``zoo.models.recipe_lookup.recipes_for`` joins the two). ``storage_of``
is the storage function a recipe implies; ``zoo.loader.apply_recipe.storage_at_load`` resolves a
``quant=`` name of an architecture to it.
``quant=None`` loads a source as it is stored (GGUF blocks as QArrays, floats dense).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from zoo.formats.ggml import BLOCK_LAYOUTS, QType
from zoo.quant import int8, storage


@dataclass(frozen=True)
class GgufPart:
    """Parameters a recipe loads from a GGUF beside the original checkpoint: ``files`` is a glob,
    searched recursively in the checkpoint directory, for the GGUF (one file, or the first shard of
    a split set); ``params`` a regex (``re.match``) of the parameter paths it provides, as stored."""

    files: str
    params: str


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    load: str
    plan: tuple[tuple[str, str], ...] | None
    fallback: str = "BF16"
    dtype: str | None = None
    gguf_part: GgufPart | None = None
    whole_gguf: str | None = None

    def kind_of(self, tensor) -> str:
        """The storage kind of an inventory tensor (``.cls``, ``.name``, numpy-order ``.shape``,
        ``.matmul``) under this recipe: the first ``plan`` rule matching ``"{class}:{name}"``; a block
        type only for a matmul matrix of whole blocks, "FP8" / "INT8" only for a matmul matrix, else
        ``fallback``."""
        key = f"{tensor.cls}:{tensor.name}"
        kind = next((k for pattern, k in self.plan if re.match(pattern, key)), self.fallback)
        if kind in QType.__members__ and BLOCK_LAYOUTS[QType[kind]].block_size > 1:
            if not tensor.matmul or tensor.shape[-1] % BLOCK_LAYOUTS[QType[kind]].block_size:
                return self.fallback
        if kind in ("FP8", "INT8") and not tensor.matmul:
            return self.fallback
        return kind


GENERIC_RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe("bf16", "every weight dense bfloat16 (quantized source tensors dequantized at load)",
           load="dequantized", plan=((r".", "BF16"),), dtype="bfloat16"),
    Recipe("Q8_0", "every float matmul weight quantized to Q8_0 by gguf's quantizer at load (weights "
                   "already quantized in the source kept as stored); embeddings, norms dense",
           load="Q8_0", plan=((r"(attention|mlp|shared_experts|routed_experts|output|mtp|vision):", "Q8_0"),)),
    Recipe("int8", "every float matmul weight as int8 with one float32 scale per output channel "
                   "(zoo.quant.int8); embeddings, norms, routers dense",
           load="int8", plan=((r"(attention|mlp|shared_experts|routed_experts|output|mtp|vision):", "INT8"),)),
]}

# load policy -> storage function (``zoo.quant.storage``)
STORES = {
    "as_stored": storage.as_stored,
    "dequantized": storage.dequantized_store,
    "Q8_0": storage.quantizing_store(QType.Q8_0),
    "int8": int8.int8_store,
    "int8_unless_quantized": int8.int8_unless_quantized,
}


def storage_of(recipe: Recipe | None, dtype: str, gguf: bool = False):
    """The storage function for ``zoo.load(quant=..., dtype=...)`` (``dtype`` a dtype name) of a
    checkpoint directory, or of a GGUF file (``gguf``); None keeps a source as stored. Raises for
    recipes that imply another dtype, and recipes that mix in a GGUF (``gguf_part``) asked of a
    GGUF file."""
    if recipe is None:
        return STORES["as_stored"]
    if gguf and recipe.gguf_part is not None:
        raise ValueError(f"quant={recipe.name!r} takes {recipe.gguf_part.params!r} from a GGUF and the rest "
                         f"from the original checkpoint: load the checkpoint directory (holding a GGUF "
                         f"matching {recipe.gguf_part.files!r}), not a .gguf file")
    if gguf and recipe.whole_gguf is not None:
        raise ValueError(f"quant={recipe.name!r} loads the GGUF matching {recipe.whole_gguf!r} found in a "
                         f"checkpoint directory: load that directory, or the .gguf file itself with quant=None")
    if recipe.dtype is not None and dtype != recipe.dtype:
        raise ValueError(f"quant={recipe.name!r} stores weights as {recipe.dtype}; got dtype={dtype!r}")
    return STORES[recipe.load]
