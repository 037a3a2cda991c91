"""Pallas kernels (TPU Mosaic, GPU Triton) with their jnp references, and the one dispatch rule."""
