"""One request's options: how the engine generates for a prompt, in one frozen object (as vLLM's
``SamplingParams``).

    built     the Python API: ``Generator.make_request(prompt, max_new_tokens=..., ...)`` ->
              ``RequestOptions.build`` (``stop`` mixing token ids and strings); the server: the protocol
              handlers through ``Service.request_options`` (the server's defaults, detokenized text)
    checked   once, by ``Generator.make_request``: ``check`` (a ``ValueError`` naming the option; the
              server answers 400 with it), and the prompt's ids by ``check_token_ids``
    carried   unchanged: Service -> EngineThread -> Generator -> ``Request.options`` (every choice of a
              request shares it); a multi-process engine sends it to its followers as JSON over all its
              fields (``to_json`` / ``from_json``, ``zoo.engine.replica``): a field added here travels
              with no other change

Not options: the prompt's ids and images (the request's inputs), the per-choice state built from
the options (a ``Constraint`` compiled from ``grammar``, a ``ThinkingBudget``, the ``TextDecoder``),
the callbacks. Field values are normalized on construction by their annotations (lists become
tuples, a dict becomes the ``OutputGrammar`` it describes, numbers their type), so an object built
from JSON equals the one that was sent.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from dataclasses import dataclass
from typing import Sequence

from zoo.engine.constraint import OutputGrammar
from zoo.engine.logprobs import MAX_TOP


@dataclass(frozen=True)
class RequestOptions:
    """Everything the engine uses of a request but its inputs (see the module doc)."""

    max_new_tokens: int                    # tokens to generate at most (0: the prompt's logprobs only)
    temperature: float = 0.0               # 0: greedy
    top_p: float = 1.0                     # nucleus mass, in (0, 1]
    top_k: int = 0                         # 0: off; past the vocabulary: every token
    seed: int = 0                          # choice i samples with ``fork_seed(seed, i)``
    stop: tuple[str, ...] = ()             # stop strings: the output ends right before the first (finish "stop")
    stop_token_ids: tuple[int, ...] = ()   # ids that end the output (besides the model's end-of-turn ids)
    n: int = 1                             # choices of the prompt (prefilled once)
    logprobs: int | None = None            # alternatives per generated token (None: no logprobs)
    prompt_logprobs: int | None = None     # alternatives per prompt token (None: none)
    thinking_budget: int | None = None     # reasoning tokens before "</think>" is forced (None: unlimited)
    thinking_opened: bool = False          # the prompt ends inside "<think>"
    grammar: OutputGrammar | None = None   # what the output must follow (None: free)
    cache_marks: tuple[int, ...] = ()      # prompt positions worth a prefix-cache snapshot (sorted)
    detokenize: bool = False               # decode the output into ``Request.text`` as it comes (stop strings do)
    keep_special: tuple[str, ...] = ()     # special tokens (by their text) kept in that text; the rest left out

    def __post_init__(self):
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _typed(hints[f.name], getattr(self, f.name)))
        object.__setattr__(self, "cache_marks", tuple(sorted(self.cache_marks)))

    @classmethod
    def build(cls, stop=None, **fields) -> RequestOptions:
        """From ``Generator.make_request``'s keywords: ``stop`` is token ids and/or strings (one, or
        several), split into ``stop_token_ids`` and ``stop``."""
        items = [] if stop is None else [stop] if isinstance(stop, (str, numbers.Integral)) else list(stop)
        strings = tuple(s for s in items if isinstance(s, str))
        ids = tuple(fields.pop("stop_token_ids", ())) + tuple(int(s) for s in items if not isinstance(s, str))
        return cls(stop=strings, stop_token_ids=ids, **fields)

    def check(self, vocab: int, tokenizer) -> RequestOptions:
        """These options, or a ``ValueError`` naming the first the engine cannot serve for a model
        with ``vocab`` logits and ``tokenizer`` (None: the model has none)."""
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_new_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError("max_new_tokens must be >= 1 (0 only with prompt_logprobs)")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_TOP:
                raise ValueError(f"{name} must be in 0..{MAX_TOP}, got {n}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if self.thinking_budget is not None and self.thinking_budget < 0:
            raise ValueError(f"thinking_budget must be >= 0, got {self.thinking_budget}")
        if any(m < 0 for m in self.cache_marks):
            raise ValueError(f"cache_marks must be prompt positions (>= 0), got {list(self.cache_marks)}")
        check_token_ids(self.stop_token_ids, vocab, "stop_token_ids")
        if tokenizer is None and self.stop:
            raise ValueError("stop strings need a tokenizer; this model has none")
        if tokenizer is None and self.detokenize:
            raise ValueError("detokenized output needs a tokenizer; this model has none")
        return self

    @property
    def needs_text(self) -> bool:
        """The engine decodes the output (``detokenize``, or stop strings to find)."""
        return self.detokenize or any(self.stop)

    def to_json(self) -> dict:
        """Every field as JSON-able values (``from_json`` gives an equal object back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RequestOptions:
        return cls(**data)


class TokenIdError(ValueError):
    """A token id outside the vocabulary: item ``index`` of the ids called ``where``."""

    def __init__(self, where: str, index: int, token: int, vocab: int):
        self.index, self.token, self.vocab = index, token, vocab
        super().__init__(self.named(where))

    def named(self, where: str) -> str:
        """The message with the ids called ``where`` (a server names them as its request does)."""
        return f"{where}[{self.index}]: token id {self.token} is not in the vocabulary (0..{self.vocab - 1})"


def check_token_ids(ids: Sequence[int], vocab: int, where: str) -> None:
    """``TokenIdError`` for the first of ``ids`` outside ``0 .. vocab - 1``."""
    for i, t in enumerate(ids):
        if not 0 <= int(t) < vocab:
            raise TokenIdError(where, i, int(t), vocab)


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _typed(hint, value):
    """``value`` as the annotation ``hint`` says: a list (or a lone string) as a tuple, a dict as the
    dataclass it describes, a number as its type; None stays None."""
    if value is None:
        return None
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _typed(args[0], value) if len(args) == 1 else value
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        items = (value,) if isinstance(value, str) else tuple(value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_typed(args[0], v) for v in items)
        return tuple(_typed(a, v) for a, v in zip(args, items))
    if dataclasses.is_dataclass(hint):
        inner = _hints(hint)
        given = value if isinstance(value, dict) else {f.name: getattr(value, f.name)
                                                       for f in dataclasses.fields(value)}
        return hint(**{k: _typed(inner[k], v) for k, v in given.items()})
    if hint in (int, float, bool, str):
        return hint(value)
    return value
