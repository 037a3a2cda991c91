"""Quantized expert kernels: bytes a decode step reads with and without de-duplicating experts, and
the speed of the quantized expert path against dequantize-everything and against copy bandwidth,
all measured in the same run.

Part 1 (counts, GLM-5.3-Flash dimensions: hidden 4096, expert width 2048, 288 routed experts,
top-8, 42 MoE layers with the UD-IQ3_XXS per-layer type mix of docs/reference.md section 3): per decode
step, the expert planes read by a kernel that re-reads an expert for every (row, expert) slot, and by
ours, which reads each distinct expert once (``zoo.kernels.dequant_matvec.expert_plan`` on sampled
routings: uniform, and Zipf-skewed expert popularity as real routers show).

Part 2 (timed on the default backend, what ``zoo.kernels.dispatch`` picks there: the Pallas kernels
on TPU/GPU, their jnp twins on CPU): one GLM-like MoE layer scaled down to fit a CPU (hidden 1024,
width 512, 64 experts, top-8), per format, for a decode step of 3 streams and a prefill of 256
tokens, against ``dispatch.dequantized_moe`` (the whole banks dequantized, then dense), and the
decode step's bytes of distinct-expert planes per second against a plain copy of as many bytes.

Run from the repo root: ``PYTHONPATH=. .venv/bin/python bench/kernels.py``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from zoo.formats import planes as P
from zoo.formats.ggml import BLOCK_LAYOUTS, F16, QType
from zoo.kernels import dequant_matvec as mv
from zoo.kernels import dispatch
from zoo.kernels.tile_decoders import FORMATS
from zoo.ops.moe import moe
from zoo.quant.qarray import QArray

GLM = dict(hidden=4096, width=2048, experts=288, top_k=8)
# routed-expert types (gate, up, down) of the 42 MoE layers 3..44
GLM_LAYERS = ([(QType.IQ2_S, QType.IQ2_S, QType.IQ3_S)] * 40 + [(QType.IQ3_S, QType.IQ3_S, QType.IQ4_XS)]
              + [(QType.IQ2_S, QType.IQ2_S, QType.IQ4_XS)])
SMALL = dict(hidden=1024, width=512, experts=64, top_k=8)


def expert_bytes(types, hidden: int, width: int) -> int:
    """Plane bytes of one expert (gate, up: width rows of hidden; down: hidden rows of width)."""
    gate, up, down = types
    return sum(P.plane_nbytes(t, width, hidden // BLOCK_LAYOUTS[t].block_size) for t in (gate, up)) + \
        P.plane_nbytes(down, hidden, width // BLOCK_LAYOUTS[down].block_size)


def sample_routing(rng, rows: int, top_k: int, n_experts: int, skew: float) -> np.ndarray:
    """ids [rows, top_k]: distinct experts per row, popularity ~ rank**-skew (0: uniform)."""
    p = np.arange(1, n_experts + 1, dtype=np.float64) ** -skew
    return np.stack([rng.choice(n_experts, top_k, replace=False, p=p / p.sum()) for _ in range(rows)])


def part1(steps: int = 200) -> None:
    per_layer = [expert_bytes(t, GLM["hidden"], GLM["width"]) for t in GLM_LAYERS]
    mean_expert = sum(per_layer) / len(per_layer)
    plan = jax.jit(lambda ids: mv.expert_plan(ids, jnp.ones(ids.shape), GLM["experts"]).n_valid[0])
    print(f"Part 1: GLM-5.3-Flash decode step, {len(per_layer)} MoE layers, {mean_expert / 2**20:.2f} MiB of "
          f"planes per expert per layer (IQ2_S/IQ2_S/IQ3_S mostly)")
    rng = np.random.default_rng(0)
    for label, rows in [("3 streams", 3), ("1 stream, verify k=3", 4), ("3 streams, verify k=3", 12)]:
        for skew in (0.0, 1.0):
            slots = rows * GLM["top_k"]
            distinct = np.mean([int(plan(sample_routing(rng, rows, GLM["top_k"], GLM["experts"], skew)))
                                for _ in range(steps)])
            per_slot = slots * sum(per_layer)
            dedup = distinct * sum(per_layer)
            print(f"  {label:22s} routing {'uniform' if skew == 0 else f'zipf {skew}':9s} slots {slots:3d}  "
                  f"distinct {distinct:6.2f}  bytes/step per-slot {per_slot / 2**30:6.2f} GiB  "
                  f"de-duplicated {dedup / 2**30:6.2f} GiB  ratio {per_slot / dedup:5.2f}x")


def random_bank(qtype: QType, n_experts: int, d_in: int, d_out: int, rng) -> QArray:
    layout = BLOCK_LAYOUTS[qtype]
    blocks = rng.integers(0, 256, size=(n_experts, d_out, d_in // layout.block_size, layout.type_size), dtype=np.uint8)
    for f in layout.fields:
        if f.dtype == F16:
            scales = (rng.standard_normal((*blocks.shape[:-1], f.count)) * 1e-3).astype(np.float16)
            blocks[..., f.offset:f.end] = scales.view(np.uint8)
    return QArray.from_blocks(blocks.reshape(n_experts, d_out, -1), qtype)


def best_seconds(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def part2() -> None:
    d, i, e, k = SMALL["hidden"], SMALL["width"], SMALL["experts"], SMALL["top_k"]
    print(f"\nPart 2: one MoE layer (hidden {d}, width {i}, {e} experts, top-{k}) on {jax.default_backend()}, "
          f"dispatch backend '{dispatch.backend_of(dispatch.current_policy())}'")
    rng = np.random.default_rng(1)
    copy = jax.jit(lambda a: a + 1)
    for qtype in sorted(FORMATS, key=lambda t: t.name):
        banks = [random_bank(qtype, e, d, i, rng), random_bank(qtype, e, d, i, rng), random_bank(qtype, e, i, d, rng)]
        expert = sum(b.nbytes for b in banks) // e
        line = [f"  {qtype.name:8s}"]
        for rows in (3, 256):
            x = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
            ids = jnp.asarray(sample_routing(rng, rows, k, e, 1.0), jnp.int32)
            weights = jnp.asarray(rng.random((rows, k)), jnp.float32)
            ours = best_seconds(jax.jit(moe, static_argnums=6), x, weights, ids, *banks, 3.0)
            whole = best_seconds(jax.jit(dispatch.dequantized_moe, static_argnums=6), x, weights, ids, *banks, 3.0)
            line.append(f"{rows:3d} rows {ours * 1e3:7.2f} ms (dequantize-all {whole * 1e3:7.2f} ms, "
                        f"{whole / ours:5.2f}x)")
            if rows == 3:
                read = int(mv.expert_plan(ids, weights, e).n_valid[0]) * expert
                buffer = jnp.zeros(read // 4, jnp.float32)
                copy_s = best_seconds(copy, buffer)
                line.append(f"{read / ours / 1e9:6.2f} GB/s of planes vs copy {2 * read / copy_s / 1e9:6.2f} GB/s "
                            f"({read / ours / (2 * read / copy_s) * 100:5.1f}%)")
        print("  ".join(line), flush=True)


def main() -> None:
    print(f"jax {jax.__version__}, devices {jax.devices()}")
    part1()
    part2()


if __name__ == "__main__":
    main()
