"""The delta rule's chunked (prefill) form equals its recurrent (decode) form, for a per-head
decay (gated DeltaNet) and a per-key-channel decay (KDA), from zero and non-zero states."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.helpers import rel_err
from zoo.kernels import linear_attention as la


def inputs(t, per_channel, seed, strong=False):
    rng = np.random.default_rng(seed)
    b, h, dk, dv = 2, 3, 8, 5
    q = la.l2_normalize(jnp.asarray(rng.standard_normal((b, t, h, dk)), jnp.float32)) * dk ** -0.5
    k = la.l2_normalize(jnp.asarray(rng.standard_normal((b, t, h, dk)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((b, t, h, dv)), jnp.float32)
    gshape = (b, t, h, dk) if per_channel else (b, t, h)
    scale = 40.0 if strong else 1.0
    g = -jnp.asarray(rng.uniform(0.01, 1.0, gshape) * scale, jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (b, t, h)), jnp.float32)
    state = jnp.asarray(rng.standard_normal((b, h, dk, dv)), jnp.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
@pytest.mark.parametrize("t", [1, 16, 17, 64, 130])    # per head: chunks of 16, 16, 32, 64, 64
def test_chunked_equals_recurrent(t, per_channel):
    q, k, v, g, beta, state = inputs(t, per_channel, seed=t)
    o_r, s_r = jax.jit(la.recurrent)(q, k, v, g, beta, state)
    o_c, s_c = jax.jit(la.chunked)(q, k, v, g, beta, state)
    assert rel_err(o_c, o_r) < 1e-5
    assert rel_err(s_c, s_r) < 1e-5


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
def test_strong_decay_stays_finite(per_channel):
    """Decays of exp(-40) per step: no overflow from exp(-G) inside a chunk."""
    q, k, v, g, beta, state = inputs(70, per_channel, seed=1, strong=True)
    o_c, s_c = la.chunked(q, k, v, g, beta, state)
    o_r, s_r = la.recurrent(q, k, v, g, beta, state)
    assert np.isfinite(np.asarray(o_c)).all() and np.isfinite(np.asarray(s_c)).all()
    assert rel_err(o_c, o_r) < 1e-5


def test_split_sequence_carries_state():
    """Running 100 tokens at once == 60 then 40 with the state carried over."""
    q, k, v, g, beta, state = inputs(100, False, seed=5)
    o_all, s_all = la.chunked(q, k, v, g, beta, state)
    o_a, s_a = la.chunked(q[:, :60], k[:, :60], v[:, :60], g[:, :60], beta[:, :60], state)
    o_b, s_b = la.recurrent(q[:, 60:], k[:, 60:], v[:, 60:], g[:, 60:], beta[:, 60:], s_a)
    assert rel_err(jnp.concatenate([o_a, o_b], 1), o_all) < 1e-5
    assert rel_err(s_b, s_all) < 1e-5
