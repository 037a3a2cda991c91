"""Qwen3.8 multimodal inputs: image rows in the prompt and the 3-axis (M-RoPE) positions.

A prompt holds each image as ``<|vision_start|> <|image_pad|> x n <|vision_end|>`` (n = t*h*w / m^2,
``vision.merged_lengths``). The forward takes, besides ``ids`` and ``mask``, an ``MMInputs``:

    MMInputs(rows [B, T, D]       the tower's merged rows at the image tokens (anything elsewhere)
             is_image [B, T]      bool: the token takes its row instead of its embedding
             positions [3, B, T]  int32 absolute (t, h, w) rotary positions, or None (1-D positions))

so ``x = where(is_image, rows, embed(ids))`` (HF's ``masked_scatter`` of the image features into
``inputs_embeds``), and the full-attention layers rotate by ``positions`` (HF ``get_rope_index``).
The cache's next position per row becomes max(position over the row's real tokens) + 1 (HF's
``rope_deltas``): decoding continues from there with no extra state.

Host side (numpy, per prompt):

    rope_index(ids [T], grids, cfg) -> int64 [3, T]       HF ``get_rope_index`` of one row, from 0
    prepare(ids [B, T], images, cfg, mask) -> MMBatch     patches, grid, gather index, positions
Device side:

    mm_inputs(model, batch) -> MMInputs                   the tower run once on every image
    gather_rows(encoded [N_rows, D], batch) -> MMInputs

Usage (a full forward / prefill)::

    batch = prepare(ids, [[(patches, (1, h, w)), ...], ...], model.config, mask)
    logits, hidden, cache = model(ids, mask, cache, mm=mm_inputs(model, batch))
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from zoo.models.qwen38.vision import as_grid
from zoo.models.shared.vision import MMBatch, MMInputs, gather_rows, mm_inputs  # noqa: F401  (this module's API)

TEXT, IMAGE, VIDEO = 0, 1, 2


def token_types(ids: np.ndarray, cfg) -> np.ndarray:
    """int [..] per token: 0 text, 1 image placeholder, 2 video placeholder (HF ``mm_token_type_ids``)."""
    ids = np.asarray(ids)
    return np.where(ids == cfg.image_token_id, IMAGE, np.where(ids == cfg.video_token_id, VIDEO, TEXT))


def _groups(types: np.ndarray) -> list[tuple[int, int, int]]:
    """``(type, start, end)`` of each run of equal token types."""
    out, start = [], 0
    for kind, run in itertools.groupby(types.tolist()):
        n = len(list(run))
        out.append((kind, start, start + n))
        start += n
    return out


def rope_index(ids: np.ndarray, grids: Sequence, cfg, video_grids: Sequence = ()) -> np.ndarray:
    """int64 ``[3, T]``: the (t, h, w) rotary positions of one prompt ``ids [T]`` (real tokens only,
    starting at 0), a numpy port of HF ``Qwen3_5Model.get_rope_index``.

    ``grids``: the (t, h, w) patch grid of each image, in prompt order; ``video_grids`` the same for
    videos (each frame is its own group, as HF splits them). A text run of n tokens takes n
    consecutive equal positions on all three axes; an image run starting at p takes
    ``(p + t', p + i, p + j)`` over its merged grid (t', i, j) and moves p on by max(h, w) / m.
    Raises ``ValueError`` when the runs of placeholders do not match the grids.
    """
    m = cfg.vision.spatial_merge_size if cfg.vision is not None else 2
    ids = np.asarray(ids).reshape(-1)
    frames = [(1, h, w) for t, h, w in as_grid(video_grids, m) for _ in range(t)] if len(video_grids) else []
    pending = {IMAGE: iter(as_grid(grids, m) if len(grids) else ()), VIDEO: iter(frames)}
    parts, pos = [], 0
    for kind, start, end in _groups(token_types(ids, cfg)):
        if kind == TEXT:
            parts.append(np.broadcast_to(np.arange(pos, pos + end - start), (3, end - start)))
            pos += end - start
            continue
        grid = next(pending[kind], None)
        if grid is None:
            raise ValueError(f"tokens {start}..{end - 1} are {'image' if kind == IMAGE else 'video'} placeholders "
                             f"beyond the {len(grids) if kind == IMAGE else len(frames)} grid(s) given")
        t, h, w = grid[0], grid[1] // m, grid[2] // m
        if end - start != t * h * w:
            raise ValueError(f"tokens {start}..{end - 1}: {end - start} placeholders for grid {grid}, "
                             f"which has {t * h * w} merged rows")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        parts.append(np.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(h, w)
    for kind, left in pending.items():
        if next(left, None) is not None:
            raise ValueError(f"more {'image' if kind == IMAGE else 'video'} grids than placeholder runs in the prompt")
    if not parts:
        return np.zeros((3, 0), np.int64)
    return np.concatenate(parts, axis=1).astype(np.int64)


def prepare(ids: np.ndarray, images: Sequence[Sequence[tuple[np.ndarray, tuple[int, int, int]]]], cfg,
            mask: np.ndarray | None = None) -> MMBatch:
    """The host side of a batch: ``ids [B, T]`` (int), ``images[b]`` the ``(patches [t*h*w, C*T*P*P],
    (t, h, w))`` of row b's images in prompt order (HF ``Qwen2VLImageProcessor`` rows,
    ``zoo.images.preprocess``), ``mask [B, T]`` (1 = token, 0 = padding; default all tokens).

    Checks that each row's placeholder runs match its images (``rope_index``); see ``MMBatch``."""
    if cfg.vision is None:
        raise ValueError("this model has no vision tower (config.vision is None)")
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"ids must be [B, T], got shape {ids.shape}")
    b, t = ids.shape
    mask = np.ones((b, t), bool) if mask is None else np.asarray(mask).astype(bool)
    if mask.shape != ids.shape or len(images) != b:
        raise ValueError(f"ids {ids.shape}, mask {mask.shape} and {len(images)} image lists do not agree")
    m, pd = cfg.vision.spatial_merge_size, cfg.vision.patch_dim
    positions = np.zeros((3, b, t), np.int64)
    index = np.zeros((b, t), np.int32)
    is_image = (token_types(ids, cfg) == IMAGE) & mask
    next_pos = np.zeros((b,), np.int64)
    patches, grid, offset = [], [], 0
    for row in range(b):
        row_grids = [tuple(int(v) for v in g) for _, g in images[row]]
        pos = rope_index(ids[row][mask[row]], row_grids, cfg)
        positions[:, row, mask[row]] = pos
        next_pos[row] = pos.max() + 1 if pos.size else 0
        n_rows = int(is_image[row].sum())
        index[row, is_image[row]] = offset + np.arange(n_rows)
        offset += n_rows
        for p, g in images[row]:
            p = np.asarray(p, np.float32)
            if p.shape != (int(np.prod(g)), pd):
                raise ValueError(f"row {row}: patches {p.shape} for grid {tuple(g)}; "
                                 f"expected ({int(np.prod(g))}, {pd})")
            patches.append(p)
            grid.append(tuple(int(v) for v in g))
    if not grid:
        raise ValueError("no image in the batch")
    return MMBatch(np.concatenate(patches), as_grid(grid, m), index, is_image,
                   positions.astype(np.int32), next_pos.astype(np.int32))


def text_positions(mask: np.ndarray) -> np.ndarray:
    """int32 ``[3, B, T]``: the 1-D positions of text-only rows on all three axes (what the forward
    computes itself without ``positions``; padding takes its predecessor's position)."""
    mask = np.asarray(mask).astype(bool)
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return np.broadcast_to(pos, (3, *pos.shape)).copy()
