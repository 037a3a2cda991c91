"""Named quantization recipes, as data: how ``zoo.load(..., quant=NAME)`` stores each weight, and
what ``zoo.plan`` assumes about every tensor's storage without reading a file.

A recipe has

* ``load``: the storage policy at load (a key of ``STORES``, see ``zoo.quant.storage``), or None
  when the recipe cannot be loaded yet (``not_loadable`` says why);
* ``plan``: ordered rules ``(pattern, kind)`` matched (``re.match``) against ``"{class}:{name}"``
  of every tensor of the inventory (``zoo.quant.plan``; llama.cpp tensor names, classes such as
  ``routed_experts``); the first match gives the tensor's storage kind: a ggml type name (block
  types apply to matmul matrices whose rows are whole blocks), ``"FP8"`` (e4m3 with 128x128 f32
  block scales, the layout of the original GLM checkpoint) or a float type. A block kind that does
  not apply, and a tensor no rule matches, fall back to ``fallback``;
* ``dtype``: the parameter dtype the recipe implies, if any.

``quant=None`` loads a source as it is stored (GGUF blocks as QArrays, floats dense).
"""

from __future__ import annotations

from dataclasses import dataclass

from zoo.quant import storage
from zoo.quant.ggml import QType


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    load: str | None
    plan: tuple[tuple[str, str], ...]
    fallback: str = "BF16"
    dtype: str | None = None
    not_loadable: str = ""


# Unsloth's UD-IQ3_XXS GGUF of GLM-5.3-Flash: the routed experts' per-layer type mix (REFERENCE.md
# section 3; the MTP layer's experts are Q2_K/Q2_K/Q3_K), everything else from the FP8 original.
_UD_IQ3_XXS_GLM53 = (
    (r"routed_experts:blk\.11\.ffn_(gate|up)_exps", "IQ3_S"),
    (r"routed_experts:blk\.11\.ffn_down_exps", "IQ4_XS"),
    (r"routed_experts:blk\.(12|44)\.ffn_(gate|up)_exps", "IQ2_S"),
    (r"routed_experts:blk\.(12|44)\.ffn_down_exps", "IQ4_XS"),
    (r"routed_experts:.*\.ffn_(gate|up)_exps", "IQ2_S"),
    (r"routed_experts:.*\.ffn_down_exps", "IQ3_S"),
    (r"mtp:.*\.ffn_(gate|up)_exps", "Q2_K"),
    (r"mtp:.*\.ffn_down_exps", "Q3_K"),
    (r"(embedding|output|router):", "BF16"),
    (r"hyper_connections:", "F32"),
    (r"[a-z_]+:", "FP8"),
)

RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe("bf16", "every weight dense bfloat16 (quantized source tensors dequantized at load)",
           load="dequantized", plan=((r".", "BF16"),), dtype="bfloat16"),
    Recipe("Q8_0", "every float matmul weight quantized to Q8_0 by gguf's quantizer at load (weights "
                   "already quantized in the source kept as stored); embeddings, norms dense",
           load="Q8_0", plan=((r"(attention|mlp|shared_experts|routed_experts|output|mtp):", "Q8_0"),)),
    Recipe("UD-IQ3_XXS", "routed experts from the Unsloth UD-IQ3_XXS GGUF as stored (a per-layer mix of "
                         "IQ2_S / IQ3_S / IQ4_XS), everything else from the original checkpoint",
           load=None, plan=_UD_IQ3_XXS_GLM53,
           not_loadable="it reads two sources (GGUF experts + the original FP8 checkpoint) and needs the "
                        "GLM-5.3 loader; plan it with zoo.plan"),
]}

# load policy -> storage function (``zoo.quant.storage``)
STORES = {
    "as_stored": storage.as_stored,
    "dequantized": storage.dequantized_store,
    "Q8_0": storage.quantizing_store(QType.Q8_0),
}


def get_recipe(name: str, also_known: tuple[str, ...] = ()) -> Recipe:
    """The recipe called ``name``; ``ValueError`` listing the known ones (and ``also_known``:
    ``quant=`` names the loader resolves elsewhere) otherwise."""
    try:
        return RECIPES[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted([*RECIPES, *also_known]))
        raise ValueError(f"unknown quantization recipe {name!r}; known: {known}") from None


def store_for(quant: str | None, dtype: str, also_known: tuple[str, ...] = ()):
    """The storage function for ``zoo.load(quant=..., dtype=...)`` (``dtype`` a dtype name); None
    keeps a source as stored. Raises for unknown recipes, recipes that cannot be loaded yet, and
    recipes that imply another dtype."""
    if quant is None:
        return STORES["as_stored"]
    recipe = get_recipe(quant, also_known)
    if recipe.load is None:
        raise NotImplementedError(f"quant={quant!r} cannot be loaded yet: {recipe.not_loadable}")
    if recipe.dtype is not None and dtype != recipe.dtype:
        raise ValueError(f"quant={quant!r} stores weights as {recipe.dtype}; got dtype={dtype!r}")
    return STORES[recipe.load]
