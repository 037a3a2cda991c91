"""Small utilities shared by the tests."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx


def rel_err(ours: np.ndarray, theirs: np.ndarray) -> float:
    """max |ours - theirs| / max |theirs| (the DESIGN.md parity measure)."""
    return float(np.max(np.abs(np.asarray(ours) - np.asarray(theirs))) / np.max(np.abs(theirs)))


def jit_forward(module: nnx.Module):
    """``f(ids, mask, cache) -> (logits, hidden, cache)``: the module's forward, jitted."""
    graphdef, state = nnx.split(module)
    fn = jax.jit(lambda s, ids, mask, cache: nnx.merge(graphdef, s)(ids, mask, cache))
    return lambda ids, mask, cache: fn(state, ids, mask, cache)
