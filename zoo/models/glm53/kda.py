"""Kimi Delta Attention (GLM-5.3's linear-attention layers): a gated delta rule with one decay per
key channel.

x [B, T, D] (padding rows zeroed) ->
  q, k, v = silu(conv_q(q_proj(x))), silu(conv_k(k_proj(x))), silu(conv_v(v_proj(x)))   [B, T, H, dk]
            (each a causal depthwise conv of width K with its own carried state)
  f = f_b(f_a(x)) + dt_bias                                 [B, T, H, dk]   (low rank D -> dk -> H*dk)
  g = lower_bound * sigmoid(exp(A_log)[h] * f)              (no lower bound: -exp(A_log)[h] * softplus(f))
  beta = sigmoid(b_proj(x))                                 [B, T, H]
  q, k = l2norm(q) * dk^-0.5, l2norm(k)
  o = delta_rule(q, k, v, g, beta)                          (chunked for prefill, recurrent for decode)
  y = o_proj(w * rmsnorm(o) * sigmoid(g_b(g_a(x))))         gated norm per head, in f32      [B, T, D]

Cache (one per layer): ``KDACache(conv=KDAConv(q, k, v: [B, K-1, H*dk]), state [B, H, dk, dk] f32)``.
Padding positions get no decay and no update (g = 0, beta = 0), so they leave the state untouched,
and the conv states end at the last real token (padding after the tokens: a right-padded chunk).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.kernels import linear_attention
from zoo.models.shared.layers import Linear, causal_depthwise_conv, conv_state_steps, param, rms_normalize, take_step
from zoo.sharding.cache_axes import CacheState, cache_state

PROJECTIONS = ("q", "k", "v")


@cache_state
class KDAConv(CacheState):
    AXES = {name: ("batch", "conv", "heads") for name in PROJECTIONS}
    q: jax.Array
    k: jax.Array
    v: jax.Array


@cache_state
class KDACache(CacheState):
    AXES = {"state": ("batch", "cache_heads", "head_dim", "head_dim")}
    conv: KDAConv
    state: jax.Array


class SigmoidGatedRMSNorm(nnx.Module):
    """``w * rmsnorm(x) * sigmoid(gate)`` per head, all in f32; x, gate [..., head_dim] -> x's dtype."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.eps = eps
        self.weight = param((dim,), ("head_dim",), dtype, 1.0)

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        out = self.weight[...].astype(jnp.float32) * rms_normalize(x, self.eps)
        return (out * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)


class KimiDeltaAttention(nnx.Module):
    def __init__(self, cfg, *, dtype):
        d = cfg.hidden_size
        self.n_heads, self.head_dim = cfg.linear_num_heads, cfg.linear_head_dim
        self.width = self.n_heads * self.head_dim
        self.conv_kernel = cfg.linear_conv_kernel_dim
        self.lower_bound = cfg.linear_lower_bound
        self.dtype = dtype
        proj = dict(axes=("embed", "heads"), dtype=dtype)
        self.q_proj, self.k_proj, self.v_proj = (Linear(d, self.width, **proj) for _ in PROJECTIONS)
        conv = lambda: param((self.conv_kernel, self.width), ("conv", "heads"), jnp.float32)
        self.q_conv, self.k_conv, self.v_conv = conv(), conv(), conv()
        self.f_a_proj = Linear(d, self.head_dim, axes=("embed_in", "head_dim"), dtype=dtype)
        self.f_b_proj = Linear(self.head_dim, self.width, axes=("head_dim", "heads"), dtype=dtype)
        self.dt_bias = param((self.width,), ("heads",), jnp.float32)
        self.A_log = param((self.n_heads,), ("heads",), jnp.float32)
        self.b_proj = Linear(d, self.n_heads, axes=("embed", "heads"), dtype=dtype)
        self.g_a_proj = Linear(d, self.head_dim, axes=("embed_in", "head_dim"), dtype=dtype)
        self.g_b_proj = Linear(self.head_dim, self.width, axes=("head_dim", "heads"), dtype=dtype)
        self.o_norm = SigmoidGatedRMSNorm(self.head_dim, eps=cfg.rms_norm_eps, dtype=dtype)
        self.o_proj = Linear(self.width, d, axes=("heads", "embed"), dtype=dtype)

    def init_cache(self, batch: int) -> KDACache:
        conv = jnp.zeros((batch, self.conv_kernel - 1, self.width), self.dtype)
        return KDACache(conv=KDAConv(q=conv, k=conv, v=conv),
                        state=jnp.zeros((batch, self.n_heads, self.head_dim, self.head_dim), jnp.float32))

    def forget_gate(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> per-channel log decay g [B, T, H, dk] (f32, <= 0)."""
        b, t, _ = x.shape
        f = self.f_b_proj(self.f_a_proj(x)).astype(jnp.float32) + self.dt_bias[...]
        f = f.reshape(b, t, self.n_heads, self.head_dim)
        rate = jnp.exp(self.A_log[...])[:, None]
        if self.lower_bound is not None:
            return self.lower_bound * jax.nn.sigmoid(rate * f)
        return -rate * jax.nn.softplus(f)

    @staticmethod
    def select_step(steps: KDACache, idx: jax.Array) -> KDACache:
        """A ``keep_steps`` cache -> the plain cache after token ``idx[b]`` of each row b."""
        conv = KDAConv(**{name: take_step(getattr(steps.conv, name), idx) for name in PROJECTIONS})
        return KDACache(conv=conv, state=take_step(steps.state, idx))

    def __call__(self, x: jax.Array, mask: jax.Array, cache: KDACache, keep_steps: bool = False
                 ) -> tuple[jax.Array, KDACache]:
        """x [B, T, D], mask [B, T] (True = token) -> (y [B, T, D], new cache).

        ``keep_steps``: the cache holds the conv and recurrent states after every token
        (conv ``[B, T, K-1, W]`` per projection, state ``[B, T, H, dk, dv]``; see ``select_step``)."""
        b, t, _ = x.shape
        heads = (b, t, self.n_heads, self.head_dim)
        x = jnp.where(mask[..., None], x, 0).astype(x.dtype)
        qkv, conv_states = {}, {}
        for name in PROJECTIONS:
            proj, weight = getattr(self, f"{name}_proj"), getattr(self, f"{name}_conv")
            projected = proj(x)
            y, conv_states[name] = causal_depthwise_conv(projected, getattr(cache.conv, name), weight[...], mask)
            if keep_steps:
                conv_states[name] = conv_state_steps(getattr(cache.conv, name), projected, mask)
            qkv[name] = jax.nn.silu(y.astype(jnp.float32)).astype(x.dtype).reshape(heads)
        g = jnp.where(mask[..., None, None], self.forget_gate(x), 0.0)
        beta = jnp.where(mask[..., None], jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32)), 0.0)
        q = linear_attention.l2_normalize(qkv["q"]) * (self.head_dim ** -0.5)
        k = linear_attention.l2_normalize(qkv["k"])
        if keep_steps:
            o, state = linear_attention.recurrent(q, k, qkv["v"], g, beta, cache.state, all_states=True)
        else:
            o, state = linear_attention.delta_rule(q, k, qkv["v"], g, beta, cache.state)
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(heads)
        o = self.o_norm(o.astype(x.dtype), gate).reshape(b, t, self.width)
        return self.o_proj(o), KDACache(conv=KDAConv(**conv_states), state=state)
