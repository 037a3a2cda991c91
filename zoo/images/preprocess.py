"""Image -> vision-tower inputs, with the semantics of the Hugging Face image processors (PIL backend).

``preprocess(image, spec)`` -> ``Processed``:

- ``pixel_values``: float32 ``[N, C * T * P * P]``, N = grid_h * grid_w patches, C = 3, T = the
  temporal patch size (one image is repeated to T frames), P = the patch size. Rows are in HF's
  order: merge windows (``merge_size`` x ``merge_size`` patches) in raster order, the patches of a
  window in raster order; within a row the layout is (C, T, P, P).
- ``grid_thw``: ``(1, grid_h, grid_w)`` with grid_h = resized height / P (a multiple of merge_size).
- ``n_tokens``: the placeholder tokens the image becomes in the prompt, t * h * w // merge_size**2.

The steps: ``to_rgb`` (HF's ``convert_to_rgb``); resize with Pillow (bicubic by default) to
``smart_resize``'s size; rescale (x * 1/255 in float64, then float32); normalize ((x - mean) / std
in float32); patchify. Rescale and normalize go through a 256-entry table per channel computed with
exactly HF's float operations, so the values are bit-identical to HF's and no float64 image is made.

The two families' resize rules (both round to multiples of factor = patch_size * merge_size):

- ``qwen3_5`` (HF ``Qwen2VLImageProcessorPil``, which ``AutoImageProcessor`` maps ``qwen3_5`` to):
  round each side to the nearest multiple, then scale down/up (keeping the aspect ratio) until
  min_pixels <= h * w <= max_pixels; the image is stretched to that size. Aspect ratios > 200 are
  refused (``ImageError``), as HF refuses them.
- ``glm5_next`` (HF ``Glm5NextImageProcessorPil``): the budget is in tokens (min/max_image_tokens;
  here min/max_pixels = tokens * factor**2). The canvas is each side rounded UP to a multiple; too
  small -> scaled up, too big -> the largest canvas within budget (binary search). The image is
  resized (never up when it has >= min_pixels) to fit the canvas keeping its aspect ratio, placed
  top-left, and the rest padded with black (0, before rescale/normalize).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import numpy as np
from PIL import Image

from zoo.images.decode import ImageError, to_rgb

FAMILIES = ("qwen3_5", "glm5_next")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)             # OPENAI_CLIP_MEAN / _STD in transformers
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = int(Image.Resampling.BICUBIC)
QWEN_MAX_ASPECT_RATIO = 200
# (before, placeholder, after): the chat template writes before + placeholder + after per image and
# the HF processor repeats the placeholder n_tokens times.
PLACEHOLDER_TOKENS = {
    "qwen3_5": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "glm5_next": ("<|begin_of_image|>", "<|image|>", "<|end_of_image|>"),
}


@dataclass(frozen=True)
class ImageSpec:
    """How one model family turns an image into patches. Build it with ``ImageSpec.qwen3_5()``,
    ``ImageSpec.glm5_next()`` (HF's class defaults) or ``from_hf_preprocessor_config``.

    min_pixels / max_pixels bound height * width of the resized canvas (for glm5_next they are
    min/max_image_tokens * factor**2). ``resample`` is a Pillow filter code (3: bicubic).
    ``rescale_factor`` 1.0 and mean 0 / std 1 express HF's do_rescale / do_normalize = False.
    """

    family: str
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resample: int = BICUBIC
    rescale_factor: float = 1 / 255

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown image family {self.family!r}; known: {', '.join(FAMILIES)}")
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")
        if self.family == "glm5_next" and self.max_pixels < self.factor ** 2:
            raise ValueError(f"max_pixels {self.max_pixels} is below one merged patch ({self.factor ** 2} pixels)")
        for name in ("mean", "std"):
            value = getattr(self, name)
            value = (value,) * 3 if isinstance(value, numbers.Real) else tuple(value)
            if len(value) != 3 or not all(isinstance(v, numbers.Real) and math.isfinite(v) for v in value):
                raise ValueError(f"{name} must be 3 finite numbers (R, G, B), got {getattr(self, name)!r}")
            object.__setattr__(self, name, tuple(float(v) for v in value))
        if 0.0 in self.std:
            raise ValueError(f"std must be non-zero, got {self.std}")
        if int(self.resample) not in {int(r) for r in Image.Resampling}:
            raise ValueError(f"resample must be a Pillow resampling filter code, got {self.resample!r}")
        object.__setattr__(self, "resample", int(self.resample))
        if not (isinstance(self.rescale_factor, numbers.Real) and self.rescale_factor > 0):
            raise ValueError(f"rescale_factor must be a positive number, got {self.rescale_factor!r}")
        object.__setattr__(self, "rescale_factor", float(self.rescale_factor))

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: patch_size * merge_size."""
        return self.patch_size * self.merge_size

    @property
    def image_token(self) -> str:
        """The placeholder token repeated n_tokens times ("<|image_pad|>" / "<|image|>")."""
        return PLACEHOLDER_TOKENS[self.family][1]

    def placeholder(self, n_tokens: int) -> str:
        """The prompt text for one image: before + image_token * n_tokens + after."""
        before, token, after = PLACEHOLDER_TOKENS[self.family]
        return before + token * n_tokens + after

    @classmethod
    def qwen3_5(cls, *, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280, patch_size: int = 14,
                temporal_patch_size: int = 2, merge_size: int = 2, mean=CLIP_MEAN, std=CLIP_STD,
                resample: int = BICUBIC, rescale_factor: float = 1 / 255) -> ImageSpec:
        """The defaults of HF's ``Qwen2VLImageProcessorPil`` class. A real Qwen3.5/3-VL checkpoint's
        preprocessor_config.json overrides them (patch_size 16, mean = std = 0.5, other pixel
        bounds): read it with ``from_hf_preprocessor_config``."""
        return cls("qwen3_5", patch_size, temporal_patch_size, merge_size, min_pixels, max_pixels, mean, std,
                   resample, rescale_factor)

    @classmethod
    def glm5_next(cls, *, min_image_tokens: int = 16, max_image_tokens: int = 8000, patch_size: int = 14,
                  temporal_patch_size: int = 2, merge_size: int = 2, mean=CLIP_MEAN, std=CLIP_STD,
                  resample: int = BICUBIC, rescale_factor: float = 1 / 255) -> ImageSpec:
        """The defaults of HF's ``Glm5NextImageProcessorPil`` class; the budget is in tokens."""
        area = (patch_size * merge_size) ** 2
        return cls("glm5_next", patch_size, temporal_patch_size, merge_size, min_image_tokens * area,
                   max_image_tokens * area, mean, std, resample, rescale_factor)

    @classmethod
    def from_hf_preprocessor_config(cls, d: dict, family: str) -> ImageSpec:
        """A checkpoint's ``preprocessor_config.json`` (as a dict) -> its spec, read as HF reads it.

        Keys read: patch_size, temporal_patch_size, merge_size, image_mean, image_std, resample,
        rescale_factor, do_rescale, do_normalize; qwen3_5: min_pixels / max_pixels, else
        size.shortest_edge / size.longest_edge (or size.min_pixels / size.max_pixels);
        glm5_next: min_image_tokens / max_image_tokens (HF ignores its ``size``). Missing keys take
        the class defaults; other keys are ignored. Raises ValueError for settings this module does
        not implement (do_resize or do_convert_rgb false, glm5_next patch_expand_factor != 1).
        """
        if family not in FAMILIES:
            raise ValueError(f"unknown image family {family!r}; known: {', '.join(FAMILIES)}")
        for flag in ("do_resize", "do_convert_rgb"):
            if d.get(flag) is False:
                raise ValueError(f"preprocessor_config {flag}=false is not supported")
        kw = {name: d[key] for key, name in (("patch_size", "patch_size"), ("temporal_patch_size",
              "temporal_patch_size"), ("merge_size", "merge_size"), ("image_mean", "mean"), ("image_std", "std"),
              ("resample", "resample"), ("rescale_factor", "rescale_factor")) if d.get(key) is not None}
        if d.get("do_rescale") is False:
            kw["rescale_factor"] = 1.0
        if d.get("do_normalize") is False:
            kw["mean"], kw["std"] = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        if family == "glm5_next":
            if d.get("patch_expand_factor", 1) not in (1, None):
                raise ValueError(f"glm5_next patch_expand_factor={d['patch_expand_factor']} is not supported")
            for key in ("min_image_tokens", "max_image_tokens"):
                if d.get(key) is not None:
                    kw[key] = d[key]
            return cls.glm5_next(**kw)
        size = d.get("size") or {}
        for name, keys in (("min_pixels", ("shortest_edge", "min_pixels")), ("max_pixels", ("longest_edge",
                                                                                              "max_pixels"))):
            value = d.get(name)
            for key in keys:
                value = size.get(key) if value is None else value
            if value is not None:
                kw[name] = value
        return cls.qwen3_5(**kw)


@dataclass(frozen=True)
class Processed:
    """One preprocessed image: ``pixel_values`` float32 [N, 3 * T * P * P] (N = h * w of the grid),
    ``grid_thw`` (1, h, w) in patches, ``n_tokens`` = t * h * w // merge_size**2 placeholder tokens,
    ``resized`` the (height, width) canvas in pixels."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    n_tokens: int
    resized: tuple[int, int]


def smart_resize(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """(height, width) of an image -> (height, width) of its canvas, both multiples of spec.factor,
    by the family's rule (module docstring). Raises ``ImageError`` for a qwen3_5 aspect ratio > 200."""
    if height < 1 or width < 1:
        raise ImageError(f"cannot preprocess an image of size {width}x{height}")
    if spec.family == "qwen3_5":
        return _qwen_smart_resize(height, width, spec.factor, spec.min_pixels, spec.max_pixels)
    t = spec.temporal_patch_size
    return _glm_smart_resize(t, height, width, t, spec.factor, spec.min_pixels * t, spec.max_pixels * t)


def _qwen_smart_resize(height, width, factor, min_pixels, max_pixels):
    """transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.smart_resize, the same float ops."""
    if max(height, width) / min(height, width) > QWEN_MAX_ASPECT_RATIO:
        raise ImageError(f"the image's aspect ratio {max(height, width) / min(height, width):.1f} is above "
                         f"{QWEN_MAX_ASPECT_RATIO}, the most this model accepts ({width}x{height})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _glm_smart_resize(num_frames, height, width, temporal_factor, factor, min_total, max_total):
    """transformers.models.glm5_next.image_processing_pil_glm5_next.smart_resize, with its budgets
    already multiplied out (min_total = min_image_tokens * temporal_factor * factor**2)."""
    def align(value):
        return math.ceil(value / factor) * factor

    frames = max(temporal_factor, round(num_frames / temporal_factor) * temporal_factor)
    aligned_h, aligned_w = align(height), align(width)
    if frames * aligned_h * aligned_w < min_total:
        scale = math.sqrt(min_total / (num_frames * height * width))
        aligned_h = align(max(1, math.ceil(height * scale)))
        aligned_w = align(max(1, math.ceil(width * scale)))
    if frames * aligned_h * aligned_w > max_total:
        low, high = 1, height                                # binary search: the tallest content that fits
        aligned_h, aligned_w = factor, factor
        while low <= high:
            content_h = (low + high) // 2
            content_w = max(1, math.floor(width * content_h / height))
            if frames * align(content_h) * align(content_w) <= max_total:
                aligned_h, aligned_w = align(content_h), align(content_w)
                low = content_h + 1
            else:
                high = content_h - 1
    return aligned_h, aligned_w


def _glm_content_size(height, width, canvas_h, canvas_w, spec):
    """The size the image is resized to inside its glm5_next canvas (HF ``resize``'s scale rule)."""
    scale = min(canvas_h / height, canvas_w / width)
    if height * width >= spec.min_pixels:                    # HF: T*h*w >= T*factor**2 * min_image_tokens
        scale = min(1.0, scale)
    return max(1, min(canvas_h, math.floor(height * scale))), max(1, min(canvas_w, math.floor(width * scale)))


def grid_thw(height: int, width: int, spec: ImageSpec) -> tuple[int, int, int]:
    """The patch grid (1, h, w) an image of this size becomes, without touching pixels."""
    canvas_h, canvas_w = smart_resize(height, width, spec)
    return 1, canvas_h // spec.patch_size, canvas_w // spec.patch_size


def count_tokens(height: int, width: int, spec: ImageSpec) -> int:
    """The placeholder tokens an image of this size becomes: t * h * w // merge_size**2."""
    t, h, w = grid_thw(height, width, spec)
    return t * h * w // spec.merge_size ** 2


def preprocess(image: Image.Image, spec: ImageSpec) -> Processed:
    """A Pillow image (any mode; see ``to_rgb``) -> ``Processed`` (module docstring for the layout)."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"preprocess takes a PIL.Image.Image, got {type(image).__name__}")
    rgb = to_rgb(image)
    width, height = rgb.size
    canvas_h, canvas_w = smart_resize(height, width, spec)
    if spec.family == "qwen3_5":
        pixels = np.asarray(rgb.resize((canvas_w, canvas_h), resample=spec.resample))
    else:
        content_h, content_w = _glm_content_size(height, width, canvas_h, canvas_w, spec)
        if (content_h, content_w) != (height, width):
            rgb = rgb.resize((content_w, content_h), resample=spec.resample)
        pixels = np.zeros((canvas_h, canvas_w, 3), np.uint8)
        pixels[:content_h, :content_w] = np.asarray(rgb)
    pixel_values, grid = _patchify(pixels, spec)
    return Processed(pixel_values, grid, grid[0] * grid[1] * grid[2] // spec.merge_size ** 2, (canvas_h, canvas_w))


@functools.lru_cache(maxsize=16)
def _value_table(rescale_factor: float, mean: tuple, std: tuple) -> np.ndarray:
    """[3, 256] float32: channel c, byte v -> HF's rescale then normalize of v, the same float ops
    (``float32(float64(v) * rescale_factor)``, then ``(x - float32(mean)) / float32(std)``)."""
    scaled = (np.arange(256, dtype=np.float64) * rescale_factor).astype(np.float32)
    table = (scaled[None, :] - np.asarray(mean, np.float32)[:, None]) / np.asarray(std, np.float32)[:, None]
    table.flags.writeable = False
    return table


def _patchify(pixels: np.ndarray, spec: ImageSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """uint8 [H, W, 3] canvas -> (float32 [gh * gw, 3 * T * P * P], (1, gh, gw)) in HF's order."""
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    gh, gw = pixels.shape[0] // p, pixels.shape[1] // p
    # (bh, mh, ph, bw, mw, pw, C) -> (bh, bw, mh, mw, C, ph, pw): HF's (gh, gw, mh, mw, C, ph, pw)
    blocks = pixels.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    channel = np.arange(3).reshape(1, 1, 1, 1, 3, 1, 1)
    values = _value_table(spec.rescale_factor, spec.mean, spec.std)[channel, blocks]
    frames = np.broadcast_to(values[:, :, :, :, :, None], (*values.shape[:5], t, p, p))
    return np.ascontiguousarray(frames.reshape(gh * gw, 3 * t * p * p)), (1, gh, gw)
