"""The GPU (Pallas Triton) decode kernels on a real GPU: compiled to PTX and run, checked against the
float64 gguf oracle, and timed against dequantize-everything and against copy bandwidth, all in the
same run.

Part 1 (correctness, every format the kernels decode): ``moe_matvec_gpu`` over 8-expert banks
(top-2, rows 1/3/8, routings: all rows on the same experts, all distinct, a random mix, and the
expert-parallel view whose padding slots no kernel may read) and ``linear_matvec_gpu``, float32
activations, compiled for the GPU (not interpret mode), against ``gguf.quants.dequantize`` then the
layer in float64. Also bfloat16 activations against the same oracle (reported, looser).

Part 2 (timing, GLM-5.3-Flash expert dimensions: hidden 4096, width 2048, top-8; 32 experts in the
bank rather than 288: a decode step reads only the distinct experts of its rows, and the GB/s figures
count those): one routed-expert layer for 3 and 12 rows (3 streams; 3 streams verifying 3 drafts) in
bfloat16, per format: the Triton kernel, ``dispatch.dequantized_moe`` (dequantize the banks whole,
then dense), and the planes the kernel must read per second against a device copy of as many bytes.

Part 3 (timing): ``linear_matvec_gpu`` for a 4096 x 4096 matrix, 3 rows, against dequantize-then-dot
and against a bfloat16 dense matmul of the same shape (what an unquantized model pays).

Needs only jax (with a GPU plugin), numpy and gguf (the test data and the float64 oracle are
``tests/support/ggml_oracle.py``'s). Run from the repo root:
``PYTHONPATH=. python bench/gpu_kernels.py [--out results.json]`` (``--interpret``: a small
smoke run of every part on the CPU in Pallas interpret mode, small shapes, two formats).
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from gguf import quants as gq

from tests.support.ggml_oracle import blocks, moe_oracle
from zoo.formats.ggml import BLOCK_LAYOUTS, QType
from zoo.kernels import dequant_matvec as mv
from zoo.kernels import dequant_matvec_gpu as mv_gpu
from zoo.kernels import dispatch
from zoo.kernels.tile_decoders import FORMATS
from zoo.quant.qarray import QArray

TYPES = sorted(FORMATS, key=lambda t: t.name)
LIMIT = 0.5


def bank(qtype: QType, n_experts: int, d_in: int, d_out: int, rng, oracle: bool, in_splits: int = 1):
    """A QArray ``[E, d_in, d_out]`` (a matrix when ``n_experts`` is 0) and its float64 weights (or None)."""
    lead = (n_experts,) if n_experts else ()
    raw = blocks(qtype, lead, d_out, d_in // BLOCK_LAYOUTS[qtype].block_size, int(rng.integers(1 << 30)),
                 probe_rows=64)
    dense = np.swapaxes(gq.dequantize(raw, qtype), -1, -2).astype(np.float64) if oracle else None
    return QArray.from_blocks(raw, qtype, in_splits=in_splits), dense


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def routings(rows: int, top_k: int, n_experts: int, rng) -> dict:
    same = np.tile(rng.permutation(n_experts)[:top_k], (rows, 1))
    distinct = (np.arange(rows * top_k) % n_experts).reshape(rows, top_k)
    mixed = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(rows)])
    cases = {name: (ids.astype(np.int32), rng.random((rows, top_k)).astype(np.float32))
             for name, ids in (("same", same), ("distinct", distinct), ("mixed", mixed))}
    ids, weights = cases["mixed"][0].copy(), cases["mixed"][1].copy()
    elsewhere = ids >= n_experts // 2
    ids[elsewhere], weights[elsewhere] = 0, 0.0
    cases["ep-view"] = (ids, weights)
    return cases


def seconds(fn, *args, calls: int = 20, repeats: int = 5) -> float:
    """Best over ``repeats`` of the mean time of ``calls`` back-to-back calls (device time, launch
    overhead amortized)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def part1(interpret: bool, results: dict) -> None:
    print("Part 1: correctness against the float64 gguf oracle (compiled)" if not interpret
          else "Part 1: correctness (interpret mode)", flush=True)
    rng = np.random.default_rng(0)
    moe = jax.jit(functools.partial(mv_gpu.moe_matvec_gpu, interpret=interpret), static_argnums=6)
    linear = jax.jit(functools.partial(mv_gpu.linear_matvec_gpu, interpret=interpret), static_argnums=2)
    types = TYPES if not interpret else TYPES[:2]
    for qtype in types:
        bs = BLOCK_LAYOUTS[qtype].block_size
        d, i = (512, 256) if bs == 256 else (8 * bs, 2 * bs)
        entry = results.setdefault(qtype.name, {})
        try:
            made = [bank(qtype, 8, d, i, rng, True, in_splits=2), bank(qtype, 8, d, i, rng, True, in_splits=2),
                    bank(qtype, 8, i, d, rng, True)]
            banks, dense = [q for q, _ in made], [w for _, w in made]
            errs, errs_bf16 = [], []
            for rows in ((1, 3, 8) if not interpret else (3,)):
                x = (rng.integers(-4, 5, size=(rows, d)) / 4).astype(np.float32)
                for name, (ids, weights) in routings(rows, 2, 8, rng).items():
                    want = moe_oracle(x, weights, ids, *dense, LIMIT)
                    errs.append(rel_err(moe(jnp.asarray(x), weights, ids, *banks, LIMIT), want))
                    errs_bf16.append(rel_err(moe(jnp.asarray(x, jnp.bfloat16), weights, ids, *banks, LIMIT), want))
            w, wd = bank(qtype, 0, d, 128, rng, True)
            x = (rng.integers(-4, 5, size=(3, d)) / 4).astype(np.float32)
            lin = rel_err(linear(jnp.asarray(x), w, jnp.float32), x.astype(np.float64) @ wd)
            entry.update(moe_rel_err_f32=max(errs), moe_rel_err_bf16=max(errs_bf16), linear_rel_err_f32=lin)
            ok = max(errs) <= 1e-5 and lin <= 1e-5
            entry["correct"] = ok
            print(f"  {qtype.name:8s} moe f32 {max(errs):.2e}  moe bf16 {max(errs_bf16):.2e}  linear f32 {lin:.2e}  "
                  f"{'OK' if ok else 'MISMATCH'}", flush=True)
        except Exception as e:                                         # noqa: BLE001  (report, go on)
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"  {qtype.name:8s} FAILED: {entry['error'][:400]}", flush=True)
            traceback.print_exc()


