"""Gated DeltaNet (Qwen3.5/3.8 linear-attention layers).

x [B, T, D] ->
  qkv = conv_silu(in_proj_qkv(x))  = [q (nk*dk) | k (nk*dk) | v (nv*dv)]   (causal depthwise conv)
  z = in_proj_z(x) [nv, dv];  beta = sigmoid(in_proj_b(x)) [nv];
  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias) [nv]             (one decay per value head)
  q, k repeated so value head j reads key head j // (nv / nk); L2-normalised; q *= dk^-0.5
  o = delta_rule(q, k, v, g, beta)  ->  gated_norm(o, z)  ->  out_proj     [B, T, D]

Cache (one per layer): ``DeltaNetCache(conv [B, K-1, conv_dim], state [B, nv, dk, dv] f32)``.
Padding positions (``mask == 0``) get no decay and no update (g = 0, beta = 0) and the conv state
ends at the last real token, so padding after a row's tokens leaves both states as they made them.
With ``keep_steps`` (speculative verify) the returned cache holds the states after *every* token,
``DeltaNetCache(conv [B, T, K-1, conv_dim], state [B, T, nv, dk, dv])``; ``select_step`` picks one per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.kernels import linear_attention
from zoo.models.shared.layers import GatedRMSNorm, Linear, causal_depthwise_conv, conv_state_steps, param, take_step
from zoo.sharding.cache_axes import CacheState, cache_state


@cache_state
class DeltaNetCache(CacheState):
    AXES = {"conv": ("batch", "conv", "linear_qkv"), "state": ("batch", "cache_heads", "head_dim", "head_dim")}
    conv: jax.Array
    state: jax.Array


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg, *, dtype):
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv_kernel = cfg.linear_conv_kernel_dim
        d = cfg.hidden_size
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.dtype = dtype
        self.in_proj_qkv = Linear(d, self.conv_dim, axes=("embed", "linear_qkv"), dtype=dtype)
        self.in_proj_z = Linear(d, self.value_dim, axes=("embed", "linear_v"), dtype=dtype)
        self.in_proj_b = Linear(d, self.nv, axes=("embed", "linear_heads"), dtype=dtype)
        self.in_proj_a = Linear(d, self.nv, axes=("embed", "linear_heads"), dtype=dtype)
        self.conv_weight = param((self.conv_kernel, self.conv_dim), ("conv", "linear_qkv"), dtype)
        self.A_log = param((self.nv,), ("linear_heads",), jnp.float32)
        self.dt_bias = param((self.nv,), ("linear_heads",), jnp.float32, 1.0)
        self.norm = GatedRMSNorm(self.dv, eps=cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(self.value_dim, d, axes=("linear_v", "embed"), dtype=dtype)

    def init_cache(self, batch: int) -> DeltaNetCache:
        return DeltaNetCache(conv=jnp.zeros((batch, self.conv_kernel - 1, self.conv_dim), self.dtype),
                             state=jnp.zeros((batch, self.nv, self.dk, self.dv), jnp.float32))

    @staticmethod
    def select_step(steps: DeltaNetCache, idx: jax.Array) -> DeltaNetCache:
        """A ``keep_steps`` cache -> the plain cache after token ``idx[b]`` of each row b."""
        return DeltaNetCache(conv=take_step(steps.conv, idx), state=take_step(steps.state, idx))

    def __call__(self, x: jax.Array, mask: jax.Array, cache: DeltaNetCache, keep_steps: bool = False
                 ) -> tuple[jax.Array, DeltaNetCache]:
        """x [B, T, D], mask [B, T] (1 = token, 0 = padding) -> (y [B, T, D], new cache)."""
        b, t, _ = x.shape
        x = jnp.where(mask[..., None], x, 0).astype(x.dtype)
        mixed = self.in_proj_qkv(x)
        qkv, conv_state = causal_depthwise_conv(mixed, cache.conv, self.conv_weight[...], mask)
        qkv = jax.nn.silu(qkv.astype(jnp.float32)).astype(x.dtype)
        q, k, v = jnp.split(qkv, [self.key_dim, 2 * self.key_dim], axis=-1)
        rep = self.nv // self.nk
        q = jnp.repeat(q.reshape(b, t, self.nk, self.dk), rep, axis=2)
        k = jnp.repeat(k.reshape(b, t, self.nk, self.dk), rep, axis=2)
        v = v.reshape(b, t, self.nv, self.dv)
        beta = jnp.where(mask[..., None], jax.nn.sigmoid(self.in_proj_b(x).astype(jnp.float32)), 0.0)
        a = self.in_proj_a(x).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a + self.dt_bias[...])
        g = jnp.where(mask[..., None], g, 0.0)                  # padding: no decay, no update
        q = linear_attention.l2_normalize(q) * (self.dk ** -0.5)
        k = linear_attention.l2_normalize(k)
        if keep_steps:
            o, state = linear_attention.recurrent(q, k, v, g, beta, cache.state, all_states=True)
            conv_state = conv_state_steps(cache.conv, mixed, mask)
        else:
            o, state = linear_attention.delta_rule(q, k, v, g, beta, cache.state)
        z = self.in_proj_z(x).reshape(b, t, self.nv, self.dv)
        o = self.norm(o.astype(x.dtype), z).reshape(b, t, self.value_dim)
        return self.out_proj(o), DeltaNetCache(conv=conv_state, state=state)
