"""zoo.images.preprocess against the Hugging Face processors (transformers 5.23, PIL backend):
``Qwen2VLImageProcessorPil`` (what ``AutoImageProcessor`` maps ``qwen3_5`` to) and
``Glm5NextImageProcessorPil``, both built from their classes (default settings, or the same config
dict), and the processors ``Qwen3VLProcessor`` / ``Glm5NextProcessor`` (with a small local
tokenizer) for the placeholder tokens. pixel_values must match to 1e-5 (they are bit-identical)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageOps

from tests.images import encode
from zoo.images import (
    PLACEHOLDER_TOKENS,
    ImageError,
    ImageSpec,
    count_tokens,
    decode_image,
    grid_thw,
    preprocess,
    smart_resize,
)

transformers = pytest.importorskip("transformers")
from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil  # noqa: E402
from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor  # noqa: E402

HF_CLASS = {"qwen3_5": Qwen2VLImageProcessorPil, "glm5_next": Glm5NextImageProcessorPil}
SPEC = {"qwen3_5": ImageSpec.qwen3_5, "glm5_next": ImageSpec.glm5_next}
FAMILIES = sorted(HF_CLASS)
RNG = np.random.default_rng(7)
LIMITS = {"max_pixels": 10_000_000, "max_bytes": 20_000_000}


def hf_image_processor(family: str):
    """The HF PIL-backend image processor that AutoImageProcessor picks for the family."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    assert IMAGE_PROCESSOR_MAPPING_NAMES[family]["pil"] == HF_CLASS[family].__name__
    return HF_CLASS[family]()


def gradient(h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], -1).astype(np.uint8)


def noise(h: int, w: int, channels: int = 3) -> np.ndarray:
    return RNG.integers(0, 256, (h, w, channels) if channels > 1 else (h, w), dtype=np.uint8)


def check_against_hf(image: Image.Image, spec: ImageSpec, hf, ours_from: Image.Image | None = None):
    """preprocess(ours_from or image) == hf(image): pixel_values to 1e-5, grid_thw exactly."""
    ours = preprocess(image if ours_from is None else ours_from, spec)
    out = hf(image, return_tensors="np")
    assert ours.grid_thw == tuple(int(v) for v in out["image_grid_thw"][0])
    assert ours.pixel_values.dtype == np.float32 and ours.pixel_values.shape == out["pixel_values"].shape
    np.testing.assert_allclose(ours.pixel_values, out["pixel_values"], rtol=0, atol=1e-5)
    t, h, w = ours.grid_thw
    assert ours.n_tokens == t * h * w // spec.merge_size ** 2 == count_tokens(image.height, image.width, spec)
    assert ours.resized == (h * spec.patch_size, w * spec.patch_size)
    return ours, out


SIZES = [(37, 211), (211, 37), (1, 1), (20, 4000), (4000, 20), (5, 900), (480, 640), (899, 1301)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("h, w", SIZES)
def test_rgb_images_match_hf(family, h, w):
    pixels = noise(h, w) if (h * w) % 2 else gradient(h, w)
    check_against_hf(Image.fromarray(pixels), SPEC[family](), hf_image_processor(family))


MODES = {"rgba": "RGBA", "palette+transparency": "P", "grey": "L", "grey+alpha": "LA", "gif": "P"}


@pytest.mark.parametrize("family", FAMILIES)
def test_decoded_modes_match_hf_given_the_same_file(family):
    """Our decode_image + preprocess against HF given Pillow's own opening of the same bytes."""
    rgba = np.concatenate([gradient(37, 211), noise(37, 211, 1)[..., None]], -1)
    palette = Image.fromarray(noise(29, 53, 1) % 7).convert("P")
    palette.putpalette(list(range(0, 252, 12)) * 12)
    files = {
        "rgba": encode(Image.fromarray(rgba), "PNG"),
        "palette+transparency": encode(palette, "PNG", transparency=3),
        "grey": encode(Image.fromarray(noise(64, 33, 1)), "PNG"),
        "grey+alpha": encode(Image.fromarray(noise(33, 64, 2), mode="LA"), "PNG"),
        "jpeg": encode(Image.fromarray(gradient(300, 200)), "JPEG", quality=90),
        "gif": encode(Image.fromarray(noise(40, 40)).quantize(32), "GIF"),
        "bmp": encode(Image.fromarray(noise(17, 90)), "BMP"),
        "webp": encode(Image.fromarray(noise(50, 70)), "WEBP", quality=80),
    }
    spec, hf = SPEC[family](), hf_image_processor(family)
    for name, data in files.items():
        theirs = Image.open(io.BytesIO(data))
        assert theirs.mode == MODES.get(name, "RGB"), name
        check_against_hf(theirs, spec, hf, ours_from=decode_image(data, **LIMITS))


@pytest.mark.parametrize("family", FAMILIES)
def test_exif_rotated_jpeg_matches_hf_after_exif_transpose(family):
    exif = Image.Exif()
    exif[0x0112] = 8                                         # rotate 90 degrees counter-clockwise to display
    data = encode(Image.fromarray(gradient(60, 150)), "JPEG", quality=90, exif=exif.tobytes())
    ours = decode_image(data, **LIMITS)
    assert ours.size == (60, 150)
    theirs = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))   # as transformers.load_image
    check_against_hf(theirs, SPEC[family](), hf_image_processor(family), ours_from=ours)


