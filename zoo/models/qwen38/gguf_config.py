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
