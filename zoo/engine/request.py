"""What one generation request is to the engine (``Request``), what it returns (``Generation``), its
images (``ImageInput``) and the seed of each of its choices (``fork_seed``).

A request that fails ends with ``finish_reason`` "error", ``stats["error"]`` (the message) and
``stats["error_status"]`` (400: it can never be served here, e.g. too large for the cache; 500: the
engine failed on it, e.g. non-finite logits, a fault while admitting or stepping it).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from zoo.engine.constraint import Constraint
from zoo.engine.logprobs import TokenLogprob
from zoo.engine.prefix_cache import Snapshot
from zoo.engine.thinking_budget import ThinkingBudget


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str                     # "stop", "length", "cancelled" or "error" (see stats["error"])
    stats: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None          # per token, if the request asked
    prompt_logprobs: list[TokenLogprob] | None = None   # per prompt token (the first: logprob None)


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt, preprocessed: the prompt holds, for each image in order, a run of exactly
    ``n_tokens`` image-placeholder ids (``config.image_token_id``) that take the tower's rows."""

    key: str                      # sha256 hex of the encoded image bytes (``zoo.images.image_key``)
    patches: np.ndarray           # float32 [t*h*w, C*T*P*P] (``zoo.images.preprocess(...).pixel_values``)
    grid: tuple[int, int, int]    # (t, h, w) in patches
    n_tokens: int                 # placeholder tokens of this image in the prompt (t*h*w // merge**2)


@dataclass(eq=False)
class Request:
    """One generation request; the engine fills ``tokens``/``finish_reason``/``stats``."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_ids: frozenset = frozenset()
    stop_strings: tuple = ()
    on_tokens: Callable[["Request", list[int]], None] | None = None   # called from the engine thread
    on_finish: Callable[["Request"], None] | None = None   # called once from the engine thread, after done
    on_admit: Callable[["Request"], None] | None = None    # engine thread: it got a row, its prefill starts
    thinking: ThinkingBudget | None = None                  # closes the reasoning after a budget of tokens
    forcing: collections.deque = field(default_factory=collections.deque)   # ids the next steps emit
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: dict = field(default_factory=dict)
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    logprobs: int | None = None            # alternatives per generated token (None: no logprobs)
    prompt_logprobs: int | None = None     # alternatives per prompt token (None: no prompt logprobs)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)    # aligned with ``tokens``
    prompt_token_logprobs: list[TokenLogprob] | None = None             # set by the prefill
    constraint: Constraint | None = None   # the output grammar (None: unconstrained)
    forks: list["Request"] = field(default_factory=list)   # the other choices of the same prompt (n > 1)
    choice: int = 0                        # this request's index among its prompt's choices
    cache_marks: tuple = ()                # prompt positions worth a prefix-cache snapshot (cache_control)
    raw: list[int] = field(default_factory=list)   # every token the device emitted for this row, uncut
    prefix_hit: Snapshot | None = None     # the cached prefix this request starts from (set at admission)
    images: tuple[ImageInput, ...] = ()    # the prompt's images, in order (``zoo.engine.image_prefill``)
    cache_tokens: list[int] | None = None  # the prefix cache's key of the prompt: image placeholders
                                           # replaced by ids of their image's content (set by the engine)

    def result(self) -> Generation:
        return Generation(list(self.tokens), self.finish_reason or "length", dict(self.stats),
                          None if self.logprobs is None else list(self.token_logprobs),
                          self.prompt_token_logprobs)


def fork_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` of a request with ``seed`` (choice 0 keeps it)."""
    return (seed + choice * 0x9E3779B1) & 0xFFFFFFFF
