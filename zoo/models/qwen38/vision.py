"""Qwen3.8 (HF ``qwen3_5``) vision tower: ``Qwen3_5VisionModel`` (``model.visual.*``) as Flax NNX.

    patches [N, C*T*P*P]  (the image processor's ``pixel_values``), grid_thw ((t, h, w), ...) static
    x = patches @ W_patch + b                                       patch embed (the stride = kernel
                                                                    Conv3d as a matmul)      [N, D]
    x += sum_4 w * pos_embed[idx]                                   learned S x S table, bilinear to
                                                                    each image's h x w grid (align_corners)
    depth x Block:  x += proj(attn(rope2d(qkv(norm1(x)))));  x += fc2(act(fc1(norm2(x))))
                    attention only within one frame of one image (HF's cu_seqlens segments)
    merged = fc2(gelu(fc1(norm(x).reshape(N / m^2, m^2 * D))))                      [N / m^2, out_hidden]

Contract (``VisionTower.__call__``):
  * ``grid_thw``: host ints, one ``(t, h, w)`` per image/video, in patches (h, w multiples of
    ``spatial_merge_size`` m). Every shape derives from it: pass it static under jit (``jit_tower``).
  * ``patches`` rows: image by image, frame by frame, each frame in merge-block order
    ``(h/m, w/m, m, m)``; each row the flattened ``(C, T, P, P)`` patch. This is exactly what HF's
    ``Qwen2VLImageProcessor`` emits; N = sum t*h*w.
  * returns ``(merged [N/m^2, out_hidden], hidden [N, D])``: merged rows image by image, frame by
    frame, in raster order over the ``(h/m, w/m)`` merged grid (image i has t*h*w/m^2 rows: the
    placeholder tokens it fills, ``merged_lengths``); ``hidden`` is the last block's output
    (HF ``last_hidden_state``), in block order.

The fixed-shape path (the engine's: one program per padded row count, whatever the grid):
``geometry(grid_thw, n)`` (host, numpy) gives a ``PatchGeometry`` padded to n patch rows (n >= N, a
multiple of m^2): the rotary positions, the position table's taps and weights, a segment id per
patch (one per frame, -1 at padding); ``encode_padded(patches [n, C*T*P*P], geometry)`` runs the
same tower with dense attention masked to ``segment_q == segment_k`` and returns ``[n/m^2,
out_hidden]`` whose first N/m^2 rows are ``__call__``'s merged rows (the rest: padding's, finite).
``__call__`` stays the reference (the parity tests against transformers run it).

The host helpers (``patch_coords``, ``interpolation_taps``, ``rotary_positions``, ``frame_segments``)
are pure numpy functions of the grid; they reproduce ``transformers.vision_utils``
(``get_vision_interpolation_indices_and_weights(mode="bilinear", align_corners=True)``,
``get_vision_position_ids``, ``get_vision_cu_seqlens``).

Parameters (logical axes): ``vision_embed`` (D, the tower's residual stream), ``vision_patch`` (the
patch kernel's C, T, P, P axes), ``vision_pos`` (position-table rows), ``vision_heads`` (the
fused qkv output, head-major ``[H, 3, hd]`` so that a split by heads keeps each head's q, k and v
together, and the attention output, heads x head_dim), ``vision_mlp`` (block MLP width),
``vision_merged`` (m^2 D merger input), ``vision_merger_mlp`` (merger hidden width), ``vision_out``
(out_hidden: the text model's embedding width).

The patch kernel is kept in the checkpoint's Conv3d layout ``[D, C, T, P, P]`` (loaded as stored:
no layout transform, so placement on a mesh and export need nothing new) and flattened to
``[C*T*P*P, D]`` in the forward.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo.models.config import ConfigError
from zoo.models.shared.layers import LayerNorm, Linear, param
from zoo.models.shared.vision import PatchGeometry, frame_ids, mmproj_patch_joins, mmproj_patch_parts, pad_rows
from zoo.ops.matmul import matmul, precision_for
from zoo.sources.names import HeadOrder, Join, NameMap, Rule, Transform

Grid = tuple[tuple[int, int, int], ...]

ACTIVATIONS = {
    "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True),
    "gelu_new": partial(jax.nn.gelu, approximate=True),
    "gelu": partial(jax.nn.gelu, approximate=False),
    "silu": jax.nn.silu,
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


def _scalar(v, name: str) -> int:
    """An int config field that HF also allows as a list (all entries must agree)."""
    if isinstance(v, (list, tuple)):
        if not v or len(set(v)) != 1:
            raise ConfigError(f"vision_config.{name} = {v!r}: only equal sizes are supported")
        v = v[0]
    return int(v)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """HF ``Qwen3_5VisionConfig`` (defaults as transformers'); ``from_hf`` reads a ``vision_config``."""

    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_theta: float = 10_000.0
    layer_norm_eps: float = 1e-6          # fixed in HF (not a config field)

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ConfigError("vision hidden_size must be a multiple of num_heads")
        if self.head_dim % 4:
            raise ConfigError(f"vision head_dim {self.head_dim} must be a multiple of 4 (2-D rotary)")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"vision hidden_act {self.hidden_act!r} is not supported; known: {sorted(ACTIVATIONS)}")
        if self.grid_side < 1:
            raise ConfigError("vision num_position_embeddings must be >= 1")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """C*T*P*P: the length of one ``pixel_values`` row."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def merged_dim(self) -> int:
        return self.hidden_size * self.merge_unit

    @property
    def grid_side(self) -> int:
        """Side S of the learned S x S position table (HF: ``int(num_position_embeddings ** 0.5)``)."""
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "VisionConfig":
        """From an HF ``vision_config`` dict (or a whole ``qwen3_5`` config holding one)."""
        if isinstance(d.get("vision_config"), dict):
            d = d["vision_config"]
        if d.get("deepstack_visual_indexes"):
            raise ConfigError("vision deepstack_visual_indexes is not supported (not a qwen3_5 tower)")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"vision rope_type {rope.get('rope_type')!r}: only 'axial' is supported")
        f = {fld.name: fld.default for fld in dataclasses.fields(cls)}
        return cls(
            depth=int(d.get("depth", f["depth"])),
            hidden_size=int(d.get("hidden_size", f["hidden_size"])),
            num_heads=int(d.get("num_heads", f["num_heads"])),
            intermediate_size=int(d.get("intermediate_size", f["intermediate_size"])),
            hidden_act=str(d.get("hidden_act", f["hidden_act"])),
            in_channels=int(d.get("in_channels", f["in_channels"])),
            patch_size=_scalar(d.get("patch_size", f["patch_size"]), "patch_size"),
            temporal_patch_size=_scalar(d.get("temporal_patch_size", f["temporal_patch_size"]),
                                        "temporal_patch_size"),
            spatial_merge_size=int(d.get("spatial_merge_size", f["spatial_merge_size"])),
            out_hidden_size=int(d.get("out_hidden_size", f["out_hidden_size"])),
            num_position_embeddings=int(d.get("num_position_embeddings", f["num_position_embeddings"])),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", f["rope_theta"]))),
        )


# -- host-side functions of the grid (numpy) -------------------------------------------------------


def as_grid(grid_thw, merge: int) -> Grid:
    """``grid_thw`` (any nested int sequence or array ``[n, 3]``) as a tuple of int triples, checked."""
    grid = tuple(tuple(int(v) for v in g) for g in np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3))
    for t, h, w in grid:
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(f"grid (t={t}, h={h}, w={w}): sizes must be >= 1, h and w multiples of {merge}")
    if not grid:
        raise ValueError("grid_thw names no image")
    return grid


def patch_coords(grid: Grid, merge: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per patch row (merge-block order, every frame): ``(row, col, h, w)`` int64 ``[N]`` each, the
    patch's place in its frame's h x w grid and that grid's size."""
    rows, cols, hs, ws = [], [], [], []
    for t, h, w in grid:
        within = np.arange(h * w)
        in_col, in_row = within % merge, (within // merge) % merge
        block_col = (within // (merge * merge)) % (w // merge)
        block_row = within // (merge * merge * (w // merge))
        rows.append(np.tile(block_row * merge + in_row, t))
        cols.append(np.tile(block_col * merge + in_col, t))
        hs.append(np.full(t * h * w, h))
        ws.append(np.full(t * h * w, w))
    return tuple(np.concatenate(a) for a in (rows, cols, hs, ws))


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear (align_corners) taps ``[n, 2]`` into a ``side``-long axis and their float32 weights,
    in float32 like HF's ``_interpolation_axis_taps_weights``."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    weights = np.maximum(np.float32(1) - np.abs(src[:, None] - floor[:, None] - offsets), np.float32(0))
    return taps, weights.astype(np.float32)


def interpolation_taps(grid: Grid, side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indices int32 [N, 4], weights float32 [N, 4])``: each patch's position embedding is
    ``sum_j weights[:, j] * table[indices[:, j]]``, the S x S table resized bilinearly
    (align_corners=True) to its frame's h x w grid."""
    row, col, h, w = patch_coords(grid, merge)
    h_taps, h_w = _axis_taps(row, h, side)
    w_taps, w_w = _axis_taps(col, w, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return indices.astype(np.int32), weights


def rotary_positions(grid: Grid, merge: int) -> np.ndarray:
    """int32 ``[N, 2]``: each patch's (row, col) in its frame, the 2-D rotary positions."""
    row, col, _, _ = patch_coords(grid, merge)
    return np.stack([row, col], axis=-1).astype(np.int32)


def frame_segments(grid: Grid) -> tuple[tuple[int, int], ...]:
    """``(start, length)`` of each attention segment: one per frame of each image (HF cu_seqlens)."""
    out, start = [], 0
    for t, h, w in grid:
        for _ in range(t):
            out.append((start, h * w))
            start += h * w
    return tuple(out)


def merged_lengths(grid: Grid, merge: int) -> tuple[int, ...]:
    """Rows of the merged output per image (= its placeholder tokens in the prompt): t*h*w / m^2."""
    return tuple(t * h * w // (merge * merge) for t, h, w in grid)


# -- device side ------------------------------------------------------------------------------------


def rotary_tables_2d(positions: np.ndarray, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin float32 ``[N, head_dim]`` for (row, col) positions ``[N, 2]``: the first head_dim/4
    frequencies on rows, the next head_dim/4 on columns, that half repeated (rotate-half layout)."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (jnp.float32(theta) ** (jnp.arange(0, spatial, 2, dtype=jnp.float32) / spatial))
    freqs = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq          # [N, 2, head_dim/4]
    half = jnp.concatenate([freqs[:, 0], freqs[:, 1]], axis=-1)
    emb = jnp.concatenate([half, half], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary over the whole head of ``x [N, H, hd]``, in float32."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments, scale: float) -> jax.Array:
    """Softmax attention of ``q, k, v [N, H, hd]`` within each ``(start, length)`` segment (static).

    Segments of one length are batched (a video's frames, same-size images); memory is
    ``H * sum(length^2)`` scores, not ``H * N^2``."""
    n, heads, hd = q.shape
    by_len: dict[int, list[int]] = {}
    for start, length in segments:
        by_len.setdefault(length, []).append(start)
    outs, order = [], []
    for length, starts in by_len.items():
        idx = (np.asarray(starts)[:, None] + np.arange(length)).reshape(-1)
        contiguous = len(by_len) == 1 and np.array_equal(idx, np.arange(n))
        qs, ks, vs = ((a if contiguous else a[idx]).reshape(len(starts), length, heads, hd) for a in (q, k, v))
        prec = precision_for(q.dtype)
        scores = jnp.einsum("bqhd,bkhd->bhqk", qs, ks, precision=prec, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(scores * scale, axis=-1).astype(v.dtype)
        o = jnp.einsum("bhqk,bkhd->bqhd", probs, vs, precision=prec, preferred_element_type=jnp.float32)
        outs.append(o.astype(q.dtype).reshape(-1, heads, hd))
        order.append(idx)
    if len(outs) == 1 and np.array_equal(order[0], np.arange(n)):
        return outs[0]
    return jnp.concatenate(outs, axis=0)[np.argsort(np.concatenate(order))]


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, scale: float) -> jax.Array:
    """``segment_attention``'s result, dense: ``q, k, v [n, H, hd]``, each row attends to the rows of its
    own segment (``segments`` int32 [n], traced), the others masked out exactly (weight 0). Memory:
    ``H * n^2`` scores."""
    prec = precision_for(q.dtype)
    scores = jnp.einsum("qhd,khd->hqk", q, k, precision=prec, preferred_element_type=jnp.float32)
    same = (segments[:, None] == segments[None, :])[None]
    probs = jax.nn.softmax(jnp.where(same, scores * scale, -jnp.inf), axis=-1).astype(v.dtype)
    o = jnp.einsum("hqk,khd->qhd", probs, v, precision=prec, preferred_element_type=jnp.float32)
    return o.astype(q.dtype)


class VisionAttention(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype):
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        # qkv columns are head-major [H, 3, hd] (the name maps reorder HF's [3, H, hd] rows, ``qkv_heads``)
        self.qkv = Linear(d, 3 * d, axes=("vision_embed", "vision_heads"), dtype=dtype, use_bias=True)
        self.proj = Linear(d, d, axes=("vision_heads", "vision_embed"), dtype=dtype, use_bias=True)

    def __call__(self, x, cos, sin, segments):
        """x [n, D]; ``segments``: static ``(start, length)`` pairs (``frame_segments``), or a segment
        id per row (int32 [n], ``PatchGeometry.segments``: dense masked attention)."""
        n = x.shape[0]
        qkv = self.qkv(x).reshape(n, self.num_heads, 3, self.head_dim)
        q, k, v = _rope(qkv[:, :, 0], cos, sin), _rope(qkv[:, :, 1], cos, sin), qkv[:, :, 2]
        attend = segment_attention if isinstance(segments, tuple) else masked_attention
        o = attend(q, k, v, segments, self.head_dim ** -0.5)
        return self.proj(o.reshape(n, self.num_heads * self.head_dim))


class VisionMLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype):
        self.act = cfg.hidden_act
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, axes=("vision_embed", "vision_mlp"),
                                 dtype=dtype, use_bias=True)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, axes=("vision_mlp", "vision_embed"),
                                 dtype=dtype, use_bias=True)

    def __call__(self, x):
        h = self.linear_fc1(x)
        return self.linear_fc2(ACTIVATIONS[self.act](h.astype(jnp.float32)).astype(h.dtype))


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype):
        norm = dict(eps=cfg.layer_norm_eps, dtype=dtype, axes=("vision_embed",))
        self.norm1 = LayerNorm(cfg.hidden_size, **norm)
        self.norm2 = LayerNorm(cfg.hidden_size, **norm)
        self.attn = VisionAttention(cfg, dtype=dtype)
        self.mlp = VisionMLP(cfg, dtype=dtype)

    def __call__(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """LayerNorm per patch, m^2 consecutive (block-order) patches concatenated, MLP (exact GELU)."""

    def __init__(self, cfg: VisionConfig, *, dtype):
        md = cfg.merged_dim
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype, axes=("vision_embed",))
        self.linear_fc1 = Linear(md, md, axes=("vision_merged", "vision_merger_mlp"), dtype=dtype, use_bias=True)
        self.linear_fc2 = Linear(md, cfg.out_hidden_size, axes=("vision_merger_mlp", "vision_out"), dtype=dtype,
                                 use_bias=True)

    def __call__(self, x):
        h = self.linear_fc1(self.norm(x).reshape(-1, self.linear_fc1.kernel.shape[0]))
        return self.linear_fc2(jax.nn.gelu(h.astype(jnp.float32), approximate=False).astype(h.dtype))


class PatchEmbed(nnx.Module):
    """The stride = kernel Conv3d as a matmul: ``patches [N, C*T*P*P] @ weight.reshape(D, -1).T + bias``."""

    def __init__(self, cfg: VisionConfig, *, dtype):
        p, t = cfg.patch_size, cfg.temporal_patch_size
        self.weight = param((cfg.hidden_size, cfg.in_channels, t, p, p),
                            ("vision_embed",) + ("vision_patch",) * 4, dtype)
        self.bias = param((cfg.hidden_size,), ("vision_embed",), dtype)

    def __call__(self, patches):
        w = self.weight[...]
        y = matmul(patches.astype(w.dtype), w.reshape(w.shape[0], -1).T)
        return y + self.bias[...].astype(y.dtype)


class VisionTower(nnx.Module):
    """HF ``Qwen3_5VisionModel``; see the module docstring for the contract."""

    def __init__(self, cfg: VisionConfig, dtype=jnp.bfloat16):
        self.config = cfg
        self.dtype = dtype
        self.patch_embed = PatchEmbed(cfg, dtype=dtype)
        self.pos_embed = param((cfg.num_position_embeddings, cfg.hidden_size), ("vision_pos", "vision_embed"), dtype)
        self.blocks = nnx.List([VisionBlock(cfg, dtype=dtype) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, dtype=dtype)

    def __call__(self, patches: jax.Array, grid_thw) -> tuple[jax.Array, jax.Array]:
        """patches [N, C*T*P*P], grid_thw static (t, h, w) per image -> (merged [N/m^2, out_hidden],
        last hidden [N, D]), both in the tower's dtype."""
        cfg, m = self.config, self.config.spatial_merge_size
        grid = as_grid(grid_thw, m)
        n = sum(t * h * w for t, h, w in grid)
        if tuple(patches.shape) != (n, cfg.patch_dim):
            raise ValueError(f"patches have shape {tuple(patches.shape)}; grid {grid} needs ({n}, {cfg.patch_dim})")
        idx, weights = interpolation_taps(grid, cfg.grid_side, m)
        return self._forward(patches, idx, weights, rotary_positions(grid, m), frame_segments(grid))

    def _forward(self, patches, idx, weights, positions, segments) -> tuple[jax.Array, jax.Array]:
        """The tower from patches [N, C*T*P*P], the position table's taps (``idx``, ``weights`` [N, 4]),
        the rotary ``positions`` [N, 2] and ``segments`` as ``VisionAttention`` takes them ->
        (merged [N/m^2, out_hidden], last hidden [N, D])."""
        cfg = self.config
        x = self.patch_embed(patches.astype(self.dtype))
        taps = jnp.take(self.pos_embed[...], jnp.asarray(idx), axis=0).astype(jnp.float32)   # [N, 4, D]
        x = x + jnp.sum(taps * jnp.asarray(weights)[..., None], axis=1).astype(x.dtype)
        cos, sin = rotary_tables_2d(positions, cfg.head_dim, cfg.rope_theta)
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        return self.merger(x), x

    def geometry(self, grid_thw, n_patches: int) -> PatchGeometry:
        """Host side of ``encode_padded``: the ``PatchGeometry`` of ``grid_thw`` padded to ``n_patches``
        rows (>= its patches, a multiple of m^2). ``ValueError`` when they do not fit."""
        cfg, m = self.config, self.config.spatial_merge_size
        grid = as_grid(grid_thw, m)
        if n_patches % (m * m):
            raise ValueError(f"n_patches {n_patches} is not a multiple of {m * m} (merge {m} x {m})")
        idx, weights = interpolation_taps(grid, cfg.grid_side, m)
        return PatchGeometry(positions=pad_rows(rotary_positions(grid, m), n_patches),
                             segments=pad_rows(frame_ids(grid), n_patches, -1),
                             taps=pad_rows(idx, n_patches), tap_weights=pad_rows(weights, n_patches))

    def encode_padded(self, patches: jax.Array, geometry: PatchGeometry) -> jax.Array:
        """patches [n, C*T*P*P] (the grid's patches, then zero rows), ``geometry`` of the same n
        (``geometry``) -> merged [n/m^2, out_hidden] in the tower's dtype: on the grid's rows equal to
        ``__call__``'s merged rows; every shape is n's, so one program serves every grid padded to n."""
        cfg = self.config
        n = patches.shape[0]
        if patches.shape[1] != cfg.patch_dim or geometry.segments.shape != (n,):
            raise ValueError(f"patches {tuple(patches.shape)} and segments {tuple(geometry.segments.shape)}: "
                             f"expected ({n}, {cfg.patch_dim}) and ({n},)")
        return self._forward(patches, geometry.taps, geometry.tap_weights, geometry.positions,
                             jnp.asarray(geometry.segments, jnp.int32))[0]


def jit_tower(tower: VisionTower):
    """``f(patches, grid_thw) -> (merged, hidden)``: the tower's forward jitted, the grid static
    (one compile per distinct grid tuple)."""
    graphdef, state = nnx.split(tower)
    fn = jax.jit(lambda s, patches, grid: nnx.merge(graphdef, s)(patches, grid), static_argnums=2)
    return lambda patches, grid_thw: fn(state, patches, as_grid(grid_thw, tower.config.spatial_merge_size))


# -- weight names ----------------------------------------------------------------------------------


def qkv_heads(cfg: VisionConfig) -> HeadOrder:
    """The fused qkv rows as stored (HF and llama.cpp: ``[3, H, hd]``, which then head) -> the
    parameter's head-major ``[H, 3, hd]`` columns."""
    return HeadOrder(axis=0, start=0, groups=cfg.num_heads, per_group=3, unit=cfg.head_dim)


def vision_rules(cfg: VisionConfig, src: str = "", dst: str = "") -> list[Rule]:
    """HF ``Qwen3_5VisionModel`` tensors under source regex prefix ``src`` (e.g. ``r"visual"`` after a
    ``model.`` strip) -> tower parameters under path prefix ``dst`` (e.g. ``"visual"``)."""
    s = f"{src}\\." if src else ""
    d = f"{dst}." if dst else ""
    b, wb = r"blocks\.(?P<i>\d+)", r"(?P<p>weight|bias)"
    heads = qkv_heads(cfg)
    return [
        Rule(rf"{s}patch_embed\.proj\.{wb}", rf"{d}patch_embed.\g<p>"),
        Rule(rf"{s}pos_embed\.weight", f"{d}pos_embed"),
        Rule(rf"{s}{b}\.(?P<n>norm1|norm2)\.{wb}", rf"{d}blocks.\g<i>.\g<n>.\g<p>"),
        Rule(rf"{s}{b}\.attn\.qkv\.weight", rf"{d}blocks.\g<i>.attn.qkv.kernel", Transform("matmul", heads)),
        Rule(rf"{s}{b}\.attn\.qkv\.bias", rf"{d}blocks.\g<i>.attn.qkv.bias", Transform(None, heads)),
        Rule(rf"{s}{b}\.attn\.proj\.weight", rf"{d}blocks.\g<i>.attn.proj.kernel", "matmul"),
        Rule(rf"{s}{b}\.attn\.proj\.bias", rf"{d}blocks.\g<i>.attn.proj.bias"),
        Rule(rf"{s}{b}\.mlp\.(?P<n>linear_fc1|linear_fc2)\.weight", rf"{d}blocks.\g<i>.mlp.\g<n>.kernel", "matmul"),
        Rule(rf"{s}{b}\.mlp\.(?P<n>linear_fc1|linear_fc2)\.bias", rf"{d}blocks.\g<i>.mlp.\g<n>.bias"),
        Rule(rf"{s}merger\.norm\.{wb}", rf"{d}merger.norm.\g<p>"),
        Rule(rf"{s}merger\.(?P<n>linear_fc1|linear_fc2)\.weight", rf"{d}merger.\g<n>.kernel", "matmul"),
        Rule(rf"{s}merger\.(?P<n>linear_fc1|linear_fc2)\.bias", rf"{d}merger.\g<n>.bias"),
    ]


def gguf_patch_parts(cfg: VisionConfig) -> tuple[str, ...]:
    """The mmproj names of the T parts of the patch kernel."""
    return mmproj_patch_parts(cfg.temporal_patch_size)


def gguf_joins(cfg: VisionConfig) -> tuple[Join, ...]:
    return mmproj_patch_joins(cfg.temporal_patch_size)


def gguf_rules(cfg: VisionConfig, dst: str = "visual") -> list[Rule]:
    """The tower in llama.cpp's mmproj names (``convert_hf_to_gguf``'s Qwen3-VL tower: ``v.*``, the
    merger's norm ``v.post_ln`` and its MLP ``mm.0`` / ``mm.2``) -> parameters under ``dst``; the
    patch kernel through ``gguf_joins``. Used by the inventory (the planner) and by the
    mmproj loader (``zoo.loader.mmproj``; ``dst=""`` for a bare ``VisionTower``)."""
    d = f"{dst}." if dst else ""
    b, wb = r"v\.blk\.(?P<i>\d+)", r"(?P<p>weight|bias)"
    heads = qkv_heads(cfg)
    return [
        Rule(r"v\.patch_embd\.frames\.weight", f"{d}patch_embed.weight"),
        Rule(r"v\.patch_embd\.bias", f"{d}patch_embed.bias"),
        Rule(r"v\.position_embd\.weight", f"{d}pos_embed"),
        Rule(rf"{b}\.ln1\.{wb}", rf"{d}blocks.\g<i>.norm1.\g<p>"),
        Rule(rf"{b}\.ln2\.{wb}", rf"{d}blocks.\g<i>.norm2.\g<p>"),
        Rule(rf"{b}\.attn_qkv\.weight", rf"{d}blocks.\g<i>.attn.qkv.kernel", Transform("matmul", heads)),
        Rule(rf"{b}\.attn_qkv\.bias", rf"{d}blocks.\g<i>.attn.qkv.bias", Transform(None, heads)),
        Rule(rf"{b}\.attn_out\.weight", rf"{d}blocks.\g<i>.attn.proj.kernel", "matmul"),
        Rule(rf"{b}\.attn_out\.bias", rf"{d}blocks.\g<i>.attn.proj.bias"),
        Rule(rf"{b}\.ffn_up\.weight", rf"{d}blocks.\g<i>.mlp.linear_fc1.kernel", "matmul"),
        Rule(rf"{b}\.ffn_up\.bias", rf"{d}blocks.\g<i>.mlp.linear_fc1.bias"),
        Rule(rf"{b}\.ffn_down\.weight", rf"{d}blocks.\g<i>.mlp.linear_fc2.kernel", "matmul"),
        Rule(rf"{b}\.ffn_down\.bias", rf"{d}blocks.\g<i>.mlp.linear_fc2.bias"),
        Rule(rf"v\.post_ln\.{wb}", rf"{d}merger.norm.\g<p>"),
        Rule(r"mm\.0\.weight", f"{d}merger.linear_fc1.kernel", "matmul"),
        Rule(r"mm\.0\.bias", f"{d}merger.linear_fc1.bias"),
        Rule(r"mm\.2\.weight", f"{d}merger.linear_fc2.kernel", "matmul"),
        Rule(r"mm\.2\.bias", f"{d}merger.linear_fc2.bias"),
    ]


@functools.lru_cache(maxsize=None)
def hf_name_map(cfg: VisionConfig) -> NameMap:
    """A whole ``qwen3_5`` checkpoint's tower tensors (``model.visual.*``, or ``visual.*``) -> a bare
    ``VisionTower`` (for ``zoo.loader.fill.fill_from_source``); every other tensor (text model,
    ``lm_head``, ``mtp``) is ignored."""
    return NameMap(
        strip_prefixes=("model.visual.", "visual."),
        ignore=(r"(?!(?:model\.)?visual\.)",),         # everything outside the tower (text model, mtp)
        rules=tuple(vision_rules(cfg)),
    )
