"""Manifold-constrained hyper-connections (mHC): N residual streams around each sub-block.

For streams X [B, T, N, D] and one sub-block f (the mixer or the MLP)::

    m = rmsnorm_noweight(flatten(X)) @ fn^T                 [B, T, (2+N)N]     (f32, eps rms_norm_eps)
    pre  = sigmoid(m_pre * scale0 + base_pre) + hc_eps      [B, T, N]
    post = 2 * sigmoid(m_post * scale1 + base_post)         [B, T, N]
    comb = sinkhorn(softmax(m_comb * scale2 + base_comb))   [B, T, N, N]  (rows and columns sum to ~1)
    h = sum_i pre_i X_i  ->  y = f(h)                       [B, T, D]
    X_j <- post_j * y + sum_i comb[i, j] X_i

Parameters (all f32): ``fn [(2+N)N, N*D]``, ``base [(2+N)N]``, ``scale [3]``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.models.shared.layers import param, rms_normalize

HIGHEST = jax.lax.Precision.HIGHEST


def sinkhorn(comb: jax.Array, iters: int, eps: float) -> jax.Array:
    """Column-normalise, then ``iters - 1`` (row, column) passes; comb [..., N, N] (positive)."""
    def rows_then_columns(_, c):
        c = c / (c.sum(-1, keepdims=True) + eps)
        return c / (c.sum(-2, keepdims=True) + eps)

    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    return jax.lax.fori_loop(0, iters - 1, rows_then_columns, comb)


class HyperConnection(nnx.Module):
    """One mHC around one sub-block; ``__call__(X, block)`` runs ``block`` on the collapsed stream."""

    def __init__(self, n_streams: int, dim: int, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        self.n = n_streams
        self.iters, self.hc_eps, self.norm_eps = sinkhorn_iters, hc_eps, norm_eps
        width = (2 + n_streams) * n_streams
        self.fn = param((width, n_streams * dim), ("hc", "hc_embed"), jnp.float32)
        self.base = param((width,), ("hc",), jnp.float32)
        self.scale = param((3,), ("hc_scale",), jnp.float32, 1.0)

    def weights(self, streams: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """X [B, T, N, D] -> (pre [B, T, N], post [B, T, N], comb [B, T, N, N]), all f32."""
        b, t, n, _ = streams.shape
        flat = rms_normalize(streams.reshape(b, t, -1), self.norm_eps)
        m = jnp.einsum("btf,wf->btw", flat, self.fn[...], precision=HIGHEST)
        base, scale = self.base[...], self.scale[...]
        pre = jax.nn.sigmoid(m[..., :n] * scale[0] + base[:n]) + self.hc_eps
        post = 2.0 * jax.nn.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
        comb = m[..., 2 * n:].reshape(b, t, n, n) * scale[2] + base[2 * n:].reshape(n, n)
        comb = jax.nn.softmax(comb, axis=-1) + self.hc_eps
        return pre, post, sinkhorn(comb, self.iters, self.hc_eps)

    def __call__(self, streams: jax.Array, block: Callable[[jax.Array], tuple[jax.Array, object]]):
        """X [B, T, N, D]; ``block(h [B, T, D]) -> (y [B, T, D], aux)`` -> (new X, aux)."""
        dtype = streams.dtype
        pre, post, comb = self.weights(streams)
        h = jnp.einsum("btn,btnd->btd", pre, streams.astype(jnp.float32), precision=HIGHEST).astype(dtype)
        y, aux = block(h)
        mixed = jnp.einsum("btij,btid->btjd", comb.astype(dtype), streams, precision=HIGHEST)
        return post.astype(dtype)[..., None] * y[:, :, None, :] + mixed, aux
