"""The fixed program set of a ``Generator`` (``zoo.engine.generator``), as a mixin: the jitted
whole-model programs, their abstract arguments on the model's mesh (what ``zoo compile`` lowers
for a target), warming every one of them up before the server says ready, and the bytes of the
batch state a configuration holds per device.

    program(name)        -> jitted "decode" (batch donated), "decode off" (a speculative generator's
                            step with drafting off) or "prefill" (one-row cache donated)
    program_set()        -> [(name, program, abstract args)]: decode at rows x L (with k MTP
                            drafts when speculating, and under the auto speculation policy
                            also with drafting off) and a prefill at each of ``prefill_widths``
                            (and, for a model with a vision tower, one with image inputs at each)
    masked_chain()       -> [(part, name, program, args_from)]: the decode step split around grammar
                            token masks (logits, pick; or draft, verify, settle), as they run
    warmup(progress)     -> [(name, seconds)]: each program run once on zeros through the calls
                            requests make; afterwards no request compiles anything
    cache_bytes(rows, L) -> int, one device's bytes of the batch state

The Generator provides the state these read (``_state``, ``_B``, ``_L``, ``k``, ``prefill_small``,
``prefill_chunk``, ``prefix``, ``model``, ``_masked`` (its ``MaskedPrograms``), ``_mask_words``, the jitted
callables ``_empty_fn``, ``_first_fn``, ``_place_fn``, ``_step_fn``, ``_graphdef`` (the programs are
``zoo.engine.step_programs``'), ``_empty_impl``; ``_images``: the
``zoo.engine.image_prefill.ImagePrefill`` or None, whose own programs ``warmup`` runs too).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from zoo.engine.options import RequestOptions
from zoo.engine.spec_policy import Plan
from zoo.engine.step_programs import DONATED, program_impl
from zoo.sharding.cache_axes import cache_shardings
from zoo.sharding.mesh import on_mesh


class ProgramSet:
    """Mixin of ``Generator``: its compiled programs (see the module docstring)."""

    @property
    def weights(self):
        """The model's parameter state, the first argument of every program."""
        return self._state

    def program(self, name: str, keep_unused: bool = False):
        """The jitted device program ``name`` ("decode": ``(state, batch, active, force, cap, masks,
        want_lp)``, the batch donated; "prefill": ``(state, ids, mask, h_prev, next_ids, next_mask, cache,
        want_lp)``, the cache donated), not wrapped in the model's mesh: lower it under ``jax.set_mesh``
        (``zoo.tools.compile_report``). ``keep_unused``: the weights a program does not read stay
        arguments (resident memory)."""
        impl = functools.partial(program_impl(name, self.narrow_rows), self._graphdef, self.k)
        return jax.jit(impl, donate_argnums=DONATED[name], keep_unused=keep_unused)

    @property
    def drafts_off(self) -> bool:
        """Whether the set has the step with drafting off (the auto speculation policy runs it)."""
        return bool(self.k) and self.spec_policy.mode == "auto"

    def abstract_plan(self, rows: int | None = None) -> dict:
        """The speculation policy's per-row inputs of the K-draft step (``zoo.engine.speculative``) for
        ``rows`` rows (default: the batch's)."""
        small, b = self._replicated_struct, rows or self._B
        return {"len": small((b,), jnp.int32), "drafts": small((b, self.k), jnp.int32), "host": small((b,), jnp.bool_)}

    def abstract_batch(self, rows: int, length: int) -> dict:
        """The batch state for ``rows`` x ``length`` slots as ShapeDtypeStructs with their shardings
        on the model's mesh (cache leaves by their logical axes, the rest replicated)."""
        mesh = getattr(self.model, "mesh", None)
        shapes = on_mesh(lambda: jax.eval_shape(lambda: self._empty_impl(rows, length)), mesh)()
        if mesh is None:
            return shapes
        replicated = NamedSharding(mesh, PartitionSpec())
        with_sharding = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)   # noqa: E731
        cache = jax.tree.map(with_sharding, shapes["cache"], cache_shardings(shapes["cache"], mesh))
        rest = {k: jax.tree.map(lambda x: with_sharding(x, replicated), v) for k, v in shapes.items() if k != "cache"}
        return {"cache": cache, **rest}

    def _replicated_struct(self, shape: tuple, dtype) -> jax.ShapeDtypeStruct:
        """A small argument of ``shape`` and ``dtype``, replicated on the model's mesh (if any)."""
        mesh = getattr(self.model, "mesh", None)
        sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    @property
    def prefill_widths(self) -> tuple[int, ...]:
        """The prefill pieces' widths (``_plan``): the small one and the chunk where it fits the row."""
        return tuple(sorted({self.prefill_small} | ({self.prefill_chunk} if self.prefill_chunk <= self._L else set())))

    def program_set(self, keep_unused: bool = False) -> list[tuple[str, object, tuple]]:
        """The whole-model programs of this configuration, all ``warmup`` compiles of them and all
        ``zoo compile`` lists: ``(name, program, abstract args)``, ``program`` from ``program`` and the
        args ShapeDtypeStructs with their shardings on the model's mesh. The decode step at rows x L
        (with k MTP drafts when speculating) and the prefill at each of ``prefill_widths``; with a vision
        tower also the prefill with image inputs (its ``mm``, ``ImagePrefill.abstract_inputs``) at each."""
        small = self._replicated_struct
        b, L = self._B, self._L
        batch = self.abstract_batch(b, L)
        # the decode step (and the auto policy's step with drafting off) on every row, and on the
        # batch's first rows where the set has the narrow width (``decode_narrow``)
        widths = [(b, "", "decode")]
        if self.narrow_rows:
            widths.append((self.narrow_rows, f" on rows 0..{self.narrow_rows - 1}", "decode narrow"))
        out = []
        for rows, where, kind in widths:
            decode = (self.weights, batch, small((rows,), jnp.bool_), small((rows,), jnp.int32),
                      small((rows,), jnp.int32), small((), jnp.bool_))
            out.append((f"decode B={b} L={L}{where}" + (f" MTP k={self.k}" if self.k else ""),
                        self.program(kind, keep_unused), decode + ((self.abstract_plan(rows),) if self.k else ())))
            if self.drafts_off:
                out.append((f"decode B={b} L={L}{where} MTP drafts off",
                            self.program(kind.replace("decode", "decode off"), keep_unused), decode))
        row = self.abstract_batch(1, L)["cache"]
        h = small((1, self.model.config.hidden_size), self.model.module.dtype)
        for w in self.prefill_widths:
            ids, mask = small((1, w), jnp.int32), small((1, w), jnp.bool_)
            out.append((f"prefill width={w} L={L}" + (" + MTP rows" if self.k else ""),
                        self.program("prefill", keep_unused), (self.weights, ids, mask, h, ids, mask, row,
                                                               small((), jnp.bool_))))
        for w in self.prefill_widths if self._images is not None else ():
            ids, mask = small((1, w), jnp.int32), small((1, w), jnp.bool_)
            out.append((f"prefill width={w} L={L} with images" + (" + MTP rows" if self.k else ""),
                        self.program("prefill", keep_unused), (self.weights, ids, mask, h, ids, mask, row,
                                                               small((), jnp.bool_),
                                                               self._images.abstract_inputs(w, small))))
        return out

    def masked_chain(self, keep_unused: bool = False) -> list[tuple[str, str, object, object]]:
        """The decode step split around token masks (``zoo.engine.masked_step``): the programs a batch
        with a grammar-constrained row runs instead of the decode step, ``(part, name, program,
        args_from)`` in the order they run (``part``: "logits", "pick", or "draft", "verify",
        "settle"), where ``args_from(outs)`` gives a part's abstract arguments from the abstract
        outputs of the parts before it (``outs[part]``). ``zoo compile`` compiles them as a chain, so
        each part sees the shardings the parts before it leave (``Compiled.out_info``)."""
        small = self._replicated_struct
        b, L, k, parts = self._B, self._L, self.k, self._masked
        batch, w = self.abstract_batch(b, L), self.weights
        active, force, cap, want = (small((b,), jnp.bool_), small((b,), jnp.int32), small((b,), jnp.int32),
                                    small((), jnp.bool_))
        masks = small((b, k + 1, self._mask_words), jnp.int32)
        plan = self.abstract_plan() if k else None
        make = {"logits": lambda o: (w, batch, active),                              # -> batch, logits
                "pick": lambda o: (*o["logits"], active, force, masks, want),
                "draft": lambda o: (w, batch, active, plan),                         # -> batch, drafts, x_m
                "verify": lambda o: (w, o["draft"][0], o["draft"][2], o["draft"][1], active, plan),
                "settle": lambda o: (w, o["verify"][0], o["verify"][3], o["verify"][1], o["verify"][2],
                                     o["draft"][1], active, force, cap, masks, want, plan)}
        shape = f" B={b} L={L}" + (f" k={k}" if k else "")
        return [(name, f"decode with token masks: {name}{shape}", parts.jitted(name, keep_unused), make[name])
                for name in parts.parts]

    def warmup(self, progress=None) -> list[tuple[str, float]]:
        """Compile every program a request can run (the ``program_set`` and the small ones around it:
        the empty batch and row, the first token, placing a row, moving one (with narrow rows), the prefix
        cache's copies; with a vision tower its programs, ``ImagePrefill.warmup``) by
        running each once on zeros, through the same calls requests make; afterwards no request
        compiles anything. ``progress(name, seconds, done, total)`` after each. Returns (name,
        seconds) per program. The batch is left empty."""
        timings: list[tuple[str, float]] = []
        images = [] if self._images is None else self._images.warmup_names(self.prefill_widths)
        decodes = (2 + self.drafts_off) * (1 + bool(self.narrow_rows))      # each width: drafting on and off, masked
        total = (len(self.prefill_widths) + 1 + decodes + bool(self.narrow_rows) + (self.prefix is not None)
                 + len(images))

        def timed(name, fn):
            t0 = time.perf_counter()
            out = fn()
            jax.block_until_ready(out)
            timings.append((name, time.perf_counter() - t0))
            if progress is not None:
                progress(name, timings[-1][1], len(timings), total)
            return out

        self._ensure_batch()
        row = None
        for w in self.prefill_widths:
            def prefill(w=w):
                cache = self._empty_fn(1, self._L)["cache"]
                return self._prefill_piece(np.zeros(w, np.int32), 0, w, w, cache, self._h_zero(), False)
            row = timed(f"prefill width={w}", prefill)
        if self._images is not None:             # the tower per bucket, then per width placing + prefill
            self._images.warmup(self._state, self.prefill_widths, lambda ids, w, mm: self._prefill_piece(
                ids, 0, len(ids), w, self._empty_fn(1, self._L)["cache"], self._h_zero(), False, mm), timed)
        logits, h_last, cache = row[:3]
        params = self._row_params(RequestOptions(max_new_tokens=1), 0)

        def first_and_place():
            first, _ = self._first_fn(logits, params, self._masks(1, 1)[:, 0], np.bool_(False))
            self._batch = self._place_fn(self._batch, cache, first, h_last, params, np.int32(0))
            return self._batch
        timed("first token + place", first_and_place)
        if self.narrow_rows:                     # row compaction (``Generator._compact``)
            def move():
                self._batch = self._move_fn(self._batch, np.int32(0), np.int32(self._B - 1))
                return self._batch
            timed("move a row", move)

        none, force, cap = np.zeros(self._B, bool), np.full(self._B, -1, np.int32), np.ones(self._B, np.int32)

        b = self._B
        plan = None if not self.k else Plan(f"d{self.k}", np.zeros(b, np.int32), np.zeros((b, self.k), np.int32),
                                            np.zeros(b, bool), [None] * b)

        def decode(masked: bool, off: bool = False, w: int = 0):
            if masked:                                                                  # no row masked
                out = self._masked_step(w, none, force, cap, np.bool_(False), {}, plan)
            else:
                out = self._decode(w, none, force, cap, np.bool_(False),
                                   dataclasses.replace(plan, option="off") if off else plan)
            self._batch = out[0]
            return out
        for w in (0, self.narrow_rows) if self.narrow_rows else (0,):
            rows = f" on rows 0..{w - 1}" if w else ""
            timed("decode" + rows + (f" MTP k={self.k}" if self.k else ""), lambda w=w: decode(False, w=w))
            if self.drafts_off:
                timed("decode" + rows + " MTP drafts off", lambda w=w: decode(False, off=True, w=w))
            timed("decode with token masks" + rows, lambda w=w: decode(True, w=w))
        if self.prefix is not None:
            timed("prefix cache copies", lambda: self._rows_io.warmup(self._state, self._batch, cache,
                                                                        h_last if self.k else None))
        self._batch = None                       # the rows were written to: a fresh batch for requests
        self._ensure_batch()
        return timings

    def cache_bytes(self, rows: int, length: int) -> int:
        """Bytes of the batch state (cache, carry, params) for ``rows`` x ``length`` slots on one
        device: on a mesh, each cache leaf counts with its shard shape (the memory budget is one
        device's), the small carry and params as replicated."""
        if (rows, length) not in self._cache_bytes:
            shapes = jax.eval_shape(lambda: self._empty_impl(rows, length))
            mesh = getattr(self.model, "mesh", None)
            cache = jax.tree.leaves(shapes["cache"])
            if mesh is None:
                shard_shapes = [x.shape for x in cache]
            else:
                shardings = jax.tree.leaves(cache_shardings(shapes["cache"], mesh))
                shard_shapes = [s.shard_shape(x.shape) for x, s in zip(cache, shardings)]
            rest = jax.tree.leaves({k: v for k, v in shapes.items() if k != "cache"})
            self._cache_bytes[rows, length] = (
                sum(int(np.prod(shape)) * x.dtype.itemsize for x, shape in zip(cache, shard_shapes))
                + sum(x.size * x.dtype.itemsize for x in rest))
        return self._cache_bytes[rows, length]

