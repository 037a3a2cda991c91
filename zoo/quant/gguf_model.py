"""What a GGUF file says besides its tensors: the model config and the tokenizer.

    config_from_gguf(source) -> frozen config   GGUF metadata -> HF config.json fields (a table per
                                                architecture) -> ``zoo.config.config_from_hf``
    tokenizer_from_gguf(source) -> Tokenizer | None   the embedded gpt2-style BPE vocabulary

Dimensions the metadata does not state are read from the tensors (vocabulary size from
``token_embd.weight``, a tied head from the absence of ``output.weight``). The embedded MTP block
counts in ``block_count``; ``nextn_predict_layers`` says how many of the blocks it is. The
architecture is read from ``general.architecture`` (``qwen35``, ``glm5next`` or ``glm5-next``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from zoo.config import ConfigError, config_from_hf
from zoo.quant.gguf import GGUFSource
from zoo.quant.safetensors import SourceError


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (9.99999997e-07 -> 1e-06)."""
    return float(str(np.float32(value)))


def _one(value: Any, what: str) -> Any:
    """A per-layer array whose non-zero entries agree -> that value; a scalar -> itself."""
    if not isinstance(value, list):
        return value
    distinct = {v for v in value if v}
    if len(distinct) != 1:
        raise SourceError(f"{what} differs between layers ({value}); the config needs one value")
    return distinct.pop()


def _qwen35(src: GGUFSource) -> dict[str, Any]:
    """``qwen35`` metadata -> HF ``qwen3_5_text`` config fields."""
    v = src.arch_value
    n_mtp = int(v("nextn_predict_layers", 0))
    n_layers = int(v("block_count")) - n_mtp
    head_dim = int(_one(v("attention.key_length"), "attention.key_length"))
    if int(_one(v("attention.value_length", head_dim), "attention.value_length")) != head_dim:
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
        "num_attention_heads": int(_one(v("attention.head_count"), "attention.head_count")),
        "num_key_value_heads": int(_one(v("attention.head_count_kv"), "attention.head_count_kv")),
        "head_dim": head_dim,
        "layer_types": None if recurrent is None else [
            "linear_attention" if r else "full_attention" for r in recurrent[:n_layers]],
        "full_attention_interval": int(v("full_attention_interval", 4)),
        "linear_conv_kernel_dim": int(v("ssm.conv_kernel")),
        "linear_key_head_dim": int(v("ssm.state_size")),
        "linear_value_head_dim": int(v("ssm.inner_size")) // n_value_heads,
        "linear_num_key_heads": int(v("ssm.group_count")),
        "linear_num_value_heads": n_value_heads,
        "rms_norm_eps": _f32(v("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_theta": _f32(v("rope.freq_base")),
                            "partial_rotary_factor": int(v("rope.dimension_count")) / head_dim},
        "max_position_embeddings": int(v("context_length")),
        "attention_bias": any(k.endswith(".attn_q.bias") for k in src.keys()),
        "tie_word_embeddings": "output.weight" not in src,
        "mtp_num_hidden_layers": n_mtp,
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
    }


