"""What a GGUF file says besides its tensors: the model config and the tokenizer.

    config_from_gguf(source) -> frozen config   GGUF metadata -> HF config.json fields (a table per
                                                architecture) -> ``zoo.config.config_from_hf``
    tokenizer_from_gguf(source) -> Tokenizer | None   the embedded gpt2-style BPE vocabulary

Dimensions the metadata does not state are read from the tensors (vocabulary size from
``token_embd.weight``, a tied head from the absence of ``output.weight``). The embedded MTP block
counts in ``block_count``; ``nextn_predict_layers`` says how many of the blocks it is.
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


# GGUF ``general.architecture`` -> fn(source) -> HF config fields.
GGUF_CONFIGS: dict[str, Callable[[GGUFSource], dict[str, Any]]] = {
    "qwen35": _qwen35,
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
    from zoo.quant.names import GGUF_NAME_MAPS

    src = GGUFSource(path)
    cfg = config_from_gguf(src)
    if src.architecture not in GGUF_NAME_MAPS:
        raise SourceError(f"{src.files[0]}: no tensor-name map for GGUF architecture {src.architecture!r}")
    return src, cfg, GGUF_NAME_MAPS[src.architecture](cfg), tokenizer_from_gguf(src)