def part2(results: dict, interpret: bool, experts: int = 32) -> None:
    d, i, k = (4096, 2048, 8) if not interpret else (512, 256, 8)
    print(f"\nPart 2: one routed-expert layer (hidden {d}, width {i}, {experts} experts, top-{k}), bf16", flush=True)
    rng = np.random.default_rng(1)
    moe = jax.jit(functools.partial(mv_gpu.moe_matvec_gpu, interpret=interpret), static_argnums=6)
    whole = jax.jit(dispatch.dequantized_moe, static_argnums=6)
    copy = jax.jit(lambda a: a + 1)
    for qtype in (TYPES if not interpret else TYPES[:1]):
        entry = results.setdefault(qtype.name, {})
        if "error" in entry:
            continue
        try:
            banks = [bank(qtype, experts, d, i, rng, False)[0], bank(qtype, experts, d, i, rng, False)[0],
                     bank(qtype, experts, i, d, rng, False)[0]]
            per_expert = sum(b.nbytes for b in banks) // experts
            line = [f"  {qtype.name:8s}"]
            for rows in (3, 12):
                x = jnp.asarray(rng.standard_normal((rows, d)) * 0.5, jnp.bfloat16)
                ids = jnp.asarray(np.stack([rng.permutation(experts)[:k] for _ in range(rows)]), jnp.int32)
                weights = jnp.asarray(rng.random((rows, k)), jnp.float32)
                ours_s = seconds(moe, x, weights, ids, *banks, 3.0)
                whole_s = seconds(whole, x, weights, ids, *banks, 3.0, calls=3, repeats=3)
                err = rel_err(moe(x, weights, ids, *banks, 3.0), whole(x, weights, ids, *banks, 3.0))
                read = int(mv.expert_plan(ids, weights, experts).n_valid[0]) * per_expert
                copy_s = seconds(copy, jnp.zeros(read // 4, jnp.float32))
                copy_bw = 2 * read / copy_s
                entry[f"moe_{rows}rows"] = dict(kernel_ms=ours_s * 1e3, dequantize_all_ms=whole_s * 1e3,
                                                speedup=whole_s / ours_s, planes_gb_s=read / ours_s / 1e9,
                                                copy_gb_s=copy_bw / 1e9, of_copy=read / ours_s / copy_bw,
                                                rel_err_vs_dequantized=err, bytes_read=read)
                line.append(f"{rows:2d} rows {ours_s * 1e6:8.1f} us (dequantize-all {whole_s * 1e3:7.2f} ms, "
                            f"{whole_s / ours_s:6.1f}x) planes {read / ours_s / 1e9:7.1f} GB/s = "
                            f"{100 * read / ours_s / copy_bw:5.1f}% of copy; err {err:.1e}")
            print("  ".join(line), flush=True)
        except Exception as e:                                         # noqa: BLE001
            entry["error_part2"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"  {qtype.name:8s} FAILED: {entry['error_part2'][:400]}", flush=True)


def part3(results: dict, interpret: bool) -> None:
    d = 4096 if not interpret else 512
    print(f"\nPart 3: linear {d} x {d}, 3 rows, bf16", flush=True)
    rng = np.random.default_rng(2)
    linear = jax.jit(functools.partial(mv_gpu.linear_matvec_gpu, interpret=interpret), static_argnums=2)
    deq = jax.jit(dispatch.dequantized_matmul, static_argnums=2)
    dense = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((3, d)), jnp.bfloat16)
    w16 = jnp.asarray(rng.standard_normal((d, d)) * 0.02, jnp.bfloat16)
    dense_s = seconds(dense, x, w16, calls=50)
    for qtype in (TYPES if not interpret else TYPES[:1]):
        entry = results.setdefault(qtype.name, {})
        if "error" in entry:
            continue
        try:
            w = bank(qtype, 0, d, d, rng, False)[0]
            ours_s = seconds(linear, x, w, jnp.bfloat16, calls=50)
            deq_s = seconds(deq, x, w, jnp.bfloat16, calls=10)
            entry["linear_3rows"] = dict(kernel_us=ours_s * 1e6, dequantize_us=deq_s * 1e6, bf16_dense_us=dense_s * 1e6,
                                         planes_gb_s=w.nbytes / ours_s / 1e9)
            print(f"  {qtype.name:8s} {ours_s * 1e6:7.1f} us (dequantize-then-dot {deq_s * 1e6:8.1f} us, "
                  f"bf16 dense {dense_s * 1e6:6.1f} us)  planes {w.nbytes / ours_s / 1e9:6.1f} GB/s", flush=True)
        except Exception as e:                                         # noqa: BLE001
            entry["error_part3"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"  {qtype.name:8s} FAILED: {entry['error_part3'][:400]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--interpret", action="store_true", help="a small smoke run in interpret mode (CPU)")
    parser.add_argument("--parts", default="123")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))        # a timeout still writes --out
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    results: dict = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "formats": {}}
    try:
        if "1" in args.parts:
            part1(args.interpret, results["formats"])
        if "2" in args.parts:
            part2(results["formats"], args.interpret)
        if "3" in args.parts:
            part3(results["formats"], args.interpret)
    finally:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
