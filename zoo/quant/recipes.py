"""Named quantization recipes, as data: how ``zoo.load(..., quant=NAME)`` stores each weight, and
what ``zoo.plan`` assumes about every tensor's storage without reading a file.

A recipe has

* ``load``: the storage policy at load (a key of ``STORES``, see ``zoo.quant.storage``);
* ``plan``: ordered rules ``(pattern, kind)`` matched (``re.match``) against ``"{class}:{name}"``
  of every tensor of the inventory (``zoo.quant.plan``; llama.cpp tensor names, classes such as
  ``routed_experts``); the first match gives the tensor's storage kind: a ggml type name (block
  types apply to matmul matrices whose rows are whole blocks), ``"FP8"`` (e4m3 with 128x128 f32
  block scales, the layout of the original GLM checkpoint) or a float type. A block kind that does
  not apply, and a tensor no rule matches, fall back to ``fallback``;
* ``dtype``: the parameter dtype the recipe implies, if any;
* ``gguf_part``: parameters taken from a GGUF stored beside the original checkpoint, the rest
  from the checkpoint itself (``sources_for``: a ``zoo.quant.views.MixedSource``).

``quant=None`` loads a source as it is stored (GGUF blocks as QArrays, floats dense).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from zoo.quant import storage
from zoo.quant.ggml import QType


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
    plan: tuple[tuple[str, str], ...]
    fallback: str = "BF16"
    dtype: str | None = None
    gguf_part: GgufPart | None = None


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
                         "IQ2_S / IQ3_S / IQ4_XS), everything else from the original checkpoint (FP8 "
                         "dequantized to the load dtype)",
           load="as_stored", plan=_UD_IQ3_XXS_GLM53,
           gguf_part=GgufPart(files="*UD-IQ3_XXS*.gguf",
                              params=r"(layers\.\d+|mtp\.block)\.mlp\.experts\.(gate|up|down)_kernel$")),
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


def store_for(quant: str | None, dtype: str, also_known: tuple[str, ...] = (), gguf: bool = False):
    """The storage function for ``zoo.load(quant=..., dtype=...)`` (``dtype`` a dtype name) of a
    checkpoint directory, or of a GGUF file (``gguf``); None keeps a source as stored. Raises for
    unknown recipes, recipes that imply another dtype, and recipes that mix in a GGUF (``gguf_part``)
    asked of a GGUF file."""
    if quant is None:
        return STORES["as_stored"]
    recipe = get_recipe(quant, also_known)
    if gguf and recipe.gguf_part is not None:
        raise ValueError(f"quant={quant!r} takes {recipe.gguf_part.params!r} from a GGUF and the rest from "
                         f"the original checkpoint: load the checkpoint directory (holding a GGUF matching "
                         f"{recipe.gguf_part.files!r}), not a .gguf file")
    if recipe.dtype is not None and dtype != recipe.dtype:
        raise ValueError(f"quant={quant!r} stores weights as {recipe.dtype}; got dtype={dtype!r}")
    return STORES[recipe.load]


def find_gguf(checkpoint: Path, pattern: str) -> Path:
    """The one GGUF (single file or first shard) matching ``pattern`` under ``checkpoint``."""
    from zoo.quant.gguf import SPLIT_NAME

    found = sorted(p for p in checkpoint.rglob(pattern)
                   if p.is_file() and ((m := SPLIT_NAME.match(p.name)) is None or int(m["no"]) == 1))
    if not found:
        raise FileNotFoundError(f"{checkpoint}: no GGUF matching {pattern!r} in this checkpoint directory "
                                f"(the recipe takes some weights from it)")
    if len(found) > 1:
        raise ValueError(f"{checkpoint}: several GGUFs match {pattern!r}: {', '.join(map(str, found))}")
    return found[0]


def sources_for(quant: str | None, checkpoint: Path, cfg, source, names):
    """``(source, name map)`` to fill a model from: ``source`` / ``names`` (the checkpoint's) as they
    are, unless the recipe has a ``gguf_part``: then a ``MixedSource`` whose selected parameters come
    from that GGUF (through its architecture's name map) and everything else from the checkpoint."""
    recipe = RECIPES.get(quant) if isinstance(quant, str) else None
    if recipe is None or recipe.gguf_part is None:
        return source, names
    from zoo.quant.gguf import GGUFSource
    from zoo.quant.gguf_model import gguf_names
    from zoo.quant.views import MixedSource, Part

    path = find_gguf(checkpoint, recipe.gguf_part.files)
    gguf_source, gguf_map = gguf_names(GGUFSource(path), cfg)
    take = re.compile(recipe.gguf_part.params)
    mixed = MixedSource([Part(f"GGUF {path}", gguf_source, gguf_map, lambda p: take.match(p) is not None),
                         Part(f"checkpoint {checkpoint}", source, names, lambda p: True)])
    return mixed, mixed.names
