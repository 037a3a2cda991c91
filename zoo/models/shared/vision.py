"""What the two vision towers share: the inputs of a multimodal forward, and the patch kernel as
llama.cpp's mmproj files split it.

    MMInputs(rows [B, T, D], is_image bool [B, T], positions int32 [3, B, T] | None)
                        what ``model(ids, mask, cache, mm=...)`` takes besides ids and mask: the
                        input embedding is ``rows`` where ``is_image``; ``positions``: the multi-axis
                        rotary positions (Qwen3.8's M-RoPE), None for a text model without positions
    MMBatch             the host side of a batch of prompts with images (each architecture's
                        ``multimodal.prepare``): every image's patches in prompt order, their grids
                        (static under jit), the encoded row each placeholder takes, the image mask,
                        and the positions / next position per row where the text model has them
    gather_rows(encoded [N_rows, D], batch) -> MMInputs      rows placed at the placeholders
    mm_inputs(model, batch) -> MMInputs                      the tower run once on every image

    PatchGeometry(positions, segments, taps, tap_weights)
                        the host-side geometry of a tower's fixed-shape path (``encode_padded``):
                        per patch row, padded to a bucket's row count, everything the grid decides
    frame_ids(grid) -> int32 [N]         each patch's attention segment (its frame), in patch order
    pad_rows(a, n, fill) -> [n, ...]     ``a`` padded with ``fill`` rows to n rows

    PATCH_FRAMES, mmproj_patch_parts(t), mmproj_patch_joins(t)
                        llama.cpp's converter writes the Conv3d patch kernel [D, C, T, P, P] as T
                        Conv2d kernels (``v.patch_embd.weight``, ``v.patch_embd.weight.1``, ...):
                        their names, and the join that stacks them back on axis 2
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zoo.sources.names import Combiner, Join

Grid = tuple[tuple[int, int, int], ...]


class MMInputs(NamedTuple):
    """What a multimodal forward takes besides ids and mask (module docstring); a prefill piece
    slices every field on T."""

    rows: jax.Array
    is_image: jax.Array
    positions: jax.Array | None = None


class MMBatch(NamedTuple):
    """Host-side inputs of a batch of prompts with images (``prepare`` of an architecture).

    patches    float32 [N, C*T*P*P]  every image's patches, row by row, in prompt order
    grid       ((t, h, w), ...)      their grids, in the same order (static under jit)
    index      int32 [B, T]          the encoded row (of ``model.encode_images(patches, grid)``)
                                     each placeholder takes; 0 elsewhere
    is_image   bool [B, T]           the token is an image (or video) placeholder
    positions  int32 [3, B, T]       multi-axis rotary positions (0 at padding); None without them
    next_pos   int32 [B]             each row's next position (max position + 1); None without them
    """

    patches: np.ndarray
    grid: Grid
    index: np.ndarray
    is_image: np.ndarray
    positions: np.ndarray | None = None
    next_pos: np.ndarray | None = None


class PatchGeometry(NamedTuple):
    """What a grid decides in a vision tower, as per-patch arrays padded to a fixed row count n (a
    pytree of numpy arrays: a jitted ``encode_padded`` takes it as an ordinary argument, so every grid
    padded to the same n runs the same program).

    positions    int32 [n, 2]     the 2-D rotary (row, column) of each patch in its frame; 0 at padding
    segments     int32 [n]        the attention segment of each patch: one per frame (of each image), in
                                  patch order (0, 1, ...); -1 at padding, which so attends only to padding
    taps         int32 [n, 4]     (Qwen3.8) the learned position table's rows of each patch's bilinear
                                  interpolation; 0 at padding; None for a tower without the table
    tap_weights  float32 [n, 4]   (Qwen3.8) their weights; 0 at padding
    """

    positions: np.ndarray
    segments: np.ndarray
    taps: np.ndarray | None = None
    tap_weights: np.ndarray | None = None


def frame_ids(grid: Grid) -> np.ndarray:
    """int32 ``[sum t*h*w]``: each patch's frame number over all images of ``grid`` (HF's
    ``cu_seqlens`` segments: frame f of image i is one segment of h*w patches)."""
    sizes = [h * w for t, h, w in grid for _ in range(t)]
    return np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)


def pad_rows(a: np.ndarray, n: int, fill=0) -> np.ndarray:
    """``a [m, ...]`` followed by ``n - m`` rows of ``fill`` (same dtype); ``ValueError`` if m > n."""
    a = np.asarray(a)
    if a.shape[0] > n:
        raise ValueError(f"{a.shape[0]} patch rows do not fit in {n}")
    out = np.full((n,) + a.shape[1:], fill, a.dtype)
    out[:a.shape[0]] = a
    return out


def gather_rows(encoded: jax.Array, batch: MMBatch) -> MMInputs:
    """``MMInputs`` from the encoded rows ``[N_rows, D]`` (``model.encode_images``)."""
    rows = jnp.take(encoded, jnp.asarray(batch.index), axis=0)
    positions = None if batch.positions is None else jnp.asarray(batch.positions)
    return MMInputs(rows=rows, is_image=jnp.asarray(batch.is_image), positions=positions)


def mm_inputs(model, batch: MMBatch) -> MMInputs:
    """The tower run on every image of the batch, its rows placed at the placeholder tokens."""
    return gather_rows(model.encode_images(jnp.asarray(batch.patches), batch.grid), batch)


def _stack_frames(*parts: np.ndarray) -> np.ndarray:
    return np.stack(parts, axis=2)


def _stack_frames_shape(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    if any(len(s) != 4 or s != shapes[0] for s in shapes):
        raise ValueError(f"patch-embedding parts {shapes} are not equal [D, C, P, P] kernels")
    d, c, p, q = shapes[0]
    return (d, c, len(shapes), p, q)


PATCH_FRAMES = Combiner(_stack_frames, _stack_frames_shape)


def mmproj_patch_parts(temporal: int) -> tuple[str, ...]:
    """The mmproj names of the ``temporal`` slices of the patch kernel (the converter writes two)."""
    return ("v.patch_embd.weight",) + tuple(f"v.patch_embd.weight.{j}" for j in range(1, temporal))


def mmproj_patch_joins(temporal: int) -> tuple[Join, ...]:
    """The patch kernel's slices joined as ``v.patch_embd.frames.weight`` (``zoo.sources.views.joined``)."""
    return (Join(r"v\.patch_embd\.weight", mmproj_patch_parts(temporal), "v.patch_embd.frames.weight",
                 PATCH_FRAMES),)