@pytest.mark.parametrize("family", FAMILIES)
def test_sixteen_bit_matches_hf_on_the_high_byte(family):
    """16-bit greyscale: we keep the high byte, HF (Pillow's convert) would clip it; equal on the 8-bit image."""
    wide = (gradient(45, 70)[..., 0].astype(np.uint16) * 257)
    ours = decode_image(encode(Image.fromarray(wide), "PNG"), **LIMITS)
    check_against_hf(Image.fromarray((wide >> 8).astype(np.uint8)), SPEC[family](), hf_image_processor(family),
                     ours_from=ours)


CHECKPOINT_CONFIGS = {
    # shaped like a Qwen3-VL/3.5 checkpoint's preprocessor_config.json (smaller bounds, to stay fast)
    "qwen3_5": {"size": {"shortest_edge": 65536, "longest_edge": 262144}, "patch_size": 16, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3,
                "rescale_factor": 0.00392156862745098, "image_processor_type": "Qwen2VLImageProcessorFast"},
    "glm5_next": {"min_image_tokens": 4, "max_image_tokens": 64, "patch_size": 14, "temporal_patch_size": 2,
                  "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                  "image_std": [0.26862954, 0.26130258, 0.27577711], "size": {"longest_edge": 1}},
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("h, w", [(37, 211), (700, 300), (1, 1), (4000, 20)])
def test_checkpoint_configs_match_hf_built_from_the_same_dict(family, h, w):
    d = {k: v for k, v in CHECKPOINT_CONFIGS[family].items() if k != "image_processor_type"}
    spec = ImageSpec.from_hf_preprocessor_config(CHECKPOINT_CONFIGS[family], family)
    check_against_hf(Image.fromarray(noise(h, w)), spec, HF_CLASS[family](**d))


def test_legacy_qwen_min_max_pixels_keys_win_over_size():
    d = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16, "size": {"shortest_edge": 1, "longest_edge": 10**8}}
    spec = ImageSpec.from_hf_preprocessor_config(d, "qwen3_5")
    assert (spec.min_pixels, spec.max_pixels) == (3136, 12544)
    check_against_hf(Image.fromarray(noise(300, 500)), spec, Qwen2VLImageProcessorPil(**d))


def test_flags_and_unsupported_settings():
    spec = ImageSpec.from_hf_preprocessor_config({"do_rescale": False, "do_normalize": False}, "qwen3_5")
    image = Image.fromarray(noise(56, 56))
    out = preprocess(image, spec)
    np.testing.assert_array_equal(out.pixel_values, Qwen2VLImageProcessorPil(do_rescale=False, do_normalize=False)(
        image, return_tensors="np")["pixel_values"])
    assert out.pixel_values.max() > 1                        # raw 0..255 values
    for bad, family in [({"do_resize": False}, "qwen3_5"), ({"patch_expand_factor": 2}, "glm5_next"),
                        ({}, "llava")]:
        with pytest.raises(ValueError):
            ImageSpec.from_hf_preprocessor_config(bad, family)
    for kw in [{"patch_size": 0}, {"min_pixels": 10, "max_pixels": 5}, {"mean": (0.5, 0.5)}, {"std": 0.0},
               {"resample": 99}]:
        with pytest.raises(ValueError):
            ImageSpec.qwen3_5(**kw)


def test_defaults_equal_the_hf_classes():
    q, g = Qwen2VLImageProcessorPil(), Glm5NextImageProcessorPil()
    qs, gs = ImageSpec.qwen3_5(), ImageSpec.glm5_next()
    assert (qs.patch_size, qs.temporal_patch_size, qs.merge_size) == (q.patch_size, q.temporal_patch_size, q.merge_size)
    assert (qs.min_pixels, qs.max_pixels) == (q.size["shortest_edge"], q.size["longest_edge"]) == (3136, 1003520)
    assert (gs.patch_size, gs.temporal_patch_size, gs.merge_size) == (g.patch_size, g.temporal_patch_size, g.merge_size)
    assert (gs.min_pixels, gs.max_pixels) == (g.min_image_tokens * 28 ** 2, g.max_image_tokens * 28 ** 2)
    for spec, hf in [(qs, q), (gs, g)]:
        assert spec.mean == tuple(hf.image_mean) and spec.std == tuple(hf.image_std)
        assert spec.resample == int(hf.resample) == 3 and spec.rescale_factor == hf.rescale_factor


@pytest.mark.parametrize("family", FAMILIES)
def test_smart_resize_and_token_counts_match_hf(family):
    spec, hf = SPEC[family](), hf_image_processor(family)
    sizes = [(1, 1), (1, 200), (27, 29), (28, 28), (56, 57), (100, 10), (333, 777), (1080, 1920), (5000, 25),
             (4000, 4000), (3, 599)]
    for h, w in sizes:
        canvas = smart_resize(h, w, spec)
        assert canvas[0] % spec.factor == 0 and canvas[1] % spec.factor == 0
        assert spec.min_pixels <= canvas[0] * canvas[1] <= spec.max_pixels
        patches = hf.get_number_of_image_patches(h, w)
        t, gh, gw = grid_thw(h, w, spec)
        assert (t, gh * gw) == (1, patches) and count_tokens(h, w, spec) == patches // spec.merge_size ** 2


def test_qwen_refuses_aspect_ratios_over_200_as_hf_does():
    image = Image.fromarray(noise(2, 401))
    with pytest.raises(ImageError, match="aspect ratio 200.5 is above 200"):
        preprocess(image, ImageSpec.qwen3_5())
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        Qwen2VLImageProcessorPil()(image)
    check_against_hf(image, ImageSpec.glm5_next(), hf_image_processor("glm5_next"))   # glm5_next has no such limit


def test_patch_layout():
    """Row r of pixel_values is patch (r // 4) of the 2x2 merge windows in raster order, then the
    patch inside its window in raster order; a row is (C, T, P, P) with the image repeated T times."""
    spec = ImageSpec.qwen3_5(mean=(0, 0, 0), std=(1, 1, 1), rescale_factor=1.0, min_pixels=1)
    pixels = noise(56, 84)                                   # already a multiple of 28: no resize
    out = preprocess(Image.fromarray(pixels), spec)
    assert out.grid_thw == (1, 4, 6) and out.pixel_values.shape == (24, 3 * 2 * 14 * 14)
    rows = out.pixel_values.reshape(24, 3, 2, 14, 14)
    np.testing.assert_array_equal(rows[:, :, 0], rows[:, :, 1])
    order = [(bh * 2 + mh, bw * 2 + mw) for bh in range(2) for bw in range(3) for mh in range(2) for mw in range(2)]
    for r, (ph, pw) in enumerate(order):
        patch = pixels[ph * 14:(ph + 1) * 14, pw * 14:(pw + 1) * 14].transpose(2, 0, 1)
        np.testing.assert_array_equal(rows[r, :, 0], patch)


def test_glm_pads_with_black_top_left():
    spec = ImageSpec.glm5_next(mean=(0, 0, 0), std=(1, 1, 1), rescale_factor=1.0)
    out = preprocess(Image.new("RGB", (200, 100), (255, 255, 255)), spec)   # 100x200 >= 16 tokens: no resize
    assert out.resized == (112, 224)
    canvas = out.pixel_values.reshape(4, 8, 2, 2, 3, 2, 14, 14)[:, :, :, :, 0, 0].transpose(0, 2, 4, 1, 3, 5)
    canvas = canvas.reshape(112, 224)
    assert (canvas[:100, :200] == 255).all() and (canvas[100:] == 0).all() and (canvas[:, 200:] == 0).all()


class _LocalTokenizerProcessor:
    """HF processors check every sub-processor's class; the video processor classes need torchvision,
    which is not installed, so this mixin accepts ``video_processor=None`` (images only)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = sorted({t for tokens in PLACEHOLDER_TOKENS.values() for t in tokens} | {
        "<|video_pad|>", "<|video|>", "<|begin_of_video|>", "<|end_of_video|>"})
    vocab = {"[UNK]": 0, "hello": 1, **{s: i + 2 for i, s in enumerate(specials)}}
    model = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]", additional_special_tokens=specials)


PROCESSORS = {"qwen3_5": Qwen3VLProcessor, "glm5_next": Glm5NextProcessor}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("h, w", [(37, 211), (1, 1), (480, 640), (20, 4000)])
def test_n_tokens_equal_the_placeholders_the_hf_processor_inserts(family, h, w, tokenizer):
    processor_class = type("Local" + PROCESSORS[family].__name__, (_LocalTokenizerProcessor, PROCESSORS[family]), {})
    processor = processor_class(image_processor=hf_image_processor(family), tokenizer=tokenizer, video_processor=None)
    image = Image.fromarray(noise(h, w))
    spec = SPEC[family]()
    out = processor(text=["hello " + spec.placeholder(1)], images=[image], return_tensors="np")
    tokens = tokenizer.convert_ids_to_tokens(out["input_ids"][0].tolist())
    ours = preprocess(image, spec)
    assert tokens == ["hello"] + tokenizer.tokenize(spec.placeholder(ours.n_tokens))
    before, token, after = PLACEHOLDER_TOKENS[family]
    assert tokens[1] == before and tokens[-1] == after and tokens.count(token) == ours.n_tokens
    np.testing.assert_allclose(ours.pixel_values, out["pixel_values"], rtol=0, atol=1e-5)