def _glm5next(src: GGUFSource) -> dict[str, Any]:
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
    clamp = {float(x) for x in _as_list(v("swiglu_clamp_exp", [])) + _as_list(v("swiglu_clamp_shexp", [])) if x}
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
        "num_attention_heads": int(_one(v("attention.head_count"), "attention.head_count")),
        "layer_types": ["indexed_attention" if kv else "linear_attention" for kv in kv_heads[:n_layers]],
        "mlp_layer_types": ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense),
        "indexer_types": ["full" if t else "shared" for t in v("attention.indexer.types")[:n_layers]],
        "n_routed_experts": int(v("expert_count")),
        "n_shared_experts": int(v("expert_shared_count", 1)),
        "num_experts_per_tok": int(v("expert_used_count")),
        "n_group": int(v("expert_group_count", 1)),
        "topk_group": int(v("expert_group_used_count", 1)),
        "routed_scaling_factor": _f32(v("expert_weights_scale", 1.0)),
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
        "linear_num_heads": int(_one(v("attention.head_count"), "attention.head_count")),
        "linear_head_dim": int(v("kda.head_dim")),
        "linear_conv_kernel_dim": int(v("ssm.conv_kernel")),
        "linear_lower_bound": v("kda.gate_lower_bound", None),
        "hc_mult": int(v("hyper_connection.count")),
        "hc_sinkhorn_iters": int(v("hyper_connection.sinkhorn_iterations")),
        "hc_eps": _f32(v("hyper_connection.epsilon")),
        "rms_norm_eps": _f32(v("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(v("context_length")),
        "attention_bias": any(k.endswith(".attn_q_a.bias") for k in src.keys()),
        "tie_word_embeddings": "output.weight" not in src,
        "num_nextn_predict_layers": n_mtp,
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
    }


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


# GGUF ``general.architecture`` -> fn(source) -> HF config fields.
GGUF_CONFIGS: dict[str, Callable[[GGUFSource], dict[str, Any]]] = {
    "qwen35": _qwen35,
    "glm5next": _glm5next,
    "glm5-next": _glm5next,
}


def config_from_gguf(src: GGUFSource):
    """The frozen model config described by a GGUF file's metadata (and tensor shapes)."""
    try:
        fields = GGUF_CONFIGS[src.architecture]
    except KeyError:
        raise SourceError(f"{src.files[0]}: GGUF architecture {src.architecture!r} is not supported; "
                          f"supported: {sorted(GGUF_CONFIGS)}") from None
    try:
        hf = fields(src)
    except (SourceError, ConfigError):
        raise
    except (TypeError, ValueError, ZeroDivisionError) as e:      # metadata of the wrong type or value
        raise SourceError(f"{src.files[0]}: GGUF metadata does not describe a {src.architecture} model ({e})") from None
    return config_from_hf(hf, source=str(src.files[0]))


# --- tokenizer ---------------------------------------------------------------------------------

# ``tokenizer.ggml.pre`` -> the split regex of the HF tokenizer it came from (llama.cpp's table).
PRE_TOKENIZER_REGEX = {
    "gpt2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
              r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "glm4": r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
PRE_TOKENIZER_REGEX["default"] = PRE_TOKENIZER_REGEX["gpt2"]
# llama.cpp token types that are never split: CONTROL and USER_DEFINED.
SPECIAL_TOKEN_TYPES = (3, 4)


def tokenizer_from_gguf(src: GGUFSource):
    """A ``zoo.serving.tokenizer.Tokenizer`` from the embedded vocabulary, or None when the file has
    none, or it is not a byte-level BPE (``tokenizer.ggml.model == "gpt2"``) with a known
    pre-tokenizer (``PRE_TOKENIZER_REGEX``)."""
    md = src.metadata
    tokens, merges = md.get("tokenizer.ggml.tokens"), md.get("tokenizer.ggml.merges")
    pre = md.get("tokenizer.ggml.pre", "default")
    if md.get("tokenizer.ggml.model") != "gpt2" or not tokens or merges is None or pre not in PRE_TOKENIZER_REGEX:
        return None
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from zoo.serving.tokenizer import Tokenizer

    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], ignore_merges=False)
    hf = HFTokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    hf.add_special_tokens([AddedToken(tok, special=True, normalized=False)
                           for tok, kind in zip(tokens, types) if kind in SPECIAL_TOKEN_TYPES])

    def token(key: str) -> str | None:
        i = md.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    config = {"eos_token": token("tokenizer.ggml.eos_token_id"), "bos_token": token("tokenizer.ggml.bos_token_id"),
              "pad_token": token("tokenizer.ggml.padding_token_id")}
    return Tokenizer(hf, config, md.get("tokenizer.chat_template"))


def open_gguf(path) -> tuple[GGUFSource, Any, Any, Any]:
    """``(source, config, name map, tokenizer or None)`` for a GGUF file or the first of a split set."""
    src = GGUFSource(path)
    cfg = config_from_gguf(src)
    source, names = gguf_names(src, cfg)
    return source, cfg, names, tokenizer_from_gguf(src)


def gguf_names(src: GGUFSource, cfg) -> tuple[Any, Any]:
    """``(source view, name map)`` of a GGUF file for a model config: the architecture's map, and
    the source with the map's joins applied (``zoo.quant.views.joined``)."""
    from zoo.quant.names import GGUF_NAME_MAPS
    from zoo.quant.views import joined

    if src.architecture not in GGUF_NAME_MAPS:
        raise SourceError(f"{src.files[0]}: no tensor-name map for GGUF architecture {src.architecture!r}")
    names = GGUF_NAME_MAPS[src.architecture](cfg)
    return joined(src, names), names
