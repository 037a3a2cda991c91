"""GLM-5.3 weight maps: HF ``glm5_next`` safetensors names and llama.cpp ``glm5next`` GGUF names ->
parameter paths of ``zoo.models.glm53.model.Glm53`` (with layout transforms and the kv_b join)."""

from __future__ import annotations

import functools

import numpy as np

from zoo.models.glm53 import vision as vision_tower
from zoo.sources.names import Combiner, Join, NameMap, Rule


def _kv_b_from_k_v(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """llama.cpp's MLA split undone: ``attn_k_b [H, C, dn]`` (each head's k part transposed) and
    ``attn_v_b [H, dv, C]`` -> ``kv_b_proj.weight [H*(dn+dv), C]`` (per head rows ``[k_nope | v]``)."""
    return np.ascontiguousarray(np.concatenate([np.swapaxes(k_b, 1, 2), v_b], axis=1).reshape(-1, k_b.shape[1]))


def _kv_b_shape(k_b: tuple[int, ...], v_b: tuple[int, ...]) -> tuple[int, int]:
    if len(k_b) != 3 or len(v_b) != 3 or k_b[0] != v_b[0] or k_b[1] != v_b[2]:
        raise ValueError(f"attn_k_b {k_b} and attn_v_b {v_b} are not [H, C, dn] and [H, dv, C]")
    return (k_b[0] * (k_b[2] + v_b[1]), k_b[1])


KV_B_FROM_K_V = Combiner(_kv_b_from_k_v, _kv_b_shape)


def _glm5next_layer_rules(src: str, dst: str) -> list[Rule]:
    """One GLM-5.3 decoder layer's on-disk HF tensors, under source prefix ``src`` and parameter prefix ``dst``."""
    sa, ix, mlp = rf"{src}\.self_attn", rf"{src}\.self_attn\.indexer", rf"{src}\.mlp"
    linears = ("q_proj|k_proj|v_proj|f_a_proj|f_b_proj|b_proj|g_a_proj|g_b_proj|o_proj"   # KDA
               "|q_a_proj|q_b_proj|kv_a_proj_with_mqa")                                   # MLA
    return [
        Rule(rf"{src}\.hc_(?P<s>attn|ffn)_(?P<n>fn|base|scale)", rf"{dst}.\g<s>_hc.\g<n>"),
        Rule(rf"{src}\.(?P<n>input_layernorm|post_attention_layernorm)\.weight", rf"{dst}.\g<n>.weight"),
        Rule(rf"{sa}\.(?P<n>{linears})\.weight", rf"{dst}.self_attn.\g<n>.kernel", "matmul"),
        Rule(rf"{sa}\.(?P<n>q_a_proj|kv_a_proj_with_mqa|o_proj)\.bias", rf"{dst}.self_attn.\g<n>.bias"),
        Rule(rf"{sa}\.(?P<n>q|k|v)_conv1d\.weight", rf"{dst}.self_attn.\g<n>_conv", "conv"),
        Rule(rf"{sa}\.(?P<n>A_log|dt_bias)", rf"{dst}.self_attn.\g<n>"),
        Rule(rf"{sa}\.(?P<n>o_norm|q_a_layernorm|kv_a_layernorm)\.weight", rf"{dst}.self_attn.\g<n>.weight"),
        Rule(rf"{sa}\.kv_b_proj\.weight", rf"{dst}.self_attn.kv_b"),
        Rule(rf"{ix}\.(?P<n>wq_b|wk|weights_proj)\.weight", rf"{dst}.self_attn.indexer.\g<n>.kernel", "matmul"),
        Rule(rf"{ix}\.k_norm\.(?P<n>weight|bias)", rf"{dst}.self_attn.indexer.k_norm.\g<n>"),
        Rule(rf"{ix}\.index_kpool_compress_gate", rf"{dst}.self_attn.indexer.compress_gate.kernel", "matmul"),
        Rule(rf"{ix}\.index_kpool_compress_ape", rf"{dst}.self_attn.indexer.compress_ape"),
        Rule(rf"{mlp}\.gate\.weight", rf"{dst}.mlp.router.weight", "transposed"),
        Rule(rf"{mlp}\.gate\.e_score_correction_bias", rf"{dst}.mlp.router.correction_bias"),
        Rule(rf"{mlp}\.experts\.(?P<e>\d+)\.(?P<n>gate|up|down)_proj\.weight",
             rf"{dst}.mlp.experts.\g<n>_kernel", "matmul", index="e"),
        Rule(rf"{mlp}\.shared_experts\.(?P<n>gate_proj|up_proj|down_proj)\.weight",
             rf"{dst}.mlp.shared_experts.\g<n>.kernel", "matmul"),
        Rule(rf"{mlp}\.(?P<n>gate_proj|up_proj|down_proj)\.weight", rf"{dst}.mlp.\g<n>.kernel", "matmul"),
    ]


def _under(prefix: str, rules) -> list[Rule]:
    """The tower's rules (``zoo.models.glm53.vision.hf_names``) for names and parameters under ``prefix.``."""
    return [Rule(rf"{prefix}\.{r.pattern}", f"{prefix}.{r.target}", r.transform, r.index) for r in rules]


@functools.lru_cache(maxsize=None)
def _glm5next_hf(num_hidden_layers: int, vision: vision_tower.VisionConfig | None) -> NameMap:
    mtp = rf"layers\.{num_hidden_layers}"
    tower = () if vision is None else _under("visual", vision_tower.hf_names(vision).rules)
    return NameMap(
        strip_prefixes=("model.language_model.", "model."),
        ignore=(() if vision is not None else (r"model\.visual\.", r"visual\."))
        + (r"(model\.(language_model\.)?)?layers\.\d+\.(embed_tokens|shared_head\.head)\.",),
        rules=tuple(
            [Rule(r"embed_tokens\.weight", "embed_tokens.embedding"),
             Rule(r"norm\.weight", "norm.weight"),
             Rule(r"lm_head\.weight", "lm_head.kernel", "matmul"),
             Rule(rf"{mtp}\.eh_proj\.weight", "mtp.fc.kernel", "matmul"),
             Rule(rf"{mtp}\.enorm\.weight", "mtp.embed_norm.weight"),
             Rule(rf"{mtp}\.hnorm\.weight", "mtp.hidden_norm.weight"),
             Rule(rf"{mtp}\.shared_head\.norm\.weight", "mtp.final_norm.weight")]
            + _glm5next_layer_rules(mtp, "mtp.block")
            + _glm5next_layer_rules(r"layers\.(?P<i>\d+)", r"layers.\g<i>")
            + list(tower)
        ),
    )


def glm5next_hf(cfg) -> NameMap:
    """HF ``glm5_next`` checkpoints (on-disk names): ``model.language_model.*`` (multimodal) or
    ``model.*`` (text only), ``lm_head.weight`` at the top level; the MTP layer is
    ``layers.{num_hidden_layers}``; the vision tower ``model.visual.*`` -> ``visual.*`` when the
    config has one (``cfg.vision``), else ignored; the MTP layer's copies of the embedding and head
    (when present) are ignored."""
    return _glm5next_hf(cfg.num_hidden_layers, getattr(cfg, "vision", None))


# llama.cpp's ``glm5next`` block: GGUF name after ``blk.N.`` -> parameter after the layer prefix,
# layout transform. KDA and MLA layers share ``attn_output`` (o_proj); ``attn_kv_b`` is joined from
# ``attn_k_b`` + ``attn_v_b`` (``GLM5NEXT_JOINS``); expert banks are stacked ``[E, out, in]``.
_GLM5NEXT_BLOCK = (
    (r"hc_(?P<s>attn|ffn)_(?P<n>fn|base|scale)\.weight", r"\g<s>_hc.\g<n>", None),
    (r"attn_norm\.weight", "input_layernorm.weight", None),
    (r"ffn_norm\.weight", "post_attention_layernorm.weight", None),
    (r"attn_(?P<p>q|k|v)\.weight", r"self_attn.\g<p>_proj.kernel", "matmul"),
    (r"ssm_conv1d_(?P<p>q|k|v)\.weight", r"self_attn.\g<p>_conv", "conv"),
    (r"ssm_(?P<p>f_a|f_b|g_a|g_b)\.weight", r"self_attn.\g<p>_proj.kernel", "matmul"),
    (r"ssm_beta\.weight", "self_attn.b_proj.kernel", "matmul"),
    (r"ssm_a", "self_attn.A_log", "a_log_from_ssm_a"),
    (r"ssm_dt\.bias", "self_attn.dt_bias", None),
    (r"ssm_norm\.weight", "self_attn.o_norm.weight", None),
    (r"attn_output\.weight", "self_attn.o_proj.kernel", "matmul"),
    (r"attn_q_a\.weight", "self_attn.q_a_proj.kernel", "matmul"),
    (r"attn_kv_a_mqa\.weight", "self_attn.kv_a_proj_with_mqa.kernel", "matmul"),
    (r"attn_q_a\.bias", "self_attn.q_a_proj.bias", None),
    (r"attn_kv_a_mqa\.bias", "self_attn.kv_a_proj_with_mqa.bias", None),
    (r"attn_output\.bias", "self_attn.o_proj.bias", None),
    (r"attn_q_a_norm\.weight", "self_attn.q_a_layernorm.weight", None),
    (r"attn_q_b\.weight", "self_attn.q_b_proj.kernel", "matmul"),
    (r"attn_kv_a_norm\.weight", "self_attn.kv_a_layernorm.weight", None),
    (r"attn_kv_b\.weight", "self_attn.kv_b", None),
    (r"indexer\.attn_q_b\.weight", "self_attn.indexer.wq_b.kernel", "matmul"),
    (r"indexer\.attn_k\.weight", "self_attn.indexer.wk.kernel", "matmul"),
    (r"indexer\.k_norm\.(?P<n>weight|bias)", r"self_attn.indexer.k_norm.\g<n>", None),
    (r"indexer\.proj\.weight", "self_attn.indexer.weights_proj.kernel", "matmul"),
    (r"indexer_compressor_gate\.weight", "self_attn.indexer.compress_gate.kernel", "matmul"),
    (r"indexer_compressor_ape\.weight", "self_attn.indexer.compress_ape", None),
    (r"ffn_gate_inp\.weight", "mlp.router.weight", "transposed"),
    (r"exp_probs_b\.bias", "mlp.router.correction_bias", None),
    (r"ffn_(?P<p>gate|up|down)_exps\.weight", r"mlp.experts.\g<p>_kernel", "matmul"),
    (r"ffn_(?P<p>gate|up|down)_shexp\.weight", r"mlp.shared_experts.\g<p>_proj.kernel", "matmul"),
    (r"ffn_(?P<p>gate|up|down)\.weight", r"mlp.\g<p>_proj.kernel", "matmul"),
)
GLM5NEXT_JOINS = (Join(r"(?P<b>blk\.\d+)\.attn_k_b\.weight", (r"\g<b>.attn_k_b.weight", r"\g<b>.attn_v_b.weight"),
                       r"\g<b>.attn_kv_b.weight", KV_B_FROM_K_V),)


@functools.lru_cache(maxsize=None)
def _glm5next_gguf(num_hidden_layers: int, vision: vision_tower.VisionConfig | None) -> NameMap:
    def block(src: str, dst: str) -> list[Rule]:
        return [Rule(rf"{src}\.{pattern}", f"{dst}.{target}", transform)
                for pattern, target, transform in _GLM5NEXT_BLOCK]

    mtp = rf"blk\.{num_hidden_layers}"
    return NameMap(
        ignore=(rf"{mtp}\.nextn\.(embed_tokens|shared_head_head)\.",),
        joins=GLM5NEXT_JOINS + (() if vision is None else vision_tower.gguf_joins(vision)),
        rules=tuple(
            [Rule(r"token_embd\.weight", "embed_tokens.embedding"),
             Rule(r"output_norm\.weight", "norm.weight"),
             Rule(r"output\.weight", "lm_head.kernel", "matmul"),
             Rule(rf"{mtp}\.nextn\.eh_proj\.weight", "mtp.fc.kernel", "matmul"),
             Rule(rf"{mtp}\.nextn\.enorm\.weight", "mtp.embed_norm.weight"),
             Rule(rf"{mtp}\.nextn\.hnorm\.weight", "mtp.hidden_norm.weight"),
             Rule(rf"{mtp}\.nextn\.shared_head_norm\.weight", "mtp.final_norm.weight")]
            + block(mtp, "mtp.block")
            + block(r"blk\.(?P<i>\d+)", r"layers.\g<i>")
            + ([] if vision is None else vision_tower.gguf_rules(vision, "visual"))
        ),
    )


def glm5next_gguf_names(cfg) -> NameMap:
    """llama.cpp's ``glm5next`` / ``glm5-next`` GGUF layout for a ``Glm53Config`` (docs/reference.md
    section 1): plain norms (no +1), ``ssm_a`` = ``-exp(A_log)``, KDA convs ``[C, (1,) K]`` (any unit
    dims), ``kv_b`` joined from ``attn_k_b`` + ``attn_v_b``, stacked expert banks ``[E, out, in]``
    ("T" -> ``[E, in, out]``); the MTP block is ``blk.{num_hidden_layers}`` plus its ``nextn.*``
    tensors (its copies of the embedding and head, when present, are the shared ones: ignored). With a
    vision tower (``cfg.vision``), its tensors in llama.cpp's mmproj names
    (``zoo.models.glm53.vision.gguf_rules``: the names of the planner's inventory)."""
    return _glm5next_gguf(cfg.num_hidden_layers, getattr(cfg, "vision", None))


hf_names = glm5next_hf
gguf_names = glm5next_gguf_names
