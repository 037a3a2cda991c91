"""What one generation request is to the engine (``Request``: its inputs, its ``RequestOptions`` and
the engine's state of it), what it returns (``Generation``), its images (``ImageInput``) and the seed
of each of its choices (``fork_seed``).

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
from zoo.engine.options import RequestOptions
from zoo.engine.prefix_cache import Snapshot
from zoo.engine.thinking_budget import ThinkingBudget
from zoo.text.detokenize import TextDecoder


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str                     # "stop", "length", "cancelled" or "error" (see stats["error"])
    stats: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None          # per token, if the request asked
    prompt_logprobs: list[TokenLogprob] | None = None   # per prompt token (the first: logprob None)
    text: str | None = None     # the output's text, cut before a stop string (when it was decoded: stop strings,
                                # ``RequestOptions.detokenize``)


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
    """One generation request (one choice of a prompt): its ``prompt`` and ``images`` (inputs), its
    ``options`` (shared by its choices, never changed), and what the engine makes of it: ``tokens``,
    ``text`` (with a decoder), ``finish_reason``, ``stats`` (``stop_sequence``: the stop string that
    ended it)."""

    prompt: list[int]
    options: RequestOptions
    on_tokens: Callable[["Request", list[int]], None] | None = None   # called from the engine thread
    on_finish: Callable[["Request"], None] | None = None   # called once from the engine thread, after done
    on_admit: Callable[["Request"], None] | None = None    # engine thread: it got a row, its prefill starts
    stop_ids: frozenset = frozenset()      # ids that end it: ``options.stop_token_ids`` and the end-of-turn ids
    thinking: ThinkingBudget | None = None                  # closes the reasoning after a budget of tokens
    decoder: TextDecoder | None = None     # its output's detokenizer (``options.needs_text``): stop strings
    forcing: collections.deque = field(default_factory=collections.deque)   # ids the next steps emit
    tokens: list[int] = field(default_factory=list)
    text: str = ""                         # with a decoder: the output's text so far (what is final of it)
    finish_reason: str | None = None
    stats: dict = field(default_factory=dict)
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)    # aligned with ``tokens``
    prompt_token_logprobs: list[TokenLogprob] | None = None             # set by the prefill
    constraint: Constraint | None = None   # the output grammar's matcher (None: unconstrained)
    forks: list["Request"] = field(default_factory=list)   # the other choices of the same prompt (n > 1)
    choice: int = 0                        # this request's index among its prompt's choices
    raw: list[int] = field(default_factory=list)   # every token the device emitted for this row, uncut
    prefix_hit: Snapshot | None = None     # the cached prefix this request starts from (set at admission)
    images: tuple[ImageInput, ...] = ()    # the prompt's images, in order (``zoo.engine.image_prefill``)
    cache_tokens: list[int] | None = None  # the prefix cache's key of the prompt: image placeholders
                                           # replaced by ids of their image's content (set by the engine)
    spec: object = None                    # the speculation policy's state of it (``zoo.engine.spec_policy``)

    @property
    def choice_seed(self) -> int:
        """The seed this choice samples with."""
        return fork_seed(self.options.seed, self.choice)

    def result(self) -> Generation:
        return Generation(list(self.tokens), self.finish_reason or "length", dict(self.stats),
                          None if self.options.logprobs is None else list(self.token_logprobs),
                          self.prompt_token_logprobs, None if self.decoder is None else self.text)


def fork_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` of a request with ``seed`` (choice 0 keeps it)."""
    return (seed + choice * 0x9E3779B1) & 0xFFFFFFFF
