"""The engine's small programs and sizes around a batch's rows (``zoo.engine.generator``): the memory
budget of the caches, the first token of a prefilled request, placing it into a row, moving a row,
the batch's first rows apart from the rest (the narrow programs').

    default_memory_budget()                          bytes the caches may use
    first_token(logits [B, V], params, mask, want_lp) the token [B] after a prefill (-1: broken logits)
    place(batch, cache, first [1], h_last [1, D], params, r, k)   a prefilled request into row r
    move_row(batch, src, dst)                        row src's state copied into row dst
    split_rows(batch, width) -> (rows, others)       the first rows apart (their slot buffers whole)
    join_rows(rows, others) -> batch                 split_rows undone, the rows' new state in
    narrow_width(requested, rows, mesh) -> int       the narrow decode programs' rows (0: none)
    rows_of(x [w, ...], rows) -> [rows, ...]         a narrow step's per-row output, zero-padded
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from zoo.engine.logprobs import maybe_token_logprobs
from zoo.engine.sampling import row_keys, sample
from zoo.engine.token_mask import apply_token_mask
from zoo.formats.host_arrays import host_memory
from zoo.sharding.cache_axes import map_with_axes

SLOT_AXES = ("kv_len", "latent_len")   # a step of the batch's first rows reads / writes these in place


def host_available() -> int:
    """Host RAM the kernel could hand out now (``MemAvailable``; free pages where that is unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def default_host_tier() -> int:
    """Bytes of the prefix cache's host-RAM tier when none is given: a tenth of host RAM, at most a
    fifth of what is available now (on a CPU host the loaded weights are in that RAM too)."""
    return int(min(0.1 * host_memory(), 0.2 * host_available()))


def default_memory_budget() -> int:
    """Bytes the caches may use: 80% of the free accelerator memory; on a host without one (the CPU
    backend, where the weights are in host RAM too) a quarter of host RAM, but at most 40% of what is
    still available once the model is loaded (the programs' temporaries need the rest: a 12.9 GB
    Qwen3.8-27B on a 24 GiB host got 16 rows of 4k, 7 GB, and was killed). With several processes the
    least of theirs (admission decides alike in every process)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        budget = int(0.8 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    else:
        budget = int(min(0.25 * host_memory(), 0.4 * host_available()))
    if jax.process_count() > 1:       # in MiB: without jax_enable_x64 the gathered int64 becomes int32
        from jax.experimental import multihost_utils
        mib = multihost_utils.process_allgather(np.int32(min(budget >> 20, 2**31 - 1)))
        budget = int(np.min(mib)) << 20
    return budget


def place(batch: dict, cache, first: jax.Array, h_last: jax.Array, params: dict, r, k: int) -> dict:
    """A prefilled request into row ``r`` of ``batch``: its ``cache`` (one row), its carry from its
    first token ``first`` [1] (and, with ``k`` MTP drafts, the prefill's last hidden state ``h_last``
    [1, D] as its one pending MTP row), its sampling ``params`` ([1] leaves)."""
    if k:
        h = jnp.zeros((1, k + 1, h_last.shape[-1]), h_last.dtype).at[:, 0].set(h_last)
        tok = jnp.zeros((1, k + 1), jnp.int32).at[:, 0].set(first)
        carry = {"h": h, "tok": tok, "n": jnp.ones((1,), jnp.int32)}
    else:
        carry = {"tok": first}
    row = {"cache": cache, "carry": carry, "params": params}
    return jax.tree.map(lambda b, x: jax.lax.dynamic_update_index_in_dim(b, x[0].astype(b.dtype), r, 0), batch, row)


def move_row(batch: dict, src, dst) -> dict:
    """``batch`` with row ``src``'s state (every leaf's entry on its leading rows axis: cache, carry,
    sampling parameters) copied into row ``dst`` (int32 scalars, traced: one program for every pair).
    A row's tokens do not depend on its index (its PRNG keys come from its seed and output positions),
    so the request steps on from ``dst`` as it would have from ``src``; ``src`` keeps a stale copy,
    which no step reads (a free row) and ``place`` overwrites."""
    return jax.tree.map(lambda b: jax.lax.dynamic_update_index_in_dim(
        b, jax.lax.dynamic_index_in_dim(b, src, 0, keepdims=False), dst, 0), batch)


def slot_buffers(cache) -> object:
    """``cache``'s tree with True at its slot buffers (leaves with a ``SLOT_AXES`` axis: the KV and
    latent caches, most of a row's bytes) and False elsewhere."""
    return map_with_axes(lambda _, x, axes: any(a in SLOT_AXES for a in axes), cache)


