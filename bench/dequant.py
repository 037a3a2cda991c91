"""Throughput of zoo.quant's jitted dequantizers, and of the load-time repack of GGUF blocks into
the kernel planes (``zoo.formats.planes.to_planes``, numpy), vs gguf.quants.dequantize (numpy).

For each type, ~16 MB of random-but-valid blocks (random bytes, finite f16 scales) laid out as
rows of 4096 weights. gguf: best of 2 calls. Ours: ``jax.jit(dequantize_jnp)`` on a device array,
best of 5 after a warm-up call, ``block_until_ready``. Also checks the two agree bit for bit.
Repack: best of 3 calls of ``to_planes`` on the same host bytes; checks ``from_planes`` inverts it.

MB/s counts quantized input bytes (1 MB = 2**20 bytes). Run from the repo root:
``PYTHONPATH=. .venv/bin/python bench/dequant.py``.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from gguf import quants as gq

from zoo.formats.ggml import BLOCK_LAYOUTS, F16, QType
from zoo.formats.planes import from_planes, to_planes
from zoo.quant import dequantize_jnp

TYPES = [QType.IQ2_S, QType.IQ3_S, QType.IQ4_XS, QType.Q8_0, QType.Q6_K]
TARGET_BYTES = 16 << 20
ROW_WEIGHTS = 4096


def valid_rows(qtype: QType, rng: np.random.Generator) -> np.ndarray:
    """uint8[n_rows, row_bytes]: random blocks whose f16 fields hold small finite scales."""
    layout = BLOCK_LAYOUTS[qtype]
    blocks_per_row = ROW_WEIGHTS // layout.block_size
    n_rows = TARGET_BYTES // (blocks_per_row * layout.type_size)
    blocks = rng.integers(0, 256, size=(n_rows * blocks_per_row, layout.type_size), dtype=np.uint8)
    for field in layout.fields:
        if field.dtype == F16:
            scales = (rng.standard_normal((len(blocks), field.count)) * 1e-3).astype(np.float16)
            blocks[:, field.offset : field.end] = scales.view(np.uint8)
    return blocks.reshape(n_rows, -1)


def best_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench(qtype: QType, rng: np.random.Generator) -> str:
    rows = valid_rows(qtype, rng)
    megabytes = rows.nbytes / 2**20

    ref = gq.dequantize(rows, qtype)
    gguf_s = best_seconds(lambda: gq.dequantize(rows, qtype), repeats=2)

    device_rows = jax.device_put(rows)
    jitted = jax.jit(dequantize_jnp, static_argnums=1)
    ours = np.asarray(jitted(device_rows, qtype).block_until_ready())  # warm-up (compiles)
    ours_s = best_seconds(lambda: jitted(device_rows, qtype).block_until_ready(), repeats=5)

    exact = np.array_equal(ours.view(np.uint32), ref.view(np.uint32))

    repack_s = best_seconds(lambda: to_planes(rows, qtype), repeats=3)
    n_blocks = rows.shape[1] // BLOCK_LAYOUTS[qtype].type_size
    inverse = np.array_equal(np.asarray(from_planes(to_planes(rows, qtype), qtype, n_blocks)), rows)
    return (
        f"{qtype.name:8s} {megabytes:6.1f} MB  gguf {megabytes / gguf_s:8.1f} MB/s  "
        f"ours {megabytes / ours_s:8.1f} MB/s  ours/gguf {gguf_s / ours_s:6.2f}x  bit-exact={exact}  "
        f"repack {megabytes / repack_s:8.1f} MB/s  repack/gguf {gguf_s / repack_s:6.2f}x  inverse={inverse}"
    )


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {ROW_WEIGHTS}-weight rows, MB/s of quantized input")
    for qtype in TYPES:
        print(bench(qtype, rng), flush=True)


if __name__ == "__main__":
    main()
