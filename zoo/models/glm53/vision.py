"""GLM-5.3-Flash vision tower (HF ``glm5_next``: ``Glm5NextVisionModel`` at ``model.visual``).

    patches [N, C*T*P*P] (the image processor's ``pixel_values``), grid_thw ((t, h, w), ...)
      -> patch_embed: a matmul with the Conv3d weight (stride = kernel)          [N, D]
      -> depth x Block: x += attn(norm1(x)); x += mlp(norm2(x))                  [N, D]
           attn: fused qkv (+bias) -> per-head q/k RMSNorm -> 2-D axial rotary (h, w)
                 -> softmax attention within each frame of each image -> proj (+bias)
           mlp:  down(act(min(gate, L)) * clip(up, -L, L)), all with bias
      -> post_layernorm (RMSNorm)                                               [N, D]
      -> downsample: each m x m block of patches, a matmul with the Conv2d weight [N / m^2, O]
      -> merger: proj -> LayerNorm -> GELU(erf) -> clamped SwiGLU (no biases)    [N / m^2, O]

D = hidden_size, O = out_hidden_size (the language model's hidden size), m = spatial_merge_size.
No learned position embedding: the rotary is the only position signal.

Contract (what transformers' ``Glm5NextModel.get_image_features`` returns as ``pooler_output``):

* ``patches`` rows are in the processor's order: image by image, frame by frame, and within a frame
  merge block by merge block (raster order over the ``(h/m, w/m)`` blocks), each block's ``m x m``
  patches in raster order; each row flattened as ``(C, T, P, P)``.
* ``grid_thw`` is a static tuple of host ints (the processor's ``image_grid_thw`` rows); every shape
  follows from it, so each distinct grid compiles once under jit. ``h`` and ``w`` are multiples of m.
* The result ``[sum(t*h*w) / m^2, O]`` stacks the images' rows in order (``merged_lengths`` gives
  each image's count: its number of ``<|image|>`` placeholder tokens). Attention never crosses a
  frame: entry (t, h, w) is t independent segments of h*w patches (transformers' ``cu_seqlens``),
  so a video given as ((t, h, w),) equals ((1, h, w),) * t, as ``get_video_features`` feeds it.

The fixed-shape path (the engine's: one program per padded row count, whatever the grid):
``geometry(grid_thw, n)`` (host, numpy) gives a ``PatchGeometry`` padded to n patch rows (n >= N, a
multiple of m^2): the rotary positions and a segment id per patch (one per frame, -1 at padding);
``encode_padded(patches [n, C*T*P*P], geometry)`` runs the same tower with dense attention masked
to ``segment_q == segment_k`` and returns ``[n / m^2, O]`` whose first N / m^2 rows are
``__call__``'s (the rest: padding's, finite). ``__call__`` stays the reference (the parity tests
against transformers run it).

Weights: ``hf_names(cfg)`` maps the checkpoint's ``model.visual.*`` tensors to the parameters (the
qkv rows reordered head-major, so splitting ``"vision_heads"`` keeps each head's q, k, v together);
the language model's map (``zoo.models.glm53.weights``) takes the same rules under ``visual.``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo.models.config import ConfigError, rope_field
from zoo.models.shared.inventory import Tensor
from zoo.models.shared.layers import LayerNorm, Linear, RMSNorm, param
from zoo.models.shared.vision import PatchGeometry, frame_ids, mmproj_patch_joins, mmproj_patch_parts, pad_rows
from zoo.ops.activation import swiglu
from zoo.ops.matmul import einsum
from zoo.sources.names import HeadOrder, Join, NameMap, Rule, Transform

Grid = tuple[tuple[int, int, int], ...]

MERGER_LAYER_NORM_EPS = 1e-5    # torch.nn.LayerNorm's default (the merger's post_projection_norm)

_ACTS = {
    "silu": jax.nn.silu, "swish": jax.nn.silu, "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
}


def _single(v: Any, name: str) -> int:
    """An int size, or a list of equal ints (HF allows ``patch_size: [14, 14]``)."""
    if isinstance(v, (list, tuple)):
        if len(set(v)) != 1:
            raise ConfigError(f"vision_config.{name} {list(v)}: only square sizes are supported")
        v = v[0]
    return int(v)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """HF ``Glm5NextVisionConfig`` (defaults as transformers'); ``from_hf`` reads ``vision_config``."""

    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    hidden_act: str = "silu"
    attention_bias: bool = True
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 1536
    projection_intermediate_size: int = 10240
    swiglu_limit: float | None = 10.0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"vision hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise ConfigError(f"vision head_dim {self.head_dim} must be a multiple of 4 (2-D rotary halves)")
        if self.hidden_act not in _ACTS:
            raise ConfigError(f"unknown vision hidden_act {self.hidden_act!r}; known: {sorted(_ACTS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one ``pixel_values`` row: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per output row: m * m."""
        return self.spatial_merge_size ** 2

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "VisionConfig":
        """From an HF ``vision_config`` dict (or a whole config.json holding one)."""
        if isinstance(d.get("vision_config"), dict):
            d = d["vision_config"]
        dflt = cls()
        get = lambda name, *alt: next((d[k] for k in (name, *alt) if d.get(k) is not None), getattr(dflt, name))
        limit = d.get("swiglu_limit", dflt.swiglu_limit)
        rope_type = (d.get("rope_parameters") or {}).get("rope_type", "axial")
        if rope_type != "axial":
            raise ConfigError(f"vision rope_type {rope_type!r}: only 'axial' is supported")
        return cls(
            depth=int(get("depth", "num_hidden_layers")),
            hidden_size=int(get("hidden_size")),
            num_heads=int(get("num_heads", "num_attention_heads")),
            intermediate_size=int(get("intermediate_size")),
            hidden_act=str(get("hidden_act")),
            attention_bias=bool(get("attention_bias")),
            in_channels=int(get("in_channels")),
            patch_size=_single(get("patch_size"), "patch_size"),
            temporal_patch_size=_single(get("temporal_patch_size"), "temporal_patch_size"),
            spatial_merge_size=int(get("spatial_merge_size")),
            out_hidden_size=int(get("out_hidden_size")),
            projection_intermediate_size=int(get("projection_intermediate_size")),
            swiglu_limit=None if limit is None else float(limit),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=float(rope_field(d, "rope_theta", dflt.rope_theta)),
        )


# -- host-side geometry (numpy, from the static grid) ---------------------------------------------


def as_grid(grid_thw, merge: int) -> Grid:
    """``grid_thw`` (rows of (t, h, w), any int-like) as a hashable tuple, checked against ``merge``."""
    grid = tuple(tuple(int(v) for v in row) for row in np.asarray(grid_thw).reshape(-1, 3))
    for t, h, w in grid:
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise ValueError(f"grid (t={t}, h={h}, w={w}): h and w must be positive multiples of {merge}")
    return grid


def merged_lengths(grid: Grid, merge: int) -> tuple[int, ...]:
    """Output rows (= placeholder tokens) per grid entry: t * h * w / m^2."""
    return tuple(t * h * w // merge ** 2 for t, h, w in grid)


def vision_positions(grid: Grid, merge: int) -> np.ndarray:
    """int32 ``[N, 2]`` (row, column) of each patch, block-major as transformers'
    ``get_vision_position_ids``; the (h, w) positions repeat for each of the t frames."""
    out = []
    for t, h, w in grid:
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        hw = np.stack([hh.reshape(block).transpose(0, 2, 1, 3).reshape(-1),
                       ww.reshape(block).transpose(0, 2, 1, 3).reshape(-1)], axis=-1)
        out.append(np.tile(hw, (t, 1)))
    return np.concatenate(out).astype(np.int32)


def attention_segments(grid: Grid) -> dict[int, np.ndarray]:
    """``{length L: int32 [G, L] patch indices}``: the frames (attention segments, transformers'
    ``cu_seqlens``) grouped by length, so each group attends as one batch."""
    starts: dict[int, list[int]] = {}
    offset = 0
    for t, h, w in grid:
        for _ in range(t):
            starts.setdefault(h * w, []).append(offset)
            offset += h * w
    return {n: (np.asarray(s)[:, None] + np.arange(n)[None]).astype(np.int32) for n, s in starts.items()}


def rotary_cos_sin(positions: np.ndarray, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[N, head_dim]`` (f32): the same frequencies ``theta^(-4j/head_dim)`` for rows and
    columns, laid out ``[rows | cols | rows | cols]`` (each ``head_dim / 4``) for rotate-half."""
    spatial = head_dim // 2                                                      # per axis (rows, columns)
    inv_freq = 1.0 / (jnp.float32(theta) ** (jnp.arange(0, spatial, 2, dtype=jnp.float32) / spatial))
    freqs = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq          # [N, 2, head_dim / 4]
    hw = freqs.reshape(freqs.shape[0], -1)                                       # [rows | cols]
    emb = jnp.concatenate([hw, hw], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary over the whole head, x ``[N, H, hd]``, math in f32 (as transformers)."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


# -- modules --------------------------------------------------------------------------------------


class ClampedSwiGLU(nnx.Module):
    """``down(act(min(gate(x), L)) * clip(up(x), -L, L))`` (no clamp when ``limit`` is None)."""

    def __init__(self, dim: int, hidden: int, *, axes: tuple[str, str], bias: bool, act: str,
                 limit: float | None, dtype):
        self.gate_proj = Linear(dim, hidden, axes=axes, dtype=dtype, use_bias=bias)
        self.up_proj = Linear(dim, hidden, axes=axes, dtype=dtype, use_bias=bias)
        self.down_proj = Linear(hidden, dim, axes=axes[::-1], dtype=dtype, use_bias=bias)
        self.act, self.limit = act, limit

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.limit, act=_ACTS[self.act]))


class VisionAttention(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.head_dim = cfg.num_heads, hd
        # qkv columns are head-major [H, 3, hd] (the name map reorders HF's [3, H, hd] rows)
        self.qkv = Linear(d, 3 * d, axes=("vision_embed", "vision_heads"), dtype=dtype, use_bias=cfg.attention_bias)
        self.proj = Linear(d, d, axes=("vision_heads", "vision_embed"), dtype=dtype, use_bias=cfg.attention_bias)
        norm = dict(eps=cfg.rms_norm_eps, dtype=dtype, zero_centered=False, axes=("head_dim",))
        self.q_norm = RMSNorm(hd, **norm)
        self.k_norm = RMSNorm(hd, **norm)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments) -> jax.Array:
        """x ``[N, D]`` -> ``[N, D]``; each segment attends only to itself: ``segments`` is the static
        ``attention_segments`` dict, or a segment id per row (int32 [N], ``PatchGeometry.segments``:
        one dense attention masked to ``segment_q == segment_k``)."""
        n = x.shape[0]
        qkv = self.qkv(x).reshape(n, self.num_heads, 3, self.head_dim)
        q = _rotate(self.q_norm(qkv[:, :, 0]), cos, sin)
        k = _rotate(self.k_norm(qkv[:, :, 1]), cos, sin)
        v = qkv[:, :, 2]
        scale = self.head_dim ** -0.5
        if not isinstance(segments, dict):
            scores = einsum("qhd,khd->hqk", q, k) * jnp.asarray(scale, q.dtype)
            same = (segments[:, None] == segments[None, :])[None]
            probs = jax.nn.softmax(jnp.where(same, scores.astype(jnp.float32), -jnp.inf), axis=-1).astype(v.dtype)
            return self.proj(einsum("hqk,khd->qhd", probs, v).reshape(n, -1))
        out = jnp.zeros_like(v)
        for idx in segments.values():                   # static: one dense attention per segment length
            qs, ks, vs = q[idx], k[idx], v[idx]         # [G, L, H, hd]
            scores = einsum("gqhd,gkhd->ghqk", qs, ks) * jnp.asarray(scale, qs.dtype)
            probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(vs.dtype)
            out = out.at[idx].set(einsum("ghqk,gkhd->gqhd", probs, vs))
        return self.proj(out.reshape(n, -1))


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype):
        norm = dict(eps=cfg.rms_norm_eps, dtype=dtype, zero_centered=False, axes=("vision_embed",))
        self.norm1 = RMSNorm(cfg.hidden_size, **norm)
        self.norm2 = RMSNorm(cfg.hidden_size, **norm)
        self.attn = VisionAttention(cfg, dtype=dtype)
        self.mlp = ClampedSwiGLU(cfg.hidden_size, cfg.intermediate_size, axes=("vision_embed", "vision_mlp"),
                                 bias=cfg.attention_bias, act=cfg.hidden_act, limit=cfg.swiglu_limit, dtype=dtype)

    def __call__(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """``proj -> LayerNorm -> GELU -> clamped SwiGLU`` at width O (no biases but the norm's)."""

    def __init__(self, cfg: VisionConfig, *, dtype):
        o = cfg.out_hidden_size
        # split along its input on a mesh, as the text model's small square matrices (MTP's fc)
        self.proj = Linear(o, o, axes=("embed_in", "embed"), dtype=dtype)
        self.post_projection_norm = LayerNorm(o, eps=MERGER_LAYER_NORM_EPS, dtype=dtype, axes=("embed",))
        self.mlp = ClampedSwiGLU(o, cfg.projection_intermediate_size, axes=("embed", "vision_merger_mlp"), bias=False,
                                 act=cfg.hidden_act, limit=cfg.swiglu_limit, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.post_projection_norm(self.proj(x))
        return self.mlp(jax.nn.gelu(h, approximate=False))


class VisionTower(nnx.Module):
    """``__call__(patches [N, C*T*P*P], grid_thw) -> [N / m^2, out_hidden_size]`` (module docstring)."""

    def __init__(self, cfg: VisionConfig, *, dtype=jnp.bfloat16):
        self.config, self.dtype = cfg, dtype
        d, o, m = cfg.hidden_size, cfg.out_hidden_size, cfg.spatial_merge_size
        c, t, p = cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size
        # the Conv3d / Conv2d weights keep their stored layouts; each is applied as one matmul
        self.patch_embed = param((d, c, t, p, p), ("vision_embed", None, None, None, None), dtype)
        self.patch_embed_bias = param((d,), ("vision_embed",), dtype)
        self.blocks = nnx.List([VisionBlock(cfg, dtype=dtype) for _ in range(cfg.depth)])
        self.post_layernorm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, zero_centered=False, axes=("vision_embed",))
        self.downsample = param((o, d, m, m), ("embed", "embed_in", None, None), dtype)     # split along its input
        self.downsample_bias = param((o,), ("embed",), dtype)
        self.merger = PatchMerger(cfg, dtype=dtype)

    def __call__(self, patches: jax.Array, grid_thw) -> jax.Array:
        cfg = self.config
        m = cfg.spatial_merge_size
        grid = as_grid(grid_thw, m)
        n = sum(t * h * w for t, h, w in grid)
        if patches.shape != (n, cfg.patch_dim):
            raise ValueError(f"patches {patches.shape} do not fit grid {grid}: expected ({n}, {cfg.patch_dim})")
        cos, sin = rotary_cos_sin(vision_positions(grid, m), cfg.head_dim, cfg.rope_theta)
        return self._forward(patches, cos, sin, attention_segments(grid))

    def _forward(self, patches, cos, sin, segments) -> jax.Array:
        """The tower from patches [N, C*T*P*P] and the rotary tables, ``segments`` as
        ``VisionAttention`` takes them -> [N / m^2, O]."""
        m, d = self.config.spatial_merge_size, self.config.hidden_size
        n = patches.shape[0]
        w = self.patch_embed[...].reshape(d, -1).astype(self.dtype)
        x = einsum("nk,dk->nd", patches.astype(self.dtype), w) + self.patch_embed_bias[...].astype(self.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        x = self.post_layernorm(x).reshape(n // (m * m), m, m, d)
        x = einsum("nijc,ocij->no", x, self.downsample[...].astype(self.dtype))
        x = x + self.downsample_bias[...].astype(self.dtype)
        return self.merger(x)

    def geometry(self, grid_thw, n_patches: int) -> PatchGeometry:
        """Host side of ``encode_padded``: the ``PatchGeometry`` of ``grid_thw`` padded to ``n_patches``
        rows (>= its patches, a multiple of m^2; no position-table taps: this tower has none).
        ``ValueError`` when they do not fit."""
        m = self.config.spatial_merge_size
        grid = as_grid(grid_thw, m)
        if n_patches % (m * m):
            raise ValueError(f"n_patches {n_patches} is not a multiple of {m * m} (merge {m} x {m})")
        return PatchGeometry(positions=pad_rows(vision_positions(grid, m), n_patches),
                             segments=pad_rows(frame_ids(grid), n_patches, -1))

    def encode_padded(self, patches: jax.Array, geometry: PatchGeometry) -> jax.Array:
        """patches [n, C*T*P*P] (the grid's patches, then zero rows), ``geometry`` of the same n ->
        rows [n / m^2, O] in the tower's dtype: on the grid's rows equal to ``__call__``'s; every
        shape is n's, so one program serves every grid padded to n."""
        cfg = self.config
        n = patches.shape[0]
        if patches.shape[1] != cfg.patch_dim or geometry.segments.shape != (n,):
            raise ValueError(f"patches {tuple(patches.shape)} and segments {tuple(geometry.segments.shape)}: "
                             f"expected ({n}, {cfg.patch_dim}) and ({n},)")
        cos, sin = rotary_cos_sin(geometry.positions, cfg.head_dim, cfg.rope_theta)
        return self._forward(patches, cos, sin, jnp.asarray(geometry.segments, jnp.int32))


# -- weights --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _hf_names(num_heads: int, head_dim: int) -> NameMap:
    # HF qkv rows are [3, H, hd] (which, head, dim); the parameter's columns are [H, 3, hd]
    heads = HeadOrder(axis=0, start=0, groups=num_heads, per_group=3, unit=head_dim)
    blk = r"blocks\.(?P<i>\d+)"
    return NameMap(
        strip_prefixes=("model.visual.", "visual."),
        ignore=(r"(?!model\.visual\.|visual\.)",),          # everything outside the tower (the text model)
        rules=(
            Rule(r"patch_embed\.proj\.weight", "patch_embed"),
            Rule(r"patch_embed\.proj\.bias", "patch_embed_bias"),
            Rule(rf"{blk}\.(?P<n>norm1|norm2)\.weight", r"blocks.\g<i>.\g<n>.weight"),
            Rule(rf"{blk}\.attn\.qkv\.weight", r"blocks.\g<i>.attn.qkv.kernel", Transform("matmul", heads)),
            Rule(rf"{blk}\.attn\.qkv\.bias", r"blocks.\g<i>.attn.qkv.bias", Transform(None, heads)),
            Rule(rf"{blk}\.attn\.proj\.weight", r"blocks.\g<i>.attn.proj.kernel", "matmul"),
            Rule(rf"{blk}\.attn\.proj\.bias", r"blocks.\g<i>.attn.proj.bias"),
            Rule(rf"{blk}\.attn\.(?P<n>q_norm|k_norm)\.weight", r"blocks.\g<i>.attn.\g<n>.weight"),
            Rule(rf"{blk}\.mlp\.(?P<n>gate_proj|up_proj|down_proj)\.weight", r"blocks.\g<i>.mlp.\g<n>.kernel",
                 "matmul"),
            Rule(rf"{blk}\.mlp\.(?P<n>gate_proj|up_proj|down_proj)\.bias", r"blocks.\g<i>.mlp.\g<n>.bias"),
            Rule(r"post_layernorm\.weight", "post_layernorm.weight"),
            Rule(r"downsample\.weight", "downsample"),
            Rule(r"downsample\.bias", "downsample_bias"),
            Rule(r"merger\.proj\.weight", "merger.proj.kernel", "matmul"),
            Rule(r"merger\.post_projection_norm\.(?P<n>weight|bias)", r"merger.post_projection_norm.\g<n>"),
            Rule(r"merger\.(?P<n>gate_proj|up_proj|down_proj)\.weight", r"merger.mlp.\g<n>.kernel", "matmul"),
        ),
    )


def hf_names(cfg: VisionConfig) -> NameMap:
    """HF ``glm5_next`` vision tensors (``model.visual.*`` on disk, or ``visual.*``) -> ``VisionTower``
    parameter paths; every other tensor (the text model) is ignored."""
    return _hf_names(cfg.num_heads, cfg.head_dim)


def _head_order(cfg: VisionConfig) -> HeadOrder:
    return HeadOrder(axis=0, start=0, groups=cfg.num_heads, per_group=3, unit=cfg.head_dim)


def gguf_patch_parts(cfg: VisionConfig) -> tuple[str, ...]:
    """The mmproj names of the T temporal slices of the patch kernel (the converter writes two)."""
    return mmproj_patch_parts(cfg.temporal_patch_size)


def gguf_joins(cfg: VisionConfig) -> tuple[Join, ...]:
    """The patch kernel's slices joined as ``v.patch_embd.frames.weight`` (``zoo.sources.views.joined``)."""
    return mmproj_patch_joins(cfg.temporal_patch_size)


def gguf_rules(cfg: VisionConfig, dst: str = "visual") -> list[Rule]:
    """The tower's tensors in llama.cpp's mmproj (clip) names -> parameters under ``dst`` ("" for a
    bare ``VisionTower``); the patch kernel through ``gguf_joins`` (its temporal slices stacked);
    stored layouts as in the HF checkpoint."""
    blk, heads = r"v\.blk\.(?P<i>\d+)", _head_order(cfg)
    d = f"{dst}." if dst else ""
    b = rf"{d}blocks.\g<i>"
    ffn = r"ffn_(?P<n>gate|up|down)"
    return [
        Rule(r"v\.patch_embd\.frames\.weight", f"{d}patch_embed"),
        Rule(r"v\.patch_embd\.bias", f"{d}patch_embed_bias"),
        Rule(rf"{blk}\.ln1\.weight", rf"{b}.norm1.weight"),
        Rule(rf"{blk}\.ln2\.weight", rf"{b}.norm2.weight"),
        Rule(rf"{blk}\.attn_qkv\.weight", rf"{b}.attn.qkv.kernel", Transform("matmul", heads)),
        Rule(rf"{blk}\.attn_qkv\.bias", rf"{b}.attn.qkv.bias", Transform(None, heads)),
        Rule(rf"{blk}\.attn_(?P<n>q|k)_norm\.weight", rf"{b}.attn.\g<n>_norm.weight"),
        Rule(rf"{blk}\.attn_out\.weight", rf"{b}.attn.proj.kernel", "matmul"),
        Rule(rf"{blk}\.attn_out\.bias", rf"{b}.attn.proj.bias"),
        Rule(rf"{blk}\.{ffn}\.weight", rf"{b}.mlp.\g<n>_proj.kernel", "matmul"),
        Rule(rf"{blk}\.{ffn}\.bias", rf"{b}.mlp.\g<n>_proj.bias"),
        Rule(r"v\.post_ln\.weight", f"{d}post_layernorm.weight"),
        Rule(r"mm\.patch_merger\.weight", f"{d}downsample"),
        Rule(r"mm\.patch_merger\.bias", f"{d}downsample_bias"),
        Rule(r"mm\.model\.fc\.weight", f"{d}merger.proj.kernel", "matmul"),
        Rule(r"mm\.post_norm\.(?P<n>weight|bias)", rf"{d}merger.post_projection_norm.\g<n>"),
        Rule(r"mm\.(?P<n>gate|up|down)\.weight", rf"{d}merger.mlp.\g<n>_proj.kernel", "matmul"),
    ]


def gguf_tensors(cfg: VisionConfig, cls: str = "vision") -> list[Tensor]:
    """The tower's tensor inventory (``zoo.models.shared.inventory``) in llama.cpp's mmproj names
    (the file's: the patch kernel as its T temporal slices ``[D, C, P, P]``), numpy-order shapes; the
    patch embedding and the downsample are convolutions the tower applies as matmuls from their stored
    layouts (dense: ``matmul=False``)."""
    d, o, hd, i_ = cfg.hidden_size, cfg.out_hidden_size, cfg.head_dim, cfg.intermediate_size
    c, p, m = cfg.in_channels, cfg.patch_size, cfg.spatial_merge_size
    bias = cfg.attention_bias
    out = [Tensor(name, (d, c, p, p), cls, False) for name in gguf_patch_parts(cfg)]
    out.append(Tensor("v.patch_embd.bias", (d,), cls, False))
    for n in range(cfg.depth):
        b = f"v.blk.{n}."
        out += [Tensor(b + "ln1.weight", (d,), cls, False), Tensor(b + "ln2.weight", (d,), cls, False),
                Tensor(b + "attn_qkv.weight", (3 * d, d), cls), Tensor(b + "attn_q_norm.weight", (hd,), cls, False),
                Tensor(b + "attn_k_norm.weight", (hd,), cls, False), Tensor(b + "attn_out.weight", (d, d), cls),
                Tensor(b + "ffn_gate.weight", (i_, d), cls), Tensor(b + "ffn_up.weight", (i_, d), cls),
                Tensor(b + "ffn_down.weight", (d, i_), cls)]
        if bias:
            out += [Tensor(b + "attn_qkv.bias", (3 * d,), cls, False), Tensor(b + "attn_out.bias", (d,), cls, False)]
            out += [Tensor(b + f"ffn_{x}.bias", (d if x == "down" else i_,), cls, False)
                    for x in ("gate", "up", "down")]
    pi = cfg.projection_intermediate_size
    return out + [
        Tensor("v.post_ln.weight", (d,), cls, False),
        Tensor("mm.patch_merger.weight", (o, d, m, m), cls, False), Tensor("mm.patch_merger.bias", (o,), cls, False),
        Tensor("mm.model.fc.weight", (o, o), cls),
        Tensor("mm.post_norm.weight", (o,), cls, False), Tensor("mm.post_norm.bias", (o,), cls, False),
        Tensor("mm.gate.weight", (pi, o), cls), Tensor("mm.up.weight", (pi, o), cls),
        Tensor("mm.down.weight", (o, pi), cls)]


def abstract_vision_tower(cfg: VisionConfig, dtype=jnp.bfloat16) -> VisionTower:
    """The tower built abstractly (shapes only), to be filled from a checkpoint."""
    return nnx.eval_shape(lambda: VisionTower(cfg, dtype=dtype))
