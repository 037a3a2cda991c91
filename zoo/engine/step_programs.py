"""The engine's two whole-model programs as functions of the model's structure (``nnx`` graphdef) and
the MTP draft count, and one jitted copy of each per configuration, shared by every ``Generator``
of the process (``shared_program``): a second engine over an equal model (the same config, dtype,
layout) reuses the first one's compiled programs instead of tracing, lowering and loading them again.

    prefill_piece(graphdef, k, state, ids, mask, h_prev, next_ids, next_mask, cache, want_lp, mm=None)
    decode_step(graphdef, k, state, batch, active, force, cap, want_lp, plan=None, k_run=None)
    decode_narrow(graphdef, k, width, state, batch, ...) -> decode_step on the batch's first ``width`` rows
    shared_program(kind, graphdef, k, mesh, width) -> the jitted program ("prefill", "decode", "decode off",
                          and at ``width`` rows "decode narrow", "decode off narrow")
    shared_masked_programs(graphdef, k, mesh) -> the step split around token masks (``masked_step``)
    shared(key, make) -> the registry's entry for key (``prefix_rows.shared_row_copies`` uses it)
    forget_shared()       drop them all

A program reads nothing but its arguments, the graphdef and k (the graphdef carries every static
attribute of the model: its config, dtype, kernels), so equal keys trace equal programs. The
registry keeps the ``SHARED`` most recently asked-for configurations (their executables live as long
as they are kept).
"""

from __future__ import annotations

import collections
import functools
import inspect
import threading

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.engine import speculative
from zoo.engine.flat_state import as_state
from zoo.engine.logprobs import maybe_token_logprobs
from zoo.engine.masked_step import MaskedPrograms, pick_next
from zoo.engine.rows import first_token, join_rows, move_row, place, split_rows
from zoo.engine.sampling import flag_nonfinite, position_keys
from zoo.sharding.cache_axes import shard_cache

SHARED = 48                   # programs (and masked-step sets) the registry keeps
_programs: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


def takes_rows(model) -> bool:
    """Whether the model's MTP forward takes the image rows (``mm``; GLM's does)."""
    mtp = getattr(model, "mtp_forward", None)
    return mtp is not None and "mm" in inspect.signature(mtp).parameters


def shared(key: tuple, make):
    """The registry's entry for ``key`` (hashable, naming what ``make`` builds from), made by ``make()``
    the first time; the least recently asked-for beyond ``SHARED`` are dropped."""
    with _lock:
        if key in _programs:
            _programs.move_to_end(key)
            return _programs[key]
        _programs[key] = made = make()
        while len(_programs) > SHARED:
            _programs.popitem(last=False)
        return made


def forget_shared() -> None:
    """Drop every entry of the registry: later generators and models compile their programs anew
    (their executables are freed once nothing else holds them)."""
    with _lock:
        _programs.clear()


def shared_program(kind: str, graphdef, k: int, mesh=None, width: int = 0):
    """The jitted ``kind`` program of this configuration ("prefill": ``prefill_piece`` with its one-row
    cache donated; "decode": ``decode_step`` with the batch donated; "decode off": the same with
    drafting off; "decode narrow", "decode off narrow": those on the batch's first ``width`` rows
    (``decode_narrow``); the small ones, ``_jitted``: "empty", "place", "move", "first", whose graphdef
    may be None where they do not read the model), one per (kind, graphdef, k, mesh, width) in the process."""
    return shared((kind, graphdef, int(k), mesh, int(width)), lambda: _jitted(kind, graphdef, int(k), int(width)))


def shared_masked_programs(graphdef, k: int, mesh=None) -> MaskedPrograms:
    """The decode step split around token masks (``masked_step.MaskedPrograms``), one per
    (graphdef, k, mesh) in the process."""
    return shared(("masked", graphdef, int(k), mesh), lambda: MaskedPrograms(graphdef, int(k), mesh))


