"""Admission and prefill of a ``Generator`` (``zoo.engine.generator``), as a mixin: a waiting request
takes free rows, its cached prefix is restored, its prompt is prefilled a piece at a time
(``zoo.engine.fill``: ``plan_pieces``, ``Fill``) between decode steps, and each choice still wanted
samples its first token into its row.

    _prefill_waiting()      run waiting prompts' pieces within this step's budget (``prefill_budget``
                            tokens, and the time ``pace`` allows while rows decode)
    _admit_next() -> bool   start the first waiting request's fill; False: none waits, or no rows
    _try_admit(req)         rows for ``req`` and its forks, its prefix hit, ``_begin_fill``
    _begin_fill / _fill_piece / _end_fill      one prompt's prefill: restore, pieces, first tokens
    _prefill_piece(...)     one piece through the prefill program (text or with image rows)
    _fail_admission(group, e)                  a refusal (400) or fault (500; the batch if it held it)

The Generator provides what these read and write: ``_rows``, ``_waiting``, ``_lock``, ``_fill``,
``_B``, ``_L``, ``k``, ``context``, ``prefix``, ``_rows_io``, ``memory_budget``, ``prefill_budget``, ``pace``, ``_ran``,
``prefill_chunk``, ``prefill_small``, ``_images``, ``_state``, ``_batch``, the counters ``prefills`` and
``prefill_tokens``, the jitted ``_empty_fn`` and ``_prefill_fn``, and ``_ensure_batch``,
``_state_bytes``, ``_h_zero``, ``_replicated``, ``_start_row``, ``_decoding``, ``_finish``, ``_fail``,
``_fail_batch``.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from zoo.engine.fill import Fill, piece_inputs, plan_pieces, snapshot_points
from zoo.engine.image_prefill import cache_tokens
from zoo.engine.logprobs import TokenLogprob, records, to_numpy
from zoo.engine.options import RequestOptions
from zoo.engine.prefix_cache import Snapshot
from zoo.engine.request import Request


class Admission:
    """Mixin of ``Generator``: admitting requests and prefilling their prompts (module docstring)."""

    def _plan(self, start: int, n: int, marks=()) -> list[tuple[int, int, int, bool]]:
        """The prefill pieces of prompt tokens ``start .. n-1`` (``fill.plan_pieces`` with this
        engine's two widths and slots): only the ``prefill_widths`` are ever compiled."""
        return plan_pieces(start, n, self.prefill_chunk, self.prefill_small, self._L, marks)

    def _check_length(self, n: int, options: RequestOptions) -> None:
        """``ValueError`` when a prompt of ``n`` tokens and ``options.max_new_tokens`` exceed the context."""
        if n + options.max_new_tokens > self.context:
            raise ValueError(f"the prompt ({n} tokens) and max_new_tokens ({options.max_new_tokens}) exceed the "
                             f"engine's context of {self.context} tokens")

    def _lookup(self, req: Request) -> Snapshot | None:
        """The longest cached prefix ``req`` may start from (at least one prompt token stays to
        prefill: its logits give the first token); none when it asks for the prompt's logprobs."""
        if self.prefix is None or req.options.prompt_logprobs is not None or len(req.prompt) < 2:
            return None
        return self.prefix.lookup(self._rows_io.root, self._key(req), len(req.prompt) - 1)

    def _key(self, req: Request) -> list[int]:
        """The prefix cache's key of ``req``'s prompt (``image_prefill.cache_tokens`` with images)."""
        if not req.images:
            return req.prompt
        if req.cache_tokens is None:
            req.cache_tokens = cache_tokens(req.prompt, req.images, self.model.config.image_token_id)
        return req.cache_tokens

    def _try_admit(self, req: Request) -> bool:
        """Give ``req`` (and its forks) free rows and start its prefill (``_begin_fill``); False if it
        must wait for rows to free. The prefix cache's device tier keeps within what the batch leaves
        of the budget."""
        group = [req] + req.forks
        if len(group) > self._B:
            raise MemoryError(f"{len(group)} choices need {len(group)} batch rows; the engine has {self._B}")
        self._check_length(len(req.prompt), req.options)
        if sum(r is None for r in self._rows) < len(group):
            return False
        hit = self._lookup(req)
        if self.prefix is not None:
            self.prefix.fit_device(self.memory_budget - self._state_bytes())
            if hit is not None and not self.prefix.holds(hit):
                hit = None
        self._ensure_batch()
        req.prefix_hit = hit
        at = []
        for member in group:
            at.append(self._rows.index(None))
            self._rows[at[-1]] = member
            if member.on_admit is not None:
                member.on_admit(member)
        self._fill = self._begin_fill(group, at)
        return True

    def _snapshot(self, tokens: list[int], row) -> None:
        """Cache the state after ``tokens`` (``PrefixRows.store``), then keep the device tier inside
        what the batch leaves."""
        self._rows_io.store(tokens, row)
        self.prefix.fit_device(self.memory_budget - self._state_bytes())

    def _begin_fill(self, group: list[Request], at: list[int]) -> Fill:
        """The prefill of ``group``'s shared prompt, ready for its first piece: from its cached
        prefix, if any (restored here), then in pieces that end at snapshot points, each cached."""
        req = group[0]
        self.prefills += 1
        n, opts = len(req.prompt), req.options
        cache = self._empty_fn(1, self._L)["cache"]
        h_prev = self._h_zero()
        snap = req.prefix_hit
        start = 0 if snap is None else snap.length
        if snap is not None:
            cache, hidden = self._rows_io.restore(snap, cache)
            if hidden is not None:
                h_prev = self._replicated(hidden)
        if self.prefix is not None and opts.prompt_logprobs is None and n >= 2:
            self.prefix.stats.hits += snap is not None
            self.prefix.stats.hit_tokens += start
            self.prefix.stats.miss_tokens += n - start
        images = None if not req.images else self._images.start(self._state, req, start)
        return Fill(group, at, snapshot_points(start, n, self.prefill_chunk, opts.cache_marks), cache, h_prev,
                    start, images)

    def _fill_piece(self, f: Fill, narrow: bool = False) -> int:
        """Run ``f``'s next piece (``narrow``: at the small width) and cache its snapshot; returns the
        piece's width. With a time budget its time goes to ``pace`` (a width's first run may have
        compiled it: not timed)."""
        req = f.request
        a, e, w, snapshot = f.piece(self.prefill_chunk, self.prefill_small, self._L, narrow)
        want = req.options.prompt_logprobs is not None
        mm = None if f.images is None else self._images.piece(f.images, a, e, w)   # text: the same program
        t0 = time.perf_counter()
        out = self._prefill_piece(f.prompt, a, e, w, f.cache, f.h_prev, want, mm)
        f.logits, f.h_prev, f.cache = out[:3]
        if self.pace.ratio is not None:           # timed for the budget (waits for the piece), else not
            jax.block_until_ready(f.h_prev)
            if f"prefill {w}" in self._ran:
                self.pace.piece_took(w, time.perf_counter() - t0)
            self._ran.add(f"prefill {w}")
        f.pos = e
        self.prefill_tokens += w
        if want:
            f.scored.append({key: v[0, :e - a] for key, v in to_numpy(out[3]).items()})
        if self.prefix is not None and snapshot:
            self._snapshot(self._key(req)[:e], lambda c=f.cache, h=f.h_prev: (c, h if self.k else None))
        return w

    def _prefill_piece(self, prompt: np.ndarray, a: int, e: int, w: int, cache, h_prev, want: bool, mm=None):
        """Prompt tokens ``a .. e-1`` of ``prompt`` as one piece of width ``w`` into the one-row
        ``cache`` (donated); returns what ``step_programs.prefill_piece`` returns."""
        ids, mask, nxt, nxt_mask = piece_inputs(prompt, a, e, w)
        extra = {} if mm is None else {"mm": mm}
        return self._prefill_fn(self._state, ids, mask, h_prev, nxt, nxt_mask, cache, np.bool_(want), **extra)

    def _end_fill(self, f: Fill) -> None:
        """``f``'s prompt is prefilled: each choice still wanted samples its first token and gets a
        copy of the row at its index in ``f.at`` (``_start_row``)."""
        req, opts = f.request, f.request.options
        n = len(req.prompt)
        prompt_lps = None
        if opts.prompt_logprobs is not None:
            at_pos = {key: np.concatenate([s[key] for s in f.scored])[:n - 1] for key in f.scored[0]}
            prompt_lps = [TokenLogprob(req.prompt[0], None)] + records(req.prompt[1:], at_pos, opts.prompt_logprobs)
        for member, r in zip(f.group, f.at):
            if member.finish_reason is not None:      # cancelled while its prompt was prefilled
                continue
            member.prompt_token_logprobs = prompt_lps
            member.stats.update(prompt_tokens=n, cached_tokens=f.start, drafted=0, accepted=0,
                                accepted_by_position=[0] * self.k, steps=0)
            if opts.max_new_tokens == 0:              # prompt logprobs only: no row kept
                member.stats["time_to_first_token"] = time.perf_counter() - f.t0
                self._finish(member, "length")
                continue
            self._start_row(member, r, f.logits, f.h_prev, f.cache)
            member.stats["time_to_first_token"] = time.perf_counter() - f.t0

    def _prefill_waiting(self) -> None:
        """Prefill waiting prompts, in order, while rows and memory allow: when some row is decoding,
        at most ``prefill_budget`` tokens of pieces (the chunk by default) estimated to take at most
        what ``pace`` allows (``zoo.engine.prefill_pace``: pieces narrowed to the small width, one
        piece at least), so its stream waits a bounded time; all of them when none is, or when the
        budget is None (whole prompts before the next step: more throughput, long stalls; see
        ``zoo.engine.fill``)."""
        decoding = bool(self._decoding().any())
        budget = self.prefill_budget if decoding else None
        table = self.pace.snapshot()           # this step decides from these estimates only (replicas alike)
        spent, spent_s = 0, 0.0
        while budget is None or spent < budget:
            if self._fill is None and not self._admit_next():
                return
            f = self._fill
            if f is None:                   # the next request was refused, cancelled or failed: go on
                continue
            if not f.live:                  # every choice cancelled meanwhile
                self._fill = None
                continue
            narrow = False
            if decoding and budget is not None:
                wide = f.piece(self.prefill_chunk, self.prefill_small, self._L)[2]
                width = self.pace.choose(table, spent_s, wide, self.prefill_small, first=spent == 0)
                if width is None:
                    return
                narrow = width != wide
            try:
                w = self._fill_piece(f, narrow)
                spent += w
                spent_s += self.pace.estimate(table, w) or 0.0
                if f.done:
                    self._fill = None
                    self._end_fill(f)
            except Exception as e:
                self._fill = None
                self._fail_admission(f.group, e)

    def _admit_next(self) -> bool:
        """Admit the first waiting request (start its fill); False if none waits or it must wait
        for rows. A request that cannot be admitted fails (see ``step`` on faults)."""
        if not self._waiting:
            return False
        with self._lock:
            req = self._waiting[0]
        group = [req] + req.forks
        if all(m.cancelled for m in group):
            with self._lock:
                self._waiting.popleft()
            for m in group:
                self._finish(m, "cancelled")
            return True
        try:
            if not self._try_admit(req):
                return False
        except Exception as e:
            with self._lock:
                self._waiting.popleft()
            self._fail_admission(group, e)
            return True
        with self._lock:
            self._waiting.popleft()
        return True

    def _fail_admission(self, group: list[Request], e: BaseException) -> None:
        """Admitting or prefilling ``group`` raised ``e``: a device program that failed holding the
        batch fails the batch; else the group fails (``MemoryError``: it can never fit, 400; else 500)."""
        if self._batch is not None and any(x.is_deleted() for x in jax.tree.leaves(self._batch)):
            self._fail_batch(e, group)
            return
        for m in group:
            self._fail(m, e, status=400 if isinstance(e, MemoryError) else 500)
