"""A request's output constraint: an llguidance matcher behind a gate, driven token by token.

The engine asks a ``Constraint`` for token bitmasks (``[W] int32`` per position, bit ``t % 32`` of
word ``t // 32`` set when token ``t`` is allowed; ``W = ceil(V / 32)`` for the logits' width V) and
tells it which tokens the row emitted (``advance``). The device masks the logits with them
(``zoo.engine.token_mask``).

The gate: the grammar applies only once the output has passed ``wait`` -- token sequences that must
appear, in order (``</think>`` when the prompt opens a reasoning block: the constraint starts after
the reasoning closes). Until then every token is allowed. ``reasoning`` (open, close): the model
may open a reasoning block itself with its first token (templates that neither open nor close one):
the first mask is the grammar's plus that opening token; taking it makes the gate wait for the
close. ``rearm``: when the grammar is complete,
the matcher restarts and the gate waits for this sequence again (tool calls in ``auto`` mode: free
text, and each ``<tool_call>`` constrained to a call); without it, a complete grammar completes the
request. Tokens the engine forces (a thinking budget's ``</think>`` and the layout after it) pass
the gate but are not grammar output.

Compiling (``compile_constraints``): one llguidance matcher per request, under ``LIMITS``, copied for
each choice; the first mask is computed there, so a grammar llguidance finds empty (a ``$ref`` loop
with no base case, an impossible regex class, a Lark rule that never ends) or one that exceeds a
limit on its first step is refused (``GrammarRejected``) before the request takes a row. A limit
hit later, in the middle of an output, ends that choice with ``error`` set (the server answers it
as that choice's error, never the whole request's).

The next mask can be started ahead (``prefetch``, on a thread pool: ``zoo.engine.mask_schedule``
decides when, and how long a step waits for it); ``fill`` takes it.

Speculative decoding: ``fill(rows, drafts)`` writes the masks of the k+1 verify positions: position
0 from the current state, position i after drafts 1..i, which the matcher consumes tentatively and
then rolls back (a draft the grammar refuses ends it: the positions after it are left all-allowed,
the device rejects that draft anyway since it is masked at its own position). Past a ``deadline``
the later positions are not computed, and ``fill`` says how many tokens may stand.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass

import llguidance
import numpy as np

ALL = -1                                    # an all-allowed mask word

# llguidance's limits, chosen (defaults in parentheses; speeds from llguidance's documentation):
# - lexer fuel to build a grammar's regexes 200k (1M, ~50k/ms): a regex bomb such as (a{1000}){1000}
#   fails in ~0.2 s instead of ~2-4 s; JSON schemas and tool grammars of realistic size use far less;
# - lexer fuel per mask 100k (200k, ~14k/ms): one constrained row's mask costs at most ~7 ms of lexing;
# - Earley items per mask 20k (50k, ~20k/ms): at most ~1 ms of parsing per mask; past either, the
#   choice ends with an error rather than slowing every row of the batch;
# - lexer states 50k (250k, 1-2 kB each): at most ~100 MB of lexer per request;
# - grammar symbols 200k (500k): with the server's size cap on grammar text (``zoo.server.grammar``)
#   this is a backstop;
# - items per grammar row 2000 (the default): a choice list of more options is refused before this;
# - errors without parser dumps (``verbose_errors``): the message names the limit, not the state.
LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=200_000, step_lexer_fuel=100_000, step_max_items=20_000,
                                   max_lexer_states=50_000, max_grammar_size=200_000, max_items_in_row=2000,
                                   verbose_errors=False)


class GrammarRejected(ValueError):
    """A grammar that does not compile, exceeds ``LIMITS``, or matches no text at all."""


def mask_words(vocab: int) -> int:
    return (vocab + 31) // 32


_VOCABS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_VOCABS_LOCK = threading.Lock()


def llg_tokenizer(tokenizer, n_vocab: int, eos_ids) -> llguidance.LLTokenizer:
    """The llguidance tokenizer for a ``zoo.text.Tokenizer`` whose model has ``n_vocab`` logits
    (built once per tokenizer; ids past the tokenizer's vocabulary are never allowed)."""
    key = (int(n_vocab), tuple(sorted(eos_ids)))
    with _VOCABS_LOCK:
        cached = _VOCABS.setdefault(tokenizer, {})
        if key not in cached:
            cached[key] = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=int(n_vocab),
                                                 eos_token=list(key[1]) or None)
        return cached[key]


