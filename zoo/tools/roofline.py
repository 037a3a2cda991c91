"""A roofline per compiled program and chip: what a step must read, how long that takes at the chip's
HBM bandwidth, and what the Pallas kernels add for their grid steps.

    must_read(module, config, rows=..., mtp_calls=..., mtp_rows=...) -> dict of bytes per chip
    state_read(state, fill=None) -> bytes per chip of the batch state a step reads at a fill level
    roofline(read, cache, calls, cost, chip) -> dict

**Bytes a step must read** (per chip, from the abstract model's shards, by parameter path):

* every weight of the main model once, but the embedding table only for the step's rows and each
  routed-expert bank only for its distinct experts: ``min(E, rows * top_k) / E`` of its shard (an
  expert's width is split across chips in "tp"; in "ep" a chip holds E/ep whole experts and gets
  ~rows*top_k/ep of the slots: the same fraction);
* the MTP layer's weights once per MTP call (``mtp_calls``: k for a decode step with k drafts,
  1 for a prefill chunk with MTP rows), its experts for ``mtp_rows`` rows a call;
* the batch state: every cache leaf whole (a decode step at full context reads all of it), or at
  ``fill`` tokens per row (``zoo compile --fill``) the per-token leaves only up to that fill, as the
  length-aware attention reads them: of a leaf split over its slots, the busiest chip's share (GLM's
  latent cache: chip 0 holds the first slots; Qwen's KV cache, interleaved: ``fill / n`` on every
  chip); of one whole on every chip (or split by heads), ``fill / L`` of it.

**Time.** ``bytes / HBM bandwidth`` is the floor. The Pallas kernels' estimate is
``grid steps * STEP_OVERHEAD_S + bytes they move / bandwidth`` (the overhead not hidden behind the
DMA: the conservative sum), from ``zoo.kernels.census``; the attention kernel's bytes at the fill
(the blocks each row reads), its steps all of them (a skipped step still costs its overhead). XLA's cost model gives
``optimal_seconds`` for the rest; where it cannot cost an op (a Pallas custom call) it counts -1,
so a negative figure's fractional part is the estimate of what it could cost (both are reported).
"""

from __future__ import annotations

import math
import re

import jax
from flax import nnx

from zoo.kernels.census import KernelCall
from zoo.loader.abstract import shard_bytes_of
from zoo.sharding.cache_axes import CacheState, map_with_axes, token_axis
from zoo.sharding.slot_layout import INTERLEAVED_AXES

STEP_OVERHEAD_S = 0.35e-6            # per Pallas grid step on TPU (the Pallas TPU pipelining guide's figure)
HBM_BANDWIDTH = {"v5e": 819e9, "v6e": 1640e9, "v5p": 2765e9}     # bytes/s per chip, vendor figures


def must_read(module, cfg, *, rows: int, mtp_calls: int = 0, mtp_rows: int = 0) -> dict:
    """Bytes per chip a step of ``rows`` rows must read of the weights (module docstring), by part:
    ``{"weights": .., "experts": .., "embedding": .., "mtp": ..}``."""
    n_experts = int(getattr(cfg, "n_routed_experts", 0) or getattr(cfg, "num_experts", 0) or 1)
    top_k = int(getattr(cfg, "num_experts_per_tok", 1) or 1)
    share = lambda n: min(n_experts, n * top_k) / n_experts            # noqa: E731
    vocab = cfg.vocab_size
    out = {"weights": 0, "experts": 0, "embedding": 0, "mtp": 0}
    for keys, var in nnx.to_flat_state(nnx.state(module)):    # parameter paths as the loader names them
        path, size = ".".join(map(str, keys)), shard_bytes_of(var.get_value())
        mtp = path.startswith("mtp.")
        if re.search(r"(^|\.)experts\.", path):
            n = mtp_rows if mtp else rows
            size = size * share(n) * (mtp_calls if mtp else 1)
            out["mtp" if mtp else "experts"] += size
        elif path.startswith("embed_tokens."):
            out["embedding"] += size * min(1.0, (rows + mtp_calls * mtp_rows) / vocab)
        elif mtp:
            out["mtp"] += size * mtp_calls
        else:
            out["weights"] += size
    return {k: int(v) for k, v in out.items()}


