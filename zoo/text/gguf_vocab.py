"""The tokenizer a GGUF file embeds: llama.cpp's gpt2-style BPE vocabulary -> ``zoo.text.tokenizer.Tokenizer``."""

from __future__ import annotations

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


def tokenizer_from_gguf(src):
    """A ``zoo.text.tokenizer.Tokenizer`` from the embedded vocabulary of ``src`` (a
    ``zoo.sources.gguf.GGUFSource``: its ``metadata``), or None when the file has
    none, or it is not a byte-level BPE (``tokenizer.ggml.model == "gpt2"``) with a known
    pre-tokenizer (``PRE_TOKENIZER_REGEX``)."""
    md = src.metadata
    tokens, merges = md.get("tokenizer.ggml.tokens"), md.get("tokenizer.ggml.merges")
    pre = md.get("tokenizer.ggml.pre", "default")
    if md.get("tokenizer.ggml.model") != "gpt2" or not tokens or merges is None or pre not in PRE_TOKENIZER_REGEX:
        return None
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from zoo.text.tokenizer import Tokenizer

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
