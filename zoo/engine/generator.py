"""Generator: continuous batching over a loaded model, plain or MTP-speculative decoding.

A request is its prompt (ids, images) and one ``RequestOptions`` (``zoo.engine.options``: sampling,
limits, stop strings and ids, choices, logprobs, grammar, thinking budget, cache marks, text), checked
once by ``make_request`` (which builds it from keywords for the Python API) and kept unchanged in
``Request.options``. Requests join and leave between steps. Device state is one *batch* pytree whose
leaves all lead with the row axis ``[B, ...]``::

    cache   the model's cache for B rows and L token slots (KV slots + recurrent states)
    carry   plain: {"tok": [B]} the last sampled token, not yet fed to the model
            spec:  {"h": [B, k+1, D], "tok": [B, k+1], "n": [B]} pending MTP rows
    params  per-row sampling parameters and PRNG state: temperature, top_k, top_p, seed, step

Shapes are fixed when the generator is made, so its programs are a fixed set (``program_set``),
compiled once (``warmup``) and never again whatever the requests ask: ``context`` tokens per
request (prompt and output), ``rows`` = ``max_batch`` or fewer, as many as ``memory_budget`` holds
(the batch's cache and one prefill row), ``L`` cache slots per row (the context, the verify
overshoot and a prefill piece's padding, rounded up to ``CACHE_BUCKET``).

A step is ONE compiled program for the whole model (``step_programs.decode_step``: plain or
``speculative.spec_step``); the cache is donated. Generators over equal models share their
compiled programs (``step_programs.shared_program``). A new request is prefilled alone into a one-row
cache of L slots, in pieces that end at every multiple of ``prefill_chunk`` tokens, at its
``cache_marks`` and at the prompt's end (``_plan``), each piece of one of two widths, the chunk or
``prefill_small`` (``fill.small_width``: chunk / 16, chunk / 64 on one CPU device; at least
``PREFILL_MIN``), right-padded; ``zoo compile`` chooses
the chunk a target's memory leaves room for. The index advances by the real tokens only, so a row
is compact (slot s holds position s). Then it is placed into a free row; a request waits while
every row is busy. A request whose prompt and ``max_new_tokens`` exceed the context is refused.
Admission and prefill live in ``zoo.engine.admission`` (a mixin, as the program set in
``zoo.engine.programs``). Prefill is interleaved with decoding (``zoo.engine.fill``): a step runs at
most ``prefill_chunk`` tokens of pieces before its decode step while rows are decoding, so a long
prompt delays the running streams by one chunk per token, never by its whole prefill.

Prefix caching (``zoo.engine.prefix_cache``): a request starts from the longest cached prefix of its
prompt with a state snapshot at its end (``_lookup``, ``PrefixRows.restore``) and prefills the rest; every
piece end and every finished request leaves a snapshot (``_snapshot``; a finished row holds its
prompt and all its tokens but the last, which was sampled and never fed). The cache's device tier is
counted against ``memory_budget`` and gives way to the batch.

Log-probabilities (``zoo.engine.logprobs``): a request with ``logprobs`` N gets a ``TokenLogprob``
per generated token (its logprob and N alternatives) in ``Request.token_logprobs``, computed inside
the same programs (always ``MAX_TOP`` alternatives, computed under a flag: steps where no row
asks skip the work in the same program). ``prompt_logprobs`` N: the prefill also yields the prompt tokens' logprobs
(``Request.prompt_token_logprobs``, the first one None); with ``max_new_tokens == 0`` the request
ends after its prefill (an echo of the prompt's logprobs, as lm-evaluation-harness asks for).

Structured outputs (``zoo.engine.constraint``): a request with a ``Constraint`` gets a token
bitmask per step, filled on the host by llguidance before the step from what it emitted so far, an
input of the split step (``zoo.engine.masked_step``: all ones for the other rows; a batch with no
constrained row runs the fused step). A row's next mask starts computing as soon as its tokens are
known, and a step waits for a late one at most a share of a step's time: past that the row sits the
step out (``zoo.engine.mask_schedule``; ``stats["mask_waits"]``). Under MTP the masks of the verify
positions follow the drafts (``Constraint.fill``). A request whose grammar completes finishes with
"stop".

Several choices (``n``): ``make_request(n=...)`` returns the first choice with the others in
``forks``; the prompt is prefilled once, its cache row copied into one row per choice, each choice
sampling with its own seed stream from its first token on.

Images (``zoo.engine.image_prefill``): a request's ``images`` fill its prompt's placeholder runs; at
admission the tower runs once per image (one program per size bucket up to ``max_image_tokens``),
each prefill piece takes its rows (and Qwen's M-RoPE positions; GLM's MTP layer the same rows),
decoding is text. The prefix cache keys it by ``Request.cache_tokens`` (placeholders: content ids).

Stop strings and text (``zoo.text.detokenize``): a request whose options have stop strings or ask
for text gets a ``TextDecoder``; each step's tokens go through it, so ``Request.text`` grows by what
is final (a possible start of a stop string is held back), and a stop string ends the request here
(finish "stop", ``stats["stop_sequence"]``): its text ends right before it, its ``tokens`` before the
token in which it starts. Every process of a multi-process engine stops alike.

Forced tokens: a request may have ids queued in ``Request.forcing`` (a thinking budget closing the
reasoning, ``zoo.engine.thinking_budget``); each step then emits the next of them for that row instead of
sampling (speculative rows reject their drafts that step), and the model continues from it.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from zoo.engine.admission import Admission
from zoo.engine.constraint import Constraint, OutputGrammar, compile_constraints, llg_tokenizer, mask_words
from zoo.engine.fill import Fill, round_up, small_width
from zoo.engine.flat_state import FlatState
from zoo.engine.image_prefill import ImagePrefill, check_images, multimodal
from zoo.engine.logprobs import TokenLogprob, records, to_numpy
from zoo.engine.mask_schedule import MaskSchedule
from zoo.engine.options import RequestOptions, check_token_ids
from zoo.engine.prefill_pace import PrefillPace
from zoo.engine.prefix_cache import PrefixCache, token_strides
from zoo.engine.prefix_rows import PrefixRows
from zoo.engine.programs import ProgramSet
from zoo.engine.request import Generation, ImageInput, Request
from zoo.engine.rows import default_host_tier, default_memory_budget, narrow_width, rows_of
from zoo.engine.spec_policy import SpecPolicy
from zoo.engine.step_programs import empty_batch, shared_masked_programs, shared_program
from zoo.engine.thinking_budget import ThinkingBudget
from zoo.sharding.mesh import host_value, on_mesh
from zoo.text.detokenize import TextDecoder, hidden_special_tokens

log = logging.getLogger("zoo.serve")
PREFILL_CHUNK = 1024
PREFILL_MIN = 16
CACHE_BUCKET = 256
PREFIX_BLOCK = 256     # tokens per prefix-cache block (zoo.engine.prefix_cache)
DEFAULT_CONTEXT = 4096     # tokens per request when none is given (capped by the model's positions)


class Generator(ProgramSet, Admission):
    """Continuous-batching engine over ``model`` (a ``zoo.Model``); ``spec_tokens`` k > 0 drafts k
    tokens per step with the model's MTP head."""

    def __init__(self, model, *, spec_tokens: int = 0, max_batch: int = 16, context: int | None = None,
                 memory_budget: int | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 prefix_cache: PrefixCache | float | None = None, prefix_cache_host_gb: float | None = None,
                 prefix_block: int = PREFIX_BLOCK, max_image_tokens: int = 1024, spec_policy: str = "auto",
                 interleave_ratio: float | None = None, narrow_rows: int | None = 0,
                 prefill_small: int | None = None):
        """``max_batch``: the most rows (fewer if ``memory_budget`` holds fewer, see ``rows``); ``context``:
        tokens per request, prompt and output (None: ``DEFAULT_CONTEXT`` or the model's positions if
        fewer); ``prefix_cache``: a ``PrefixCache`` (one may be shared by generators: entries are keyed by
        the model's identity), its device budget in GiB (0: no prefix caching), or None for the default (a
        quarter of ``memory_budget``); ``prefix_cache_host_gb``: the host-RAM tier (None:
        ``rows.default_host_tier``); ``prefix_block``: tokens per cached block (a power of two dividing
        ``CACHE_BUCKET``); ``max_image_tokens``: merged rows per image at most (``image_prefill.image_buckets``);
        ``spec_policy``: with ``spec_tokens``, "auto" (each step's draft lengths and sources chosen from
        costs and acceptance, ``zoo.engine.spec_policy``) or "fixed" (k MTP drafts every step);
        ``interleave_ratio``: while rows decode, a step's prefill pieces are estimated to keep a stream
        waiting at most this many decode steps (``zoo.engine.prefill_pace``: pieces narrowed to the
        small width; ``zoo serve`` uses ``INTERLEAVE_RATIO``); None: one chunk's tokens per step,
        whatever they take. Narrowed pieces follow measured timings, and a prompt prefilled in other
        widths sums in another order: its logprobs may differ from an unnarrowed run's in float32's
        last digits (~1e-5), so outputs are reproducible run to run only with None.
        ``narrow_rows``: a second width of the decode programs (``step_programs.decode_narrow``): a step
        whose decoding rows all lie below it runs on that many rows instead of all of them (0: none;
        None: ``rows.narrow_width``'s default, a quarter of the rows on a CPU without a mesh). Rows are
        compacted for it (``_compact``): when the decoding rows past it fit the free rows below it, they
        move there (``rows.move_row``), so a stream left in a high row by streams that finished does
        not keep every step at full width. Its tokens equal the whole batch's step's; logprobs may differ
        in float32's last digits (~1e-6: other matmul shapes sum in other orders). ``prefill_small``:
        the small prefill width, a power of two from ``PREFILL_MIN`` to the chunk (None:
        ``fill.small_width``'s default for the device)."""
        if spec_tokens and getattr(model.module, "mtp", None) is None:
            raise ValueError("speculative decoding needs an MTP layer; this model has none")
        self.model = model
        self.k, self.max_image_tokens = int(spec_tokens), int(max_image_tokens)
        self.spec_policy = SpecPolicy(self.k, spec_policy, lockstep=jax.process_count() > 1) if self.k else None
        self._ran: set[str] = set()                        # programs run (timed from their second run)
        if prefill_chunk < PREFILL_MIN or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill_chunk must be a power of two >= {PREFILL_MIN}, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        mesh = getattr(model, "mesh", None)
        if prefill_small is None:
            prefill_small = small_width(prefill_chunk, PREFILL_MIN, mesh)
        if not PREFILL_MIN <= prefill_small <= prefill_chunk or prefill_small & (prefill_small - 1):
            raise ValueError(f"prefill_small must be a power of two from {PREFILL_MIN} to the chunk "
                             f"({prefill_chunk}), got {prefill_small}")
        self.prefill_small = int(prefill_small)
        self.prefill_budget: int | None = prefill_chunk     # prefill tokens a step runs while rows decode
        self.pace = PrefillPace(interleave_ratio, lockstep=jax.process_count() > 1)   # and their time
        positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20)
        self.context = int(context or min(DEFAULT_CONTEXT, positions))
        if self.context < 1:
            raise ValueError(f"context must be >= 1, got {self.context}")
        if self.context > positions:
            log.warning("a context of %d tokens is past the model's %d positions", self.context, positions)
        self.memory_budget = memory_budget or default_memory_budget()
        self._graphdef, state = nnx.split(model.module)
        self._state = FlatState.of(state)                   # flattened once: each call dispatches faster
        eos = set(getattr(model.config, "eos_token_id", ()) or ())
        if model.tokenizer is not None:
            eos |= set(model.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._waiting: collections.deque[Request] = collections.deque()
        self._cache_bytes: dict[tuple[int, int], int] = {}
        self._L = round_up(self.context + max(self.prefill_small, self.k + 1), CACHE_BUCKET)
        self._B = self._fit_rows(max_batch)
        self.max_batch = self._B
        self._rows: list[Request | None] = [None] * self._B
        self._batch = None                                  # made on first use (``_ensure_batch``)
        self._fill: Fill | None = None                      # the prompt being prefilled (``zoo.engine.fill``)
        # the whole-model programs: one jitted copy per configuration in the process (``step_programs``)
        self._step_fn = shared_program("decode", self._graphdef, self.k, mesh)
        self._step_off_fn = shared_program("decode off", self._graphdef, self.k, mesh)
        self.narrow_rows = narrow_width(narrow_rows, self._B, mesh)
        narrow = lambda kind: shared_program(kind, self._graphdef, self.k, mesh, self.narrow_rows)  # noqa: E731
        # none asked for where there are no narrow rows: the registry keeps only the SHARED latest
        self._narrow_fn = narrow("decode narrow") if self.narrow_rows else None
        self._narrow_off_fn = narrow("decode off narrow") if self.narrow_rows and self.drafts_off else None
        self._prefill_fn = shared_program("prefill", self._graphdef, self.k, mesh)
        self._place_fn = shared_program("place", None, self.k, mesh)
        self._move_fn = shared_program("move", None, 0, mesh) if self.narrow_rows else None
        self._empty_fn = functools.partial(shared_program("empty", self._graphdef, self.k, mesh), self._state)
        self._first_fn = shared_program("first", None, 0, mesh)
        for name in ("_step_fn", "_step_off_fn", "_narrow_fn", "_narrow_off_fn", "_prefill_fn", "_place_fn",
                     "_move_fn", "_empty_fn", "_first_fn"):
            if getattr(self, name) is not None:
                setattr(self, name, on_mesh(getattr(self, name), mesh))   # sharded model
        self._masked = shared_masked_programs(self._graphdef, self.k, mesh)
        self._images = ImagePrefill(model, self._graphdef, mesh, self.max_image_tokens) if multimodal(model) else None
        self.vocab = int(model.config.vocab_size)           # the logits' width
        self._mask_words = mask_words(self.vocab)
        self._all_ones = None                               # the resident all-allowed masks (``_masks``)
        self.mask_schedule = MaskSchedule()                 # when masks are computed, how long a step waits
        self._init_prefix_cache(prefix_cache, prefix_cache_host_gb, prefix_block)
        self.prefills = 0                                   # prompts prefilled (a request's choices share one)
        self.prefill_tokens = 0                             # prefill piece widths run (padding included)
        self.steps = 0                                      # decode steps run
        self.narrow_steps = 0                               # of which on the narrow programs' rows
        self.moved_rows = 0                                 # requests moved below the narrow width
        self.faults = {"failed_requests": 0, "failed_steps": 0, "last_error": None}   # see ``step``
        self.on_step_failure = None     # called with the error before a failed step fails its requests

    def _init_prefix_cache(self, prefix, host_gb, block) -> None:
        if prefix is None or isinstance(prefix, (int, float)):
            device = int(0.25 * self.memory_budget) if prefix is None else int(float(prefix) * 2**30)
            host = default_host_tier() if host_gb is None else int(float(host_gb) * 2**30)
            prefix = PrefixCache(device, host, block) if device > 0 else None
        self.prefix = prefix
        if prefix is None:
            return
        if CACHE_BUCKET % prefix.block:
            raise ValueError(f"prefix block {prefix.block} must divide the cache bucket {CACHE_BUCKET}")
        shapes = jax.eval_shape(lambda: self._empty_impl(1, CACHE_BUCKET))["cache"]
        info = getattr(self.model, "load_info", {}) or {}
        mesh = getattr(self.model, "mesh", None)
        root = PrefixCache.root("|".join(map(str, (
            id(self.model.module), info.get("path"), info.get("format"), info.get("quant"), info.get("dtype"),
            self.model.config, f"mtp={bool(self.k)}", f"block={prefix.block}",
            None if mesh is None else dict(mesh.shape)))))
        self._rows_io = PrefixRows(prefix, root, self._graphdef, self.k, token_strides(shapes, CACHE_BUCKET), mesh)

    def _fit_rows(self, most: int) -> int:
        """The most rows (up to ``most``) whose batch state, with the one-row cache a prefill writes
        into, fits ``memory_budget``; ``MemoryError`` when not even one does."""
        row = self.cache_bytes(1, self._L)
        rows = max(0, min(most, (self.memory_budget - row) // max(row, 1)))
        while rows < most and self.cache_bytes(rows + 1, self._L) + row <= self.memory_budget:
            rows += 1
        while rows and self.cache_bytes(rows, self._L) + row > self.memory_budget:
            rows -= 1
        if not rows:
            raise MemoryError(f"a context of {self.context} tokens needs {2 * row} bytes of cache for one row (and "
                              f"its prefill); the budget is {self.memory_budget}: give a smaller context")
        return rows

    @property
    def rows(self) -> int:
        """Requests decoded together (the batch's rows)."""
        return self._B

    def _state_bytes(self) -> int:
        """Bytes the batch and the prefill's row take of ``memory_budget``."""
        return self.cache_bytes(self._B, self._L) + self.cache_bytes(1, self._L)

    def _ensure_batch(self) -> None:
        if self._batch is None:
            self._batch = self._empty_fn(self._B, self._L)

    # -- device programs ----------------------------------------------------------------------
    def _empty_impl(self, rows: int, length: int) -> dict:
        """The empty batch state for ``rows`` x ``length`` slots (``step_programs.empty_batch``)."""
        return empty_batch(self._graphdef, self.k, self._state, rows, length)

    def _replicated(self, x):
        """``x`` as the one kind of array a program sees for it, wherever it came from (a program's
        output, the prefix cache's host RAM, zeros): on a mesh, replicated on all its devices; on one
        device, uncommitted, as everything there is (a committed input is another program)."""
        mesh = getattr(self.model, "mesh", None)
        if mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))

    def _h_zero(self):
        """The hidden state before a prompt's first token ([1, D] zeros)."""
        return self._replicated(np.zeros((1, self.model.config.hidden_size), self.model.module.dtype))

    def _row_params(self, opts: RequestOptions, seed: int) -> dict:
        """A row's sampling parameters ([1] leaves; PRNG step 1: the first token used step 0)."""
        return {"temperature": np.float32([opts.temperature]), "top_k": np.int32([min(opts.top_k, self.vocab)]),
                "top_p": np.float32([opts.top_p]), "seed": np.uint32([seed]), "step": np.int32([1])}

    def _masks(self, rows: int, positions: int) -> np.ndarray:
        """All-allowed token bitmasks [rows, positions, W] (a fresh array: callers fill theirs in)."""
        return np.full((rows, positions, self._mask_words), -1, np.int32)

    def _start_row(self, req: Request, r: int, logits, h_last, cache) -> None:
        """Sample ``req``'s first token from the prefill's last ``logits`` (masked by its grammar) and
        put the prefilled ``cache`` with its carry and parameters into row ``r``."""
        opts = req.options
        params = self._row_params(opts, req.choice_seed)
        mask = self._masks(1, 1)[:, 0]
        if req.constraint is not None:
            req.constraint.fill(mask)
        want = opts.logprobs is not None
        first, out = self._first_fn(logits, params, mask, np.bool_(want))
        first_lp, token = None, int(host_value(first)[0])
        if token < 0:
            raise FloatingPointError("the model's logits for this prompt are not finite (NaN or inf)")
        if want:
            first_lp = records([token], {key: v[0] for key, v in to_numpy(out).items()}, opts.logprobs)
        self._batch = self._place_fn(self._batch, cache, first, h_last, params, np.int32(r))
        req.raw.append(token)
        self._deliver(req, [token], first_lp)

    # -- stepping -----------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        self.check(req)
        req.stats.setdefault("submitted", time.perf_counter())
        with self._lock:
            self._waiting.append(req)
        self._wakeup.set()
        return req

    def check(self, req: Request) -> None:
        """``ValueError`` for a request ``submit`` refuses (before it is queued anywhere): its images
        (its options and prompt ids were checked by ``make_request``)."""
        check_images(self.model, req.prompt, req.images, self.max_image_tokens)   # text only, runs, sizes

    def cancel(self, req: Request) -> None:
        """Ask the engine to stop ``req`` (thread-safe); it finishes as "cancelled" at the next step
        and its row is freed."""
        req.cancelled = True
        self._wakeup.set()

    def run_forever(self, stop: threading.Event, idle_wait: float = 0.05) -> None:
        """The engine thread's loop: step while there is work, sleep until a submit otherwise."""
        while not stop.is_set():
            if not self.step():
                self._wakeup.wait(idle_wait)
                self._wakeup.clear()

    def has_work(self) -> bool:
        return bool(self._waiting) or any(self._rows)

    def step(self) -> bool:
        """Prefill waiting prompts (at most a chunk's worth while rows are decoding:
        ``_prefill_waiting``), then run one decode step for every decoding row. False if idle.

        Faults stay with the request they belong to: an exception while admitting or prefilling a
        request, or while handling its tokens, and a row whose logits are not finite, fail that
        request (``_fail``) and the others go on. An exception from the step program itself fails
        every running request and the batch is rebuilt for the next ones (``_fail_batch``)."""
        for r, req in enumerate(self._rows):
            if req is not None and req.cancelled:
                self._finish(req, "cancelled")
        self._prefill_waiting()
        active = self._decoding()
        if not active.any():
            return bool(self._waiting) or self._fill is not None
        if self.narrow_rows and active[self.narrow_rows:].any():
            self._compact(active)
        constrained = self._constrained(active)
        if constrained:
            late = self.mask_schedule.late(constrained, others=len(constrained) < active.sum())
            for r in late:
                active[r] = False            # its mask is not ready: it sits this step out
                self._rows[r].stats["mask_waits"] = self._rows[r].stats.get("mask_waits", 0) + 1
                del constrained[r]
            if not active.any():
                return True
        rows = [req if on else None for req, on in zip(self._rows, active)]
        force = np.array([r.forcing[0] if r is not None and r.forcing else -1 for r in rows], np.int32)
        cap = np.array([self._room(r) if r is not None else 1 for r in rows], np.int32)
        want = any(r is not None and r.options.logprobs is not None for r in rows)
        masked = any(r is not None and r.constraint is not None for r in rows)
        w = self.narrow_rows if self.narrow_rows and not active[self.narrow_rows:].any() else 0
        plan = None if not self.k else self.spec_policy.plan(rows, active, cap, force, w)
        self.steps += 1
        t0 = time.perf_counter()
        try:
            if masked:
                out = self._masked_step(w, active, force, cap, np.bool_(want), constrained, plan)
            else:
                out = self._decode(w, active, force, cap, np.bool_(want), plan)
            self._batch, tokens, counts = out[:3]
            tokens, counts = host_value(tokens), host_value(counts)
            scored = to_numpy(out[3]) if want else None
        except Exception as e:
            self._fail_batch(e)
            return True
        seconds = time.perf_counter() - t0
        self.mask_schedule.timed(seconds)
        program = "masked" if masked else "plain" if plan is None else "off" if plan.option == "off" else "drafts"
        if w:
            self.narrow_steps += 1
            program += " narrow"
            tokens, counts = rows_of(tokens, self._B), rows_of(counts, self._B)
        timed = program in self._ran   # a program's first run may have compiled it: not a step's cost
        self._ran.add(program)
        if timed:
            self.pace.decode_took(seconds)
        if plan is not None:           # the policy costs the fused programs only
            self.spec_policy.observe(plan, rows, counts, cap, seconds if timed and not masked else None)
        for r, req in enumerate(rows):
            if req is None or req.finish_reason is not None:
                continue
            try:
                if counts[r] < 0:
                    raise FloatingPointError("the model's logits for this request are not finite (NaN or inf)")
                row_scores = None if scored is None else {key: v[r] for key, v in scored.items()}
                self._take_step(req, tokens[r, :counts[r]].tolist(), row_scores, bool(force[r] >= 0),
                                0 if plan is None else int(plan.lengths[r]))
            except Exception as e:
                self._fail(req, e)
        self.mask_schedule.prefetch(self._constrained(self._decoding()).values())    # the next step's masks
        return True

    def _compact(self, active: np.ndarray) -> None:
        """Move the decoding rows at or past ``narrow_rows`` into the free rows below it, when all of
        them fit there (``active`` [B] is updated): the steps then run the narrow programs. A row being
        prefilled stays where it is (its prefill is placed there), and so does every row when some
        would be left above the width (a move would not narrow the step). Each move copies one row's
        state on the device (``rows.move_row``); the request's tokens are those it would have had."""
        w = self.narrow_rows
        high = [r for r in range(w, self._B) if active[r]]
        free = [r for r in range(w) if self._rows[r] is None]
        if len(high) > len(free):
            return
        for src, dst in zip(high, free):
            self._batch = self._move_fn(self._batch, np.int32(src), np.int32(dst))
            self._rows[dst], self._rows[src] = self._rows[src], None
            active[dst], active[src] = True, False
            self.moved_rows += 1

    def _constrained(self, active: np.ndarray) -> dict:
        """Row -> constraint of the ``active`` rows whose next token is masked (running, constrained,
        not forcing a token)."""
        return {r: req.constraint for r, req in enumerate(self._rows)
                if active[r] and req is not None and req.finish_reason is None and req.constraint is not None
                and not req.forcing}

    def _decoding(self) -> np.ndarray:
        """[B] bool: the rows a decode step runs (held by a request whose prompt is prefilled)."""
        filling = () if self._fill is None else self._fill.at
        return np.array([req is not None and r not in filling for r, req in enumerate(self._rows)], bool)

    def _take_step(self, req: Request, new: list[int], scored: dict | None, forced: bool, drafted: int = 0) -> None:
        """Record one step's tokens ``new`` of ``req`` (``scored``: their logprob leaves; ``drafted``:
        the drafts the row proposed) and deliver them."""
        recs = records(new, scored, req.options.logprobs) if req.options.logprobs is not None else None
        req.stats["steps"] += 1
        req.raw.extend(new)
        if forced:
            req.forcing.popleft()
            req.stats["forced"] = req.stats.get("forced", 0) + 1
        elif self.k:
            req.stats["drafted"] += drafted
            req.stats["accepted"] += len(new) - 1
            for i in range(len(new) - 1):
                req.stats["accepted_by_position"][i] += 1
        self._deliver(req, new, recs, forced=forced)

    def _fail(self, req: Request, e: BaseException, status: int = 500, logged: bool = False) -> None:
        """End ``req`` with an error (``status`` 400: it can never be served here; 500: the engine
        failed on it); its row is freed and nothing of it is cached."""
        if status >= 500:
            if not logged:
                log.error("request failed: %s: %s", type(e).__name__, e, exc_info=e)
            self.faults["failed_requests"] += 1
            self.faults["last_error"] = f"{type(e).__name__}: {e}"
        req.stats["error"] = str(e) if isinstance(e, MemoryError) else f"{type(e).__name__}: {e}"
        req.stats["error_status"] = status
        self._finish(req, "error")

    def _fail_batch(self, e: BaseException, also: Sequence[Request] = ()) -> None:
        """The step (or a program holding the batch) failed: fail every running request (and
        ``also``), drop the batch, and start the next requests on a new one."""
        if self.on_step_failure is not None:    # a replicated engine first learns whether a process is lost
            self.on_step_failure(e)
        log.error("the decode step failed; failing %d running request(s) and rebuilding the batch",
                  sum(r is not None for r in self._rows), exc_info=e)
        self.faults["failed_steps"] += 1
        for req in [r for r in self._rows if r is not None] + [m for m in also if m not in self._rows]:
            self._fail(req, e, logged=True)
        self._rows, self._batch, self._fill = [None] * self._B, None, None

    def _decode(self, w: int, active, force, cap, want, plan):
        """The fused decode step (``plan``: the speculation policy's, None without drafts) on every row,
        or with ``w`` on the first ``w`` rows only (the narrow programs: ``active`` holds no row past
        them); returns what ``_step_fn`` returns, the narrow programs' tokens and counts for w rows."""
        off = plan is not None and plan.option == "off"
        fn = (self._narrow_off_fn if off else self._narrow_fn) if w else (self._step_off_fn if off else self._step_fn)
        rows = slice(0, w or None)
        arrays = () if plan is None or off else ({key: v[rows] for key, v in plan.arrays().items()},)
        return fn(self._state, self._batch, active[rows], force[rows], cap[rows], want, *arrays)

    def _masked_step(self, w: int, active, force, cap, want, rows: dict, plan=None):
        """The step split around the host's token bitmasks (``zoo.engine.masked_step``) for the masked
        ``rows`` (row -> constraint, ``_constrained``); returns what ``_step_fn`` returns (with ``w``:
        on the batch's first ``w`` rows, as ``_decode``). ``cap`` may be lowered where a row's draft
        masks ran out of time. ``plan``: the speculation policy's (its "off" runs as K-draft parts with
        every length 0: no masked program of its own)."""
        p, batch = self._masked, self._batch
        if w:
            batch, others = p.split(batch, w)
            active, force, cap = active[:w], force[:w], cap[:w]       # views: a lowered cap is the caller's
        masks = self._masks(w or self._B, self.k + 1)
        if not self.k:
            batch, logits = p.logits(self._state, batch, active)             # dispatched, runs meanwhile
            self.mask_schedule.fill(masks, rows)
            out = p.pick(batch, logits, active, force, masks[:, :1], want)
        else:
            arrays = None if plan is None else {key: v[:w or None] for key, v in plan.arrays().items()}
            batch, drafts, x_m = p.draft(self._state, batch, active, arrays)
            host_drafts = host_value(drafts)
            batch, p_logits, h, before = p.verify(self._state, batch, x_m, drafts, active, arrays)
            if plan is not None:
                np.minimum(cap, plan.lengths[:w or None] + 1, out=cap)         # no mask past a row's drafts
            self.mask_schedule.fill(masks, rows, host_drafts, cap)           # while the verify runs
            out = p.settle(self._state, batch, before, p_logits, h, drafts, active, force, cap, masks, want, arrays)
        return (p.join(out[0], others),) + tuple(out[1:]) if w else out

    def _room(self, req: Request) -> int:
        """Tokens ``req`` may take this step: k+1, fewer near its length limit or thinking budget."""
        room = min(self.k + 1, req.options.max_new_tokens - len(req.tokens))
        thinking = None if req.thinking is None else req.thinking.room()
        return max(1, room if thinking is None else min(room, thinking))

    def _deliver(self, req: Request, new: list[int], recs: list[TokenLogprob] | None = None,
                 forced: bool = False) -> None:
        """Append sampled tokens (and their logprob records, aligned) and their text, applying stop
        ids, the length limit, the output grammar (``forced``: tokens the engine forced) and stop
        strings (the tokens up to the one that completes one are delivered; then the request's
        ``tokens`` are cut before the one in which it starts, see the module doc)."""
        if req.finish_reason is not None:
            return
        accepted, stopped = [], False
        limit = req.options.max_new_tokens
        for tok in new:
            if tok in req.stop_ids:
                stopped = True
                break
            accepted.append(tok)
            if len(req.tokens) + len(accepted) >= limit:
                break
        c = req.constraint
        if c is not None:
            accepted = accepted[:c.advance(accepted, forced)]
        text, d = "", req.decoder
        if d is not None:
            text = d.feed(accepted)
            accepted = accepted[:d.taken]
        self._emit(req, accepted, recs, text)
        if c is not None and c.error is not None:
            req.stats["error"], req.stats["error_status"] = c.error, 400     # the request's grammar, not the engine
            return self._finish(req, "error")
        if d is not None and d.stopped is not None:
            req.stats["stop_sequence"] = d.stopped
            del req.tokens[d.tokens_before_stop(req.tokens):]
            del req.token_logprobs[len(req.tokens):]
            return self._finish(req, "stop")
        if stopped or (c is not None and c.complete):
            return self._finish(req, "stop")
        if req.thinking is not None:
            req.forcing.extend(req.thinking.observe(accepted))
        if len(req.tokens) >= limit:
            self._finish(req, "length")

    def _emit(self, req: Request, tokens: list[int], recs: list[TokenLogprob] | None = None, text: str = "") -> None:
        if tokens:
            if recs is not None:
                req.token_logprobs.extend(recs[:len(tokens)])
            req.tokens.extend(tokens)
            req.text += text
            if req.on_tokens is not None:
                req.on_tokens(req, tokens)

    def _finish(self, req: Request, reason: str) -> None:
        if req.finish_reason is None:
            req.finish_reason = reason
        if req.decoder is not None:
            req.text += req.decoder.flush()        # a held-back partial stop string is text after all
        if req in self._rows:
            r = self._rows.index(req)
            if self.prefix is not None and req.raw and req.finish_reason != "error":   # a failed row's state
                try:                                                                     # may be broken
                    consumed = (self._key(req) + req.raw)[:len(req.prompt) + len(req.raw) - 1]   # last: pending
                    self._snapshot(consumed, lambda: self._rows_io.row(self._state, self._batch, jnp.int32(r)))
                except Exception:
                    log.exception("caching a finished request's prefix failed; not cached")
            self._rows[r] = None
        now = time.perf_counter()
        req.stats.update(generated_tokens=len(req.tokens), seconds=now - req.stats.get("submitted", now))
        first = not req.done.is_set()
        req.done.set()
        if first and req.on_finish is not None:
            try:
                req.on_finish(req)
            except Exception:
                log.exception("a request's on_finish callback failed")

    # -- Python API ---------------------------------------------------------------------------
    def make_request(self, prompt: Sequence[int], options: RequestOptions | None = None, *, on_tokens=None,
                     on_finish=None, on_admit=None, constraints: Sequence[Constraint] | None = None,
                     images: Sequence[ImageInput] = (), **fields) -> Request:
        """A request for ``prompt`` with ``options`` (a ``RequestOptions``), or with its fields as
        keywords (``RequestOptions.build``: ``max_new_tokens``, ``temperature``, ``stop`` as token ids
        and/or strings, ``n``, ``grammar``, ...). The options and the prompt's ids are checked here,
        once: ``ValueError`` names what this engine cannot serve (``TokenIdError`` for an id outside
        the vocabulary). With ``n`` choices the first is returned, the others in its ``forks`` (the
        prompt is prefilled once; choice i samples with ``fork_seed(seed, i)``). ``constraints``:
        ready ``Constraint``s, one per choice (else each is compiled from ``options.grammar``).
        ``images``: the prompt's images (``ImageInput``), each filling its run of placeholder ids."""
        if options is None:
            options = RequestOptions.build(**fields)
        elif fields:
            raise TypeError(f"make_request takes options or their fields, not both ({', '.join(sorted(fields))})")
        options.check(self.vocab, self.model.tokenizer)
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        check_token_ids(prompt, self.vocab, "prompt")
        self._check_length(len(prompt), options)
        n = options.n
        if constraints is None and options.grammar is not None:
            constraints = self.constraints(options.grammar, n)
        if constraints is not None and len(constraints) != n:
            raise ValueError(f"{len(constraints)} constraints for {n} choices")
        stop_ids = frozenset(options.stop_token_ids) | self.eos_token_ids
        hidden = hidden_special_tokens(self.model.tokenizer, options.keep_special) if options.needs_text else None
        group = []
        for i in range(n):
            thinking = (None if options.thinking_budget is None
                        else self.thinking_budget(options.thinking_budget, options.thinking_opened))
            decoder = TextDecoder(self.model.tokenizer, hidden, options.stop) if options.needs_text else None
            group.append(Request(list(map(int, prompt)), options, on_tokens, on_finish, on_admit, stop_ids, thinking,
                                 decoder, choice=i, constraint=None if constraints is None else constraints[i],
                                 images=tuple(images)))
        group[0].forks = group[1:]
        return group[0]

    def constraints(self, grammar: OutputGrammar, n: int = 1) -> list[Constraint]:
        """``n`` fresh ``Constraint``s for one request's choices (``compile_constraints``: ``grammar``
        compiled once with this model's vocabulary and checked to start; ``GrammarRejected`` if not.
        It may take a while: the caller may want it off a latency-sensitive thread)."""
        tok = self.model.tokenizer
        if tok is None:
            raise ValueError("an output grammar needs a tokenizer; this model has none")
        return compile_constraints(llg_tokenizer(tok, self.vocab, self.eos_token_ids), grammar, n)

    def thinking_budget(self, budget: int, opened: bool = False) -> ThinkingBudget:
        """A ``ThinkingBudget`` with this model's ``<think>`` / ``</think>`` token ids."""
        tok = self.model.tokenizer
        if tok is None:
            raise ValueError("a thinking budget needs a tokenizer; this model has none")
        return ThinkingBudget(int(budget), open=tuple(tok.encode("<think>")), close=tuple(tok.encode("</think>")),
                              insert=tuple(tok.encode("\n</think>\n\n")), opened=opened)

    def generate(self, input_ids, **kwargs) -> list[Generation]:
        """Generations for each prompt of ``input_ids`` (with ``n``: its n choices in turn)."""
        reqs = [m for p in input_ids for r in [self.submit(self.make_request(p, **kwargs))] for m in [r] + r.forks]
        if not reqs:
            raise ValueError("no prompts given")
        while not all(r.done.is_set() for r in reqs):
            self.step()
        return [r.result() for r in reqs]

    def stream(self, prompt: Sequence[int], **kwargs) -> Iterator[int]:
        out: collections.deque[int] = collections.deque()
        req = self.submit(self.make_request(prompt, on_tokens=lambda _, toks: out.extend(toks), **kwargs))
        try:
            while not req.done.is_set() or out:
                while out:
                    yield out.popleft()
                if not req.done.is_set():
                    self.step()
        finally:
            self.cancel(req)
