"""GLM-5.3: llama.cpp ``glm5next`` / ``glm5-next`` GGUF metadata -> HF config.json fields."""

from __future__ import annotations

from typing import Any

from zoo.models.shared.gguf_metadata import as_list, f32, one
from zoo.sources.base import SourceError
from zoo.sources.gguf import GGUFSource


def hf_fields(src: GGUFSource) -> dict[str, Any]:
    """``glm5next`` / ``glm5-next`` metadata -> HF ``glm5_next_text`` config fields.

    Per-layer arrays cover the main layers and (where llama.cpp writes one) the MTP block: the mixer
    of layer i is MLA iff ``attention.head_count_kv[i]`` is non-zero (KDA layers have no KV heads);
    ``attention.indexer.types[i]`` is True for a "full" indexer; the SwiGLU clamp is one value.
    """
    v = src.arch_value
    n_mtp = int(v("nextn_predict_layers", 0))
    n_layers = int(v("block_count")) - n_mtp
    kv_heads = v("attention.head_count_kv")
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * n_layers
    n_dense = int(v("leading_dense_block_count", 0))
    clamp = {float(x) for x in as_list(v("swiglu_clamp_exp", [])) + as_list(v("swiglu_clamp_shexp", [])) if x}
    if len(clamp) > 1:
        raise SourceError(f"{src.files[0]}: swiglu_clamp_exp / _shexp differ between layers or experts "
                          f"({sorted(clamp)}); the config needs one value")
    md = src.metadata
    return {
        "model_type": "glm5_next_text",
        "vocab_size": src.info("token_embd.weight").shape[0],
        "hidden_size": int(v("embedding_length")),
        "intermediate_size": int(v("feed_forward_length")),
        "moe_intermediate_size": int(v("expert_feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": int(one(v("attention.head_count"), "attention.head_count")),
        "layer_types": ["indexed_attention" if kv else "linear_attention" for kv in kv_heads[:n_layers]],
        "mlp_layer_types": ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense),
        "indexer_types": ["full" if t else "shared" for t in v("attention.indexer.types")[:n_layers]],
        "n_routed_experts": int(v("expert_count")),
        "n_shared_experts": int(v("expert_shared_count", 1)),
        "num_experts_per_tok": int(v("expert_used_count")),
        "n_group": int(v("expert_group_count", 1)),
        "topk_group": int(v("expert_group_used_count", 1)),
        "routed_scaling_factor": f32(v("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(v("expert_weights_norm", True)),
        "swiglu_limit": clamp.pop() if clamp else None,
        "q_lora_rank": int(v("attention.q_lora_rank")),
        "kv_lora_rank": int(v("attention.kv_lora_rank")),
        "qk_rope_head_dim": int(v("rope.dimension_count", 0)),
        "qk_nope_head_dim": int(v("attention.key_length_mla")) - int(v("rope.dimension_count", 0)),
        "v_head_dim": int(v("attention.value_length_mla")),
        "index_topk": int(v("attention.indexer.top_k")),
        "index_head_dim": int(v("attention.indexer.key_length")),
        "index_n_heads": int(v("attention.indexer.head_count")),
        "index_kpool": int(v("attention.indexer.kpool")),
        "index_kpool_always_select_tail": bool(v("attention.indexer.kpool_select_tail", True)),
        "linear_num_heads": int(one(v("attention.head_count"), "attention.head_count")),
        "linear_head_dim": int(v("kda.head_dim")),
        "linear_conv_kernel_dim": int(v("ssm.conv_kernel")),
        "linear_lower_bound": v("kda.gate_lower_bound", None),
        "hc_mult": int(v("hyper_connection.count")),
        "hc_sinkhorn_iters": int(v("hyper_connection.sinkhorn_iterations")),
        "hc_eps": f32(v("hyper_connection.epsilon")),
        "rms_norm_eps": f32(v("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(v("context_length")),
        "attention_bias": any(k.endswith(".attn_q_a.bias") for k in src.keys()),
        "tie_word_embeddings": "output.weight" not in src,
        "num_nextn_predict_layers": n_mtp,
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
    }


def gguf_metadata(cfg) -> dict[str, Any]:
    """The inverse of ``hf_fields``: a text config -> its ``glm5-next`` metadata keys (without the arch
    prefix), as llama.cpp's converter writes them (``zoo.tools.synthetic_gguf`` writes these). The
    per-layer arrays cover the MTP block too (an MLA layer with a full indexer, as the converter writes it)."""
    n_mtp = int(cfg.mtp_num_hidden_layers)
    n = cfg.num_hidden_layers + n_mtp
    mla = [t != "linear_attention" for t in cfg.layer_types] + [True] * n_mtp
    clamp = [float(cfg.swiglu_limit or 0.0)] * n
    out = {
        "block_count": n,
        "nextn_predict_layers": n_mtp,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "expert_feed_forward_length": cfg.moe_intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": [1 if m else 0 for m in mla],
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "leading_dense_block_count": next((i for i, t in enumerate(cfg.mlp_layer_types) if t != "dense"),
                                          cfg.num_hidden_layers),
        "expert_count": cfg.n_routed_experts,
        "expert_shared_count": cfg.n_shared_experts,
        "expert_used_count": cfg.num_experts_per_tok,
        "expert_group_count": cfg.n_group,
        "expert_group_used_count": cfg.topk_group,
        "expert_weights_scale": float(cfg.routed_scaling_factor),
        "expert_weights_norm": bool(cfg.norm_topk_prob),
        "swiglu_clamp_exp": clamp,
        "swiglu_clamp_shexp": clamp,
        "attention.q_lora_rank": cfg.q_lora_rank,
        "attention.kv_lora_rank": cfg.kv_lora_rank,
        "rope.dimension_count": 0,
        "attention.key_length_mla": cfg.qk_nope_head_dim,
        "attention.value_length_mla": cfg.v_head_dim,
        "attention.key_length": cfg.kv_lora_rank,
        "attention.value_length": cfg.kv_lora_rank,
        "attention.indexer.types": [t == "full" for t in cfg.indexer_types] + [True] * n_mtp,
        "attention.indexer.top_k": cfg.index_topk,
        "attention.indexer.key_length": cfg.index_head_dim,
        "attention.indexer.head_count": cfg.index_n_heads,
        "attention.indexer.kpool": cfg.index_kpool,
        "attention.indexer.kpool_select_tail": bool(cfg.index_kpool_always_select_tail),
        "kda.head_dim": cfg.linear_head_dim,
        "ssm.conv_kernel": cfg.linear_conv_kernel_dim,
        "hyper_connection.count": cfg.hc_mult,
        "hyper_connection.sinkhorn_iterations": cfg.hc_sinkhorn_iters,
        "hyper_connection.epsilon": float(cfg.hc_eps),
        "vocab_size": cfg.vocab_size,
    }
    if cfg.linear_lower_bound is not None:
        out["kda.gate_lower_bound"] = float(cfg.linear_lower_bound)
    return out


# -- the vision tower from a llama.cpp mmproj (``zoo.loader.mmproj``) --------------------------------

# ``clip.projector_type`` of the GLM-5.3 tower: "glm5v" (llama.cpp's Glm5NextVisionModel, PR #27773 and
# the converter vendored in llama-cpp-python 0.3.36), "glm5next" (unsloth's branch and its published files)
MMPROJ_PROJECTORS = ("glm5v", "glm5next")
_ACTS = {"clip.use_silu": "silu", "clip.use_gelu": "gelu"}


def mmproj_vision_fields(src: GGUFSource) -> dict[str, Any]:
    """An mmproj's ``clip.*`` metadata and tensor shapes -> the HF ``vision_config`` fields it carries.

    From shapes: ``in_channels`` and ``temporal_patch_size`` (the patch kernel's slices),
    ``out_hidden_size`` (``mm.patch_merger.weight`` rows), ``projection_intermediate_size``
    (``mm.gate.weight`` rows), ``attention_bias`` (``attn_qkv.bias`` present). ``swiglu_limit``:
    ``clip.vision.swiglu_clamp`` or ``clip.vision.swiglu_limit`` (the two converters' keys). Not
    carried: ``rope_theta`` (clip hard-codes 10000).
    """
    md = src.metadata
    acts = [act for key, act in _ACTS.items() if md.get(key) is True]
    if len(acts) != 1:
        raise SourceError(f"{src.files[0]}: expected exactly one of clip.use_silu / clip.use_gelu set, "
                          f"found {acts or 'none'}")
    if "v.position_embd.weight" in src or "v.norm_embd.weight" in src:
        raise SourceError(f"{src.files[0]}: a GLM-4V tower (learned position embedding / post-conv norm), "
                          f"not GLM-5.3's")
    slices = [k for k in src.keys() if k == "v.patch_embd.weight" or k.startswith("v.patch_embd.weight.")]
    patch = src.info("v.patch_embd.weight").shape                   # [D, C, P, P] (one temporal slice)
    limit = md.get("clip.vision.swiglu_clamp", md.get("clip.vision.swiglu_limit"))
    fields = {
        "depth": int(md["clip.vision.block_count"]),
        "hidden_size": int(md["clip.vision.embedding_length"]),
        "num_heads": int(md["clip.vision.attention.head_count"]),
        "intermediate_size": int(md["clip.vision.feed_forward_length"]),
        "hidden_act": acts[0],
        "attention_bias": "v.blk.0.attn_qkv.bias" in src,
        "in_channels": int(patch[1]),
        "patch_size": int(md["clip.vision.patch_size"]),
        "temporal_patch_size": len(slices),
        "spatial_merge_size": int(md.get("clip.vision.spatial_merge_size", 2)),
        "out_hidden_size": int(src.info("mm.patch_merger.weight").shape[0]),
        "projection_intermediate_size": int(src.info("mm.gate.weight").shape[0]),
        "rms_norm_eps": f32(md["clip.vision.attention.layer_norm_epsilon"]),
    }
    if limit is not None:
        fields["swiglu_limit"] = f32(limit)
    return fields
