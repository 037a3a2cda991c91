"""Prompts with images in the engine (``zoo.engine.generator``), in a fixed set of programs.

A request's prompt holds, for each of its images (``Request.images``, ``ImageInput``) in order, a run
of exactly ``n_tokens`` placeholder ids (``config.image_token_id``); the model takes the vision tower's
rows there (the ``multimodal`` part of the architecture's row, ``zoo.models.architectures``:
``prepare`` gives the gather index, the image mask and, where the text model's rotary has several
axes, the absolute positions of the whole prompt).

    image_buckets(max_image_tokens) -> (rows, ...)   the tower's padded sizes, in merged rows
    check_images(model, prompt, images, limit)   ValueError: text-only model, runs not matching, an
                                                 image of more rows than ``limit``
    cache_tokens(prompt, images, token_id)       the prefix cache's key of the prompt
    ImagePrefill(model, graphdef, mesh, max_image_tokens)
        .start(state, req, start) -> PromptImages    the tower once per image still to prefill
        .piece(p, a, e, width) -> MMInputs           one prefill piece's rows / mask / positions
        .warmup(state, widths, prefill, timed)       every program above run once (``warmup_names``)

Programs (shapes fixed when the generator is made, so ``Generator.warmup`` compiles them all):

- the tower, one program per bucket: an image of r merged rows runs at the smallest bucket b >= r
  (``image_buckets``: 256 * 2^i up to ``max_image_tokens``, which is the last bucket itself when it
  is not of that form, the only one below 256), its patches zero-padded to b * m^2 rows with the
  tower's ``PatchGeometry`` (``model.image_geometry``, ``model.encode_images_padded``: attention
  masked to each frame, padding to itself); the program pads its output to the largest bucket, so
  every image's encoding is ``[max_rows, D]``;
- placing rows, one program per prefill width w: a piece's rows start from a cached zero ``[1, w, D]``
  and each image with placeholders in the piece is put in with ``where(sel, take(encoding, row),
  rows)``;
- the prefill with ``mm=MMInputs`` at each width (``Generator.program_set`` lists it).

Prefix cache: the key replaces each placeholder by a negative id (never a real token) derived from
its image's content key, grid and index in the run, so two prompts with the same ids but other
images never share a cached prefix; a prefix ending inside a run restores the state and the rest of
the run takes the tower's rows (positions are absolute, so a piece may start anywhere). The tower
runs only for images with placeholders after the cached prefix (none: skipped).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo.engine.flat_state import as_state
from zoo.engine.request import ImageInput
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


def image_buckets(max_image_tokens: int) -> tuple[int, ...]:
    """The tower's padded sizes in merged rows: 256, 512, 1024, ... up to ``max_image_tokens``, and
    ``max_image_tokens`` itself last when it is not one of them (below 256: the only one)."""
    cap = int(max_image_tokens)
    if cap < 1:
        raise ValueError(f"max_image_tokens must be >= 1, got {max_image_tokens}")
    out, b = [], 256
    while b <= cap:
        out.append(b)
        b *= 2
    return tuple(out) if out and out[-1] == cap else tuple(out) + (cap,)


def check_images(model, prompt: Sequence[int], images: Sequence, max_image_tokens: int | None = None) -> None:
    """``ValueError`` unless ``model`` has a vision tower, ``prompt``'s placeholder runs match ``images``
    and no image has more merged rows than ``max_image_tokens`` (None: no limit)."""
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
        if max_image_tokens is not None and rows > max_image_tokens:
            raise ValueError(f"image {i}: its grid {tuple(im.grid)} makes {rows} image tokens, more than this "
                             f"engine's limit of {max_image_tokens} per image (max_image_tokens)")
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
    """One prompt's image inputs: per image its encoding ``[max_rows, D]`` (device; None for an image
    wholly inside the cached prefix: the tower did not run) and, per prompt token, ``image`` (the
    number of the image whose placeholder it is, -1 for text), ``row`` (its row in that encoding, 0
    for text) and ``positions [3, n]`` (None: 1-D positions)."""

    encoded: tuple
    image: np.ndarray
    row: np.ndarray
    positions: np.ndarray | None


class _Warm(NamedTuple):
    """What ``ImagePrefill.start`` reads of a request (warmup's made-up one)."""

    prompt: list
    images: tuple


class ImagePrefill:
    """The device side of prompts with images for one generator (``graphdef``: the model's; see
    the module docstring for its programs)."""

    def __init__(self, model, graphdef, mesh=None, max_image_tokens: int = 1024):
        self.mm = multimodal(model)
        self.cfg = model.config
        self.module = model.module
        self.dtype = model.module.dtype
        self.graphdef = graphdef
        self.buckets = image_buckets(max_image_tokens)
        self.max_rows = self.buckets[-1]
        self.merge = self.cfg.vision.spatial_merge_size
        self._tower = on_mesh(jax.jit(self._tower_impl), mesh)                 # one program per bucket
        self._place = on_mesh(jax.jit(place_rows), mesh)                       # one program per width
        self._zeros: dict[int, jax.Array] = {}                                 # width -> [1, w, D]
        m = self.merge
        probe = _Warm([self.cfg.image_token_id], (_image(1, (1, m, m), self.cfg.vision.patch_dim),))
        self.positions = prepare(self.mm, self.cfg, probe.prompt, probe.images).positions is not None

    def _tower_impl(self, state, patches, geometry):
        rows = nnx.merge(self.graphdef, as_state(state)).encode_images_padded(patches, geometry)
        return jnp.pad(rows, ((0, self.max_rows - rows.shape[0]), (0, 0)))

    def bucket(self, rows: int) -> int:
        """The smallest bucket holding ``rows`` merged rows (``ValueError`` past the largest)."""
        for b in self.buckets:
            if rows <= b:
                return b
        raise ValueError(f"an image of {rows} image tokens is more than the limit of {self.max_rows} per image "
                         f"(max_image_tokens)")

    def encode(self, state, image) -> jax.Array:
        """One ``ImageInput``'s rows, ``[max_rows, D]`` (its own first: t*h*w / m^2), by the tower's
        program of its bucket."""
        grid = tuple(int(v) for v in image.grid)
        n = self.bucket(int(np.prod(grid)) // self.merge ** 2) * self.merge ** 2
        patches = np.zeros((n, self.cfg.vision.patch_dim), np.float32)
        patches[:int(np.prod(grid))] = image.patches
        return self._tower(state, patches, self.module.image_geometry((grid,), n))

    def start(self, state, req, start: int = 0) -> PromptImages:
        """``req``'s image inputs; the tower runs once for each image with a placeholder at or after
        prompt token ``start`` (the cached prefix's end)."""
        batch = prepare(self.mm, self.cfg, req.prompt, req.images)
        lengths = [int(np.prod(im.grid)) // self.merge ** 2 for im in req.images]
        offsets = np.cumsum([0] + lengths)
        index, is_image = np.asarray(batch.index)[0], np.asarray(batch.is_image)[0]
        image = np.where(is_image, np.searchsorted(offsets, index, side="right") - 1, -1).astype(np.int32)
        row = np.where(is_image, index - offsets[np.maximum(image, 0)], 0).astype(np.int32)
        wanted = set(image[start:][image[start:] >= 0].tolist())
        encoded = tuple(self.encode(state, im) if i in wanted else None for i, im in enumerate(req.images))
        positions = None if batch.positions is None else np.asarray(batch.positions)[:, 0]
        return PromptImages(encoded, image, row, positions)

    def _zero_rows(self, width: int) -> jax.Array:
        """The cached zero rows ``[1, width, D]`` a piece starts from: an output of the placing program
        itself, so that a piece without images hands the prefill the same kind of array as one with."""
        if width not in self._zeros:
            zeros = np.zeros((1, width, self.cfg.hidden_size), self.dtype)
            nothing = np.zeros((1, width), bool)
            self._zeros[width] = self._place(zeros, np.zeros((self.max_rows, self.cfg.hidden_size), self.dtype),
                                             nothing, nothing.astype(np.int32))
        return self._zeros[width]

    def piece(self, p: PromptImages, a: int, e: int, width: int):
        """``MMInputs`` of prompt tokens ``a .. e-1`` right-padded to ``width``: rows ``[1, width, D]``
        (device), is_image ``[1, width]`` bool and positions ``[3, 1, width]`` int32 or None (numpy)."""
        rows = self._zero_rows(width)
        image = p.image[a:e]
        for i in np.unique(image[image >= 0]).tolist():
            if p.encoded[i] is None:
                raise RuntimeError(f"image {i} has placeholders at or after token {a} but was not encoded")
            sel = np.zeros((1, width), bool)
            idx = np.zeros((1, width), np.int32)
            sel[0, :e - a] = image == i
            idx[0, :e - a] = np.where(image == i, p.row[a:e], 0)
            rows = self._place(rows, p.encoded[i], sel, idx)
        is_image = np.zeros((1, width), bool)
        is_image[0, :e - a] = image >= 0
        positions = None
        if p.positions is not None:
            positions = np.zeros((3, 1, width), np.int32)
            positions[:, 0, :e - a] = p.positions[:, a:e]
            positions[:, 0, e - a:] = p.positions[:, e - 1:e]      # padding: the last real position
        return MMInputs(rows, is_image, positions)          # host arrays, as the piece's ids and mask

    def abstract_inputs(self, width: int, struct) -> MMInputs:
        """The ``MMInputs`` of a piece of ``width`` as abstract values, ``struct(shape, dtype)`` each
        (what ``piece`` gives the prefill)."""
        return MMInputs(struct((1, width, self.cfg.hidden_size), self.dtype), struct((1, width), jnp.bool_),
                        struct((3, 1, width), jnp.int32) if self.positions else None)

    def warmup_names(self, widths: Sequence[int]) -> list[str]:
        """The stages ``warmup`` runs, in order."""
        return ([f"image tower rows={b}" for b in self.buckets]
                + [n for w in widths for n in (f"image rows width={w}", f"prefill width={w} with images")])

    def warmup(self, state, widths: Sequence[int], prefill, timed) -> None:
        """Run every image program once through the calls requests make: the tower at each bucket
        (an image filling it), then at each prefill width the placing program and the prefill with
        image inputs (``prefill(prompt, width, mm)`` runs one piece of ``prompt`` into a fresh row;
        ``timed(name, fn)`` runs and records ``fn``)."""
        m, dim = self.merge, self.cfg.vision.patch_dim
        for b in self.buckets:
            timed(f"image tower rows={b}", lambda b=b: self.encode(state, _image(b, (1, m, m * b), dim)))
        warm = _Warm([self.cfg.image_token_id], (_image(1, (1, m, m), dim),))
        images = self.start(state, warm)
        for w in widths:
            mm = timed(f"image rows width={w}", lambda w=w: self.piece(images, 0, 1, w))
            timed(f"prefill width={w} with images", lambda w=w, mm=mm: prefill(np.asarray(warm.prompt, np.int32),
                                                                              w, mm))


def place_rows(rows, encoded, sel, idx):
    """``rows [1, w, D]`` with the positions ``sel [1, w]`` taking ``encoded[idx]`` (``encoded [R, D]``,
    ``idx [1, w]`` int32): one image's rows put into a prefill piece."""
    return jnp.where(sel[..., None], jnp.take(encoded, idx, axis=0).astype(rows.dtype), rows)


def _image(rows: int, grid: tuple[int, int, int], patch_dim: int):
    """A zero image of ``grid`` (``rows`` merged rows) for warmup and probes."""
    return ImageInput("0" * 64, np.zeros((int(np.prod(grid)), patch_dim), np.float32), grid, rows)
