"""zoo.images.decode: the five accepted formats decode to RGB; every hostile input is an ImageError that
names the problem, and a decompression bomb is refused before a pixel is decoded."""

from __future__ import annotations

import base64
import hashlib
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from tests.images import encode, png_bytes, png_chunk
from zoo.images import ImageError, decode_image, image_key, parse_data_url, to_rgb
from zoo.images.decode import _webp_canvas, sniff_format

LIMITS = {"max_pixels": 10_000_000, "max_bytes": 20_000_000}
RNG = np.random.default_rng(1234)


def noise(h: int, w: int, channels: int = 3) -> np.ndarray:
    shape = (h, w, channels) if channels > 1 else (h, w)
    return RNG.integers(0, 256, shape, dtype=np.uint8)


def decode(data: bytes, **kw) -> Image.Image:
    return decode_image(data, **{**LIMITS, **kw})


@pytest.mark.parametrize("fmt, kw", [("PNG", {}), ("BMP", {}), ("WEBP", {"lossless": True}), ("GIF", {})])
def test_lossless_formats_round_trip(fmt, kw):
    pixels = noise(37, 211)
    image = Image.fromarray(pixels)
    if fmt == "GIF":                                         # GIF is a palette format: 256 colours at most
        image = image.quantize(64).convert("RGB")
        pixels = np.asarray(image)
    out = decode(encode(image, fmt, **kw))
    assert out.mode == "RGB" and out.size == (211, 37)
    np.testing.assert_array_equal(np.asarray(out), pixels)


def test_jpeg_decodes_close_to_its_source():
    gradient = np.stack([*np.meshgrid(np.linspace(0, 255, 64), np.linspace(0, 255, 48)), np.full((48, 64), 99.0)], -1)
    out = decode(encode(Image.fromarray(gradient.astype(np.uint8)), "JPEG", quality=95))
    assert out.mode == "RGB" and out.size == (64, 48)
    assert np.abs(np.asarray(out).astype(int) - gradient).mean() < 2


def test_animations_give_their_first_frame():
    red, blue = Image.new("RGB", (20, 10), (255, 0, 0)), Image.new("RGB", (20, 10), (0, 0, 255))
    for fmt, kw in [("GIF", {}), ("WEBP", {"lossless": True}), ("PNG", {})]:
        data = encode(red, fmt, save_all=True, append_images=[blue], duration=100, **kw)
        assert np.asarray(decode(data))[5, 5].tolist() == [255, 0, 0], fmt


def test_alpha_is_composited_on_white_as_hf_does():
    rgba = np.concatenate([noise(9, 13), noise(9, 13, 1)[..., None]], -1)
    rgba[0, 0, 3], rgba[0, 1, 3] = 0, 255                    # fully transparent, fully opaque
    out = np.asarray(decode(encode(Image.fromarray(rgba), "PNG")))
    assert out[0, 0].tolist() == [255, 255, 255]
    assert out[0, 1].tolist() == rgba[0, 1, :3].tolist()
    alpha = rgba[..., 3:].astype(np.float64) / 255
    np.testing.assert_allclose(out, alpha * rgba[..., :3] + (1 - alpha) * 255, atol=1)
    convert_to_rgb = pytest.importorskip("transformers.image_transforms").convert_to_rgb
    np.testing.assert_array_equal(out, convert_to_rgb(Image.fromarray(rgba), return_numpy=True))


def test_palette_transparency_greyscale_and_grey_alpha_become_rgb():
    palette = Image.fromarray(np.arange(12, dtype=np.uint8).reshape(3, 4) % 3, mode="L").convert("P")
    palette.putpalette([10, 20, 30, 200, 100, 0, 0, 0, 0] + [0] * 759)
    out = np.asarray(decode(encode(palette, "PNG", transparency=2)))
    assert out[0, 0].tolist() == [10, 20, 30] and out[0, 1].tolist() == [200, 100, 0]
    assert out[0, 2].tolist() == [255, 255, 255]             # the transparent index -> white

    grey = noise(5, 7, 1)
    out = np.asarray(decode(encode(Image.fromarray(grey), "PNG")))
    np.testing.assert_array_equal(out, np.repeat(grey[..., None], 3, -1))

    la = np.stack([grey, np.where(grey > 128, 255, 0).astype(np.uint8)], -1)
    out = np.asarray(decode(encode(Image.fromarray(la, mode="LA"), "PNG")))
    np.testing.assert_array_equal(out[..., 0], np.where(grey > 128, grey, 255))


def test_sixteen_bit_greyscale_keeps_its_high_byte():
    wide = (np.arange(4 * 6, dtype=np.uint16).reshape(4, 6) * 2700)
    image = Image.open(io.BytesIO(encode(Image.fromarray(wide), "PNG")))
    assert image.mode == "I;16"                               # Pillow's convert("RGB") would clip to 255 here
    out = np.asarray(decode(encode(Image.fromarray(wide), "PNG")))
    np.testing.assert_array_equal(out, np.repeat((wide >> 8).astype(np.uint8)[..., None], 3, -1))


