"""Prompts with images in the engine (``zoo.engine.generator``).

A request's prompt holds, for each of its images (``Request.images``, ``ImageInput``) in order, a run
of exactly ``n_tokens`` placeholder ids (``config.image_token_id``); the model takes the vision tower's
rows there (the ``multimodal`` part of the architecture's row, ``zoo.models.architectures``:
``prepare`` gives the gather index, the image mask and, where the text model's rotary has several
axes, the absolute positions of the whole prompt).

    check_images(model, prompt, images)          ValueError: text-only model, runs not matching
    cache_tokens(prompt, images, token_id)       the prefix cache's key of the prompt
    ImagePrefill(model, graphdef, mesh)
        .start(state, req, start) -> PromptImages    the tower once per image (a program per grid)
        .piece(p, a, e, width) -> MMInputs           one prefill piece's rows / mask / positions

Prefix cache: the key replaces each placeholder by a negative id (never a real token) derived from
its image's content key, grid and index in the run, so two prompts with the same ids but other
images never share a cached prefix; a prefix ending inside a run restores the state and the rest of
the run takes the tower's rows (positions are absolute, so a piece may start anywhere). The tower is
skipped when the cached prefix covers every placeholder.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo.models.architectures import architecture
from zoo.models.shared.vision import MMInputs
from zoo.sharding.mesh import on_mesh


def multimodal(model):
    """The architecture's ``multimodal`` module (its host side: ``prepare``), or None when ``model``
    takes text only."""
    if getattr(model.config, "vision", None) is None or getattr(model.module, "visual", None) is None:
        return None
    return architecture(model.config.arch).part("multimodal")


def placeholder_runs(prompt: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each maximal run of ``token_id`` in ``prompt``."""
    runs, start = [], None
    for i, t in enumerate(list(prompt) + [None]):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i))
            start = None
    return runs


def check_images(model, prompt: Sequence[int], images: Sequence) -> None:
    """``ValueError`` unless ``model`` has a vision tower and ``prompt``'s placeholder runs match ``images``."""
    if not images:
        return
    mm = multimodal(model)
    if mm is None:
        raise ValueError(f"this model takes text only: the request has {len(images)} image(s) and the model "
                         f"has no vision tower")
    cfg = model.config
    merge, patch_dim = cfg.vision.spatial_merge_size, cfg.vision.patch_dim
    runs = placeholder_runs(prompt, cfg.image_token_id)
    if len(runs) != len(images):
        raise ValueError(f"the prompt has {len(runs)} run(s) of image placeholder tokens "
                         f"(id {cfg.image_token_id}) for {len(images)} image(s)")
    for i, ((a, e), im) in enumerate(zip(runs, images)):
        t, h, w = (int(v) for v in im.grid)
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise ValueError(f"image {i}: grid {tuple(im.grid)} is not a (t, h, w) grid of multiples of {merge}")
        rows = t * h * w // merge ** 2
        if im.n_tokens != rows or e - a != rows:
            raise ValueError(f"image {i}: its grid {tuple(im.grid)} makes {rows} rows, n_tokens is {im.n_tokens} "
                             f"and its placeholder run (tokens {a}..{e - 1}) has {e - a}")
        if tuple(np.shape(im.patches)) != (t * h * w, patch_dim):
            raise ValueError(f"image {i}: patches {tuple(np.shape(im.patches))} for grid {tuple(im.grid)}; "
                             f"expected ({t * h * w}, {patch_dim})")
    prepare(mm, model.config, prompt, images)      # the architecture's own rules (positions, video spans)


def prepare(mm, cfg, prompt: Sequence[int], images: Sequence):
    """The architecture's ``MMBatch`` of the single prompt row."""
    return mm.prepare(np.asarray(prompt, np.int64)[None], [[(im.patches, tuple(im.grid)) for im in images]], cfg)


def cache_tokens(prompt: Sequence[int], images: Sequence, token_id: int) -> list[int]:
    """``prompt`` with placeholder j of image i's run replaced by a negative id (-1 .. -2**31) derived
    from the image's key, grid and j: the prefix cache's key of a prompt with images."""
    out = [int(t) for t in prompt]
    for (a, e), im in zip(placeholder_runs(out, token_id), images):
        tag = f"{im.key}:{tuple(int(v) for v in im.grid)}:"
        for j in range(a, e):
            d = hashlib.blake2b((tag + str(j - a)).encode(), digest_size=4).digest()
            out[j] = -1 - (int.from_bytes(d, "little") & 0x7FFFFFFF)
    return out


class PromptImages(NamedTuple):
    """One prompt's image inputs: the tower's rows ``encoded [N, D]`` (device) and, per prompt
    token, ``index`` (its row), ``is_image`` and ``positions [3, n]`` (None: 1-D positions)."""

    encoded: jax.Array
    index: np.ndarray
    is_image: np.ndarray
    positions: np.ndarray | None


class ImagePrefill:
    """The device side of prompts with images for one generator (``graphdef``: the model's)."""

    def __init__(self, model, graphdef, mesh=None):
        self.mm = multimodal(model)
        self.cfg = model.config
        self.dtype = model.module.dtype
        self.graphdef = graphdef
        self._encode = on_mesh(jax.jit(self._encode_impl, static_argnums=(2,)), mesh)   # one program per grid
        self._gather = on_mesh(jax.jit(lambda enc, idx: jnp.take(enc, idx, axis=0)), mesh)

    def _encode_impl(self, state, patches, grid):
        return nnx.merge(self.graphdef, state).encode_images(patches, (grid,))

    def start(self, state, req, start: int = 0) -> PromptImages:
        """``req``'s image inputs; the tower runs (once per image) unless no placeholder is at or
        after prompt token ``start`` (the cached prefix's end)."""
        batch = prepare(self.mm, self.cfg, req.prompt, req.images)
        if batch.is_image[0, start:].any():
            encoded = jnp.concatenate([self._encode(state, jnp.asarray(im.patches, jnp.float32),
                                                    tuple(int(v) for v in im.grid)) for im in req.images])
        else:
            encoded = jnp.zeros((1, self.cfg.hidden_size), self.dtype)
        positions = None if batch.positions is None else np.asarray(batch.positions)[:, 0]
        return PromptImages(encoded, np.asarray(batch.index)[0], np.asarray(batch.is_image)[0], positions)

    def piece(self, p: PromptImages, a: int, e: int, width: int):
        """``MMInputs`` of prompt tokens ``a .. e-1`` right-padded to ``width``."""
        index = np.zeros((1, width), np.int32)
        is_image = np.zeros((1, width), bool)
        index[0, :e - a], is_image[0, :e - a] = p.index[a:e], p.is_image[a:e]
        positions = None
        if p.positions is not None:
            positions = np.zeros((3, 1, width), np.int32)
            positions[:, 0, :e - a] = p.positions[:, a:e]
            positions[:, 0, e - a:] = p.positions[:, e - 1:e]      # padding: the last real position
        return MMInputs(self._gather(p.encoded, index), jnp.asarray(is_image), positions)