def state_read(state, fill: int | None = None) -> int:
    """Bytes per chip a step reads of the batch ``state`` (arrays or ShapeDtypeStructs with their
    shardings; cache containers carry their logical axes) with rows filled to ``fill`` tokens (None:
    every leaf whole). A per-token leaf of E entries (slots, or pools of L / E tokens) reads
    ``min(filled entries, S) / S`` of its shard of S entries (the busiest chip: its slots come first),
    or where its slots interleave over the chips (``slot_layout.INTERLEAVED_AXES``) ``filled / n`` of them."""
    if fill is None:
        return shard_bytes_of(state)
    is_cache = lambda x: isinstance(x, CacheState)                                  # noqa: E731
    leaves = jax.tree.leaves(state, is_leaf=is_cache)
    whole = [x for x in leaves if not is_cache(x)]
    per_token = []                                                  # (leaf, its token axis)

    def sort(_, x, axes):
        a = token_axis(axes)
        per_token.append((x, a, axes[a] in INTERLEAVED_AXES)) if a is not None else whole.append(x)
        return x

    map_with_axes(sort, [x for x in leaves if is_cache(x)])
    slots = max((x.shape[a] for x, a, _ in per_token), default=0)
    total = shard_bytes_of(whole)
    for x, a, interleaved in per_token:
        entries = x.shape[a]
        share = x.sharding.shard_shape(x.shape)[a] if getattr(x, "sharding", None) is not None else entries
        filled = -(-min(fill, slots) * entries // slots)                  # entries holding the first fill tokens
        if interleaved:                                                   # every chip holds 1 / n of them
            filled = -(-filled * share // entries)
        total += shard_bytes_of(x) * min(filled, share) / share
    return int(total)


def xla_seconds(cost: dict) -> tuple[float, int]:
    """XLA's ``optimal_seconds`` and the ops it could not cost: a negative figure is ``-ops +
    estimate``, whose fractional part is the estimate."""
    seconds = float(cost.get("optimal_seconds", 0.0))
    if seconds >= 0:
        return seconds, 0
    return seconds - math.floor(seconds), -math.floor(seconds)


def roofline(read: dict, cache_bytes: int, calls: list[KernelCall], cost: dict, chip: str,
             fill: int | None = None) -> dict:
    """The roofline figures of one program on one chip (``chip``: "v5e", "v6e" or "v5p"), its kernels'
    bytes at ``fill`` tokens per row (``KernelCall.bytes_at``; None: the whole window)."""
    bandwidth = HBM_BANDWIDTH[chip]
    total = sum(read.values()) + cache_bytes
    by_kernel: dict[str, dict] = {}
    for c in calls:
        k = by_kernel.setdefault(c.kernel, {"calls": 0, "steps": 0, "weight_bytes": 0})
        k["calls"] += 1
        k["steps"] += c.steps
        k["weight_bytes"] += c.bytes_at(fill)
    steps = sum(c.steps for c in calls)
    kernel_bytes = sum(c.bytes_at(fill) for c in calls)
    kernel_floor = kernel_bytes / bandwidth
    kernel_estimate = steps * STEP_OVERHEAD_S + kernel_floor
    xla, uncosted = xla_seconds(cost)
    return {
        "hbm_bandwidth": bandwidth, "must_read": {**read, "cache": cache_bytes, "total": total},
        "floor_s": total / bandwidth,
        "pallas": {"calls": len(calls), "grid_steps": steps, "weight_bytes": kernel_bytes,
                   "step_overhead_s": STEP_OVERHEAD_S, "floor_s": kernel_floor, "estimate_s": kernel_estimate,
                   "ratio": kernel_estimate / kernel_floor if kernel_floor else None, "by_kernel": by_kernel},
        "xla": {"optimal_seconds": float(cost.get("optimal_seconds", 0.0)), "estimate_s": xla,
                "uncosted_ops": uncosted, "bytes_accessed": float(cost.get("bytes accessed", -1))},
    }
