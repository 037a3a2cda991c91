"""Small utilities shared by the tests."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx


def rel_err(ours, theirs) -> float:
    """max |ours - theirs| / max |theirs|, in float64: the one parity measure of the tests."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


def jit_forward(module: nnx.Module):
    """``f(ids, mask, cache) -> (logits, hidden, cache)``: the module's forward, jitted."""
    graphdef, state = nnx.split(module)
    fn = jax.jit(lambda s, ids, mask, cache: nnx.merge(graphdef, s)(ids, mask, cache))
    return lambda ids, mask, cache: fn(state, ids, mask, cache)


def bigram_variant(model):
    """A copy of ``model`` (a ``zoo.Model``) whose MTP head agrees with it: every layer's output
    projection is scaled by 0.02 (the model is close to a bigram model of its embedding) and the MTP
    head echoes its next-token embedding (fc = [I | 0], identity norms), so drafts are mostly
    accepted and speculative decoding exercises every rollback depth."""
    import jax.numpy as jnp

    from zoo.api import Model

    graphdef, state = nnx.split(nnx.clone(model.module))
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        if any(str(p) in ("o_proj", "out_proj", "down_proj", "down_kernel") for p in path):
            var.set_value(var.get_value() * 0.02)
    mtp = model.module.mtp
    d = model.config.hidden_size
    dtype = flat[("mtp", "fc", "kernel")].get_value().dtype
    flat[("mtp", "fc", "kernel")].set_value(jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))]).astype(dtype))
    identity = 0.0 if mtp.embed_norm.zero_centered else 1.0
    flat[("mtp", "embed_norm", "weight")].set_value(jnp.full((d,), identity, dtype))
    flat[("mtp", "final_norm", "weight")].set_value(flat[("norm", "weight")].get_value())
    module = nnx.merge(graphdef, nnx.from_flat_state(list(flat.items())))
    return Model(module, model.config, model.tokenizer, dict(model.load_info))


def random_tiny_model(tmp_path_factory, name: str = "qwen38-tiny"):
    """Embedded demo model ``name``'s config with one decoder layer of each kind and random weights
    (``random_tiny_checkpoint``, written under a fresh temporary directory), loaded in float32. Tests
    that take it share its programs through the persistent compilation cache."""
    import zoo
    from tests.support.random_checkpoints import random_tiny_checkpoint

    return zoo.load(random_tiny_checkpoint(tmp_path_factory.mktemp(name), name), dtype="float32")


def random_models_and_bigrams(tmp_path_factory, names) -> dict:
    """For each embedded demo model in ``names``: :func:`random_tiny_model` under its name, and its
    ``bigram_variant`` under ``name + "/bigram"`` (the same programs: only the weights differ)."""
    out = {}
    for name in names:
        out[name] = random_tiny_model(tmp_path_factory, name)
        out[name + "/bigram"] = bigram_variant(out[name])
    return out


class CountingSource:
    """A weight-source wrapper that records every read as ``(key, index, nbytes)``."""

    def __init__(self, inner):
        self.inner, self.reads = inner, []

    def keys(self):
        return self.inner.keys()

    def info(self, key):
        return self.inner.info(key)

    def read(self, key, index=()):
        out = self.inner.read(key, index)
        self.reads.append((key, index, out.nbytes))
        return out


def rss() -> tuple[int, int]:
    """(current, peak) resident bytes of this process (peak: since ``5`` was last written to
    ``/proc/self/clear_refs``)."""
    from pathlib import Path

    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def assert_same_generation(got, want, tol: float = 1e-5) -> None:
    """Two ``Generation`` results agree: the same tokens and finish, the same logprobs and prompt
    logprobs (as many, the same token and alternative ids exactly, values within ``tol`` relative
    and absolute: float32 rounding)."""
    import pytest

    assert got.tokens == want.tokens and got.finish_reason == want.finish_reason
    for a, b in ((got.logprobs, want.logprobs), (got.prompt_logprobs, want.prompt_logprobs)):
        assert (a is None) == (b is None) and len(a or ()) == len(b or ())
        for x, y in zip(a or (), b or ()):
            assert x.token == y.token and [i for i, _ in x.top] == [i for i, _ in y.top]
            assert (x.logprob is None) == (y.logprob is None)
            if x.logprob is not None:
                assert x.logprob == pytest.approx(y.logprob, rel=tol, abs=tol)
                assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], rel=tol, abs=tol)
