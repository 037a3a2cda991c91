"""ggml quantization: block layouts (:mod:`zoo.quant.ggml`) and bit-exact jnp dequantizers
(:mod:`zoo.quant.dequant`)."""

from .dequant import dequantize, dequantize_jnp

__all__ = ["dequantize", "dequantize_jnp"]
