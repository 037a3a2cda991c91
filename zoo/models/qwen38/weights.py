"""Qwen3.8 weight maps: HF ``qwen3_5`` safetensors names and llama.cpp ``qwen35`` GGUF names ->
parameter paths of ``zoo.models.qwen38.model.Qwen38`` (with layout transforms).

With a vision tower (``config.vision``) the HF map also loads ``model.visual.*`` into ``visual.*``
and the GGUF map places llama.cpp's mmproj names of the tower (``v.*``, ``mm.*``: the inventory's);
without one the tower's tensors are ignored.
"""

from __future__ import annotations

import functools

from zoo.models.qwen38.vision import VisionConfig, gguf_joins, gguf_rules, vision_rules
from zoo.sources.names import HeadOrder, NameMap, Rule, Transform


def _qwen35_layer_rules(src: str, dst: str) -> list[Rule]:
    """One Qwen3.5 decoder layer's tensors, under source prefix ``src`` and parameter prefix ``dst``."""
    la, sa = rf"{src}\.linear_attn", rf"{src}\.self_attn"
    return [
        Rule(rf"{src}\.(?P<n>input_layernorm|post_attention_layernorm)\.weight", rf"{dst}.\g<n>.weight"),
        Rule(rf"{la}\.(?P<n>in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)\.weight",
             rf"{dst}.linear_attn.\g<n>.kernel", "matmul"),
        Rule(rf"{la}\.conv1d\.weight", rf"{dst}.linear_attn.conv_weight", "conv"),
        Rule(rf"{la}\.(?P<n>A_log|dt_bias)", rf"{dst}.linear_attn.\g<n>"),
        Rule(rf"{la}\.norm\.weight", rf"{dst}.linear_attn.norm.weight"),
        Rule(rf"{sa}\.(?P<n>q_proj|k_proj|v_proj|o_proj)\.weight", rf"{dst}.self_attn.\g<n>.kernel", "matmul"),
        Rule(rf"{sa}\.(?P<n>q_proj|k_proj|v_proj|o_proj)\.bias", rf"{dst}.self_attn.\g<n>.bias"),
        Rule(rf"{sa}\.(?P<n>q_norm|k_norm)\.weight", rf"{dst}.self_attn.\g<n>.weight"),
        Rule(rf"{src}\.mlp\.(?P<n>gate_proj|up_proj|down_proj)\.weight", rf"{dst}.mlp.\g<n>.kernel", "matmul"),
    ]


_QWEN35_HF_STRIP = ("model.language_model.", "model.")
_QWEN35_HF_RULES = tuple(
    [Rule(r"embed_tokens\.weight", "embed_tokens.embedding"),
     Rule(r"norm\.weight", "norm.weight"),
     Rule(r"lm_head\.weight", "lm_head.kernel", "matmul"),
     Rule(r"mtp\.fc\.weight", "mtp.fc.kernel", "matmul"),
     Rule(r"mtp\.pre_fc_norm_embedding\.weight", "mtp.embed_norm.weight"),
     Rule(r"mtp\.pre_fc_norm_hidden\.weight", "mtp.hidden_norm.weight"),
     Rule(r"mtp\.norm\.weight", "mtp.final_norm.weight")]
    + _qwen35_layer_rules(r"layers\.(?P<i>\d+)", r"layers.\g<i>")
    + _qwen35_layer_rules(r"mtp\.layers\.0", "mtp.block")
)

# HF qwen3_5 checkpoints: ``model.language_model.*`` (multimodal) or ``model.*`` (text only),
# ``lm_head.weight`` and ``mtp.*`` at the top level; the vision tower ``model.visual.*`` (or
# ``visual.*``) is ignored (a text-only config) or loaded into ``visual.*`` (``hf_names``).
QWEN35_HF = NameMap(
    strip_prefixes=_QWEN35_HF_STRIP,
    ignore=(r"model\.visual\.", r"visual\."),
    rules=_QWEN35_HF_RULES,
)


@functools.lru_cache(maxsize=None)
def _qwen35_hf_with_vision(vision: VisionConfig) -> NameMap:
    # "model." is stripped first, so the tower's names are matched as ``visual.*``
    return NameMap(strip_prefixes=_QWEN35_HF_STRIP,
                   rules=_QWEN35_HF_RULES + tuple(vision_rules(vision, r"visual", "visual")))


