"""Tensor-name maps: source tensor name -> model parameter path (+ a layout transform), as data.

A map is a ``NameMap``: prefixes stripped from source names, patterns of names that are ignored on
purpose (vision towers), and rules ``(regex, parameter-path template, transform)``. The regex is
matched against the whole stripped name; the template may use its groups (``\\1``). A transform
names a function in ``TRANSFORMS`` that turns the stored array into the parameter's layout, or is a
``Transform``: a ``TRANSFORMS`` entry preceded by a ``HeadOrder`` (a permutation of heads that
depends on the config, e.g. llama.cpp's value-head order in ``qwen35`` GGUFs). Each architecture's
maps live in its package (``zoo.models.<arch>.weights``), built by a function of the config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np


def _conv(w: np.ndarray) -> np.ndarray:
    """A depthwise conv weight stored channels first, with or without unit dims (HF ``[C, 1, K]``,
    GGUF ``[C, K]``, ``[C, 1, K]`` or ``[1, C, 1, K]`` by llama.cpp version) -> ``[K, C]``."""
    return np.ascontiguousarray(w.reshape(-1, w.shape[-1]).T)


def _a_log_from_ssm_a(w: np.ndarray) -> np.ndarray:
    """GGUF ``ssm_a`` holds ``-exp(A_log)``; the parameter is ``A_log``."""
    return np.log(-w.astype(np.float32))


def _swap_last_two(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(w, -1, -2))


@dataclass(frozen=True)
class LayoutTransform:
    """How a stored array becomes a parameter, and what that implies, as data:

    fn          stored array -> parameter array
    reindex     how a parameter index maps to a stored index: "same" (elementwise), "swap" (the last
                two axes swapped), or None (not a pure re-indexing: the stored tensor is read whole)
    matmul      the parameter is a weight ``[*lead, in, out]`` consumed through ``zoo.ops.matmul`` /
                ``moe`` (stored ``[*lead, out, in]``): storage may keep it quantized (a QArray,
                int8); otherwise the parameter is always dense
    """

    fn: Callable[[np.ndarray], np.ndarray]
    reindex: str | None = None
    matmul: bool = False


TRANSFORMS: dict[str | None, LayoutTransform] = {
    None: LayoutTransform(lambda w: w, reindex="same"),
    # torch Linear / GGUF matrix [*lead, out, in] -> [*lead, in, out] (lead: stacked experts)
    "matmul": LayoutTransform(_swap_last_two, reindex="swap", matmul=True),
    # the same swap for a matrix the model reads directly (a router, MLA's absorbed kv_b)
    "transposed": LayoutTransform(_swap_last_two, reindex="swap"),
    "conv": LayoutTransform(_conv),
    "minus_one": LayoutTransform(lambda w: w.astype(np.float32) - np.float32(1), reindex="same"),  # GGUF (1 + w) norms
    "a_log_from_ssm_a": LayoutTransform(_a_log_from_ssm_a, reindex="same"),
}


@dataclass(frozen=True)
class HeadOrder:
    """A head permutation to undo on one axis of a stored (numpy-order) tensor.

    llama.cpp writes ``qwen35`` value heads *tiled* (``[G0_v0, G1_v0, ..., G0_v1, G1_v1, ...]``)
    where HF keeps them *grouped* by key head (``[G0_v0..v{r-1}, G1_v0..]``): stored head
    ``s * groups + g`` is logical head ``g * per_group + s``. Entries ``[start, start + span)``
    of ``axis`` are heads of ``unit`` entries each (``span = groups * per_group * unit``); the rest
    of the axis is left alone.
    """

    axis: int
    start: int
    groups: int
    per_group: int
    unit: int

    @property
    def span(self) -> int:
        return self.groups * self.per_group * self.unit

    def index(self, n: int) -> np.ndarray:
        """int[n]: ``logical = stored.take(index, axis)`` for an axis of length ``n``."""
        if self.start + self.span > n:
            raise ValueError(f"head order needs {self.start + self.span} entries on axis {self.axis}, "
                             f"the tensor has {n}")
        heads = np.arange(self.span).reshape(self.per_group, self.groups, self.unit).transpose(1, 0, 2)
        return np.concatenate([np.arange(self.start), self.start + heads.reshape(-1),
                               np.arange(self.start + self.span, n)])

    def restore(self, w: np.ndarray) -> np.ndarray:
        return np.take(w, self.index(w.shape[self.axis]), axis=self.axis)

    def as_view(self, n: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The order as a reshape + transpose of the whole axis, ``(shape, axes)`` with
        ``stored = logical.reshape(shape).transpose(axes).reshape(n)``; None unless the head span
        is the whole axis."""
        if self.start or self.span != n:
            return None
        return (self.groups, self.per_group, self.unit), (1, 0, 2)