def split_rows(batch: dict, width: int) -> tuple[dict, dict]:
    """``(rows, others)``: ``rows`` the batch's first ``width`` rows with its slot buffers whole (a
    step of those rows reads their first rows and writes its tokens in place:
    ``zoo.models.shared.filled_blocks``, ``kv_slots``), every other leaf cut to rows [0, width) (per
    row small: recurrent states, slot bookkeeping, carry, params); ``others`` those other leaves whole
    (None at the slot buffers), for ``join_rows``."""
    whole = slot_buffers(batch["cache"])

    def part(keep, cut):
        return {"cache": jax.tree.map(lambda w, x: keep(x) if w else cut(x), whole, batch["cache"]),
                **{key: jax.tree.map(cut, v) for key, v in batch.items() if key != "cache"}}
    return part(lambda x: x, lambda x: x[:width]), part(lambda x: None, lambda x: x)


def join_rows(rows: dict, others: dict) -> dict:
    """The batch ``split_rows`` took apart, with ``rows``' (possibly stepped) state as its first rows:
    the slot buffers ``rows``' own, every other leaf ``others``' with its first rows written over."""
    put = lambda x, part: jax.lax.dynamic_update_slice_in_dim(x, part.astype(x.dtype), 0, 0)   # noqa: E731
    cache = jax.tree.map(lambda w, part, x: part if w else put(x, part), slot_buffers(rows["cache"]), rows["cache"],
                         others["cache"])
    return {"cache": cache, **{key: jax.tree.map(lambda part, x: put(x, part), v, others[key])
                               for key, v in rows.items() if key != "cache"}}


def first_token(logits: jax.Array, params: dict, mask: jax.Array, want_lp: jax.Array):
    """The token [B] sampled from the prefill's last logits [B, V] (PRNG step 0; -1 where they are not
    finite), masked by ``mask`` [B, W] (all ones: unconstrained), and its ``maybe_token_logprobs``
    ([B, 1] leaves, from the unmasked logits; computed where the traced bool ``want_lp`` holds)."""
    keys = row_keys({**params, "step": jnp.zeros_like(params["step"])})
    tok = sample(apply_token_mask(logits, mask), keys, params["temperature"], params["top_k"], params["top_p"])
    tok = jnp.where(jnp.isfinite(logits).all(axis=-1), tok, -1)     # -1: the prefill's logits are broken
    return tok, maybe_token_logprobs(want_lp, logits[:, None], tok[:, None])


def narrow_width(requested: int | None, rows: int, mesh) -> int:
    """The rows of the narrow decode programs (``step_programs.decode_narrow``) for a batch of ``rows``:
    ``requested`` if it is below ``rows`` (0 or a width at or past ``rows``: none); None: a quarter of
    the rows where a step's cost follows the rows it computes and a narrow program needs no layout of
    its own, one CPU device without a mesh (elsewhere a decode step reads the weights whatever its
    rows, and each program is another compile: none). ``ValueError`` for a negative width, or a
    width asked for on a mesh (the rows of a batch there are laid out over its devices)."""
    if requested is None:
        requested = rows // 4 if mesh is None and jax.default_backend() == "cpu" else 0
    elif requested < 0:
        raise ValueError(f"narrow_rows must be >= 0, got {requested}")
    elif requested and mesh is not None:
        raise ValueError("narrow_rows needs one device without a mesh (on a mesh the rows are laid out over it)")
    return int(requested) if 0 < requested < rows else 0


def rows_of(x: np.ndarray, rows: int) -> np.ndarray:
    """A narrow step's per-row host output ``x`` [w, ...] as the whole batch's [rows, ...] (zeros past w)."""
    out = np.zeros((rows,) + x.shape[1:], x.dtype)
    out[:len(x)] = x
    return out
