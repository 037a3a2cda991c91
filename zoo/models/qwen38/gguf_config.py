"""Qwen3.8: llama.cpp ``qwen35`` GGUF metadata -> HF config.json fields."""

from __future__ import annotations

from typing import Any

from zoo.models.shared.gguf_metadata import f32, one
from zoo.sources.base import SourceError
from zoo.sources.gguf import GGUFSource


def hf_fields(src: GGUFSource) -> dict[str, Any]:
    """``qwen35`` metadata -> HF ``qwen3_5_text`` config fields."""
    v = src.arch_value
    n_mtp = int(v("nextn_predict_layers", 0))
    n_layers = int(v("block_count")) - n_mtp
    head_dim = int(one(v("attention.key_length"), "attention.key_length"))
    if int(one(v("attention.value_length", head_dim), "attention.value_length")) != head_dim:
        raise SourceError(f"{src.files[0]}: attention key and value lengths differ; qwen35 needs one head_dim")
    recurrent = v("attention.recurrent_layers", None)
    n_value_heads = int(v("ssm.time_step_rank"))
    md = src.metadata
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": src.info("token_embd.weight").shape[0],
        "hidden_size": int(v("embedding_length")),
        "intermediate_size": int(v("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": int(one(v("attention.head_count"), "attention.head_count")),
        "num_key_value_heads": int(one(v("attention.head_count_kv"), "attention.head_count_kv")),
        "head_dim": head_dim,
        "layer_types": None if recurrent is None else [
            "linear_attention" if r else "full_attention" for r in recurrent[:n_layers]],
        "full_attention_interval": int(v("full_attention_interval", 4)),
        "linear_conv_kernel_dim": int(v("ssm.conv_kernel")),
        "linear_key_head_dim": int(v("ssm.state_size")),
        "linear_value_head_dim": int(v("ssm.inner_size")) // n_value_heads,
        "linear_num_key_heads": int(v("ssm.group_count")),
        "linear_num_value_heads": n_value_heads,
        "rms_norm_eps": f32(v("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_theta": f32(v("rope.freq_base")),
                            "partial_rotary_factor": int(v("rope.dimension_count")) / head_dim},
        "max_position_embeddings": int(v("context_length")),
        "attention_bias": any(k.endswith(".attn_q.bias") for k in src.keys()),
        "tie_word_embeddings": "output.weight" not in src,
        "mtp_num_hidden_layers": n_mtp,
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
    }


def gguf_metadata(cfg) -> dict[str, Any]:
    """The inverse of ``hf_fields``: a text config -> its ``qwen35`` metadata keys (without the arch
    prefix), as llama.cpp's converter writes them (``zoo.tools.synthetic_gguf`` writes these)."""
    n_mtp = int(cfg.mtp_num_hidden_layers)
    return {
        "block_count": cfg.num_hidden_layers + n_mtp,
        "nextn_predict_layers": n_mtp,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "rope.dimension_sections": [*cfg.mrope_section, 0],
        "rope.freq_base": float(cfg.rope_theta),
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "attention.key_length": cfg.head_dim,
        "attention.value_length": cfg.head_dim,
        "ssm.conv_kernel": cfg.linear_conv_kernel_dim,
        "ssm.state_size": cfg.linear_key_head_dim,
        "ssm.group_count": cfg.linear_num_key_heads,
        "ssm.time_step_rank": cfg.linear_num_value_heads,
        "ssm.inner_size": cfg.linear_num_value_heads * cfg.linear_value_head_dim,
        "attention.recurrent_layers": [t == "linear_attention" for t in cfg.layer_types] + [False] * n_mtp,
        "full_attention_interval": next((i + 1 for i, t in enumerate(cfg.layer_types) if t == "full_attention"), 4),
        "rope.dimension_count": round(cfg.partial_rotary_factor * cfg.head_dim),
    }


# -- the vision tower from a llama.cpp mmproj (``zoo.loader.mmproj``) --------------------------------

MMPROJ_PROJECTORS = ("qwen3vl_merger",)     # ``clip.projector_type`` of convert_hf_to_gguf's Qwen3-VL tower


def mmproj_vision_fields(src: GGUFSource) -> dict[str, Any]:
    """An mmproj's ``clip.*`` metadata and tensor shapes -> the HF ``vision_config`` fields it carries.

    Not carried (they come from the text model's config, else transformers' defaults): ``hidden_act``
    (the file only says "a GELU"), ``rope_theta``. The file's ``layer_norm_epsilon`` is the *text*
    model's rms eps (the converter's choice); the tower's LayerNorms are fixed at 1e-6 in HF: ignored.
    """
    md = src.metadata
    if any(md.get("clip.vision.is_deepstack_layers") or []) or any(k.startswith("v.deepstack.") for k in src.keys()):
        raise SourceError(f"{src.files[0]}: a Qwen3-VL tower with deepstack mergers; only the qwen3_5 tower "
                          f"(no deepstack) is supported")
    if md.get("clip.use_gelu") is not True:
        raise SourceError(f"{src.files[0]}: clip.use_gelu is not set; the qwen3_5 tower's MLP is a GELU")
    slices = [k for k in src.keys() if k == "v.patch_embd.weight" or k.startswith("v.patch_embd.weight.")]
    patch = src.info("v.patch_embd.weight").shape                   # [D, C, P, P] (one temporal slice)
    return {
        "depth": int(md["clip.vision.block_count"]),
        "hidden_size": int(md["clip.vision.embedding_length"]),
        "num_heads": int(md["clip.vision.attention.head_count"]),
        "intermediate_size": int(md["clip.vision.feed_forward_length"]),
        "in_channels": int(patch[1]),
        "patch_size": int(md["clip.vision.patch_size"]),
        "temporal_patch_size": len(slices),
        "spatial_merge_size": int(md.get("clip.vision.spatial_merge_size", 2)),
        "num_position_embeddings": int(src.info("v.position_embd.weight").shape[0]),
        "out_hidden_size": int(src.info("mm.2.weight").shape[0]),
    }
