"""Plots and summary tables of the audit, the memory plan and throughput runs (for notebooks).

    tensor_class(name) -> str                      "blk.3.ffn_down_exps.weight" -> "ffn_down_exps"
    audit_table(rows) -> [dict]                    one dict per (tensor class, quant type, ref type)
    format_audit_table(table) -> str               that table as aligned text
    audit_figure(rows, metric="rel_frob") -> Figure    the metric per layer, one series per (class, type)
    per_chip_by_class(plan) -> {cls: int}          bytes one chip holds, by the plan's tensor class
    plan_figure(plan, budget_bytes=None) -> Figure     those bytes as horizontal bars, in GiB
    throughput_figure(results) -> Figure           decode tokens/s against batch size, one line per label
    kld_figure(reports) -> Figure                  zoo eval: mean and p99 KL divergence by recipe
    kld_distribution_figure(per_token) -> Figure   zoo eval: the per-token KL divergence, one curve per recipe

``rows`` are ``zoo.tools.audit.AuditRow`` or their dicts (``dataclasses.asdict``, as ``zoo audit
--json`` writes them under ``"rows"``). A tensor's class is its GGUF name without ``blk.N.`` and
``.weight`` (non-block tensors keep their name: ``token_embd``, ``output``). Of a bank, only its
``expert == "all"`` row (every chosen expert together) is used when it has one; the per-expert rows
are details. ``audit_table`` gives, per group: ``class``, ``quant_type``, ``ref_type``, ``count``
(tensors), ``rel_frob_median``, ``rel_frob_max``, ``matvec_rel_median``, ``cosine_min``; the groups
are sorted by (class, quant type, ref type).

``audit_figure`` puts the layer index (from ``blk.N.``) on x and the metric on a log y axis.
Non-block tensors are left out of it (they have no layer; the table shows them), and so are
points whose metric is not a positive number (an exact copy, e.g. an F32 norm, has rel_frob 0,
which a log axis cannot show). The plan's tensor class is ``Tensor.cls`` (``routed_experts``,
``attention``, ...), the classes of ``Plan.by_class``; ``plan_figure``'s bars are per-chip bytes.
``throughput_figure``'s ``results`` are dicts ``{"label": str, "batch": int, "tokens_per_s": float}``.
``kld_figure``'s ``reports`` map a label (a recipe) to ``zoo eval kld``'s figures (``Report.figures``, or
the ``"figures"`` of its ``--json``); ``kld_distribution_figure``'s ``per_token`` map a label to the
per-token KL divergences (``Report.per_token["kld"]``, or ``--per-token``'s ``kld``).

Every figure is a ``matplotlib.figure.Figure`` made with the object API (no pyplot state): save it
with ``fig.savefig(path)``, or show it with ``IPython.display.display(fig)`` in a notebook.
matplotlib is optional: ``pip install 'zoo[notebooks]'``.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import asdict, is_dataclass

import numpy as np

GIB = 2 ** 30
_BLOCK = re.compile(r"^blk\.(\d+)\.")
_MARKERS = "osD^v<>ph*"


def _figure(figsize: tuple[float, float]):
    try:
        from matplotlib.figure import Figure
    except ImportError as e:                                  # pragma: no cover - matplotlib is installed in dev
        raise ImportError("plots need matplotlib: pip install 'zoo[notebooks]'") from e
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def tensor_class(name: str) -> str:
    """The GGUF tensor name without ``blk.N.`` and ``.weight``."""
    name = _BLOCK.sub("", name)
    return name[: -len(".weight")] if name.endswith(".weight") else name


def layer_of(name: str) -> int | None:
    """N of ``blk.N.``; None for a non-block tensor."""
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


def _summary_rows(rows) -> list[dict]:
    """The rows as dicts, a bank's per-expert rows dropped where it has an ``"all"`` row."""
    dicts = [asdict(r) if is_dataclass(r) else dict(r) for r in rows]
    with_all = {d["tensor"] for d in dicts if d.get("expert") == "all"}
    return [d for d in dicts if d["tensor"] not in with_all or d.get("expert") == "all"]


def audit_table(rows) -> list[dict]:
    """One dict per (tensor class, quant type, ref type); see the module docstring."""
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for d in _summary_rows(rows):
        groups[(tensor_class(d["tensor"]), d["quant_type"], d["ref_type"])].append(d)
    out = []
    for (cls, qt, rt), members in sorted(groups.items()):
        col = lambda k: np.array([float(m[k]) for m in members])
        out.append({"class": cls, "quant_type": qt, "ref_type": rt, "count": len(members),
                    "rel_frob_median": float(np.median(col("rel_frob"))),
                    "rel_frob_max": float(np.max(col("rel_frob"))),
                    "matvec_rel_median": float(np.median(col("matvec_rel"))),
                    "cosine_min": float(np.min(col("cosine")))})
    return out


def format_audit_table(table: list[dict]) -> str:
    """``audit_table``'s dicts as a fixed-width text table."""
    width = max([len("class")] + [len(t["class"]) for t in table])
    lines = [f"{'class':{width}s} {'quant':>8s} {'ref':>5s} {'n':>4s} {'rel_frob':>9s} {'max':>9s} "
             f"{'matvec':>9s} {'min cos':>9s}"]
    for t in table:
        lines.append(f"{t['class']:{width}s} {t['quant_type']:>8s} {t['ref_type']:>5s} {t['count']:4d} "
                     f"{t['rel_frob_median']:9.5f} {t['rel_frob_max']:9.5f} {t['matvec_rel_median']:9.5f} "
                     f"{t['cosine_min']:9.6f}")
    return "\n".join(lines)


