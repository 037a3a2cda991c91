"""GLM-5.3 multimodal inputs: the vision tower's rows in place of the prompt's placeholder tokens.

A prompt holds each image as ``<|begin_of_image|> <|image|> x n <|end_of_image|>`` (n = t*h*w / m^2,
``vision.merged_lengths``); a video is ``<|begin_of_video|>`` ... ``<|end_of_video|>`` around one such
run per frame (plus its timestamp text). The forward takes, besides ``ids`` and ``mask``, an ``MMInputs``:

    MMInputs(rows [B, T, D]       the tower's merged rows at the placeholder tokens (anything elsewhere)
             is_image [B, T]      bool: the token takes its row instead of its embedding
             positions None       GLM's text model has no positional encoding: nothing multi-axis)

so ``x = where(is_image, rows, embed(ids))`` (transformers' ``masked_scatter`` in ``Glm5NextModel``),
before the hyper-connection streams are made.

Placeholders (transformers' ``Glm5NextModel.get_placeholder_mask``): every ``image_token_id``; one
inside a ``video_start_token_id`` ... ``video_end_token_id`` span is a video frame's, else an image's.
Row b's images fill its image placeholders in order, its videos (all frames of each, in order: the
tower's rows for grid (t, h, w) are those of ``((1, h, w),) * t``) its video placeholders.

Host side (numpy):

    placeholder_masks(ids [B, T], cfg) -> (image, video) bool [B, T]
    prepare(ids [B, T], images, cfg, mask, videos) -> MMBatch     patches, grid, gather index
Device side:

    mm_inputs(model, batch) -> MMInputs                   the tower run once on every image
    gather_rows(encoded [N_rows, D], batch) -> MMInputs

Usage (a full forward / prefill)::

    batch = prepare(ids, [[(patches, (1, h, w)), ...], ...], model.config, mask)
    logits, hidden, cache = model(ids, mask, cache, mm=mm_inputs(model, batch))
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from zoo.models.glm53.vision import as_grid, merged_lengths
from zoo.models.shared.vision import MMBatch, MMInputs, gather_rows, mm_inputs  # noqa: F401  (this module's API)


def placeholder_masks(ids: np.ndarray, cfg) -> tuple[np.ndarray, np.ndarray]:
    """``(image, video)`` bool masks of the placeholders in ``ids [..., T]`` (transformers' rule)."""
    ids = np.asarray(ids)
    placeholder = ids == cfg.image_token_id
    in_video = np.cumsum(ids == cfg.video_start_token_id, axis=-1) > np.cumsum(ids == cfg.video_end_token_id, axis=-1)
    return placeholder & ~in_video, placeholder & in_video


def prepare(ids: np.ndarray, images: Sequence[Sequence[tuple[np.ndarray, tuple[int, int, int]]]], cfg,
            mask: np.ndarray | None = None, videos: Sequence | None = None) -> MMBatch:
    """The host side of a batch: ``ids [B, T]`` (int), ``images[b]`` the ``(patches [t*h*w, C*T*P*P],
    (t, h, w))`` of row b's images in prompt order (the image processor's rows), ``videos[b]`` the
    same for its videos (default none), ``mask [B, T]`` (1 = token, 0 = padding; default all tokens).

    Raises ``ValueError`` unless each row's placeholders and its images' (videos') rows agree in number."""
    if cfg.vision is None:
        raise ValueError("this model has no vision tower (config.vision is None)")
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"ids must be [B, T], got shape {ids.shape}")
    b, t = ids.shape
    mask = np.ones((b, t), bool) if mask is None else np.asarray(mask).astype(bool)
    videos = [()] * b if videos is None else videos
    if mask.shape != ids.shape or len(images) != b or len(videos) != b:
        raise ValueError(f"ids {ids.shape}, mask {mask.shape}, {len(images)} image lists and {len(videos)} "
                         f"video lists do not agree")
    m, pd = cfg.vision.spatial_merge_size, cfg.vision.patch_dim
    image_mask, video_mask = (x & mask for x in placeholder_masks(ids, cfg))
    index = np.zeros((b, t), np.int32)
    patches, grid, offset = [], [], 0
    for row in range(b):
        for kind, items, where in (("image", images[row], image_mask[row]), ("video", videos[row], video_mask[row])):
            n_rows = 0
            for p, g in items or ():
                g = tuple(int(v) for v in g)
                p = np.asarray(p, np.float32)
                if p.shape != (int(np.prod(g)), pd):
                    raise ValueError(f"row {row}: {kind} patches {p.shape} for grid {g}; "
                                     f"expected ({int(np.prod(g))}, {pd})")
                patches.append(p)
                grid.append(g)
                n_rows += merged_lengths(as_grid((g,), m), m)[0]
            if n_rows != int(where.sum()):
                raise ValueError(f"row {row}: {int(where.sum())} {kind} placeholder tokens, "
                                 f"its {kind}s make {n_rows} rows")
            index[row, where] = offset + np.arange(n_rows)
            offset += n_rows
    if not grid:
        raise ValueError("no image in the batch")
    return MMBatch(np.concatenate(patches), as_grid(grid, m), index, image_mask | video_mask)