def qwen35_gguf_names(cfg) -> NameMap:
    """llama.cpp's ``qwen35`` GGUF layout for a ``Qwen38Config`` (docs/reference.md section 2), and
    with a vision tower its mmproj names (``zoo.models.qwen38.vision.gguf_rules``).

    Numpy-order matrices are ``[out, in]`` ("matmul"); norms are stored ``1 + w`` ("minus_one", all but
    the DeltaNet output norm); ``ssm_a`` is ``-exp(A_log)``; every value-head tensor has its heads
    tiled (``HeadOrder``); the MTP block is ``blk.{num_hidden_layers}`` plus its ``nextn.*`` tensors
    (the ``nextn`` copies of the embedding and head, when present, are the shared ones: ignored).
    """
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    order = dict(groups=nk, per_group=nv // nk)
    v_rows = HeadOrder(axis=0, start=0, unit=cfg.linear_value_head_dim, **order)
    qkv_rows = HeadOrder(axis=0, start=2 * nk * cfg.linear_key_head_dim, unit=cfg.linear_value_head_dim, **order)
    head_rows = HeadOrder(axis=0, start=0, unit=1, **order)
    v_cols = HeadOrder(axis=1, start=0, unit=cfg.linear_value_head_dim, **order)

    def block(src: str, dst: str) -> list[Rule]:
        return [
            Rule(rf"{src}\.attn_norm\.weight", f"{dst}.input_layernorm.weight", "minus_one"),
            Rule(rf"{src}\.post_attention_norm\.weight", f"{dst}.post_attention_layernorm.weight", "minus_one"),
            Rule(rf"{src}\.attn_qkv\.weight", f"{dst}.linear_attn.in_proj_qkv.kernel", Transform("matmul", qkv_rows)),
            Rule(rf"{src}\.attn_gate\.weight", f"{dst}.linear_attn.in_proj_z.kernel", Transform("matmul", v_rows)),
            Rule(rf"{src}\.ssm_beta\.weight", f"{dst}.linear_attn.in_proj_b.kernel", Transform("matmul", head_rows)),
            Rule(rf"{src}\.ssm_alpha\.weight", f"{dst}.linear_attn.in_proj_a.kernel", Transform("matmul", head_rows)),
            Rule(rf"{src}\.ssm_conv1d\.weight", f"{dst}.linear_attn.conv_weight", Transform("conv", qkv_rows)),
            Rule(rf"{src}\.ssm_a", f"{dst}.linear_attn.A_log", Transform("a_log_from_ssm_a", head_rows)),
            Rule(rf"{src}\.ssm_dt\.bias", f"{dst}.linear_attn.dt_bias", Transform(None, head_rows)),
            Rule(rf"{src}\.ssm_norm\.weight", f"{dst}.linear_attn.norm.weight"),
            Rule(rf"{src}\.ssm_out\.weight", f"{dst}.linear_attn.out_proj.kernel", Transform("matmul", v_cols)),
            Rule(rf"{src}\.attn_(?P<p>q|k|v)\.weight", rf"{dst}.self_attn.\g<p>_proj.kernel", "matmul"),
            Rule(rf"{src}\.attn_(?P<p>q|k|v)\.bias", rf"{dst}.self_attn.\g<p>_proj.bias"),
            Rule(rf"{src}\.attn_output\.weight", f"{dst}.self_attn.o_proj.kernel", "matmul"),
            Rule(rf"{src}\.attn_output\.bias", f"{dst}.self_attn.o_proj.bias"),
            Rule(rf"{src}\.attn_(?P<p>q|k)_norm\.weight", rf"{dst}.self_attn.\g<p>_norm.weight", "minus_one"),
            Rule(rf"{src}\.ffn_(?P<p>gate|up|down)\.weight", rf"{dst}.mlp.\g<p>_proj.kernel", "matmul"),
        ]

    mtp = rf"blk\.{cfg.num_hidden_layers}"
    vision = getattr(cfg, "vision", None)
    return NameMap(
        ignore=(rf"{mtp}\.nextn\.(embed_tokens|shared_head_head)\.",),
        joins=() if vision is None else gguf_joins(vision),
        rules=tuple(
            [Rule(r"token_embd\.weight", "embed_tokens.embedding"),
             Rule(r"output_norm\.weight", "norm.weight", "minus_one"),
             Rule(r"output\.weight", "lm_head.kernel", "matmul"),
             Rule(rf"{mtp}\.nextn\.eh_proj\.weight", "mtp.fc.kernel", "matmul"),
             Rule(rf"{mtp}\.nextn\.enorm\.weight", "mtp.embed_norm.weight", "minus_one"),
             Rule(rf"{mtp}\.nextn\.hnorm\.weight", "mtp.hidden_norm.weight", "minus_one"),
             Rule(rf"{mtp}\.nextn\.shared_head_norm\.weight", "mtp.final_norm.weight", "minus_one")]
            + block(mtp, "mtp.block")
            + block(r"blk\.(?P<i>\d+)", r"layers.\g<i>")
            + ([] if vision is None else gguf_rules(vision, "visual"))
        ),
    )


def hf_names(cfg) -> NameMap:
    """HF ``qwen3_5`` checkpoints: the text model (and MTP layer), plus the vision tower when the
    config has one (``config.vision``); a text-only config ignores the tower's tensors."""
    vision = getattr(cfg, "vision", None)
    return QWEN35_HF if vision is None else _qwen35_hf_with_vision(vision)


gguf_names = qwen35_gguf_names
