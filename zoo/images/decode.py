"""Decode untrusted image bytes (as HTTP clients send them) into an RGB Pillow image.

``decode_image(data, max_pixels=, max_bytes=)`` accepts PNG (APNG: first frame), JPEG (MPO: first
picture), WEBP (animated: first frame), GIF (first frame) and BMP, and returns a loaded ``RGB``
image of size (W, H) with W * H <= max_pixels. Every refusal is an ``ImageError`` (a ``ValueError``)
whose message names the problem:

- too many bytes ("image too large: N bytes, the limit is M") -- checked before anything is parsed;
- empty or corrupt bytes ("cannot decode the image: ...");
- a format outside the five ("unsupported image format TIFF; accepted formats: PNG, JPEG, ...");
- a decompression bomb ("refused a possible decompression bomb: ...") -- the declared width * height
  is checked right after Pillow has parsed the header, BEFORE any pixel is decoded (for WEBP, whose
  decoder allocates its canvas when it opens, before Pillow is called at all). While the header
  is parsed, Pillow's own guard (``Image.MAX_IMAGE_PIXELS``) is set to ``max_pixels`` under a lock
  (and restored after), so Pillow refuses anything above 2 * max_pixels itself, and the GIF plugin
  (whose first frame may grow the canvas) is held to the same limit.

After decoding: the EXIF orientation is applied (``ImageOps.exif_transpose``; a malformed EXIF block
is ignored, as browsers do) and the pixels become RGB with ``to_rgb`` (HF's ``convert_to_rgb``).

``parse_data_url(url)`` -> (media type, bytes) for ``data:image/...;base64,...`` URLs, and
``image_key(data)`` is the SHA-256 content key of the encoded bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import threading
import urllib.parse

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Pillow's format names -> ours (an MPO file is a JPEG with extra pictures after the first).
_PILLOW_FORMATS = {"PNG": "PNG", "JPEG": "JPEG", "MPO": "JPEG", "WEBP": "WEBP", "GIF": "GIF", "BMP": "BMP"}
_ACCEPTED = ", ".join(ACCEPTED_FORMATS)
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")     # 16-bit greyscale PNG ("I": older Pillow)
_PILLOW_GUARD = threading.Lock()                            # Image.MAX_IMAGE_PIXELS is process-global


class ImageError(ValueError):
    """An image (bytes or data URL) that is refused; the message says why, fit for an HTTP 400."""


def decode_image(data: bytes, *, max_pixels: int, max_bytes: int) -> Image.Image:
    """``data`` (an encoded image) -> a loaded ``RGB`` Pillow image, EXIF orientation applied.

    Contract: ``len(data) <= max_bytes`` and the declared width * height <= ``max_pixels`` are
    checked before any pixel is decoded, so a hostile input costs at most ``max_bytes`` of parsing
    and ``max_pixels`` pixels of memory. Raises ``ImageError`` for every bad input.
    """
    if max_pixels < 1 or max_bytes < 1:
        raise ValueError(f"max_pixels and max_bytes must be positive, got {max_pixels}, {max_bytes}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode_image takes bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise ImageError("cannot decode the image: no bytes")
    if len(data) > max_bytes:
        raise ImageError(f"image too large: {len(data)} bytes, the limit is {max_bytes}")

    if (declared := _webp_canvas(data)) is not None:      # libwebp allocates the canvas when it opens
        _check_size(*declared, max_pixels)
    image = _open_header(data, max_pixels)
    try:
        image.load()                                         # the first frame of an animation
    except Exception as e:                                   # hostile bytes may raise anything
        raise ImageError(f"cannot decode the image: {_reason(e)}") from e
    try:
        image = ImageOps.exif_transpose(image)
    except Exception:                                        # a malformed EXIF block: keep the pixels
        pass
    return to_rgb(image)


def _open_header(data: bytes, max_pixels: int) -> ImageFile.ImageFile:
    """Parse the header only (no pixels) with Pillow's guard at ``max_pixels``; check the size."""
    with _PILLOW_GUARD:
        saved = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = max_pixels
        try:
            image = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
        except Image.DecompressionBombError as e:
            raise ImageError(f"refused a possible decompression bomb: {e}") from e
        except UnidentifiedImageError as e:
            raise _unidentified(data) from e
        except Exception as e:
            raise ImageError(f"cannot decode the image: {_reason(e)}") from e
        finally:
            Image.MAX_IMAGE_PIXELS = saved
    if image.format not in _PILLOW_FORMATS:                  # cannot happen with formats= above
        raise ImageError(f"unsupported image format {image.format}; accepted formats: {_ACCEPTED}")
    _check_size(*image.size, max_pixels)
    return image


def _check_size(width: int, height: int, max_pixels: int) -> None:
    if width < 1 or height < 1:
        raise ImageError(f"cannot decode the image: it declares a size of {width}x{height}")
    if width * height > max_pixels:
        raise ImageError(f"refused a possible decompression bomb: the image declares {width}x{height} = "
                         f"{width * height} pixels, the limit is {max_pixels}")


def _webp_canvas(data: bytes) -> tuple[int, int] | None:
    """The (width, height) a WEBP header declares (VP8X canvas, VP8 or VP8L frame), None if not WEBP."""
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    chunk = data[12:16]
    if chunk == b"VP8X":
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        return int.from_bytes(data[26:28], "little") & 0x3FFF, int.from_bytes(data[28:30], "little") & 0x3FFF
    if chunk == b"VP8L" and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def _reason(e: BaseException) -> str:
    return str(e) or type(e).__name__


