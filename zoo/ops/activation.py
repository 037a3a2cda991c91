"""The gated activation every MLP and expert shares: the (optionally clamped) SwiGLU.

    swiglu(gate, up, limit, act=silu) = act(min(gate, L)) * clip(up, -L, L)     (L = limit)

``gate`` and ``up`` are the two projections of the same input (any equal shapes, e.g. ``[..., I]``);
``limit`` is GLM's ``swiglu_limit`` (None: no clamp, the plain SwiGLU of Qwen). The clamp is
one-sided on the gate (only large positive pre-activations are cut) and two-sided on ``up``. The
result has the inputs' shape and dtype (``limit`` is a Python float, so it does not promote); the
caller applies the down projection. Every copy of this math (dense MLPs, the MoE reference, the
Pallas MoE kernels' epilogues, the vision towers) calls this function, so they agree bit for bit.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def swiglu(gate: jax.Array, up: jax.Array, limit: float | None,
           act: Callable[[jax.Array], jax.Array] = jax.nn.silu) -> jax.Array:
    """``act(min(gate, limit)) * clip(up, -limit, limit)``; ``act(gate) * up`` when ``limit`` is None.
    ``act`` is SiLU for every language-model MLP; a vision tower may configure another (GELU)."""
    if limit is not None:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return act(gate) * up
