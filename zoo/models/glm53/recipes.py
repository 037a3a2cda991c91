"""GLM-5.3's own quantization recipes (besides ``zoo.quant.recipe.GENERIC_RECIPES``)."""

from __future__ import annotations

from zoo.quant.recipe import GgufPart, Recipe

# Unsloth's UD-IQ3_XXS GGUF of GLM-5.3-Flash: the routed experts' per-layer type mix (docs/reference.md
# section 3; the MTP layer's experts are Q2_K/Q2_K/Q3_K), everything else from the FP8 original.
_UD_EXPERTS = (
    (r"routed_experts:blk\.11\.ffn_(gate|up)_exps", "IQ3_S"),
    (r"routed_experts:blk\.11\.ffn_down_exps", "IQ4_XS"),
    (r"routed_experts:blk\.(12|44)\.ffn_(gate|up)_exps", "IQ2_S"),
    (r"routed_experts:blk\.(12|44)\.ffn_down_exps", "IQ4_XS"),
    (r"routed_experts:.*\.ffn_(gate|up)_exps", "IQ2_S"),
    (r"routed_experts:.*\.ffn_down_exps", "IQ3_S"),
    (r"mtp:.*\.ffn_(gate|up)_exps", "Q2_K"),
    (r"mtp:.*\.ffn_down_exps", "Q3_K"),
)
# the rest as the best existing engine for this model keeps it: every matmul weight int8 with a scale
# per output channel (quantized at load from the FP8 checkpoint); embedding, router, norms dense
_UD_IQ3_XXS_GLM53 = _UD_EXPERTS + ((r"(embedding|router):", "BF16"), (r"hyper_connections:", "F32"),
                                   (r"[a-z_]+:", "INT8"))
# the same experts, the rest read from FP8 into the load dtype (bf16)
_UD_IQ3_XXS_BF16_GLM53 = _UD_EXPERTS + ((r"(embedding|output|router):", "BF16"), (r"hyper_connections:", "F32"),
                                        (r"[a-z_]+:", "FP8"))
_UD_EXPERTS_PART = GgufPart(files="*UD-IQ3_XXS*.gguf",
                            params=r"(layers\.\d+|mtp\.block)\.mlp\.experts\.(gate|up|down)_kernel$")

RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe("UD-IQ3_XXS", "routed experts (the MTP layer's too) from the Unsloth UD-IQ3_XXS GGUF as stored (a "
                         "per-layer mix of IQ2_S / IQ3_S / IQ4_XS), every other matmul weight int8 with a scale "
                         "per output channel from the original FP8 checkpoint; embedding, router, norms dense",
           load="int8_unless_quantized", plan=_UD_IQ3_XXS_GLM53, gguf_part=_UD_EXPERTS_PART),
    Recipe("UD-IQ3_XXS-bf16", "the UD-IQ3_XXS experts as stored, everything else from the original checkpoint "
                              "(FP8 dequantized to the load dtype)",
           load="as_stored", plan=_UD_IQ3_XXS_BF16_GLM53, gguf_part=_UD_EXPERTS_PART),
]}
