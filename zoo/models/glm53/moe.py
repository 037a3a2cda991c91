"""Mixture of experts (GLM-5.3 / DeepSeek-V3 style): sigmoid router with a selection-only bias,
routed SwiGLU experts stored as stacked banks, and a shared expert.

x [B, T, D] ->
  s = sigmoid(x @ W_router)                          [N, E]  (f32)
  ids = top-k of (s + e_score_correction_bias)       (the bias only chooses; with n_group > 1 the
                                                      choice is limited to the best topk_group groups)
  w = s[ids] / (sum s[ids] + 1e-20) * routed_scaling_factor     (normalised when norm_topk_prob)
  y = sum_k w_k expert_{ids_k}(x) + shared(x)        experts: down(silu(min(gate, L)) * clip(up, -L, L))

The routed part goes through ``zoo.ops.moe.moe``, which dispatches on the stored bank type.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.models.shared.layers import SwiGLU, param
from zoo.ops.moe import moe

HIGHEST = jax.lax.Precision.HIGHEST


class Router(nnx.Module):
    """x [N, D] -> (weights [N, k] f32, expert ids [N, k] int32)."""

    def __init__(self, cfg, *, dtype):
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = param((cfg.hidden_size, self.n_experts), ("router_embed", "experts"), dtype)
        self.correction_bias = param((self.n_experts,), ("experts",), jnp.float32)

    def _group_mask(self, choice: jax.Array) -> jax.Array:
        """[N, E] bool: the expert is in one of the ``topk_group`` best groups (by top-2 sum)."""
        grouped = choice.reshape(choice.shape[0], self.n_group, -1)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)                       # [N, G]
        best = jax.lax.top_k(group_scores, self.topk_group)[1]
        keep = jnp.zeros(group_scores.shape, bool).at[jnp.arange(choice.shape[0])[:, None], best].set(True)
        return jnp.repeat(keep, self.n_experts // self.n_group, axis=1)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = jnp.dot(x.astype(jnp.float32), self.weight[...].astype(jnp.float32), precision=HIGHEST)
        scores = jax.nn.sigmoid(logits)
        choice = scores + self.correction_bias[...]
        if self.n_group > 1:
            choice = jnp.where(self._group_mask(choice), choice, -jnp.inf)
        ids = jax.lax.top_k(choice, self.top_k)[1]
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return weights * self.scale, ids


class Experts(nnx.Module):
    """Routed experts as banks: gate/up ``[E, D, I]``, down ``[E, I, D]`` (any stored-bank type)."""

    def __init__(self, n_experts: int, dim: int, hidden: int, *, dtype, limit: float | None):
        self.gate_kernel = param((n_experts, dim, hidden), ("experts", "embed", "mlp"), dtype)
        self.up_kernel = param((n_experts, dim, hidden), ("experts", "embed", "mlp"), dtype)
        self.down_kernel = param((n_experts, hidden, dim), ("experts", "mlp", "embed"), dtype)
        self.limit = limit

    def __call__(self, x: jax.Array, weights: jax.Array, ids: jax.Array) -> jax.Array:
        """x [N, D], weights/ids [N, k] -> [N, D]."""
        return moe(x, weights, ids, self.gate_kernel.get_value(), self.up_kernel.get_value(),
                   self.down_kernel.get_value(), self.limit)


class MoE(nnx.Module):
    """Router + routed experts + shared expert; ``__call__(x [B, T, D]) -> [B, T, D]``."""

    def __init__(self, cfg, *, dtype):
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.router = Router(cfg, dtype=dtype)
        self.experts = Experts(cfg.n_routed_experts, d, inter, dtype=dtype, limit=cfg.swiglu_limit)
        self.shared_experts = SwiGLU(d, inter * cfg.n_shared_experts, dtype=dtype, limit=cfg.swiglu_limit
                                     ) if cfg.n_shared_experts else None

    def __call__(self, x: jax.Array) -> jax.Array:
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.router(flat)
        y = self.experts(flat, weights, ids).reshape(x.shape)
        return y if self.shared_experts is None else y + self.shared_experts(x)