def test_sixteen_bit_rgb_png_keeps_its_high_byte():
    wide = (np.arange(2 * 3 * 3).reshape(2, 3, 3) * 3000).astype(">u2")
    raw = b"".join(b"\x00" + row.tobytes() for row in wide)
    out = np.asarray(decode(png_bytes(3, 2, zlib.compress(raw), bit_depth=16, colour_type=2)))
    np.testing.assert_array_equal(out, (wide >> 8).astype(np.uint8))


def test_exif_orientation_is_applied():
    halves = np.zeros((20, 40, 3), np.uint8)
    halves[:, :20] = (255, 0, 0)                             # left red, right blue
    halves[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6                                         # "rotate 90 degrees clockwise to display"
    out = decode(encode(Image.fromarray(halves), "JPEG", quality=95, exif=exif.tobytes()))
    assert out.size == (20, 40)                              # (W, H): now portrait
    top, bottom = np.asarray(out)[5, 10].astype(int), np.asarray(out)[35, 10].astype(int)
    assert top[0] > 200 and top[2] < 50 and bottom[2] > 200 and bottom[0] < 50


def test_to_rgb_returns_rgb_images_unchanged():
    image = Image.new("RGB", (3, 3), (1, 2, 3))
    assert to_rgb(image) is image


@pytest.mark.parametrize("data, message", [
    (b"", "cannot decode the image: no bytes"),
    (bytes(range(256)) * 4, "cannot decode the image: not a recognized image (accepted formats: PNG, JPEG, WEBP"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "cannot decode the image: invalid or corrupt PNG data"),
    (b"\xff\xd8\xff\xe0" + b"\x00" * 40, "cannot decode the image: invalid or corrupt JPEG data"),
    (b"II*\x00" + b"\x00" * 40, "unsupported image format TIFF; accepted formats: PNG, JPEG, WEBP, GIF, BMP"),
    (b"\x00\x00\x00\x1cftypavif" + b"\x00" * 40, "unsupported image format AVIF; accepted formats: PNG, JPEG"),
    (b"\x00\x00\x00\x1cftypheic" + b"\x00" * 40, "unsupported image format HEIC"),
    (b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"/>', "unsupported image format SVG"),
])
def test_bad_bytes_are_refused_with_a_reason(data, message):
    with pytest.raises(ImageError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        decode(data)


@pytest.mark.parametrize("fmt", ["TIFF", "ICO", "PDF"])
def test_real_files_of_other_formats_are_named(fmt):
    data = encode(Image.fromarray(noise(16, 16)), fmt)
    assert sniff_format(data) == fmt
    accepted = "accepted formats: PNG, JPEG, WEBP, GIF, BMP"
    with pytest.raises(ImageError, match=f"unsupported image format {fmt}; {accepted}"):
        decode(data)


def test_truncated_and_corrupt_pixel_data_are_refused():
    good = encode(Image.fromarray(noise(64, 64)), "PNG")
    with pytest.raises(ImageError, match="^cannot decode the image: .*truncated"):
        decode(good[: len(good) // 2])
    idat = good.index(b"IDAT") + 4
    broken = png_bytes(8, 8, b"this is not zlib data")
    with pytest.raises(ImageError, match="^cannot decode the image: "):
        decode(broken)
    flipped = bytearray(good)
    flipped[idat + 20] ^= 0xFF                               # a CRC mismatch inside IDAT
    with pytest.raises(ImageError, match="^cannot decode the image: "):
        decode(bytes(flipped))
    with pytest.raises(ImageError, match="^cannot decode the image: "):
        decode(encode(Image.fromarray(noise(64, 64)), "JPEG")[:300])


def test_too_many_bytes_are_refused_before_parsing(monkeypatch):
    opened = []
    monkeypatch.setattr(Image, "open", lambda *a, **k: opened.append(a))
    with pytest.raises(ImageError, match="^image too large: 1001 bytes, the limit is 1000$"):
        decode(b"\x89PNG" + b"\x00" * 997, max_bytes=1000)
    assert opened == []


@pytest.fixture
def loads(monkeypatch):
    """Records every pixel decode (``ImageFile.load``) of the test."""
    calls = []
    real = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: calls.append(self.size) or real(self))
    return calls


def patched_ihdr(width: int, height: int) -> bytes:
    """A real small PNG whose IHDR is rewritten to declare width x height (CRC fixed up)."""
    data = bytearray(encode(Image.fromarray(noise(16, 16)), "PNG"))
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[8:33] = png_chunk(b"IHDR", ihdr)
    return bytes(data)


def test_a_declared_huge_png_is_refused_by_pillows_guard_before_decoding(loads):
    before = Image.MAX_IMAGE_PIXELS
    with pytest.raises(ImageError, match="^refused a possible decompression bomb: .*10000000000 pixels"):
        decode(patched_ihdr(100_000, 100_000), max_pixels=1_000_000)
    assert loads == [] and Image.MAX_IMAGE_PIXELS == before   # the global guard is restored


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_a_declared_size_just_over_the_limit_is_refused_before_decoding(loads):
    with pytest.raises(ImageError, match="the image declares 1200x1000 = 1200000 pixels, the limit is 1000000"):
        decode(patched_ihdr(1200, 1000), max_pixels=1_000_000)
    assert loads == []
    assert decode(patched_ihdr(16, 16)).size == (16, 16) and set(loads) == {(16, 16)}    # the spy sees loads


def test_a_real_highly_compressible_png_is_refused_before_decoding(loads):
    side = 6000                                              # 36 M pixels of zeros, about 36 kB of PNG
    zipper = zlib.compressobj(9)
    row = bytes(side + 1)
    idat = b"".join(zipper.compress(row) for _ in range(side)) + zipper.flush()
    data = png_bytes(side, side, idat)
    assert len(data) < 100_000
    with pytest.raises(ImageError, match="decompression bomb"):
        decode(data, max_pixels=10_000_000)
    assert loads == []


def test_a_gif_whose_first_frame_grows_the_canvas_is_refused(loads):
    frame = struct.pack("<HHHHB", 0, 0, 5000, 5000, 0)       # a 5000x5000 frame on a 16x16 screen
    data = (b"GIF89a" + struct.pack("<HHBBB", 16, 16, 0, 0, 0) + b"," + frame
            + b"\x02\x02\x4c\x01\x00" + b";")
    with pytest.raises(ImageError, match="decompression bomb"):
        decode(data, max_pixels=1_000_000)
    assert loads == []


def test_webp_canvas_sizes_are_read_from_the_header():
    image = Image.fromarray(noise(37, 211))
    exif = Image.Exif()
    exif[0x0112] = 1
    for kw in [{"quality": 80}, {"lossless": True}, {"exif": exif.tobytes()}]:      # VP8, VP8L, VP8X
        assert _webp_canvas(encode(image, "WEBP", **kw)) == (211, 37), kw
    assert _webp_canvas(encode(image, "PNG")) is None


def test_a_forged_webp_canvas_is_refused_before_pillow_opens_it(monkeypatch):
    opened = []
    monkeypatch.setattr(Image, "open", lambda *a, **k: opened.append(a))
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\x00" * 4 + (16383).to_bytes(3, "little") * 2
    data = b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x
    with pytest.raises(ImageError, match="declares 16384x16384 = 268435456 pixels, the limit is 1000000"):
        decode(data, max_pixels=1_000_000)
    assert opened == []


def png_data_url(media_type: str = "image/png") -> tuple[bytes, str]:
    data = encode(Image.fromarray(noise(4, 5)), "PNG")
    return data, f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def test_data_urls_parse():
    data, url = png_data_url()
    assert parse_data_url(url) == ("image/png", data)
    assert parse_data_url(url.replace("data:image/png", "DATA:Image/PNG;name=x.png")) == ("image/png", data)
    body = url.split(",", 1)[1]
    wrapped = "\n".join(body[i:i + 60] for i in range(0, len(body), 60))
    assert parse_data_url("data:image/png;base64," + wrapped.rstrip("="))[1] == data   # newlines, no padding
    urlsafe = base64.urlsafe_b64encode(data).decode()
    assert parse_data_url("data:image/png;base64," + urlsafe)[1] == data
    assert parse_data_url("data:image/gif,GIF89a%01%00")[1] == b"GIF89a\x01\x00"     # percent-encoded
    assert np.asarray(decode(parse_data_url(url)[1])).shape == (4, 5, 3)


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "^not a data URL"),
    ("data:image/png;base64", "^malformed data URL: no ','"),
    ("data:text/plain;base64,aGVsbG8=", "^the data URL's media type 'text/plain' is not an image type"),
    ("data:;base64,aGVsbG8=", "^the data URL's media type 'text/plain' is not an image type"),
    ("data:application/octet-stream;base64,aGVsbG8=", "is not an image type"),
    ("data:image/png;base64,@@@@", "^malformed base64 in the data URL"),
    ("data:image/png;base64,aGVsb", "^malformed base64 in the data URL: its length"),
    ("data:image/png;base64,aGVsbG8é", "^malformed base64 in the data URL"),
    ("data:image/png;base64,", "^cannot decode the image: the data URL holds no bytes"),
])
def test_bad_data_urls_are_refused(url, message):
    with pytest.raises(ImageError, match=message):
        parse_data_url(url)


def test_data_url_size_limit():
    data, url = png_data_url()
    assert parse_data_url(url, max_bytes=len(data))[1] == data
    with pytest.raises(ImageError, match="^image too large"):
        parse_data_url(url, max_bytes=len(data) - 1)
    with pytest.raises(ImageError, match="^image too large: about"):
        parse_data_url("data:image/png;base64," + "A" * 4000, max_bytes=100)


def test_image_key_is_the_sha256_of_the_bytes():
    data, _ = png_data_url()
    assert image_key(data) == hashlib.sha256(data).hexdigest() and len(image_key(data)) == 64
    assert image_key(data) != image_key(data + b"\x00")