def program_impl(kind: str, width: int = 0):
    """The function of ``kind`` (its donated argument: ``DONATED[kind]``, counted after graphdef and k;
    the narrow kinds at ``width`` rows)."""
    if kind.endswith(" narrow"):
        return functools.partial(decode_narrow, width=width, k_run=0 if kind == "decode off narrow" else None)
    return {"prefill": prefill_piece, "decode": decode_step,
            "decode off": functools.partial(decode_step, k_run=0)}[kind]


DONATED = {"prefill": (6,), "decode": (1,), "decode off": (1,), "decode narrow": (1,), "decode off narrow": (1,)}


def _jitted(kind: str, graphdef, k: int, width: int = 0):
    """``kind`` jitted for (graphdef, k): the whole-model programs (``program_impl``, ``DONATED``) and
    the small ones around them: "empty" (``empty_batch`` of (state, rows, length), rows and length
    static), "place" (``rows.place``, the batch donated), "move" (``rows.move_row``, the batch donated),
    "first" (``rows.first_token``)."""
    if kind == "empty":
        return jax.jit(functools.partial(empty_batch, graphdef, k), static_argnums=(1, 2))
    if kind == "place":
        return jax.jit(functools.partial(place, k=k), donate_argnums=(0,))
    if kind == "move":
        return jax.jit(move_row, donate_argnums=(0,))
    if kind == "first":
        return jax.jit(first_token)
    return jax.jit(functools.partial(program_impl(kind, width), graphdef, k), donate_argnums=DONATED[kind])


def prefill_piece(graphdef, k: int, state, ids, mask, h_prev, next_ids, next_mask, cache, want_lp, mm=None):
    """One prompt piece ``ids`` [1, C], right-padded (``mask``: its real tokens first), written at
    the cache's index; the index then advances by the real tokens only, so the row stays compact
    (slot s holds position s) and the next piece overwrites the padding. With spec, also the MTP
    rows of the piece, lagged by one: the row of token x_t pairs it with h_{t-1} (``h_prev``
    [1, D] for the first, the previous piece's last hidden state) and sits in slot t, so the MTP
    slots of a block depend on that block's tokens only (the prefix cache shares them).
    Returns (logits [1, V] and hidden [1, D] at the last real token, cache, the
    ``maybe_token_logprobs`` of ``next_ids`` ([1, C] leaves: position t scores the token after t;
    computed where the traced bool ``want_lp`` holds)).
    ``mm``: the piece's image inputs (``ImagePrefill.piece``), None for text."""
    model = nnx.merge(graphdef, as_state(state))
    count = mask.sum(axis=1, dtype=jnp.int32)
    index, has_prev = cache.slots.index, cache.slots.pos > 0
    logits, hidden, cache = model(ids, mask, cache) if mm is None else model(ids, mask, cache, mm=mm)
    cache = cache.replace(slots=cache.slots.replace(index=index + count))
    if k:
        mtp_index = cache.mtp.slots.index
        rows = mask & jnp.concatenate([has_prev[:, None], mask[:, :-1]], axis=1)
        h_in = jnp.concatenate([h_prev[:, None].astype(hidden.dtype), hidden[:, :-1]], axis=1)
        mtp_mm = {} if mm is None or not takes_rows(model) else {"mm": mm._replace(positions=None)}
        _, _, cache = model.mtp_forward(h_in, ids, rows, cache, **mtp_mm)   # row t embeds x_t: mm aligned
        cache = cache.replace(mtp=cache.mtp.replace(slots=cache.mtp.slots.replace(index=mtp_index + count)))
    last = jnp.maximum(count - 1, 0)
    logits_last = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    hidden_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return logits_last, hidden_last, shard_cache(cache), maybe_token_logprobs(want_lp, logits, next_ids)