def audit_series(rows, metric: str = "rel_frob") -> dict[str, tuple[list[int], list[float]]]:
    """``{"<class> <quant type>": (layers, values)}``, by layer, as ``audit_figure`` draws them."""
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for d in _summary_rows(rows):
        layer, value = layer_of(d["tensor"]), float(d[metric])
        if layer is None or not (math.isfinite(value) and value > 0):
            continue
        series[f"{tensor_class(d['tensor'])} {d['quant_type']}"][layer] = value
    return {label: (sorted(pts), [pts[k] for k in sorted(pts)]) for label, pts in sorted(series.items())}


def audit_figure(rows, metric: str = "rel_frob"):
    """The audit's ``metric`` (``rel_frob``, ``matvec_rel``, ...) per layer; one series (line and
    markers) per (tensor class, quant type), one colour per class."""
    fig, ax = _figure((9, 5))
    series = audit_series(rows, metric)
    classes = sorted({label.rsplit(" ", 1)[0] for label in series})
    colours = {cls: f"C{i % 10}" for i, cls in enumerate(classes)}
    seen: dict[str, int] = defaultdict(int)
    for label, (layers, values) in series.items():
        cls = label.rsplit(" ", 1)[0]
        k = seen[cls]
        seen[cls] += 1
        ax.plot(layers, values, marker=_MARKERS[k % len(_MARKERS)], linestyle=("-", "--", ":", "-.")[k % 4],
                color=colours[cls], label=label)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per layer, by tensor class and ggml type")
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize="small", ncols=2 if len(series) > 8 else 1)
        ax.xaxis.get_major_locator().set_params(integer=True)
    return fig


def per_chip_by_class(plan) -> dict[str, int]:
    """Bytes one chip holds, by tensor class (``Tensor.cls``): the sum of ``per_device_bytes``."""
    out: dict[str, int] = defaultdict(int)
    for t in plan.tensors:
        out[t.tensor.cls] += t.per_device_bytes
    return dict(out)


def plan_figure(plan, budget_bytes: int | None = None):
    """Per-chip GiB by tensor class as horizontal bars, the largest on top; a vertical line at
    ``budget_bytes`` when given; the total per chip in the title."""
    fig, ax = _figure((8, 4.5))
    by_class = sorted(per_chip_by_class(plan).items(), key=lambda kv: kv[1])
    names, gib = [k for k, _ in by_class], [v / GIB for _, v in by_class]
    bars = ax.barh(names, gib, color="C0")
    ax.bar_label(bars, labels=[f"{g:.2f}" for g in gib], padding=3, fontsize="small")
    if budget_bytes is not None:
        ax.axvline(budget_bytes / GIB, color="C3", linestyle="--", label=f"budget {budget_bytes / GIB:.1f} GiB")
        ax.legend(loc="lower right")
    ax.set_xlabel("GiB per chip")
    ax.set_title(f"{plan.model} {plan.recipe}, {plan.devices} chips ({plan.layout}): "
                 f"{plan.per_device_bytes / GIB:.2f} GiB per chip")
    ax.margins(x=0.15)
    return fig


def throughput_figure(results: list[dict]):
    """Decode tokens/s against batch size (log2 x, ticks at the batch sizes); one line per label."""
    fig, ax = _figure((7, 4.5))
    lines: dict[str, dict[int, float]] = defaultdict(dict)
    for r in results:
        lines[r["label"]][int(r["batch"])] = float(r["tokens_per_s"])
    for i, (label, pts) in enumerate(lines.items()):
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], marker=_MARKERS[i % len(_MARKERS)], label=label)
    batches = sorted({b for pts in lines.values() for b in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("decode throughput")
    ax.grid(True, alpha=0.3)
    if lines:
        ax.legend()
    return fig


def kld_figure(reports: dict[str, dict]):
    """Mean KL divergence (bars, ± one standard error) and its 99th percentile (markers) by recipe,
    on a log axis, with each recipe's top-1 agreement written to the right of the axes."""
    fig, ax = _figure((8, 0.6 * max(len(reports), 2) + 1.5))
    labels = list(reports)
    mean = [reports[k]["kld"]["mean"] for k in labels]
    err = [reports[k]["kld"]["stderr"] for k in labels]
    ax.barh(labels, mean, xerr=err, color="C0", label="mean")
    ax.plot([reports[k]["kld"]["p99"] for k in labels], labels, "D", color="C3", label="99th percentile")
    right = ax.get_yaxis_transform()                          # x in axes fractions, y in data: beside the axes
    for y, k in enumerate(labels):
        ax.text(1.02, y, f"top-1 {100 * reports[k]['top1']['mean']:.1f}%", transform=right, va="center",
                fontsize="small")
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("KL divergence from the reference (nats per token)")
    ax.set_title("what each recipe costs in output")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    return fig


def kld_distribution_figure(per_token: dict[str, np.ndarray]):
    """The share of tokens whose KL divergence is at least x (log x), one curve per label: where the
    curves part is where the recipes differ, the right tail is the tokens a recipe gets badly wrong."""
    fig, ax = _figure((7, 4.5))
    for i, (label, kld) in enumerate(per_token.items()):
        x = np.sort(np.maximum(np.asarray(kld, np.float64), 1e-12))
        ax.step(x, 1 - np.arange(len(x)) / len(x), where="post", color=f"C{i % 10}", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("KL divergence (nats)")
    ax.set_ylabel("share of tokens at or above")
    ax.set_title("per-token KL divergence")
    ax.grid(True, which="both", alpha=0.3)
    if per_token:
        ax.legend(fontsize="small")
    return fig
