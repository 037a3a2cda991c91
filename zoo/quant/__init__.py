"""Quantized storage: what a parameter holds (``QArray`` planes of ggml blocks, int8 + scales), the
storage functions that decide it per tensor, and the named recipes. ``zoo.quant.dequantize`` is
the bit-exact dequantizer of every ggml type (``zoo.formats.dequant``), with gguf's contract."""

from zoo.formats.dequant import dequantize, dequantize_jnp

__all__ = ["dequantize", "dequantize_jnp"]
