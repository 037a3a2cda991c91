"""Images for the multimodal models: decode untrusted bytes safely, preprocess as the HF processors do.

``decode_image(bytes, max_pixels=, max_bytes=)`` -> RGB ``PIL.Image`` (PNG, JPEG, WEBP, GIF, BMP;
bombs, corrupt and unsupported inputs raise ``ImageError``); ``parse_data_url`` and ``image_key``
for ``data:`` URLs and content keys. ``preprocess(image, ImageSpec.qwen3_5() / .glm5_next())`` ->
``Processed(pixel_values [N, C*T*P*P] float32, grid_thw, n_tokens)``, equal to the HF PIL-backend
image processors' output. Imports only the standard library, numpy and Pillow.
"""

from zoo.images.decode import ACCEPTED_FORMATS, ImageError, decode_image, image_key, parse_data_url, to_rgb
from zoo.images.preprocess import (
    FAMILIES,
    PLACEHOLDER_TOKENS,
    ImageSpec,
    Processed,
    count_tokens,
    grid_thw,
    preprocess,
    smart_resize,
)

__all__ = [
    "ACCEPTED_FORMATS", "FAMILIES", "PLACEHOLDER_TOKENS", "ImageError", "ImageSpec", "Processed", "count_tokens",
    "decode_image", "grid_thw", "image_key", "parse_data_url", "preprocess", "smart_resize", "to_rgb",
]
