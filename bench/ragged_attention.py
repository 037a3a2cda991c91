"""Qwen3.8-27B's gated attention and GLM-5.3-Flash's absorbed MLA on a v5e-8, the Pallas kernel with
per-row lengths (``zoo.kernels.ragged_attention``) against the jnp key blocks it replaces on TPU, one
layer's call compiled by the real TPU compiler (libtpu's topology; no TPU needed).

The call: 3 rows, T tokens (1: decode; 4: a k=3 verify) in a 33,024-slot window, the cache split
over the 8 chips by its slots (4,128 each) under ``shard_map``, as the models run it (Qwen's
interleaved, chip c holding slots c, c + 8, ...; GLM's contiguous, chip c the c-th eighth). Both
forms are compiled for the target in the same run. What each moves per chip is counted from the
programs: XLA's bytes accessed for the jnp blocks' program is one trip of its block loop
(its cost model counts a loop body once; printed beside the three rows' keys and values of a block,
the part of it a trip must read), taken once per trip: the loop visits, on each chip, the blocks up
to the longest live row for every row; the kernel's
census gives its bytes per block, and it moves each row's own blocks (at least one per row and head:
the first step's block is fetched whatever the count). Printed for rows at equal and at mixed fill
levels: the busiest chip's bytes for each form, the kernel's estimate (grid steps x 0.35 us + its
bytes and XLA's bytes accessed for the rest of its program, e.g. GLM's token mask, / 819 GB/s)
against the jnp blocks' bytes at the same bandwidth (no loop overhead: the baseline's best
case), and their ratio. These are the programs' byte counts at the chip's bandwidth, not a
measurement on a TPU. From the repo root:
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zoo.kernels.census import kernel_census
from zoo.models.glm53 import mla
from zoo.models.qwen38 import gated_attention as ga
from zoo.models.shared.filled_blocks import kernel_block
from zoo.tools.compile_report import target_devices
from zoo.tools.roofline import HBM_BANDWIDTH, STEP_OVERHEAD_S
from zoo.tools.targets import get_target

B, L = 3, 33024


def _arg(mesh, shape, dtype, s=P()):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, s))


def qwen_call(mesh, t: int, kernel: bool):
    """Qwen3.8-27B: 24 query heads, 4 KV heads of 256, the KV cache split over its slots."""
    h, g, d, spec = 24, 4, 256, P(None, None, "tp", None)

    def attend(q, k, v, key_valid, query_slot, write_at, live):
        slots = ga.Slots(write_at, key_valid, query_slot, live, None, None)
        if kernel:
            return ga.kernel_attention(q, k, v, slots, d ** -0.5, spec)
        return ga.split_filled_attention(q, k, v, slots, d ** -0.5, spec)

    a = functools.partial(_arg, mesh)
    return attend, (a((B, t, h, d), jnp.bfloat16), a((B, g, L, d), jnp.bfloat16, spec),
                    a((B, g, L, d), jnp.bfloat16, spec), a((B, L), jnp.bool_),
                    a((B, t), jnp.int32), a((B,), jnp.int32), a((B,), jnp.bool_))


def glm_call(mesh, t: int, kernel: bool):
    """GLM-5.3-Flash's absorbed MLA: 64 heads over the 512-dim latent (keys and values), the
    indexer's pools of 4 tokens, the latent split over its slots."""
    h, c, pool, spec = 64, 512, 4, P(None, "tp", None)
    visibility = dict(pool=pool, select_tail=True)

    def attend(q, latent, pools, key_pos, query_pos, write_at, live):
        if kernel:
            return mla.kernel_latent_attention(q, latent, pools, key_pos, query_pos, write_at, live, c ** -0.5,
                                               spec, **visibility)
        whole = P(None, None, None, None)
        local = functools.partial(mla.split_latent_share, axis="tp", scale=c ** -0.5, **visibility)
        return jax.shard_map(local, in_specs=(whole, spec, P(None, None, None), P(None, "tp"), P(None, None),
                                              P(None), P(None)), out_specs=whole, check_vma=False)(
            q, latent, pools, key_pos, query_pos, write_at, live)

    a = functools.partial(_arg, mesh)
    return attend, (a((B, t, h, c), jnp.bfloat16), a((B, L, c), jnp.bfloat16, spec), a((B, t, L // pool), jnp.bool_),
                    a((B, L), jnp.int32, P(None, "tp")), a((B, t), jnp.int32), a((B,), jnp.int32),
                    a((B,), jnp.bool_))


def compile_call(mesh, model: str, t: int, kernel: bool):
    attend, args = (qwen_call if model == "qwen" else glm_call)(mesh, t, kernel)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh), kernel_census() as calls:
        compiled = jax.jit(attend).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return compiled, cost, calls, time.perf_counter() - t0


def blocks_per_chip(fills, t: int, share: int, block: int, chips: int, interleaved: bool):
    """Per chip: (the jnp loop's blocks, the same for every row; each row's own blocks), for rows
    whose last token after the call is at ``fill + t - 1`` (global slots; chip c holds c*share ..
    or, ``interleaved``, slots c, c + chips, ...: ``zoo.sharding.slot_layout``)."""
    out = []
    for c in range(chips):
        here = [(f + t - 1 - c) // chips + 1 if interleaved else f + t - c * share for f in fills]   # local reach
        own = [max(0, min(-(-n // block), -(-share // block))) for n in here]
        out.append((max(own), own))
    return out


def main() -> None:
    mesh = Mesh(np.asarray(target_devices(get_target("v5e-8"))), ("tp",))
    bandwidth = HBM_BANDWIDTH["v5e"]
    share, block = L // 8, kernel_block(L // 8)
    for model, title in [("qwen", "Qwen3.8-27B gated attention, 24 heads / 4 KV heads of 256"),
                         ("glm", "GLM-5.3-Flash absorbed MLA, 64 heads over a 512-dim latent")]:
        print(f"{title}, B={B}, L={L} split over 8 v5e chips ({share} slots each, blocks of {block}); per chip")
        for t in (1, 4):
            _, jnp_cost, _, jnp_s = compile_call(mesh, model, t, kernel=False)
            _, k_cost, calls, k_s = compile_call(mesh, model, t, kernel=True)
            around = k_cost["bytes accessed"]             # the kernel program's own XLA work (e.g. GLM's mask)
            (call,) = calls
            row_block = call.step_bytes                   # one row's keys and values over one block, all heads
            print(f"  T={t}: jnp blocks compiled in {jnp_s:.1f} s: XLA's bytes accessed (one loop trip) "
                  f"{jnp_cost['bytes accessed'] / 2**20:.1f} MiB, the {B} rows' block {B * row_block / 2**20:.1f} MiB; "
                  f"kernel compiled in {k_s:.1f} s: {call.steps} grid steps, {call.step_bytes / 2**20:.2f} MiB a step, "
                  f"XLA's bytes accessed around it {around / 2**20:.1f} MiB")
            for fills in [(1024,) * 3, (4096,) * 3, (32767 - t,) * 3, (1024, 4096, 32767 - t), (200, 300, 32767 - t)]:
                per_chip = blocks_per_chip(fills, t, share, block, 8, interleaved=model == "qwen")
                jnp_bytes = max(loop for loop, _ in per_chip) * jnp_cost["bytes accessed"]
                kernel_bytes = max(sum(max(1, n) for n in own) * row_block for _, own in per_chip)
                kernel_est = call.steps * STEP_OVERHEAD_S + (kernel_bytes + around) / bandwidth
                jnp_est = jnp_bytes / bandwidth
                layout = ""
                if model == "qwen":         # the same kernel had the slots been split contiguously
                    contiguous = blocks_per_chip(fills, t, share, block, 8, interleaved=False)
                    before = max(sum(max(1, n) for n in own) * row_block for _, own in contiguous)
                    layout = f"; contiguous shares {before / 2**20:5.1f} MiB, interleaved / contiguous " \
                             f"{kernel_bytes / before:.2f}"
                print(f"     rows at {'/'.join(map(str, fills)):>17}: jnp blocks {jnp_bytes / 2**20:6.1f} MiB "
                      f"{jnp_est * 1e3:.3f} ms; kernel {kernel_bytes / 2**20:6.1f} MiB {kernel_est * 1e3:.3f} ms; "
                      f"kernel / jnp {kernel_est / jnp_est:.2f}{layout}")


if __name__ == "__main__":
    main()
