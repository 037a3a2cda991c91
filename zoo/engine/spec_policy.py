"""Speculation that pays: each step's draft lengths and draft sources, chosen from what a step costs
and what each row's drafts have been accepted at.

A speculative ``Generator`` (``spec_tokens`` K) has two decode programs: the K-draft step, whose
per-row ``plan`` (``zoo.engine.speculative``) gives each row a draft length 0..K and a source, and
the step with drafting off (``spec_step(k=0)``: the MTP catch-up and one token per row). Before each
step ``SpecPolicy.plan`` picks one *option*::

    "off"      the drafting-off program: every row emits one token
    "d1".."dK" the K-draft program; MTP rows draft up to that many (the chained MTP drafts past it
               are skipped), prompt-lookup rows propose what their context continues with (up to K)

``auto`` takes the option with the most expected tokens per second: a row drafting d tokens from a
source whose conditional acceptance by position is a_1..a_K emits 1 + sum_{j<=d} a_1...a_j tokens
on average (``Acceptance``: the row's own counts, shrunk toward every row's, which for lookup
drafts are kept by the length of the n-gram that matched); an option's seconds are the median of
its last timed steps at that batch size and program width (``table_key``: a step of the narrow
decode programs is timed apart from the whole batch's) or the nearest batch size where it was timed
at that width. An option never
timed is tried first (in order), and every ``REFRESH`` steps the least recently timed one is timed
again. Drafting is chosen only when it expects ``MARGIN`` (5%) more tokens per second than drafting
off: a smaller gain is within the timings' noise. ``fixed`` is MTP drafts of length K every step (the
step before this policy existed).

Prompt lookup (``PromptLookup``): where the last n tokens (n = 4, 3, 2, longest first) of a row's
prompt and output occurred before, the tokens that followed are its drafts. Agents re-emit spans of
their context (code they read, a file they edit); those drafts cost no model work. Per row, lookup
is used when its expected tokens beat the MTP's; before any are counted, lookup drafts are expected
to be accepted at ``LOOKUP_PRIORS`` by match length, so that they are tried.

Multi-process (``zoo.engine.replica``): decisions must be identical in every process, and timings
are not. So a policy decides from its ``table`` (costs by option and batch size), which on one
process follows its own timings, and over several processes is what the leader publishes with each
step's plan (``export`` / ``load``); the rows' acceptance counts are the same everywhere. A
generator that several processes step in lockstep without a leader (``model.generate`` on every
process of a multi-host mesh: ``lockstep``, and no table ever loaded) drafts as ``fixed`` does.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

MODES = ("auto", "fixed")
SAMPLES = 9            # timed steps kept per (option, batch size)
MIN_SAMPLES = 2        # an option timed fewer times at a batch size is tried before any is chosen
REFRESH = 128          # steps between re-timings of the least recently timed option
MARGIN = 1.05          # drafting is chosen when it expects this much more than drafting off
ROW_WEIGHT = 3.0       # pseudo-steps of the pooled acceptance in a row's own estimate
POOL_WEIGHT = 8.0      # pseudo-steps of the prior in the pooled estimate
MTP_PRIOR = 0.7
NGRAMS = (4, 3, 2)
LOOKUP_PRIORS = {4: 0.8, 3: 0.6, 2: 0.4}   # a longer match is likelier a copied span than a coincidence


class Acceptance:
    """Counts of drafts tried and accepted by position (0-based), for one source: accepted[i] /
    tried[i] is the conditional acceptance of draft i given drafts 0..i-1 were (``reach``)."""

    def __init__(self, k: int):
        self.tried, self.accepted = [0.0] * k, [0.0] * k     # Python floats: a step reads a few of them

    def add(self, length: int, accepted: int, capped: bool) -> None:
        """A step that proposed ``length`` drafts and accepted the first ``accepted``; ``capped``: the
        step could not emit more (the rejection after them was not observed)."""
        count_step(self.tried, self.accepted, length, accepted, capped)


def count_step(tried: list, accepted_at: list, length: int, accepted: int, capped: bool) -> None:
    """``Acceptance.add`` on lists by position: the drafts the verify reached (the accepted ones and
    the first rejected one, unless the step was capped before it) and the accepted ones."""
    for i in range(accepted):
        tried[i] += 1
        accepted_at[i] += 1
    if accepted < length and not capped:
        tried[accepted] += 1



def reach(counts: Acceptance, pool: list[float], n: int) -> list[float]:
    """The expected tokens a row emits with 0..n drafts whose conditional acceptance by position is
    its ``counts`` shrunk toward ``pool`` (every row's): 1, 1 + a_1, 1 + a_1 + a_1 a_2, ..."""
    out, total, p = [1.0], 1.0, 1.0
    for a, t, prior in zip(counts.accepted[:n], counts.tried[:n], pool):
        p *= (a + ROW_WEIGHT * prior) / (t + ROW_WEIGHT)
        total += p
        out.append(total)
    return out


class PromptLookup:
    """A row's n-gram index over its context (prompt, then output), grown as tokens arrive:
    ``propose(k)`` -> the up to ``k`` tokens that followed the latest earlier occurrence of the
    context's last n tokens (the longest n of ``NGRAMS`` that occurred)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.last: dict[tuple, int] = {}        # n-gram -> the index just after its latest occurrence
        self._pending: dict[tuple, int] = {}    # the context's own last n-grams (registered one token late)

    def extend(self, tokens) -> None:
        for t in tokens:
            self.last.update(self._pending)
            self.tokens.append(int(t))
            end = len(self.tokens)
            self._pending = {tuple(self.tokens[end - n:]): end for n in NGRAMS if end >= n}

    def propose(self, k: int) -> tuple[list[int], int]:
        """(the drafts, the n of the n-gram that matched); ([], 0) where none did."""
        end = len(self.tokens)
        for n in NGRAMS:
            if end < n:
                continue
            at = self.last.get(tuple(self.tokens[end - n:]))
            if at is not None:
                return self.tokens[at:at + k], n
        return [], 0


@dataclass
class RowSpec:
    """What the policy keeps of one request: acceptance by source and its lookup index."""

    mtp: Acceptance
    lookup: Acceptance
    index: PromptLookup = field(default_factory=PromptLookup)
    fed: int = 0                                 # context tokens given to ``index`` so far


@dataclass
class Plan:
    """One step's choice: ``option`` ("off" or "d1".."dK"); for the K-draft program, per row
    ``lengths`` [B] int32, ``drafts`` [B, K] int32 (lookup rows' drafts), ``host`` [B] bool (the row's
    drafts are ``drafts``) and ``sources`` (None, "mtp" or "lookup")."""

    option: str
    lengths: np.ndarray
    drafts: np.ndarray
    host: np.ndarray
    sources: list
    active: int = 0                              # rows decoding this step (the batch size it is timed at)
    width: int = 0                               # the program's rows: 0 the whole batch, else the narrow one's
    matches: list | None = None                  # per row: the n-gram length of its lookup match (0: none)

    def arrays(self) -> dict:
        return {"len": self.lengths, "drafts": self.drafts, "host": self.host}


def batch_bucket(active: int) -> int:
    """Timings are kept per power-of-two count of decoding rows (1, 2, 4, ...)."""
    return 1 << max(0, int(active) - 1).bit_length()


def table_key(option: str, bucket: int, width: int = 0) -> str:
    """A cost table's key: ``"option@bucket"`` for a step of the whole batch, ``"option@bucket/width"``
    for one of the narrow decode programs (``step_programs.decode_narrow``: on a CPU it costs what its
    rows cost, so its timings are not the whole batch's at the same count of decoding rows)."""
    return f"{option}@{bucket}" + (f"/{width}" if width else "")


def parse_key(key: str) -> tuple[str, int, int]:
    """``table_key``'s (option, bucket, width)."""
    option, _, rest = key.partition("@")
    bucket, _, width = rest.partition("/")
    return option, int(bucket), int(width or 0)


class SpecPolicy:
    """Chooses each step's ``Plan`` (see the module doc) for a generator drafting up to ``k``."""

    def __init__(self, k: int, mode: str = "auto", lookup: bool = True, lockstep: bool = False):
        if mode not in MODES:
            raise ValueError(f"unknown speculation policy {mode!r}; expected one of {', '.join(MODES)}")
        if k < 1:
            raise ValueError("a speculation policy needs spec_tokens >= 1")
        self.k, self.mode, self.lookup = k, mode, lookup and mode == "auto"
        self.options = ("off",) + tuple(f"d{m}" for m in range(1, k + 1))
        self.samples: dict[str, list[float]] = {}       # "option@bucket" -> recent step seconds
        self.timed_at: dict[str, int] = {}
        self.table: dict[str, list] = {}                # "option@bucket" -> [seconds, samples, step last timed]
        self.shared = False                             # True: ``table`` comes from ``load`` only
        self.lockstep = lockstep                        # several processes run this generator's steps
        self.steps = 0
        self.pool = {"mtp": Acceptance(k), **{f"lookup{n}": Acceptance(k) for n in NGRAMS}}
        self.chosen = {o: 0 for o in self.options}      # steps per option

    # -- per-row state ----------------------------------------------------------------------------
    def row(self, req) -> RowSpec:
        if getattr(req, "spec", None) is None:
            req.spec = RowSpec(Acceptance(self.k), Acceptance(self.k))
        st = req.spec
        if self.lookup:                                 # the context: the prompt, then every emitted token
            n = len(req.prompt)                         # (raw ends with the pending one the verify feeds)
            if st.fed < n:
                st.index.extend(req.prompt[st.fed:])
                st.fed = n
            st.index.extend(req.raw[st.fed - n:])
            st.fed = n + len(req.raw)
        return st

    # -- choosing -----------------------------------------------------------------------------------
    def plan(self, rows: list, active: np.ndarray, cap: np.ndarray, force: np.ndarray, width: int = 0) -> Plan:
        """The plan for a step over ``rows`` (Request or None per batch row) with ``active`` [B] bool,
        ``cap`` [B] (tokens a row may emit) and ``force`` [B] (>= 0: the row emits a forced token);
        ``width``: the rows of the program the step runs (0: the whole batch; the narrow programs'
        timings are kept apart)."""
        b = len(rows)
        lengths, drafts = np.zeros(b, np.int32), np.zeros((b, self.k), np.int32)
        host, sources = np.zeros(b, bool), [None] * b
        if self.mode == "fixed" or (self.lockstep and not self.shared):
            for r, req in enumerate(rows):       # (processes in lockstep decide alike only from a shared table)
                if active[r] and req is not None:
                    lengths[r], sources[r] = self.k, "mtp"
            return self._chose(Plan(f"d{self.k}", lengths, drafts, host, sources, int(active.sum()), width))
        n_active = int(active.sum())
        bucket = batch_bucket(n_active)
        live = [r for r, req in enumerate(rows) if active[r] and req is not None and force[r] < 0 and cap[r] > 1]
        pool = {src: [(acc + POOL_WEIGHT * prior) / (tried + POOL_WEIGHT) for acc, tried in zip(a.accepted, a.tried)]
                for src, a in self.pool.items()
                for prior in [MTP_PRIOR if src == "mtp" else LOOKUP_PRIORS[int(src[-1])]]}
        e_mtp, e_lookup, proposals, matches = [], [], [], [0] * b    # per live row: expected tokens by MTP
        for r in live:                                               # draft count (up to its room); lookup's
            st = self.row(rows[r])
            room = min(int(cap[r]) - 1, self.k)
            e_mtp.append(reach(st.mtp, pool["mtp"], room))
            proposal, match = st.index.propose(room) if self.lookup else ([], 0)
            e_lookup.append(reach(st.lookup, pool[f"lookup{match}"], len(proposal))[-1] if proposal else 0.0)
            proposals.append(proposal)
            matches[r] = match
        n = len(live)

        def expected(m: int) -> float:
            """The live rows' expected tokens with up to m MTP drafts each, or its lookup drafts."""
            return sum(max(e[min(m, len(e) - 1)], look) for e, look in zip(e_mtp, e_lookup))

        costs = self._costs(bucket, width)
        option = self._explore(costs)
        if option is None:
            score = {o: (n_active if o == "off" else n_active - n + expected(int(o[1:]))) / max(costs[o][0], 1e-9)
                     for o in self.options}
            option = max(score, key=score.get)
            if score[option] < MARGIN * score["off"]:     # a gain within the timings' noise: the cheap step
                option = "off"
        if option != "off":
            m = int(option[1:])
            for i, r in enumerate(live):
                proposal, d = proposals[i], min(m, len(e_mtp[i]) - 1)
                if proposal and e_lookup[i] > e_mtp[i][d]:
                    lengths[r], sources[r], host[r] = len(proposal), "lookup", True
                    drafts[r, :len(proposal)] = proposal
                else:
                    lengths[r], sources[r] = d, "mtp"
        return self._chose(Plan(option, lengths, drafts, host, sources, n_active, width, matches))

    def _chose(self, plan: Plan) -> Plan:
        self.steps += 1
        self.chosen[plan.option] += 1
        return plan

    def _costs(self, bucket: int, width: int = 0) -> dict:
        """Each option's table entry at this batch size and program width, or where it was never
        timed there, at the nearest batch size where it was at that width (None: never timed)."""
        out = {}
        keys = [(parse_key(key), key) for key in self.table]
        for o in self.options:
            timed = [(abs(b.bit_length() - bucket.bit_length()), key) for (opt, b, w), key in keys
                     if opt == o and w == width]
            out[o] = self.table[min(timed)[1]] if timed else None
        return out

    def _explore(self, costs: dict) -> str | None:
        """The option to time now: one timed fewer than ``MIN_SAMPLES`` times (at any batch size), or
        every ``REFRESH`` steps the least recently timed; None: choose by the costs."""
        for o, e in costs.items():
            if e is None or e[1] < MIN_SAMPLES:
                return o
        if self.steps % REFRESH == REFRESH - 1:
            return min(costs, key=lambda o: costs[o][2])
        return None

    # -- learning -----------------------------------------------------------------------------------
    def observe(self, plan: Plan, rows: list, counts: np.ndarray, cap: np.ndarray, seconds: float | None) -> None:
        """After the step: ``counts`` [B] tokens each row emitted (the device's, before stop strings
        cut them); ``seconds`` the step's time (None: not timed, e.g. a grammar-masked step)."""
        for r, req in enumerate(rows):
            source = plan.sources[r]
            if req is None or source is None or counts[r] < 1:
                continue
            length, accepted = int(plan.lengths[r]), int(counts[r]) - 1
            capped = accepted >= int(cap[r]) - 1
            st = self.row(req) if self.mode == "auto" else None
            if st is not None:
                (st.mtp if source == "mtp" else st.lookup).add(length, accepted, capped)
            self.pool[source if source == "mtp" else f"lookup{plan.matches[r]}"].add(length, accepted, capped)
            spec = req.stats.setdefault("spec", {})
            by = spec.setdefault(source, {"tried": [0] * self.k, "accepted": [0] * self.k})
            count_step(by["tried"], by["accepted"], length, accepted, capped)
            hist = spec.setdefault("lengths", {})
            hist[str(length)] = hist.get(str(length), 0) + 1
        if seconds is None or self.mode == "fixed":
            return
        key = table_key(plan.option, batch_bucket(plan.active), plan.width)
        got = self.samples.setdefault(key, [])
        got.append(float(seconds))
        del got[:-SAMPLES]
        self.timed_at[key] = self.steps
        if not self.shared:
            self.table[key] = [statistics.median(got), len(got), self.steps]

    def export(self) -> dict:
        """The cost table the leader of a multi-process engine publishes for the next step:
        ``"option@rows"`` -> [median seconds, samples, the step it was last timed at]."""
        return {key: [statistics.median(got), len(got), self.timed_at[key]] for key, got in self.samples.items()}

    def load(self, table: dict) -> None:
        """Decide from ``table`` (an ``export``) from now on: every process the same."""
        self.shared = True
        self.table = {k: list(v) for k, v in table.items()}
