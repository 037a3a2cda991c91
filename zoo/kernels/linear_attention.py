"""The gated delta rule (gated DeltaNet, Kimi Delta Attention): recurrent and chunked forms.

Per head, with state ``S [dk, dv]`` (float32), for each token t::

    S   <- S * exp(g_t)                      # g_t: scalar (GDN) or per key channel [dk] (KDA)
    S   <- S + k_t (x) (beta_t * (v_t - k_t @ S))
    o_t  = q_t @ S

Inputs (all already projected, normalised and scaled; heads already expanded to the value heads):
    q, k  [B, T, H, dk]     v [B, T, H, dv]     beta [B, T, H]
    g     [B, T, H]  (one log-decay per head)  or  [B, T, H, dk]  (one per key channel), g <= 0
    state [B, H, dk, dv] float32
Outputs: (o [B, T, H, dv] float32, final state [B, H, dk, dv] float32).

``recurrent`` steps token by token (decode, verify); ``chunked`` is the prefill form (the UT
transform of DeltaNet: intra-chunk work as matmuls, a scan over chunks for the state). Both compute
the same function; tests check them against each other and against transformers. Decays inside a
chunk are always formed as ``exp(G_i - G_j)`` with ``i >= j`` (never ``exp(-G)``), so neither form
can overflow however strong the decay.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def _mm(spec: str, *xs: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *xs, precision=HIGHEST)


def _decay_as_state(g: jax.Array) -> jax.Array:
    """A decay shaped to multiply a state: scalar -> [..., 1, 1], per-channel -> [..., dk, 1]."""
    return g[..., None, None] if g.ndim == 2 else g[..., None]


def recurrent(q, k, v, g, beta, state, all_states: bool = False):
    """Token-by-token delta rule (see module docstring for shapes). T may be any length >= 1.

    With ``all_states`` the second result is the state after every token, ``[B, T, H, dk, dv]``
    (what speculative decoding keeps to roll back to the last accepted token)."""
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs                       # [B,H,dk] .. [B,H] / [B,H,dk]
        s = s * jnp.exp(_decay_as_state(g_t))
        delta = (v_t - _mm("bhk,bhkv->bhv", k_t, s)) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        o_t = _mm("bhk,bhkv->bhv", q_t, s)
        return s, (o_t, s) if all_states else o_t

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state.astype(jnp.float32), xs)
    if all_states:
        o, states = out
        return jnp.moveaxis(o, 0, 1), jnp.moveaxis(states, 0, 1)
    return jnp.moveaxis(out, 0, 1), state


def _pairwise_decay(G: jax.Array, per_channel: bool) -> jax.Array:
    """``exp(G_i - G_j)`` for ``i >= j`` else 0. G: [..., C] or [..., C, dk] (cumulative log decay).

    Returns [..., C, C] or [..., C, C, dk].
    """
    c = G.shape[-2] if per_channel else G.shape[-1]
    causal = jnp.tril(jnp.ones((c, c), dtype=bool))
    if per_channel:
        diff = G[..., :, None, :] - G[..., None, :, :]
        causal = causal[:, :, None]
    else:
        diff = G[..., :, None] - G[..., None, :]
    return jnp.exp(jnp.where(causal, diff, -jnp.inf))


def chunked(q, k, v, g, beta, state, chunk_size: int | None = None):
    """Chunked delta rule (see module docstring). ``chunk_size`` defaults to 64 for a per-head
    decay (T rounded up to 16 when that is less) and 16 for a per-channel decay (whose pairwise
    decays are ``[C, C, dk]`` per chunk)."""
    per_channel = g.ndim == 4
    b, t, h, dk = k.shape
    # a short call (a small prefill piece) in one chunk of its own length rounded up to 16, not
    # padded to 64: the intra-chunk work grows with the square of the chunk
    c = chunk_size or (16 if per_channel else min(64, -(-t // 16) * 16))
    dv = v.shape[-1]
    pad = (-t) % c
    n = (t + pad) // c

    def to_chunks(x):  # [B,T,H,...] -> [B,H,N,C,...], zero padded at the end
        x = x.astype(jnp.float32)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape(x.shape[:2] + (n, c) + x.shape[3:])

    q, k, v, g, beta = (to_chunks(x) for x in (q, k, v, g, beta))
    G = jnp.cumsum(g, axis=3)                                  # [B,H,N,C] / [B,H,N,C,dk]
    D = _pairwise_decay(G, per_channel)
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    G_vec = G if per_channel else G[..., None]                # broadcastable to [..., C, dk]
    G_last = G_vec[..., -1:, :]                               # [B,H,N,1,dk|1]
    if per_channel:
        a_kk = _mm("bhnik,bhnjk,bhnijk->bhnij", k_beta, k, D)
        a_qk = _mm("bhnik,bhnjk,bhnijk->bhnij", q, k, D)
    else:
        a_kk = _mm("bhnik,bhnjk->bhnij", k_beta, k) * D
        a_qk = _mm("bhnik,bhnjk->bhnij", q, k) * D
    # (I + strictly-lower(A_kk)) u = v_beta ; same for the decayed keys.
    system = jnp.tril(a_kk, -1) + jnp.eye(c, dtype=jnp.float32)
    solve = lambda rhs: jax.lax.linalg.triangular_solve(
        system, rhs, left_side=True, lower=True, unit_diagonal=True)
    u = solve(v_beta)                                          # [B,H,N,C,dv]
    w = solve(k_beta * jnp.exp(G_vec))                         # [B,H,N,C,dk]
    q_dec = q * jnp.exp(G_vec)
    k_dec = k * jnp.exp(G_last - G_vec)
    chunk_decay = jnp.exp(G_last[..., 0, :])                   # [B,H,N,dk|1]

    def step(s, xs):
        u_n, w_n, q_n, k_n, a_n, dec_n = xs
        v_new = u_n - _mm("bhck,bhkv->bhcv", w_n, s)
        o_n = _mm("bhck,bhkv->bhcv", q_n, s) + _mm("bhij,bhjv->bhiv", a_n, v_new)
        s = s * dec_n[..., :, None] + _mm("bhck,bhcv->bhkv", k_n, v_new)
        return s, o_n

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, q_dec, k_dec, a_qk, chunk_decay))
    state, o = jax.lax.scan(step, state.astype(jnp.float32), xs)   # o: [N,B,H,C,dv]
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * c, dv)[:, :, :t]
    return jnp.moveaxis(o, 1, 2), state


def delta_rule(q, k, v, g, beta, state):
    """The form to use for T tokens: recurrent for a few (decode, verify), chunked for prefill."""
    return recurrent(q, k, v, g, beta, state) if q.shape[1] <= 8 else chunked(q, k, v, g, beta, state)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x * rsqrt(sum(x^2) + eps)`` over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