def decode_step(graphdef, k: int, state, batch, active, force, cap, want_lp, plan=None,
                k_run: int | None = None):
    """One decode step; ``force`` [B] int32: the token a row must emit this step (-1: sample);
    ``cap`` [B] int32: the most tokens a speculative row may emit this step; ``plan``: the
    speculation policy's per-row draft lengths and host drafts (``zoo.engine.speculative``);
    ``k_run`` 0: the speculative generator's step with drafting off. Returns
    (batch, tokens [B, T], n [B]: -1 for a row whose logits are not finite, the
    ``maybe_token_logprobs`` of ``tokens`` ([B, T] leaves) from the target model's logits (the
    verify logits when speculating), computed where the traced bool ``want_lp`` holds)."""
    model = nnx.merge(graphdef, as_state(state))
    cache, carry, params = batch["cache"], batch["carry"], batch["params"]
    if k:
        k = k if k_run is None else k_run
        cache, carry, tokens, n, logits = speculative.spec_step(model, cache, carry, active,
                                                                position_keys(params, k + 1), params, k, force,
                                                                cap, with_logits=True, plan=plan)
    else:
        logits, _, cache = model(carry["tok"][:, None], active[:, None], cache)
        carry, new = pick_next(carry["tok"], params, logits[:, 0], active, force)
        tokens, n = new[:, None], active.astype(jnp.int32)
    params = {**params, "step": params["step"] + n}          # the output position of each row's next token
    n = flag_nonfinite(n, logits)
    batch = {"cache": shard_cache(cache), "carry": carry, "params": params}
    return batch, tokens, n, maybe_token_logprobs(want_lp, logits, tokens)


def decode_narrow(graphdef, k: int, state, batch, active, force, cap, want_lp, plan=None, *, width: int,
                  k_run: int | None = None):
    """``decode_step`` on the batch's first ``width`` rows (every batch leaf's first axis is its row;
    the batch is donated). The slot buffers (cache leaves with a ``rows.SLOT_AXES`` axis: the KV and
    latent caches, most of a row's bytes) go in whole: the attention reads their first rows and writes
    the step's tokens in place (``zoo.models.shared.filled_blocks``, ``kv_slots``). The rest (recurrent
    states, slot bookkeeping, carry, params: per row small) is cut to rows [0, width) and written back
    (``rows.split_rows``, ``rows.join_rows``). ``active``, ``force``, ``cap`` and the ``plan``'s
    leaves are those rows' ([width, ...]), as are the returned tokens, counts and logprob leaves. A
    row's step does not depend on the rows beside it, so a batch whose decoding rows all lie below
    ``width`` steps here for what ``width`` rows cost instead of B (a compute-bound backend's cost
    grows with the rows: on a CPU, the embedded models' step at 16 rows costs ~3x one at 1 or 4)."""
    rows, others = split_rows(batch, width)
    rows, tokens, n, scored = decode_step(graphdef, k, state, rows, active, force, cap, want_lp, plan, k_run)
    batch = join_rows(rows, others)
    return batch, tokens, n, scored


def empty_batch(graphdef, k: int, state, rows: int, length: int) -> dict:
    """The batch state of ``rows`` x ``length`` slots, zeroed: ``cache`` (the model's, without its MTP
    part when ``k`` is 0), ``carry`` and the sampling ``params`` (``Generator``'s layout)."""
    model = nnx.merge(graphdef, as_state(state))
    cache = shard_cache(model.init_cache(rows, length))
    if not k:
        cache = cache.without_mtp()
    d = model.config.hidden_size
    carry = ({"h": jnp.zeros((rows, k + 1, d), model.dtype), "tok": jnp.zeros((rows, k + 1), jnp.int32),
              "n": jnp.ones((rows,), jnp.int32)} if k else {"tok": jnp.zeros((rows,), jnp.int32)})
    params = {"temperature": jnp.zeros((rows,), jnp.float32), "top_k": jnp.zeros((rows,), jnp.int32),
              "top_p": jnp.ones((rows,), jnp.float32), "seed": jnp.zeros((rows,), jnp.uint32),
              "step": jnp.zeros((rows,), jnp.int32)}
    return {"cache": cache, "carry": carry, "params": params}
