"""Generator: jitted prefill and decode over a loaded model, with on-device sampling.

    prefill  prompts left-padded to a bucketed length (multiples of ``PREFILL_BUCKET``), one compiled
             program per (batch, bucket, cache length); returns the cache and the first token
    decode   one compiled program per step for the whole model; the cache is donated

The cache length is the bucketed prompt length plus ``max_new_tokens``, rounded up to
``CACHE_BUCKET``, so a request never outgrows its cache. Continuous batching and speculative
decoding build on this (see the engine issue).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo.serving.sampling import sample

PREFILL_BUCKET = 16
CACHE_BUCKET = 64


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str                     # "stop" (stop token / string) or "length"
    stats: dict = field(default_factory=dict)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _prefill(graphdef, cache_len, state, ids, mask):
    model = nnx.merge(graphdef, state)
    logits, _, cache = model(ids, mask, model.init_cache(ids.shape[0], cache_len))
    return logits[:, -1], cache


def _decode(graphdef, state, tokens, cache):
    model = nnx.merge(graphdef, state)
    logits, _, cache = model(tokens[:, None], jnp.ones(tokens.shape + (1,), bool), cache)
    return logits[:, -1], cache


class Generator:
    def __init__(self, model):
        self.model = model
        self._graphdef, self._state = nnx.split(model.module)
        self._prefill = {}
        self._decode = jax.jit(functools.partial(_decode, self._graphdef), donate_argnums=(2,))
        self._sample = jax.jit(sample)
        eos = set(getattr(model.config, "eos_token_id", ()) or ())
        if model.tokenizer is not None:
            eos |= set(model.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)

    def _prefill_fn(self, cache_len: int):
        if cache_len not in self._prefill:
            self._prefill[cache_len] = jax.jit(functools.partial(_prefill, self._graphdef, cache_len))
        return self._prefill[cache_len]

    def _split_stop(self, stop) -> tuple[set[int], list[str]]:
        stop = [] if stop is None else [stop] if isinstance(stop, (str, int)) else list(stop)
        ids = {s for s in stop if isinstance(s, int)} | set(self.eos_token_ids)
        strings = [s for s in stop if isinstance(s, str)]
        if strings and self.model.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        return ids, strings

    def _steps(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature, top_p, top_k,
               seed) -> Iterator[np.ndarray]:
        """Yield the sampled tokens [B] of each step (the first comes from the prefill)."""
        b = len(prompts)
        plen = _round_up(max(len(p) for p in prompts), PREFILL_BUCKET)
        ids = np.zeros((b, plen), np.int32)
        mask = np.zeros((b, plen), bool)
        for i, p in enumerate(prompts):
            ids[i, plen - len(p):] = p
            mask[i, plen - len(p):] = True
        cache_len = _round_up(plen + max_new_tokens, CACHE_BUCKET)
        per_row = lambda x, dt: jnp.asarray(np.broadcast_to(np.asarray(x, dt), (b,)))
        temp, tp, tk = per_row(temperature, np.float32), per_row(top_p, np.float32), per_row(top_k, np.int32)
        keys = jax.vmap(jax.random.key)(per_row(seed, np.uint32))
        logits, cache = self._prefill_fn(cache_len)(self._state, jnp.asarray(ids), jnp.asarray(mask))
        for step in range(max_new_tokens):
            step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)
            tokens = self._sample(logits, step_keys, temp, tk, tp)
            yield np.asarray(tokens)
            if step + 1 < max_new_tokens:
                logits, cache = self._decode(self._state, tokens, cache)

    def generate(self, input_ids, *, max_new_tokens: int, temperature=0.0, top_p=1.0, top_k=0, seed=0,
                 stop=None, spec_tokens: int = 0) -> list[Generation]:
        if spec_tokens:
            raise NotImplementedError("speculative decoding (spec_tokens > 0) is not implemented yet")
        prompts = [list(map(int, p)) for p in input_ids]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        stop_ids, stop_strings = self._split_stop(stop)
        out = [Generation([], "length") for _ in prompts]
        done = [False] * len(prompts)
        t0 = time.perf_counter()
        t_first = None
        for tokens in self._steps(prompts, max_new_tokens, temperature, top_p, top_k, seed):
            t_first = t_first or time.perf_counter()
            for i, tok in enumerate(tokens.tolist()):
                if done[i]:
                    continue
                if tok in stop_ids:
                    done[i], out[i].finish_reason = True, "stop"
                    continue
                out[i].tokens.append(tok)
                if stop_strings and self._hit_stop_string(out[i], stop_strings):
                    done[i] = True
            if all(done):
                break
        elapsed = time.perf_counter() - t0
        for g, p in zip(out, prompts):
            g.stats = {"prompt_tokens": len(p), "generated_tokens": len(g.tokens),
                       "seconds": elapsed, "time_to_first_token": (t_first or t0) - t0,
                       "drafted": 0, "accepted": 0}
        return out

    def _hit_stop_string(self, g: Generation, stop_strings: list[str]) -> bool:
        """Truncate ``g`` at the first stop string in its text; True if one was found."""
        text = self.model.tokenizer.decode(g.tokens)
        hits = [text.find(s) for s in stop_strings if s in text]
        if not hits:
            return False
        cut = min(hits)
        while g.tokens and len(self.model.tokenizer.decode(g.tokens)) > cut:
            g.tokens.pop()
        g.finish_reason = "stop"
        return True

    def stream(self, input_ids: Sequence[int], *, max_new_tokens: int, temperature=0.0, top_p=1.0,
               top_k=0, seed=0, stop=None) -> Iterator[int]:
        """Tokens of one prompt as they are sampled (stop tokens end the stream, unreported)."""
        stop_ids, _ = self._split_stop([s for s in (stop or []) if isinstance(s, int)] if stop else None)
        for tokens in self._steps([list(map(int, input_ids))], max_new_tokens, temperature, top_p, top_k, seed):
            tok = int(tokens[0])
            if tok in stop_ids:
                return
            yield tok