@dataclass(frozen=True)
class OutputGrammar:
    """What a request's output must follow: an llguidance ``grammar`` (``zoo.server.grammar``) and
    its gate, as token ids (``wait``: sequences to pass first; ``rearm``: see the module doc)."""
    grammar: str
    wait: tuple[tuple[int, ...], ...] = ()
    rearm: tuple[int, ...] | None = None
    reasoning: tuple[int, tuple[int, ...]] | None = None    # (opening token, close sequence)
    source: str | None = None                                 # the request field it came from (errors name it)


class Constraint:
    """One request's constraint (see the module doc). ``grammar``: an llguidance grammar string
    (``zoo.server.grammar``), already checked; ``wait`` / ``rearm``: token-id sequences."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, *, wait=(), rearm=None, reasoning=None):
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        if self.matcher.is_error():
            raise GrammarRejected(_clean(self.matcher.get_error()))
        self.words = mask_words(tokenizer.vocab_size)
        self.eos = frozenset(tokenizer.eos_tokens)
        self.wait = [tuple(w) for w in wait if w]
        self.rearm = tuple(rearm) if rearm else None
        self.tail: list[int] = []           # recent tokens while the gate waits
        self.error: str | None = None
        self.complete = False               # the grammar finished and nothing re-arms it
        self.reasoning = None if self.wait else reasoning   # undecided: the first token may open reasoning
        self._ahead: tuple[np.ndarray, object] | None = None   # the next mask being computed (``prefetch``)

    @property
    def armed(self) -> bool:
        return not self.wait

    def copy(self) -> "Constraint":
        """The same constraint, fresh for another choice: the matcher deep-copied (nothing compiles
        again). Call before any token was fed."""
        new = object.__new__(Constraint)
        new.__dict__.update(self.__dict__)
        new.matcher, new.wait, new.tail = self.matcher.deep_copy(), list(self.wait), list(self.tail)
        new._ahead = None
        return new

    def check_start(self) -> None:
        """``GrammarRejected`` if the grammar cannot even start (``dead_end`` of its first mask,
        computed here, the gate aside): how llguidance shows a grammar whose language is empty or a
        limit hit on the first step."""
        rows = np.zeros((1, self.words), np.int32)
        self.matcher.unsafe_compute_mask_ptr(rows.ctypes.data, rows.shape[1] * 4)
        why = self.dead_end(rows[0])
        if why is not None:
            raise GrammarRejected("it matches no text: " + why)

    def dead_end(self, row: np.ndarray) -> str | None:
        """Why the output cannot go on from the mask ``row`` [W] just computed, or None: the matcher is
        in error (a limit hit), or the mask allows only end-of-sequence ids while the output so far
        is not complete (llguidance's answer when its lexer gave up; its error flag may only follow
        on a later mask). Such a choice would otherwise end "stop", silently cut."""
        if self.matcher.is_error():
            error = _clean(self.matcher.get_error())
            return "no token can start or continue the output" if error == "NoExtensionBias" else error
        if np.count_nonzero(row) > len(self.eos) or self.matcher.is_accepting():      # the usual case: cheap
            return None
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        if set(allowed.tolist()) <= self.eos:
            return "no token can continue the output (a limit of the grammar engine was hit)"
        return None

    # -- the gate ---------------------------------------------------------------------------------
    @staticmethod
    def _pass(wait: list, tail: list, tok: int) -> bool:
        """Feed ``tok`` to a waiting gate (``wait``/``tail`` updated); True when it opens."""
        tail.append(tok)
        want = wait[0]
        if tuple(tail[-len(want):]) == want:
            wait.pop(0)
            tail.clear()
        else:
            del tail[:-len(want)]
        return not wait

    # -- the engine's side ------------------------------------------------------------------------
    def advance(self, tokens, forced: bool = False) -> int:
        """The row emitted ``tokens`` (``forced``: the engine forced them). Returns how many of them
        stand: all, or up to the one that completed the grammar (``complete`` set), or those before
        the one that broke it (``error`` set)."""
        self._drop_ahead()
        for n, tok in enumerate(tokens):
            if self.complete:
                return n
            if self.error:
                return n
            if self.reasoning is not None:
                opening, close = self.reasoning
                self.reasoning = None
                if int(tok) == opening:
                    self.wait = [tuple(close)]
                    continue
            if not self.armed:
                self._pass(self.wait, self.tail, int(tok))
            elif forced:
                pass
            elif not self.matcher.consume_token(int(tok)):
                self.error = f"token {tok} broke the output grammar: {_clean(self.matcher.get_error())}"
                return n
            elif self.matcher.is_stopped():
                if self.rearm:
                    self.matcher.reset()
                    self.wait = [self.rearm]
                else:
                    self.complete = True
        return len(tokens)

    # -- the masks ------------------------------------------------------------------------------
    @property
    def pending(self):
        """The future of the next mask started by ``prefetch`` (None: none started)."""
        return None if self._ahead is None else self._ahead[1]

    def prefetch(self, pool) -> None:
        """Start computing the next position's mask on ``pool`` (a ``concurrent.futures`` executor;
        llguidance drops the GIL), unless one is started or the gate waits (an all-allowed mask:
        ``fill`` makes it at once); ``fill`` takes it. The matcher must not be touched meanwhile
        (``advance`` waits for it)."""
        if self._ahead is None and self.armed:
            row = np.empty(self.words, np.int32)
            self._ahead = (row, pool.submit(self._first_mask, row))

    def _drop_ahead(self) -> np.ndarray | None:
        """Wait for the mask ``prefetch`` started and forget it; returns it (None: none started)."""
        if self._ahead is None:
            return None
        row, future = self._ahead
        future.result()
        self._ahead = None
        return row

    def _first_mask(self, row: np.ndarray) -> None:
        """The next position's mask into ``row`` [W] (all-allowed while the gate waits; the opening
        reasoning token added while undecided); a dead end sets ``error``."""
        row[:] = ALL
        if self.armed:
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            why = self.dead_end(row) if self.error is None else None
            if why is not None:
                self.error = f"the output grammar cannot go on: {why}"    # the step ends the choice
        if self.reasoning is not None:
            opening = self.reasoning[0]
            row[opening // 32] |= np.int32(np.uint32(1 << (opening % 32)).view(np.int32))

    def fill(self, rows: np.ndarray, drafts=(), deadline: float | None = None) -> int:
        """Masks for the next ``1 + len(drafts)`` positions into ``rows`` ``[>= 1 + len(drafts), W]``
        int32 (see the module doc): the first one ``prefetch`` started (waited for) or computed
        here. Past ``deadline`` (``time.perf_counter()``) no further draft position is computed.
        Returns how many positions' tokens may stand: ``1 + len(drafts)``, or j when the deadline
        stopped the masks at position j (the later positions are left all-allowed)."""
        rows[:len(drafts) + 1] = ALL
        ahead = self._drop_ahead()
        if ahead is not None:
            rows[0] = ahead
        else:
            self._first_mask(rows[0])
        if not len(drafts) or (self.reasoning is not None and int(drafts[0]) == self.reasoning[0]):
            return len(drafts) + 1          # reasoning opened by the first draft: the rest is free
        wait, tail = list(self.wait), list(self.tail)
        consumed, standing = 0, len(drafts) + 1
        for i in range(1, len(drafts) + 1):
            tok = int(drafts[i - 1])
            if wait:
                self._pass(wait, tail, tok)
            elif self.matcher.is_stopped() or not self.matcher.try_consume_tokens([tok]):
                break                       # refused: the device rejects that draft at its own position
            else:
                consumed += 1
            if not wait:
                if deadline is not None and time.perf_counter() >= deadline:
                    standing = i
                    break
                self.matcher.unsafe_compute_mask_ptr(rows[i].ctypes.data, rows.shape[1] * 4)
        if consumed:
            self.matcher.rollback(consumed)
        return standing


def _clean(error: str) -> str:
    """llguidance's error without its non-verbose marker and trailing detail lines."""
    return error.replace("<non-verbose/>", "").strip().splitlines()[0] if error.strip() else "rejected"


def compile_constraints(tokenizer: llguidance.LLTokenizer, grammar: OutputGrammar, n: int) -> list[Constraint]:
    """``n`` fresh constraints of ``grammar``: compiled once under ``LIMITS`` and checked to start
    (``Constraint.check_start``), then copied; ``GrammarRejected`` naming what is wrong."""
    first = Constraint(tokenizer, grammar.grammar, wait=grammar.wait, rearm=grammar.rearm, reasoning=grammar.reasoning)
    # on a copy: a mask computed on the matcher itself changes how a later failure shows (at a consume
    # instead of at the next mask; seen with a regex bomb)
    first.copy().check_start()
    return [first] + [first.copy() for _ in range(n - 1)]
