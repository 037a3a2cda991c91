"""Weight-space audit: a quantized GGUF against a bf16 (or f32) GGUF of the same model.

    audit(quant, ref, tensors=["blk.*.ffn_*_exps.weight"], experts=[0, 5], rows=(0, 256)) -> [AuditRow]

For every tensor of ``quant`` whose name matches one of the glob ``tensors`` patterns, every chosen
expert of a stacked bank (``experts``; all when None) and the chosen output rows (``rows`` =
``(start, stop)``; all when None), with ``W`` the reference and ``Q`` the quantized weight, both
dequantized bit-exactly (``zoo.quant.dequantize``) and viewed as float64 ``[rows, in]``:

    rel_frob   = ||Q - W||_F / ||W||_F
    cosine     = <Q, W> / (||Q||_F ||W||_F)
    matvec_rel = ||(Q - W) X||_F / ||W X||_F      X [in, n_cols] ~ N(0, 1), numpy default_rng(seed)

Banks get one row per expert plus one ``expert="all"`` row over every chosen expert together.
Only the chosen experts and rows are read (one expert at a time; ``GGUFSource.read`` with an index
touches only those bytes of the memory-mapped files). Remote files (``hf://OWNER/REPO/PATH.gguf``,
``https://...``) are read with HTTP range requests: the headers, then those same byte ranges.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from zoo.formats.dequant import dequantize
from zoo.sources.base import SourceError
from zoo.sources.gguf import GGUFSource

N_COLS = 64
SEED = 0


@dataclass(frozen=True)
class AuditRow:
    tensor: str
    expert: int | str | None        # an expert index, "all" (the chosen experts together), None (no bank)
    rows: tuple[int, int]
    quant_type: str
    ref_type: str
    rel_frob: float
    cosine: float
    matvec_rel: float


class _Sums:
    """Sums over matrices: ||D||^2, ||W||^2, ||Q||^2, <Q, W>, ||D X||^2, ||W X||^2 (D = Q - W)."""

    FIELDS = ("dd", "ww", "qq", "qw", "ydd", "yww")

    def __init__(self, **sums: float):
        for f in self.FIELDS:
            setattr(self, f, sums.get(f, 0.0))

    @classmethod
    def of(cls, q: np.ndarray, w: np.ndarray, x: np.ndarray) -> "_Sums":
        d = q - w
        return cls(dd=float(np.sum(d * d)), ww=float(np.sum(w * w)), qq=float(np.sum(q * q)),
                   qw=float(np.sum(q * w)), ydd=float(np.sum(np.square(d @ x))), yww=float(np.sum(np.square(w @ x))))

    def __add__(self, other: "_Sums") -> "_Sums":
        return _Sums(**{f: getattr(self, f) + getattr(other, f) for f in self.FIELDS})

    def metrics(self) -> tuple[float, float, float]:
        ratio = lambda a, b: math.sqrt(a / b) if b else math.nan   # noqa: E731
        cos = self.qw / math.sqrt(self.qq * self.ww) if self.qq and self.ww else math.nan
        return ratio(self.dd, self.ww), cos, ratio(self.ydd, self.yww)


def _open(source: GGUFSource | str | Path) -> GGUFSource:
    return source if isinstance(source, GGUFSource) else GGUFSource(source)


def _matrix(src: GGUFSource, key: str, index: tuple) -> np.ndarray:
    """``tensor[index]`` dequantized, as float64 ``[rows, last dim]``."""
    info, data = src.info(key), src.read(key, index)
    values = dequantize(data, info.qtype) if info.quantized else data.astype(np.float32)
    return values.astype(np.float64).reshape(-1, info.shape[-1])


def _inputs(n_in: int, n_cols: int, seed: int, cache: dict) -> np.ndarray:
    if n_in not in cache:
        cache[n_in] = np.random.default_rng(seed).standard_normal((n_in, n_cols))
    return cache[n_in]


def _selection(path: Path, key: str, shape: tuple[int, ...], experts, rows) -> tuple[list, tuple[int, int]]:
    """(experts to read: indices, or ``[None]`` for a plain tensor; the ``(start, stop)`` rows).

    Rows select along the output axis of a matrix or bank; other ranks are read whole."""
    bank = len(shape) == 3
    n_rows = shape[-2] if len(shape) in (2, 3) else math.prod(shape[:-1])
    start, stop = rows if rows is not None and len(shape) in (2, 3) else (0, n_rows)
    if not 0 <= start < stop <= n_rows:
        raise SourceError(f"{path}: tensor {key!r} has {n_rows} rows; rows {start}:{stop} are out of range")
    chosen = (list(range(shape[0])) if experts is None else list(experts)) if bank else [None]
    bad = [e for e in chosen if e is not None and not 0 <= e < shape[0]]
    if bad:
        raise SourceError(f"{path}: tensor {key!r} has {shape[0]} experts; expert {bad[0]} is out of range")
    return chosen, (start, stop)


def _index(shape: tuple[int, ...], expert: int | None, rows: tuple[int, int]) -> tuple:
    if len(shape) not in (2, 3):
        return ()
    return (slice(*rows),) if expert is None else (expert, slice(*rows))


def audit(quant: GGUFSource | str | Path, ref: GGUFSource | str | Path, tensors: list[str],
          experts: list[int] | None = None, rows: tuple[int, int] | None = None,
          n_cols: int = N_COLS, seed: int = SEED) -> list[AuditRow]:
    """Compare the matching tensors of ``quant`` with ``ref`` (see the module docstring).

    Raises ``ValueError`` when no tensor matches, ``SourceError`` (naming file and tensor) when
    the reference lacks a tensor, the shapes differ, or an expert / row range is out of bounds.
    """
    q_src, r_src = _open(quant), _open(ref)
    keys = [k for k in q_src.keys() if any(fnmatch.fnmatchcase(k, p) for p in tensors)]
    if not keys:
        raise ValueError(f"{q_src.files[0]}: no tensor matches {tensors}")
    out, x_cache = [], {}
    for key in keys:
        q_info = q_src.info(key)
        if key not in r_src:
            raise SourceError(f"{r_src.files[0]}: no tensor {key!r} (present in {q_src.files[0]})")
        r_info = r_src.info(key)
        if r_info.shape != q_info.shape:
            raise SourceError(f"tensor {key!r}: shape {q_info.shape} in {q_src.files[0]}, {r_info.shape} "
                              f"in {r_src.files[0]}")
        chosen, span = _selection(q_src.files[0], key, q_info.shape, experts, rows)
        x = _inputs(q_info.shape[-1], n_cols, seed, x_cache)
        types, total = (q_info.qtype.name, r_info.qtype.name), _Sums()
        for e in chosen:
            index = _index(q_info.shape, e, span)
            q, w = _matrix(q_src, key, index), _matrix(r_src, key, index)
            one = _Sums.of(q, w, x)
            total += one
            out.append(AuditRow(key, e, span, *types, *one.metrics()))
        if len(chosen) > 1:
            out.append(AuditRow(key, "all", span, *types, *total.metrics()))
    return out


def table(rows: list[AuditRow]) -> str:
    """A fixed-width text table of audit rows."""
    lines = [f"{'tensor':44s} {'expert':>6s} {'rows':>11s} {'quant':>7s} {'ref':>5s} "
             f"{'rel_frob':>9s} {'cosine':>8s} {'matvec':>9s}"]
    for r in rows:
        expert = "-" if r.expert is None else str(r.expert)
        lines.append(f"{r.tensor:44s} {expert:>6s} {f'{r.rows[0]}:{r.rows[1]}':>11s} {r.quant_type:>7s} "
                     f"{r.ref_type:>5s} {r.rel_frob:9.5f} {r.cosine:8.5f} {r.matvec_rel:9.5f}")
    return "\n".join(lines)


def write_json(rows: list[AuditRow], path: str | Path, quant: str | Path, ref: str | Path,
               n_cols: int = N_COLS, seed: int = SEED) -> None:
    """``{"quant", "ref", "n_cols", "seed", "rows": [AuditRow fields]}`` to ``path``."""
    doc = {"quant": str(quant), "ref": str(ref), "n_cols": n_cols, "seed": seed,
           "rows": [asdict(r) for r in rows]}
    Path(path).write_text(json.dumps(doc, indent=2))
