"""Images in requests: from an API's image part to the engine's ``ImageInput`` and prompt ids.

    ImagePolicy        the server's limits: images per request, bytes per image, decoded pixels (the
                       decompression-bomb guard), whether http(s) URLs are fetched (off by default),
                       the fetch's timeout and byte cap
    VisionInputs       per loaded model (``from_model``; None for a text-only model): its ``ImageSpec``
                       (``max_pixels`` capped so no image exceeds the engine's ``max_image_tokens``),
                       its image-pad token, ``prepare`` (bytes -> ``ImageInput``) and ``expand`` (one
                       pad id per image -> ``n_tokens`` pad ids)
    ImageParts         per request: each image part of any surface (``add_url``: OpenAI chat
                       ``image_url``, Responses ``input_image``; ``add_base64`` / ``add_url``:
                       Anthropic ``source``) becomes a unique sentinel inside the message text; after
                       the chat template rendered the messages, ``substitute`` turns each sentinel
                       into the model's placeholder text (one pad token) and gives the images in the
                       order the rendered prompt holds them (a template may reorder or drop turns)

The ImageSpec of a model: the image processor settings of the checkpoint directory
(``model.load_info["path"]``; ``processor_settings``: transformers 5's ``processor_config.json``,
whose ``"image_processor"`` entry holds them, else a flat ``preprocessor_config.json``), read by
``ImageSpec.from_hf_preprocessor_config``; an unreadable one is an error. Without either (a GGUF, or
a directory saved without its processor) the family's HF class defaults (pixel bounds, mean/std,
resampling) with the vision config's patch_size, temporal_patch_size and spatial_merge_size, and a
warning in the log saying so. The family is the ``image_family`` of ``config.arch``'s row of the architecture
table (``zoo.models.architectures``). ``from_model(model, policy, max_image_tokens)`` then caps the spec's
``max_pixels`` at ``max_image_tokens * factor**2`` (factor = patch * merge: one merged row's pixels, and
``min_pixels`` with it), so every image is resized to at most the engine's largest tower bucket
(``zoo.engine.image_prefill.image_buckets``).

Every refusal is an ``ApiError`` 400 naming the part (``messages[0].content[1]``) and the problem:
a text-only model ("this model takes text only"), too many images, an over-large, corrupt,
unsupported or bomb image (``zoo.images.ImageError``'s message), a URL when URLs are not allowed,
another URL scheme, a fetch that fails or is too large / slow, and a prompt whose count of image-pad
tokens differs from its images (the placeholder text written in a message's text).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from zoo.images import ImageError, ImageSpec, decode_image, image_key, parse_data_url, preprocess
from zoo.models.architectures import ARCHITECTURES
from zoo.server.image_fetch import fetch, fetch_failed
from zoo.server.validation import ApiError

log = logging.getLogger("zoo.serve")
MB = 1 << 20


@dataclass(frozen=True)
class ImagePolicy:
    """The server's image limits. ``max_url_bytes`` None: ``max_bytes``."""
    max_images: int = 8                    # per request
    max_bytes: int = 20 * MB               # per encoded image (data URL, base64 or fetched)
    max_pixels: int = 50_000_000           # declared width * height, checked before decoding
    allow_urls: bool = False               # fetch http(s) image URLs
    url_timeout_s: float = 10.0            # the whole fetch of one URL
    max_url_bytes: int | None = None
    allow_private_urls: bool = False       # also loopback, private, link-local... addresses (image_fetch)
    max_request_pixels: int = 64_000_000   # decoded pixels of all of one request's images

    def __post_init__(self):
        for name in ("max_images", "max_bytes", "max_pixels", "max_request_pixels"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.url_timeout_s > 0:
            raise ValueError(f"url_timeout_s must be > 0, got {self.url_timeout_s}")

    @property
    def url_cap(self) -> int:
        return self.max_url_bytes or self.max_bytes


def _image_input_class():
    """The engine's ``ImageInput`` (``zoo.engine.request``), imported when first needed."""
    from zoo.engine.request import ImageInput
    return ImageInput


def model_spec(model) -> ImageSpec:
    """The ``ImageSpec`` of a model with a vision tower (module docstring)."""
    cfg = model.config
    row = ARCHITECTURES.get(getattr(cfg, "arch", None) or "")
    if row is None or row.image_family is None:
        raise ValueError(f"images: no image preprocessing is known for architecture {getattr(cfg, 'arch', None)!r}")
    v = cfg.vision
    path = (getattr(model, "load_info", None) or {}).get("path")
    found = processor_settings(Path(path)) if path and Path(path).is_dir() else None
    if found is not None:
        settings, where = found
        try:
            spec = ImageSpec.from_hf_preprocessor_config(settings, row.image_family)
        except ValueError as e:
            raise ValueError(f"images: {where}: {e}") from None
    else:            # the family's class defaults (every key missing) but the tower's patch sizes
        tower_sizes = {"patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
                       "merge_size": v.spatial_merge_size}
        spec = ImageSpec.from_hf_preprocessor_config(tower_sizes, row.image_family)
        log.warning("images: %s has no processor_config.json or preprocessor_config.json: images are prepared "
                    "with HF's %s class defaults (pixel bounds, mean and std) and the tower's patch sizes %s",
                    path, row.image_family, (v.patch_size, v.temporal_patch_size, v.spatial_merge_size))
    tower = (v.patch_size, v.temporal_patch_size, v.spatial_merge_size)
    if (spec.patch_size, spec.temporal_patch_size, spec.merge_size) != tower:
        raise ValueError(f"images: the processor config's (patch, temporal, merge) = "
                         f"{(spec.patch_size, spec.temporal_patch_size, spec.merge_size)} differs from the vision "
                         f"tower's {tower}")
    return spec


def processor_settings(directory: Path) -> tuple[dict, Path] | None:
    """The image processor's settings a checkpoint directory holds, found as transformers finds them:
    the ``"image_processor"`` entry of ``processor_config.json`` (transformers 5 saves the whole
    processor there), else a flat ``preprocessor_config.json``; with the file they came from. None
    when the directory has neither; a file that cannot be read as JSON, or whose settings are not an
    object, is a ``ValueError`` naming it (never the defaults in silence)."""
    def read(f: Path):
        try:
            return json.loads(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"images: cannot read {f}: {e}") from None

    nested = directory / "processor_config.json"
    if nested.is_file():
        processor = read(nested)
        if isinstance(processor, dict) and "image_processor" in processor:
            if not isinstance(processor["image_processor"], dict):
                raise ValueError(f"images: {nested}: its \"image_processor\" is not an object")
            return processor["image_processor"], nested
    flat = directory / "preprocessor_config.json"
    if flat.is_file():
        settings = read(flat)
        if not isinstance(settings, dict):
            raise ValueError(f"images: {flat} is not a JSON object")
        return settings, flat
    return None


def cap_tokens(spec: ImageSpec, max_image_tokens: int) -> ImageSpec:
    """``spec`` with ``max_pixels`` at most ``max_image_tokens * factor**2`` (one merged row is
    factor x factor pixels), ``min_pixels`` at most that too: no image it resizes makes more than
    ``max_image_tokens`` rows (both families' resize rules keep h * w within ``max_pixels``)."""
    cap = int(max_image_tokens) * spec.factor ** 2
    if spec.max_pixels <= cap:
        return spec
    log.info("images: at most %d pixels per image (max_image_tokens %d; the processor's max_pixels is %d)",
             cap, max_image_tokens, spec.max_pixels)
    return dataclasses.replace(spec, max_pixels=cap, min_pixels=min(spec.min_pixels, cap))


@dataclass(frozen=True)
class Source:
    """One image of a request: its bytes, or (URL fetching allowed) its http(s) URL; ``where`` names
    the part in the request."""
    where: str
    data: bytes | None = None
    url: str | None = None


class VisionInputs:
    """A loaded model's image handling (module docstring)."""

    def __init__(self, spec: ImageSpec, image_token_id: int, policy: ImagePolicy):
        self.spec, self.image_token_id, self.policy = spec, int(image_token_id), policy

    @classmethod
    def from_model(cls, model, policy: ImagePolicy | None = None,
                   max_image_tokens: int | None = None) -> VisionInputs | None:
        """None when the model has no vision tower (``config.vision`` None). Raises ValueError when
        the tokenizer's id of the image-pad token is not ``config.image_token_id``. ``max_image_tokens``
        (the engine's, None: no cap): images are resized to at most that many merged rows
        (``cap_tokens``)."""
        cfg = model.config
        if getattr(cfg, "vision", None) is None:
            return None
        spec = model_spec(model)
        if max_image_tokens is not None:
            spec = cap_tokens(spec, max_image_tokens)
        tok = model.tokenizer
        found = tok.token_to_id(spec.image_token) if tok is not None else None
        if found != cfg.image_token_id:
            raise ValueError(f"images: the tokenizer's id of {spec.image_token!r} is {found}, the config's "
                             f"image_token_id is {cfg.image_token_id}")
        return cls(spec, cfg.image_token_id, policy or ImagePolicy())

    @property
    def placeholder(self) -> str:
        """The text one image is in the rendered prompt (one pad token, ``expand`` makes n)."""
        return self.spec.placeholder(1)

    def prepare(self, sources: Sequence[Source], policy: ImagePolicy | None = None) -> list:
        """The images' bytes (fetched if URLs) -> ``ImageInput``s: decoded (within the policy's bytes
        and pixels; default: this model's policy), preprocessed. 400 naming the part on any
        ``ImageError``. The same ``Source`` twice is prepared once."""
        policy = policy or self.policy
        image_input = _image_input_class()
        done: dict[int, object] = {}
        out, pixels = [], 0
        for s in sources:
            if id(s) not in done:
                data = s.data if s.data is not None else fetch(s.url, policy, s.where)
                try:
                    image = decode_image(data, max_pixels=policy.max_pixels, max_bytes=policy.max_bytes)
                except ImageError as e:
                    if s.url is not None:          # what a URL served is not described (image_fetch)
                        fetch_failed(s.url, policy, s.where, e)
                    raise ApiError(400, f"{s.where}: {e}", param=s.where) from None
                pixels += image.width * image.height
                if pixels > policy.max_request_pixels:
                    raise ApiError(400, f"{s.where}: the request's images hold more than {policy.max_request_pixels} "
                                        "decoded pixels together", param=s.where)
                try:
                    p = preprocess(image, self.spec)
                except ImageError as e:
                    raise ApiError(400, f"{s.where}: {e}", param=s.where) from None
                done[id(s)] = image_input(key=image_key(data), patches=p.pixel_values,
                                          grid=tuple(int(g) for g in p.grid_thw), n_tokens=int(p.n_tokens))
            out.append(done[id(s)])
        return out

    def expand(self, ids: list[int], images: Sequence, marks: Sequence[int] = ()) -> tuple[list[int], tuple[int, ...]]:
        """``ids`` with each image-pad id (one per image, in order) made ``n_tokens`` of them, and
        ``marks`` (token positions) moved to match. 400 when the count of pad ids differs from the
        images (the placeholder text in a message's text)."""
        pads = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(pads) != len(images):
            raise ApiError(400, f"the prompt holds {len(pads)} image placeholder token(s) "
                                f"({self.spec.image_token!r}) for {len(images)} image(s): a message's text may not "
                                "contain the image placeholder text")
        out, prev = [], 0
        for p, image in zip(pads, images):
            out += ids[prev:p]
            out += [self.image_token_id] * int(image.n_tokens)
            prev = p + 1
        out += ids[prev:]
        moved = tuple(m + sum(int(im.n_tokens) - 1 for p, im in zip(pads, images) if p < m) for m in marks)
        return out, moved


class ImageParts:
    """The images of one request, collected from its parts in any order (module docstring)."""

    def __init__(self, vision: VisionInputs | None, policy: ImagePolicy):
        self.vision, self.policy = vision, policy
        self.sources: list[Source] = []
        self.order: list[Source] = []      # set by ``substitute``
        self._nonce = uuid.uuid4().hex

    def __bool__(self) -> bool:
        return bool(self.sources)

    def _sentinel(self, k: int) -> str:
        return f"<zoo-image-{self._nonce}-{k}>"

    def _add(self, source: Source) -> str:
        self.sources.append(source)
        return self._sentinel(len(self.sources) - 1)

    def _check(self, where: str) -> None:
        if self.vision is None:
            raise ApiError(400, f"{where}: this model takes text only (it has no vision tower); image parts are "
                                "not supported", param=where)
        if len(self.sources) >= self.policy.max_images:
            raise ApiError(400, f"{where}: too many images: at most {self.policy.max_images} per request",
                           param=where)

    def add_url(self, url, where: str) -> str:
        """An image given by URL: ``data:image/...;base64,...``, or http(s) when the policy allows
        it (fetched later, in ``VisionInputs.prepare``). Returns the text standing for it."""
        self._check(where)
        if not isinstance(url, str) or not url:
            raise ApiError(400, f"{where}: expected an image URL (a string)", param=where)
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            try:
                _, data = parse_data_url(url, max_bytes=self.policy.max_bytes)
            except ImageError as e:
                raise ApiError(400, f"{where}: {e}", param=where) from None
            return self._add(Source(where, data=data))
        if scheme in ("http", "https"):
            if not self.policy.allow_urls:
                raise ApiError(400, f"{where}: image URLs are not allowed on this server; send the image inline "
                                    "(a data:image/...;base64 URL or base64 data)", param=where)
            return self._add(Source(where, url=url))
        raise ApiError(400, f"{where}: unsupported image URL scheme {scheme or url[:16]!r} (expected a data: URL"
                            f"{' or http(s)' if self.policy.allow_urls else ''})", param=where)

    def add_base64(self, media_type, data, where: str) -> str:
        """An image given as base64 data (Anthropic ``source.type`` base64)."""
        self._check(where)
        if not isinstance(data, str) or not data:
            raise ApiError(400, f"{where}.data: expected base64 image data (a non-empty string)", param=where)
        if not isinstance(media_type, str) or not media_type.lower().startswith("image/"):
            raise ApiError(400, f"{where}.media_type: expected an image media type (image/png, image/jpeg, "
                                f"image/gif, image/webp), got {media_type!r}", param=where)
        if len(data) * 3 // 4 > self.policy.max_bytes + 3:
            raise ApiError(400, f"{where}: image too large: about {len(data) * 3 // 4} bytes, the limit is "
                                f"{self.policy.max_bytes}", param=where)
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ApiError(400, f"{where}.data: malformed base64: {e}", param=where) from None
        return self._add(Source(where, data=raw))

    def substitute(self, text: str) -> str:
        """The rendered prompt with each sentinel made the model's placeholder text; ``order``
        becomes the images in the order the prompt holds them (an image the template left out is
        not sent, one it repeats is sent each time)."""
        self.order = []
        if not self.sources:
            return text
        prefix = f"<zoo-image-{self._nonce}-"
        out, order, at = [], [], 0
        while (start := text.find(prefix, at)) >= 0:
            end = text.find(">", start)
            k = int(text[start + len(prefix):end])
            out += [text[at:start], self.vision.placeholder]
            order.append(self.sources[k])
            at = end + 1
        out.append(text[at:])
        self.order = order
        return "".join(out)