def to_rgb(image: Image.Image) -> Image.Image:
    """Any Pillow image -> ``RGB``, with the semantics of HF's ``convert_to_rgb`` (transformers
    ``image_transforms.convert_to_rgb``, which every HF image processor applies first):

    - an alpha band ("A" in the bands: RGBA, LA, PA) or a ``transparency`` entry (palette / tRNS):
      ``convert("RGBA")`` and alpha-composite onto opaque white, then drop the alpha;
    - anything else (L, P, 1, CMYK, RGB): ``convert("RGB")``.

    One deliberate difference: 16-bit greyscale (mode ``I;16``/``I``) keeps its high byte
    (v >> 8, as Pillow already does for 16-bit RGB PNGs), where Pillow's ``convert("RGB")``, and so
    HF, clips every value above 255 to 255 (a near-white image). A 16-bit tRNS grey is made white.
    Returns ``image`` itself when it is already RGB without transparency.
    """
    if image.mode in _SIXTEEN_BIT:
        wide = np.asarray(image).astype(np.int64)
        grey = (np.clip(wide, 0, 65535) >> 8).astype(np.uint8)
        key = image.info.get("transparency")
        if isinstance(key, int):
            grey[wide == key] = 255                          # binary alpha on white
        image = Image.fromarray(grey)
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if image.mode == "RGB" and not has_alpha:
        return image
    try:
        if has_alpha:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")
    except (ValueError, OSError) as e:
        raise ImageError(f"cannot decode the image: cannot convert pixel mode {image.mode} to RGB ({e})") from e


# Magic numbers of formats Pillow was not allowed to open, to name them in the refusal.
_MAGIC = [
    (b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
    (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"II+\x00", "TIFF"), (b"MM\x00+", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"), (b"\x00\x00\x02\x00", "CUR"), (b"icns", "ICNS"), (b"8BPS", "PSD"),
    (b"%PDF", "PDF"), (b"qoif", "QOI"), (b"v/1\x01", "OpenEXR"), (b"#?RADIANCE", "HDR"), (b"DDS ", "DDS"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000"), (b"\xffO\xffQ", "JPEG 2000"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JPEG XL"), (b"\xff\n", "JPEG XL"),
]
_HEIF_BRANDS = {b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1"}


def sniff_format(data: bytes) -> str | None:
    """The format the first bytes announce ("PNG", "TIFF", "HEIC", ...), or None if unknown."""
    head = bytes(data[:1024])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in (b"avif", b"avis"):
            return "AVIF"
        return "HEIC" if brand in _HEIF_BRANDS else f"ISO media ({brand.decode('latin-1').strip()})"
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    text = head.lstrip().lower()
    if text.startswith(b"<svg") or (text.startswith(b"<?xml") and b"<svg" in text):
        return "SVG"
    return None


def _unidentified(data: bytes) -> ImageError:
    name = sniff_format(data)
    if name in ACCEPTED_FORMATS:
        return ImageError(f"cannot decode the image: invalid or corrupt {name} data")
    if name is not None:
        return ImageError(f"unsupported image format {name}; accepted formats: {_ACCEPTED}")
    return ImageError(f"cannot decode the image: not a recognized image (accepted formats: {_ACCEPTED})")


_MEDIA_TYPE = re.compile(r"image/[a-z0-9][a-z0-9.+-]*")
_SPACE = re.compile(r"\s+")


def parse_data_url(url: str, *, max_bytes: int | None = None) -> tuple[str, bytes]:
    """``data:image/png;base64,iVBOR...`` -> ("image/png", the decoded bytes).

    RFC 2397: parameters (``;charset=...``) are allowed and ignored; ``;base64`` payloads may hold
    whitespace, may lack their ``=`` padding and may use the URL-safe alphabet; a payload without
    ``;base64`` is percent-decoded. The media type (lowercased) must be ``image/*``; whether the bytes
    really are that format is ``decode_image``'s business. With ``max_bytes``, an over-long payload is
    refused before it is decoded. Raises ``ImageError`` for anything else.
    """
    if not isinstance(url, str):
        raise TypeError(f"parse_data_url takes a str, got {type(url).__name__}")
    if url[:5].lower() != "data:":
        raise ImageError("not a data URL (expected data:image/<type>;base64,<data>)")
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ImageError("malformed data URL: no ',' before the data")
    params = [p.strip().lower() for p in header.split(";")]
    media_type = params[0] or "text/plain"
    if not _MEDIA_TYPE.fullmatch(media_type):
        raise ImageError(f"the data URL's media type {media_type!r} is not an image type (expected image/...)")
    if max_bytes is not None and len(payload) * 3 // 4 > max_bytes + 3:
        raise ImageError(f"image too large: about {len(payload) * 3 // 4} bytes, the limit is {max_bytes}")
    if "base64" in params[1:]:
        if "%" in payload:
            payload = urllib.parse.unquote(payload)
        payload = _SPACE.sub("", payload).replace("-", "+").replace("_", "/")
        if len(payload) % 4 == 1:
            raise ImageError("malformed base64 in the data URL: its length is not a whole number of bytes")
        try:
            data = base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"malformed base64 in the data URL: {e}") from e
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if not data:
        raise ImageError("cannot decode the image: the data URL holds no bytes")
    if max_bytes is not None and len(data) > max_bytes:
        raise ImageError(f"image too large: {len(data)} bytes, the limit is {max_bytes}")
    return media_type, data


def image_key(data: bytes) -> str:
    """The content key of an encoded image: the SHA-256 of its bytes, 64 lowercase hex digits.

    It keys the bytes, not the pixels: the same picture in two encodings gets two keys.
    """
    return hashlib.sha256(data).hexdigest()
