"""Building blocks shared by the models: norms, embedding, linear, SwiGLU, rotary, causal conv.

Every parameter is an ``nnx.Param`` carrying ``axes``: one logical axis name per dimension
(``"embed"``, ``"vocab"``, ``"heads"``, ``"kv_heads"``, ``"mlp"``, ...). ``zoo.sharding.mesh`` maps those
names to mesh axes; modules never name a mesh axis themselves.

Parameters are created with zeros/ones: a model is always built abstractly (``nnx.eval_shape``) and
then filled from a checkpoint, so no initializer ever runs on real sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo.ops.activation import swiglu
from zoo.ops.matmul import matmul


def param(shape: tuple[int, ...], axes: tuple[str | None, ...], dtype, fill: float = 0.0) -> nnx.Param:
    """A parameter of ``shape`` filled with ``fill``, annotated with logical ``axes``."""
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} and axes {axes} differ in rank")
    return nnx.Param(jnp.full(shape, fill, dtype), axes=tuple(axes))


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``x / rms(x)`` over the last axis, computed in float32 (returns float32)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, statistics in f32.

    ``zero_centered=True`` is Qwen3.5's variant, ``(1 + w) * x/rms(x)`` multiplied in f32 then cast
    (weights stored as ``w``, init 0). ``zero_centered=False`` is the plain ``w * (x/rms(x))``
    with the normalised value cast to the input dtype before the weight (GLM, Llama).
    """

    def __init__(self, dim: int, *, eps: float, dtype, zero_centered: bool, axes=("embed",)):
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = param((dim,), axes, dtype, 0.0 if zero_centered else 1.0)

    def __call__(self, x: jax.Array) -> jax.Array:
        normed = rms_normalize(x, self.eps)
        w = self.weight[...]
        if self.zero_centered:
            return (normed * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
        return w.astype(x.dtype) * normed.astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """``w * rmsnorm(x) * silu(gate)`` per head (Qwen's DeltaNet output norm), math in f32.

    x, gate: ``[..., head_dim]``; the result has x's dtype.
    """

    def __init__(self, dim: int, *, eps: float, dtype):
        self.eps = eps
        self.weight = param((dim,), ("head_dim",), dtype, 1.0)

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        normed = rms_normalize(x, self.eps).astype(x.dtype)
        out = self.weight[...].astype(x.dtype) * normed
        return (out.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class LayerNorm(nnx.Module):
    """``w * (x - mean) / sqrt(var + eps) + b`` over the last axis (statistics in f32, result in x's dtype)."""

    def __init__(self, dim: int, *, eps: float, dtype, axes=("embed",)):
        self.eps = eps
        self.weight = param((dim,), axes, dtype, 1.0)
        self.bias = param((dim,), axes, dtype, 0.0)

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        normed = ((xf - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return normed * self.weight[...].astype(x.dtype) + self.bias[...].astype(x.dtype)


class Linear(nnx.Module):
    """``y = x @ W (+ b)`` with ``W [in, out]``; quantized weights dispatch in ``zoo.ops.matmul``."""

    def __init__(self, d_in: int, d_out: int, *, axes: tuple[str | None, str | None], dtype,
                 use_bias: bool = False):
        self.kernel = param((d_in, d_out), axes, dtype)
        self.bias = param((d_out,), (axes[1],), dtype) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = matmul(x, self.kernel.get_value(), axes=self.kernel.axes)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


class Embed(nnx.Module):
    """Token embedding ``[vocab, embed]``; ``__call__(ids [B, T]) -> [B, T, embed]``."""

    def __init__(self, vocab: int, dim: int, *, dtype):
        self.embedding = param((vocab, dim), ("vocab", "embed"), dtype)
        self.dtype = dtype

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))``; with ``limit`` the GLM clamp
    ``down(silu(min(gate, L)) * clip(up, -L, L))`` (``zoo.ops.activation.swiglu``)."""

    def __init__(self, dim: int, hidden: int, *, dtype, limit: float | None = None):
        self.gate_proj = Linear(dim, hidden, axes=("embed", "mlp"), dtype=dtype)
        self.up_proj = Linear(dim, hidden, axes=("embed", "mlp"), dtype=dtype)
        self.down_proj = Linear(hidden, dim, axes=("mlp", "embed"), dtype=dtype)
        self.limit = limit

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


def rotary_tables(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[B, T, rotary_dim]`` (f32) for integer ``positions [B, T]``, halves repeated."""
    exponents = jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim
    inv_freq = 1.0 / (jnp.float32(theta) ** exponents)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def multi_axis_rotary_tables(positions: jax.Array, rotary_dim: int, theta: float, freq_axes: tuple[int, ...]
                             ) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[B, T, rotary_dim]`` (f32) for positions along several axes, ``positions [A, B, T]``
    (M-RoPE: a token's (t, h, w)): frequency j rotates by the position on axis ``freq_axes[j]``
    (``rotary_dim / 2`` entries), halves repeated. With all A axes equal this is exactly
    ``rotary_tables`` of one of them (the same products, selected)."""
    if len(freq_axes) != rotary_dim // 2:
        raise ValueError(f"freq_axes has {len(freq_axes)} entries for {rotary_dim // 2} frequencies")
    exponents = jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim
    inv_freq = 1.0 / (jnp.float32(theta) ** exponents)
    every = positions.astype(jnp.float32)[..., None] * inv_freq                 # [A, B, T, rotary_dim / 2]
    axes = np.asarray(freq_axes)
    freqs = every[0]
    for a in range(1, positions.shape[0]):
        if (axes == a).any():
            freqs = jnp.where(jnp.asarray(axes == a), every[a], freqs)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary on the first ``cos.shape[-1]`` dims of ``x [B, T, H, D]``; the rest pass."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    half = rd // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)


def causal_depthwise_conv(x: jax.Array, state: jax.Array, weight: jax.Array, mask: jax.Array | None = None
                          ) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv along time with a carried state.

    x ``[B, T, C]``; state ``[B, K-1, C]`` (the previous K-1 inputs, zeros at the start);
    weight ``[K, C]`` (tap j multiplies input t-(K-1)+j). Returns (y ``[B, T, C]``, new state
    ``[B, K-1, C]``: the K-1 inputs up to the last real token). ``mask [B, T]`` (True = token): the
    state ends at each row's last real token, so padding *after* the tokens (a right-padded prefill
    chunk, an inactive decode row) leaves it as those tokens made it; without a mask, at the end.
    Padding must not sit between real tokens of a row (it would enter the window of later tokens).
    """
    k = weight.shape[0]
    t = x.shape[1]
    full = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    w = weight.astype(jnp.float32)
    acc = sum(full[:, j:j + t, :].astype(jnp.float32) * w[j] for j in range(k))
    if mask is None:
        return acc.astype(x.dtype), full[:, t:, :]
    mask = mask.astype(bool)
    end = jnp.where(mask.any(axis=1), t - jnp.argmax(mask[:, ::-1], axis=1), 0)          # last token + 1
    new_state = jax.vmap(lambda f, e: jax.lax.dynamic_slice_in_dim(f, e, k - 1, 0))(full, end)
    return acc.astype(x.dtype), new_state


def conv_state_steps(state: jax.Array, x: jax.Array, mask: jax.Array) -> jax.Array:
    """The conv state after each of the T inputs: ``[B, T, K-1, C]`` from state ``[B, K-1, C]``,
    x ``[B, T, C]`` and mask ``[B, T]`` (True = token; padding only after a row's tokens): entry t
    equals the state ``causal_depthwise_conv`` returns after x[:, :t+1] with that mask, so a padding
    step keeps the state of the last token before it, and a row of padding only (an inactive decode
    row) keeps ``state`` at every step."""
    k1, t = state.shape[1], x.shape[1]
    full = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    mask = mask.astype(bool)
    steps, last = [], state.astype(x.dtype)
    for i in range(t):
        last = jnp.where(mask[:, i, None, None], full[:, i + 1:i + 1 + k1], last)
        steps.append(last)
    return jnp.stack(steps, axis=1)


def take_step(steps: jax.Array, idx: jax.Array) -> jax.Array:
    """Row b of ``steps [B, T, ...]`` at step ``idx[b]`` -> ``[B, ...]`` (idx clipped to [0, T))."""
    idx = jnp.clip(idx, 0, steps.shape[1] - 1)
    return jnp.take_along_axis(steps, idx.reshape((-1, 1) + (1,) * (steps.ndim - 2)), axis=1)[:, 0]