@dataclass(frozen=True)
class Transform:
    """Undo ``heads`` on the stored array, then apply ``TRANSFORMS[layout]``."""

    layout: str | None = None
    heads: HeadOrder | None = None

    def __call__(self, w: np.ndarray) -> np.ndarray:
        return TRANSFORMS[self.layout].fn(w if self.heads is None else self.heads.restore(w))


def apply_transform(transform: "str | Transform | None", w: np.ndarray) -> np.ndarray:
    """A rule's transform (a ``TRANSFORMS`` name or a ``Transform``) applied to a stored array."""
    return transform(w) if isinstance(transform, Transform) else TRANSFORMS[transform].fn(w)


def layout_transform(transform: "str | Transform | None") -> LayoutTransform:
    """The ``LayoutTransform`` a rule's transform ends with (its head order aside)."""
    return TRANSFORMS[transform.layout if isinstance(transform, Transform) else transform]


@dataclass(frozen=True)
class Rule:
    """``index`` (optional) names the regex group holding a slice index: many source tensors then fill
    slices of one parameter along its first axis (experts stored one tensor per expert on disk,
    stacked into one ``[E, in, out]`` bank); ``transform`` applies to each source tensor."""

    pattern: str
    target: str
    transform: str | Transform | None = None
    index: str | None = None


class Target(NamedTuple):
    """Where a source tensor goes: parameter ``path`` (after ``transform``), or slice ``index`` of it.
    ``index_span`` is where the index sits in the source name."""

    path: str
    transform: str | Transform | None
    index: int | None = None
    index_span: tuple[int, int] | None = None

    def sibling(self, name: str, index: int | str) -> str:
        """The source name of slice ``index`` of the same parameter, given this slice's ``name``."""
        start, end = self.index_span
        return f"{name[:start]}{index}{name[end:]}"


class Combiner(NamedTuple):
    """How the parts of a ``Join`` make one tensor: ``fn(*float32 parts)`` and ``shape(*part shapes)``
    (which raises ``ValueError`` for parts that do not fit together)."""

    fn: Callable[..., np.ndarray]
    shape: Callable[..., tuple[int, ...]]




@dataclass(frozen=True)
class Join:
    """Stored tensors that together make one tensor: ``pattern`` matches the first part's name; the
    ``parts`` and the joined ``name`` are templates over its groups. The parts are read as float32 and
    combined by ``combine``; the rules then map the joined name like a stored tensor
    (``zoo.sources.views.JoinedSource`` presents it). Nothing is joined when the file already holds a
    tensor of the joined name."""

    pattern: str
    parts: tuple[str, ...]
    name: str
    combine: Combiner

    def match(self, key: str) -> tuple[str, tuple[str, ...]] | None:
        """``(joined name, part names)`` when ``key`` is this join's first part, else None."""
        m = re.fullmatch(self.pattern, key)
        return None if m is None else (m.expand(self.name), tuple(m.expand(p) for p in self.parts))


class NameMap:
    """Rules (first match wins), prefixes to strip, names ignored on purpose, and ``joins``: tensors
    the source must present joined (``Join``) before the rules apply."""

    def __init__(self, rules, strip_prefixes: tuple[str, ...] = (), ignore: tuple[str, ...] = (),
                 joins: tuple[Join, ...] = ()):
        self.rules = tuple(rules)
        self.joins = tuple(joins)
        self.strip_prefixes = strip_prefixes
        self._compiled = [(re.compile(r.pattern), r) for r in self.rules]
        self._compiled_ignore = [re.compile(p) for p in ignore]

    def resolve(self, name: str) -> Target | None:
        """The ``Target`` of a source name; None if no rule matches."""
        stripped = name
        for prefix in self.strip_prefixes:
            if stripped.startswith(prefix):
                stripped = stripped[len(prefix):]
                break
        offset = len(name) - len(stripped)
        for regex, rule in self._compiled:
            m = regex.fullmatch(stripped)
            if m:
                if rule.index is None:
                    return Target(m.expand(rule.target), rule.transform)
                start, end = m.span(rule.index)
                return Target(m.expand(rule.target), rule.transform, int(m.group(rule.index)),
                              (start + offset, end + offset))
        return None

    def lookup(self, name: str) -> tuple[str, str | Transform | None] | None:
        """(parameter path, transform) for a source name; None if no rule matches."""
        target = self.resolve(name)
        return None if target is None else (target.path, target.transform)

    def joined_names(self, keys) -> dict[str, str]:
        """``{part name: joined name}`` for every join whose first part is among ``keys``."""
        out: dict[str, str] = {}
        for key in keys:
            for join in self.joins:
                hit = join.match(key)
                if hit is not None:
                    out.update(dict.fromkeys(hit[1], hit[0]))
        return out

    def ignored(self, name: str) -> bool:
        return any(p.match(name) for p in self._compiled_ignore)
