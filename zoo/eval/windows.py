"""The evaluation text as token windows, scored as llama.cpp's ``llama-perplexity`` scores them.

    text_tokens(tokenizer, text) -> list[int]
    token_windows(tokens, ctx, chunks=None) -> int32 [W, ctx]
    scored_positions(ctx) -> (first, count)
    tokenizer_fingerprint(tokenizer) -> str | None

The text is tokenized whole (no BOS or other special tokens added) and cut into consecutive,
non-overlapping windows of ``ctx`` tokens; a tail shorter than a window is dropped, and ``chunks``
keeps only the first windows. Each window is one forward pass with no cache; only its second half is
scored, so every scored token sees at least ``ctx / 2`` tokens of context: the logits at positions
``first .. ctx - 2`` (``first = ctx // 2``) predict the tokens at ``first + 1 .. ctx - 1``, which is
``ctx - 1 - first`` tokens per window (255 for ``ctx`` 512, as llama.cpp).

``tokenizer_fingerprint`` is the SHA-256 of the vocabulary (every token string with its id, added
tokens included): two models whose fingerprints match split every text into the same ids.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

MIN_CTX = 4


def text_tokens(tokenizer, text: str) -> list[int]:
    """The ids of ``text`` under the model's tokenizer (None: the model has no tokenizer, an error)."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: give the evaluation text as token ids "
                         "(tokens=, --tokens FILE.npy)")
    return tokenizer.encode(text)


def scored_positions(ctx: int) -> tuple[int, int]:
    """``(first, count)``: the logits at ``first .. first + count - 1`` of a window are scored."""
    first = ctx // 2
    return first, ctx - 1 - first


def token_windows(tokens: Sequence[int] | np.ndarray, ctx: int, chunks: int | None = None) -> np.ndarray:
    """``tokens`` cut into ``[W, ctx]`` windows (module doc); ``ValueError`` when not even one fits."""
    if ctx < MIN_CTX:
        raise ValueError(f"ctx must be at least {MIN_CTX} tokens, got {ctx}")
    if chunks is not None and chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    ids = np.asarray(tokens)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"tokens must be a 1-D array of integer ids, got {ids.dtype} of shape {ids.shape}")
    count = len(ids) // ctx
    if count == 0:
        raise ValueError(f"the text has {len(ids)} tokens: one window of ctx {ctx} needs {ctx}")
    if chunks is not None:
        count = min(count, chunks)
    return ids[:count * ctx].reshape(count, ctx).astype(np.int32)


def check_ids(windows: np.ndarray, vocab: int) -> None:
    """Every id a token of a ``vocab``-sized model (``ValueError`` naming the first that is not)."""
    bad = (windows < 0) | (windows >= vocab)
    if bad.any():
        w, t = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"token id {int(windows[w, t])} (window {w}, position {t}) is outside the model's "
                         f"vocabulary of {vocab}")


def tokenizer_fingerprint(tokenizer) -> str | None:
    """SHA-256 of the tokenizer's vocabulary (module doc); None for a model without a tokenizer."""
    if tokenizer is None:
        return None
    vocab = sorted(tokenizer.vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
